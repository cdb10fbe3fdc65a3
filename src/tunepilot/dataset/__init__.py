"""Training data, from the user's files to micro-batches.

    sources    where rows come from: JSONL, Parquet, Arrow, a save_to_disk directory
    formats    a row -> text + trained spans (text, prompt-completion, messages)
    templates  chat templates (the tokenizer's, a named default, a Jinja file) and their spans
    encode     the whole dataset tokenized once, cached by content hash
    samples    the datasets (synthetic, encoded, packed rows) and DataInfo
    loader     collation, the checkpointable loader, the longest batch
    profile    the whole dataset's length profile (`tunepilot data`)
"""

from tunepilot.dataset.loader import (
    DataStream,
    batch_fingerprint,
    collate,
    is_packed,
    longest_batch,
    make_loader,
    useful_tokens,
)
from tunepilot.dataset.samples import (
    IGNORE_INDEX,
    DataInfo,
    EncodedSamples,
    PackedRows,
    SyntheticTokens,
    build_dataset,
    pack,
)
from tunepilot.resources import TINY_DIR

__all__ = ["IGNORE_INDEX", "TINY_DIR", "DataInfo", "DataStream", "EncodedSamples", "PackedRows",
           "SyntheticTokens", "batch_fingerprint", "build_dataset", "collate", "is_packed",
           "longest_batch", "make_loader", "pack", "useful_tokens"]
