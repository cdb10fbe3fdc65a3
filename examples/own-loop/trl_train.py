"""A user's own TRL script - DPOTrainer or GRPOTrainer - with the two lines that pilot it
(marked). The tiny random Llama, the shipped chat tokenizer and tunepilot's tiny preference pairs
or prompts, LoRA - runs on a CPU in under a minute.

    python examples/own-loop/trl_train.py --trainer dpo --out runs/trl-dpo [--steps 6]
    python examples/own-loop/trl_train.py --trainer grpo --out runs/trl-grpo
    tunepilot quote runs/trl-grpo/spec.yaml --from runs/trl-grpo --card h100-sxm-80gb

GRPO generates with transformers' generate here (use_vllm needs a GPU and vLLM): the callback
times each generate call as the step's generation phase (pilot.json "generation").
"""

from __future__ import annotations

import argparse
import json

import torch
from datasets import Dataset
from peft import LoraConfig
from tiny_data import tiny_config
from transformers import AutoTokenizer, LlamaForCausalLM

from tunepilot.integrations.hf import TunepilotCallback  # (1) import
from tunepilot.resources import TINY_CHAT_TOKENIZER, TINY_PREFERENCE, TINY_PROMPTS


def rows(path, n: int) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def echo_reward(prompts, completions, **kwargs) -> list[float]:
    """A stand-in reward that varies between completions (so the advantages do): their length
    in characters modulo 13, scaled to [0, 1)."""
    return [(len(str(c)) % 13) / 13 for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", choices=["dpo", "grpo"], default="dpo")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    out = a.out or f"runs/trl-{a.trainer}"
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(TINY_CHAT_TOKENIZER))
    model = LlamaForCausalLM(tiny_config())
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    peft = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    common = dict(output_dir=f"{out}/trainer", max_steps=a.steps, learning_rate=1e-4,
                  logging_steps=2, report_to=[], use_cpu=True, bf16=False, seed=0,
                  gradient_checkpointing=False, save_strategy="no")
    callbacks = [TunepilotCallback(out_dir=out)]  # (2) the callback
    if a.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_length=256, beta=0.1, **common)
        trainer = DPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft,
                             train_dataset=Dataset.from_list(rows(TINY_PREFERENCE, 64)),
                             callbacks=callbacks)
    else:
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_generations=4, max_completion_length=32, beta=0.04,
                          use_vllm=False, **common)
        trainer = GRPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft,
                              reward_funcs=echo_reward,
                              train_dataset=Dataset.from_list(rows(TINY_PROMPTS, 64)),
                              callbacks=callbacks)
    trainer.train()


if __name__ == "__main__":
    main()
