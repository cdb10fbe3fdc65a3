"""Data loading edge cases that must be clear errors, not hangs or tracebacks."""

from __future__ import annotations

import json
import shutil

import pytest

from tunepilot.dataset import TINY_DIR, DataStream, build_dataset, make_loader
from tunepilot.errors import UserError
from tunepilot.spec import spec_from_dict


def test_an_epoch_with_no_full_micro_batch_is_a_user_error(tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ("one sample", "another")))
    shutil.copytree(TINY_DIR / "tokenizer", tmp_path / "tok")
    spec = spec_from_dict({"model": {"preset": "tiny"}, "micro_batch_size": 4,
                           "data": {"source": "jsonl", "path": str(data),
                                    "tokenizer": str(tmp_path / "tok")}})
    ds, info = build_dataset(spec, 512)
    stream = DataStream(make_loader(spec, ds, info))
    with pytest.raises(UserError, match="no full micro-batch") as err:
        stream.next()
    assert err.value.field == "micro_batch_size"


def test_texts_that_tokenize_to_nothing_are_refused(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps({"text": ""}) + "\n")
    spec = spec_from_dict({"model": {"preset": "tiny"},
                           "data": {"source": "jsonl", "path": str(data),
                                    "tokenizer": str(TINY_DIR / "tokenizer")}})
    with pytest.raises(UserError, match="tokenizes to nothing"):
        build_dataset(spec, 512)
