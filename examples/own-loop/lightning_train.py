"""A user's own Lightning script, with the one line that pilots it (marked). Tiny random model,
varied-length samples padded per batch - runs on a CPU in seconds.

    python examples/own-loop/lightning_train.py --out runs/lightning-own [--steps 12]
    tunepilot report runs/lightning-own
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from tiny_data import VariedLengths, collate, tiny_config
from transformers import LlamaForCausalLM

from tunepilot.integrations.lightning import TunepilotCallback


class CausalLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = LlamaForCausalLM(tiny_config())

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/lightning-own")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    torch.manual_seed(0)
    train = torch.utils.data.DataLoader(VariedLengths(256, 512), batch_size=4,
                                        collate_fn=collate)
    val = torch.utils.data.DataLoader(VariedLengths(16, 512, seed=1), batch_size=4,
                                      collate_fn=collate)
    trainer = L.Trainer(max_steps=a.steps, accelerator="cpu", devices=1,
                        accumulate_grad_batches=2, val_check_interval=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        num_sanity_val_steps=0,
                        callbacks=[TunepilotCallback(out_dir=a.out)])  # the callback
    trainer.fit(CausalLM(), train, val)


if __name__ == "__main__":
    main()
