"""The HF Trainer callback on a CUDA GPU: Llama-3.2-1B (random weights, nothing downloaded), a
full bf16 fine-tune with fused AdamW, varied-length samples padded per batch, under
TunepilotCallback; then the run directory's pilot.json beside the analytic plan of the spec the
callback derived. Prints one JSON object (the figures) on its last line.

    python scripts/gpu_check_hf.py --out runs/gpu-check/hf [--steps 12] [--cpu-smoke]

--cpu-smoke runs the same code on the tiny preset on the CPU (CI-sized, no allocator figures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class VariedLengths:
    """n samples of lo..hi tokens, the first quarter of each a prompt (label -100)."""

    def __init__(self, n: int, vocab: int, lo: int, hi: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = torch.randint(0, vocab, (length,), generator=g)
            labels = ids.clone()
            labels[: length // 4] = -100
            self.rows.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows):
    import torch

    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu-check" / "hf"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--liger", action="store_true",
                    help="TrainingArguments(use_liger_kernel=True): Liger's kernels (CUDA only)")
    a = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from tunepilot.integrations.hf import TunepilotCallback
    from tunepilot.model.arch import META_KEY, load_preset

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    preset, (lo, hi), mb = ("llama-3.2-1b", (512, 2048), 4) if cuda else ("tiny", (16, 128), 4)
    cfg = load_preset(preset)
    cfg.pop(META_KEY, None)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf.use_cache = False
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16 if cuda else torch.float32)
    out = Path(a.out)
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=a.steps, per_device_train_batch_size=mb,
        gradient_accumulation_steps=2, learning_rate=1e-5, logging_steps=2,
        save_steps=a.steps, eval_strategy="steps", eval_steps=a.steps,
        per_device_eval_batch_size=mb, report_to=[], use_cpu=not cuda, bf16=cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", dataloader_num_workers=0,
        seed=0, data_seed=0, save_only_model=False, use_liger_kernel=a.liger)
    vocab = int(hf.vocab_size)
    cb = TunepilotCallback(out_dir=out)
    trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(256, vocab, lo, hi),
                      eval_dataset=VariedLengths(8, vocab, lo, hi, seed=1),
                      data_collator=collate, callbacks=[cb])
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
        direct = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                  "max_memory_reserved": torch.cuda.max_memory_reserved()}
    else:
        direct = {}
    pilot = json.loads((out / "pilot.json").read_text())
    print(json.dumps({"preset": preset, "pilot_json": str(out / "pilot.json"),
                      "spec_yaml": str(out / "spec.yaml"), "torch_direct": direct,
                      "pilot": pilot}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
