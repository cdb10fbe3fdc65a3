"""The tiny model and data the own-loop examples share: a random 2-layer Llama, and samples of
8..64 tokens whose first half is prompt (label -100), padded per batch."""

from __future__ import annotations

import torch
from transformers import LlamaConfig


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256)


class VariedLengths(torch.utils.data.Dataset):
    """Samples of 8..64 tokens; the first half of each is prompt (label -100)."""

    def __init__(self, n: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(8, 65, (1,), generator=g))
            ids = torch.randint(0, vocab, (length,), generator=g)
            labels = ids.clone()
            labels[: length // 2] = -100
            self.rows.append((ids, labels))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids, labels = self.rows[i]
        return {"input_ids": ids, "labels": labels}


def collate(rows):
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
