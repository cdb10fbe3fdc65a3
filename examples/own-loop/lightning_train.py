"""A user's own Lightning script, with the lines that pilot it and prove its resume (marked).
Tiny random model, varied-length samples padded per batch - runs on a CPU in seconds.

    python examples/own-loop/lightning_train.py --out runs/lightning-own [--steps 12]
    tunepilot report runs/lightning-own
    tunepilot restore --trainer lightning --out runs/lightning-proof -- \
        python examples/own-loop/lightning_train.py
The training loader is torchdata's StatefulDataLoader: Lightning saves its position in the
checkpoint, so a mid-epoch resume continues where it stopped. With --plain-loader (a plain
torch DataLoader) the resumed run re-reads the epoch from its start, and the restore proof
fails naming the data position.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from tiny_data import VariedLengths, collate, tiny_config
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import LlamaForCausalLM

from tunepilot.integrations.lightning import TunepilotCallback, resume_from


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
    ap.add_argument("--accelerator", default="cpu", help="Lightning's accelerator (cpu, gpu)")
    ap.add_argument("--plain-loader", action="store_true",
                    help="a torch DataLoader (not resumable mid-epoch)")
    a = ap.parse_args()
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader if a.plain_loader else StatefulDataLoader
    train = loader(VariedLengths(256, 512), batch_size=4, collate_fn=collate)
    val = torch.utils.data.DataLoader(VariedLengths(16, 512, seed=1), batch_size=4,
                                      collate_fn=collate)
    trainer = L.Trainer(max_steps=a.steps, accelerator=a.accelerator, devices=1,
                        accumulate_grad_batches=2, val_check_interval=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        num_sanity_val_steps=0,
                        callbacks=[TunepilotCallback(out_dir=a.out)])  # the callback
    trainer.fit(CausalLM(), train, val, ckpt_path=resume_from())  # the resume


if __name__ == "__main__":
    main()
