"""A user's own HF Trainer script, with the two lines that pilot it (marked). Tiny random model,
varied-length samples padded per batch, LoRA - runs on a CPU in seconds.

    python examples/own-loop/hf_train.py --out runs/hf-own [--steps 12]
    tunepilot restore --trainer hf --out runs/hf-proof -- python examples/own-loop/hf_train.py
    tunepilot report --from runs/hf-own
    tunepilot quote runs/hf-own/spec.yaml --from runs/hf-own --card h100-sxm-80gb --hours 24
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from tiny_data import VariedLengths, collate, tiny_config
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

from tunepilot.integrations.hf import TunepilotCallback, resume_from  # (1) import


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/hf-own")
    ap.add_argument("--output-dir", default=None, help="the Trainer's output_dir")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-steps", type=int, default=6)
    ap.add_argument("--resume", action="store_true", help="resume from output_dir's newest "
                    "complete checkpoint")
    ap.add_argument("--ignore-data-skip", action="store_true",
                    help="a resume bug on purpose: do not skip the data already trained on")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(tiny_config()),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                      target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    output_dir = a.output_dir or os.path.join(a.out, "trainer")
    args = TrainingArguments(output_dir=output_dir, max_steps=a.steps,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=1e-3, logging_steps=4, save_steps=a.save_steps,
                             eval_strategy="steps", eval_steps=a.save_steps,
                             per_device_eval_batch_size=4, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, seed=0, data_seed=0,
                             ignore_data_skip=a.ignore_data_skip)
    trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(256, 512),
                      eval_dataset=VariedLengths(16, 512, seed=1), data_collator=collate,
                      callbacks=[TunepilotCallback(out_dir=a.out)])  # (2) the callback
    # resume_from(): under `tunepilot restore --trainer hf` the proof's checkpoint, else
    # output_dir's newest complete checkpoint when --resume is given (None: start fresh)
    trainer.train(resume_from_checkpoint=resume_from(output_dir if a.resume else None))


if __name__ == "__main__":
    main()
