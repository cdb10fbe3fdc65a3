"""Real datasets: chat and instruction data in JSONL, Parquet, Arrow and save_to_disk form, the
completions-only mask, packing, the whole-dataset profile, and bad rows named by row and field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tunepilot.dataset import build_dataset, collate, longest_batch, useful_tokens
from tunepilot.dataset.profile import profile_dataset
from tunepilot.errors import UserError
from tunepilot.resources import TINY_CHAT, TINY_CHAT_TOKENIZER, TINY_TOKENIZER
from tunepilot.spec import spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
CHAT_ROWS = [json.loads(x) for x in TINY_CHAT.read_text().splitlines()]
SINGLE_TURN = [r for r in CHAT_ROWS if [m["role"] for m in r["messages"]] == ["user", "assistant"]]


def _spec(data: dict, **top):
    return spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 512,
                           "micro_batch_size": 4, "data": data, **top})


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompt_completion(rows: list[dict]) -> list[dict]:
    return [{"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"]}
            for r in rows]


@pytest.mark.slow
def test_chat_jsonl_and_the_same_data_as_parquet_arrow_and_disk_supervise_the_same(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    tok = str(TINY_CHAT_TOKENIZER)
    chat = _spec({"source": "jsonl", "path": str(_jsonl(tmp_path / "chat.jsonl", SINGLE_TURN)),
                  "tokenizer": tok, "format": "messages", "chat_template": "tokenizer"})
    table = pa.Table.from_pylist(_prompt_completion(SINGLE_TURN))
    pq.write_table(table, tmp_path / "pc.parquet")
    with ipc.new_stream(str(tmp_path / "pc.arrow"), table.schema) as w:
        w.write_table(table)
    pc = {"tokenizer": tok, "format": "prompt-completion", "chat_template": "tokenizer"}
    specs = {"chat jsonl": chat,
             "parquet": _spec({"source": "parquet", "path": str(tmp_path / "pc.parquet"), **pc}),
             "arrow": _spec({"source": "arrow", "path": str(tmp_path / "pc.arrow"), **pc})}
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(_prompt_completion(SINGLE_TURN)).save_to_disk(tmp_path / "disk")
    specs["save_to_disk"] = _spec({"source": "hf-disk", "path": str(tmp_path / "disk"), **pc})
    profiles = {k: profile_dataset(s, 512) for k, s in specs.items()}
    counts = {k: (p.samples, p.tokens_total.value, p.tokens_supervised.value)
              for k, p in profiles.items()}
    assert len(set(counts.values())) == 1, counts
    assert counts["chat jsonl"][0] == len(SINGLE_TURN)


@pytest.mark.slow
def test_completions_only_trains_the_assistant_turns_and_less_than_all():
    comp = _spec({"source": "tiny-chat"})
    every = _spec({"source": "tiny-chat", "train_on": "all"})
    p_comp, p_all = profile_dataset(comp, 512), profile_dataset(every, 512)
    assert p_comp.tokens_total == p_all.tokens_total
    assert 0 < p_comp.tokens_supervised.value < 0.8 * p_all.tokens_supervised.value
    # the trained tokens of a multi-turn sample are exactly its assistant turns + end of turn
    ds, _ = build_dataset(comp.with_changes(sequence_length=4096), 512)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_CHAT_TOKENIZER))
    i = next(i for i, r in enumerate(CHAT_ROWS) if len(r["messages"]) >= 4
             and len(tok.apply_chat_template(r["messages"], tokenize=False)) < 1500)
    ids, labels = ds[i]
    trained = tok.decode(ids[labels != -100].tolist())
    want = "".join(m["content"] + "<|im_end|>\n" for m in CHAT_ROWS[i]["messages"]
                   if m["role"] == "assistant")  # what the template adds with each answer
    assert trained == want


def test_packing_pads_less_and_keeps_every_trained_token():
    spec = _spec({"source": "tiny-chat", "packing": True})
    p = profile_dataset(spec, 512)
    assert p.packed.padding_fraction.value < 0.5 * p.padded.padding_fraction.value
    assert p.packed.positions < p.padded.positions
    ds, info = build_dataset(spec, 512)
    assert info.packing and len(ds) == info.packed_rows < p.samples
    trained = sum(int((ds[r][1][1:] != -100).sum()) for r in range(len(ds)))
    assert trained == p.tokens_supervised.value  # every sample's trained tokens, once
    ids, labels, pos = ds[0]
    assert len(ids) <= 512 and (pos == 0).sum() == len(ds.rows[0])  # positions restart per sample
    batch = collate([ds[0], ds[1]], info.pad_token_id)
    assert "position_ids" in batch and "attention_mask" not in batch


def test_the_longest_batch_holds_the_datasets_longest_sample():
    spec = _spec({"source": "tiny-chat"}, sequence_length=1024)
    ds, info = build_dataset(spec, 512)
    lengths = ds.lengths()
    batch = longest_batch(ds, info, 4)
    assert batch["input_ids"].shape == (4, int(lengths.max()))
    longest = int(np.argmax(lengths))
    assert (batch["input_ids"][0, : lengths[longest]].numpy() == ds[longest][0]).all()
    assert useful_tokens(batch) < batch["input_ids"].numel()  # prompts are not useful


@pytest.mark.slow
def test_the_pilot_runs_the_longest_batch_and_counts_trained_tokens(tmp_path):
    spec_file = tmp_path / "chat.yaml"
    spec_file.write_text((ROOT / "examples" / "tiny-chat.yaml").read_text()
                         .replace("packing: true", "packing: false"))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tunepilot", "pilot", str(spec_file), "--out",
                           str(out), "--max-steps", "4", "--json"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pilot = json.loads(proc.stdout)
    data = pilot["data"]
    assert data["format"] == "messages" and data["train_on"] == "completions"
    assert data["longest_batch"]["sequence_length"] == data["longest_sample_tokens"]["value"]
    t = pilot["throughput"]
    assert 0 < t["useful_tokens_per_s"]["value"] < t["padded_tokens_per_s"]["value"]


def test_the_quote_trains_epochs_times_the_supervised_tokens(tmp_path):
    from tunepilot.cost.quote import quote

    spec = _spec({"source": "tiny-chat"}, target={"epochs": 2})
    p = profile_dataset(spec, 512)
    q = quote(spec, card_id="h100", count=1, term_s=None)
    assert q.target_useful_tokens == 2 * p.tokens_supervised.value
    assert q.optimizer_steps == 2 * p.padded.steps_per_epoch
    assert q.throughput.useful_fraction.value == pytest.approx(p.padded.useful_fraction.value)
    assert q.padding["padding_fraction"]["value"] == pytest.approx(
        p.padded.padding_fraction.value)
    assert q.padding["packing_would_cut_positions_by"]["value"] > 0


def test_a_tokenizer_without_a_template_says_which_default_rendered_the_chats(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", SINGLE_TURN[:20])
    spec = _spec({"source": "jsonl", "path": str(path), "tokenizer": str(TINY_TOKENIZER),
                  "format": "messages"})
    _, info = build_dataset(spec, 512)
    assert info.chat_template == "chatml"
    assert any("no chat template" in n and "chatml" in n for n in info.notes)


BAD = [
    ("missing field", [SINGLE_TURN[0], {"text": "x"}], "messages", "row 2: messages is missing",
     "messages_field"),
    ("non-string content", [{"messages": [{"role": "user", "content": 3},
                                          {"role": "assistant", "content": "a"}]}],
     "messages", "row 1: messages[0].content is a int", "messages_field"),
    ("unknown role", [{"messages": [{"role": "wizard", "content": "hi"}]}],
     "messages", "messages[0].role 'wizard' is not one of", "messages_field"),
    ("no assistant turn", [{"messages": [{"role": "user", "content": "hi"}]}],
     "messages", "has no assistant turn", "messages_field"),
    ("missing completion", [{"prompt": "p"}], "prompt-completion", "completion is missing",
     "completion_field"),
]


@pytest.mark.parametrize("name,rows,fmt,message,field", BAD, ids=[b[0] for b in BAD])
def test_bad_rows_are_named_by_row_and_field(tmp_path, name, rows, fmt, message, field):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    spec = _spec({"source": "jsonl", "path": str(path), "tokenizer": str(TINY_CHAT_TOKENIZER),
                  "format": fmt})
    with pytest.raises(UserError) as err:
        build_dataset(spec, 512)
    assert message in err.value.message and "bad.jsonl" in err.value.message
    assert err.value.field == f"data.{field}"


def test_bad_rows_are_skipped_and_counted_only_when_asked(tmp_path):
    rows = SINGLE_TURN[:10] + [{"messages": [{"role": "wizard", "content": "x"}]}]
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    (tmp_path / "mixed.jsonl").write_text(path.read_text() + "{not json\n")
    spec = _spec({"source": "jsonl", "path": str(path), "tokenizer": str(TINY_CHAT_TOKENIZER),
                  "format": "messages", "skip_bad_rows": True})
    ds, info = build_dataset(spec, 512)
    assert len(ds) == 10 and info.skipped_rows == 2
    assert any("2 rows were skipped" in n for n in info.notes)


@pytest.mark.slow
def test_an_empty_file_and_a_corrupt_parquet_file_exit_2_without_a_traceback(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    corrupt = tmp_path / "bad.parquet"
    corrupt.write_bytes(b"PAR1" + b"\x00" * 100)
    for source, path, words in (("jsonl", empty, "holds no samples"),
                                ("parquet", corrupt, "is not a readable Parquet file")):
        spec = tmp_path / f"{source}.yaml"
        spec.write_text(json.dumps({"model": {"preset": "tiny"}, "data": {
            "source": source, "path": str(path), "tokenizer": str(TINY_CHAT_TOKENIZER),
            "format": "messages"}}))
        proc = subprocess.run([sys.executable, "-m", "tunepilot", "data", str(spec), "--out",
                               str(tmp_path / source)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and "Traceback" not in proc.stderr


def test_a_text_dataset_cannot_train_on_completions():
    with pytest.raises(UserError, match="train_on 'completions' needs"):
        _spec({"source": "tiny-text", "train_on": "completions"})


def test_the_profile_is_cached_by_content(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", SINGLE_TURN[:30])
    spec = _spec({"source": "jsonl", "path": str(path), "tokenizer": str(TINY_CHAT_TOKENIZER),
                  "format": "messages"})
    first, again = profile_dataset(spec, 512), profile_dataset(spec, 512)
    assert not first.cached and again.cached and again.tokens_supervised == first.tokens_supervised
    _jsonl(path, SINGLE_TURN[:31])  # other bytes: tokenized again
    third = profile_dataset(spec, 512)
    assert not third.cached and third.samples == 31
