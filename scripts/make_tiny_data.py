"""Regenerate the shipped tiny text set and tokenizer (src/tunepilot/resources/tiny/).

Run once by a developer; the outputs are committed so nothing is generated or downloaded at run
time. Deterministic: the same seed gives the same files.
    python scripts/make_tiny_data.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "tunepilot" / "resources" / "tiny"
SUBJECTS = ["the cluster", "a checkpoint", "the optimizer", "every rank", "the scheduler",
            "the data loader", "a long sequence", "the allocator", "the lease", "an H200",
            "the validation pass", "a LoRA adapter", "the gradient", "the learning rate"]
VERBS = ["restores", "measures", "shards", "accumulates", "writes", "reads", "warms up",
         "fits", "overflows", "synchronises", "checks", "records", "streams", "quantizes"]
OBJECTS = ["the training state", "one micro-batch", "the longest batch", "its memory budget",
           "the random streams", "the data position", "a shard of the weights", "every tensor",
           "the billing increment", "the useful tokens", "a fresh process", "the loss curve"]
TAILS = ["before the term is booked.", "after the first optimizer step.", "on every node.",
         "without a traceback.", "in a few seconds.", "exactly as it was saved.",
         "when the batch is longest.", "at the same global batch.", "within the headroom."]


def sentence(rng: random.Random) -> str:
    return " ".join([rng.choice(SUBJECTS).capitalize(), rng.choice(VERBS), rng.choice(OBJECTS),
                     rng.choice(TAILS)])


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(20261202)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(256):
        n = rng.choice([1, 2, 3, 4, 6, 8, 12]) if rng.random() < 0.9 else rng.randint(14, 20)
        rows.append({"text": " ".join(sentence(rng) for _ in range(n))})
    with open(OUT / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([r["text"] for r in rows], trainer)
    tdir = OUT / "tokenizer"
    tdir.mkdir(exist_ok=True)
    tok.save(str(tdir / "tokenizer.json"))
    (tdir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 512}, indent=2) + "\n")
    print(f"wrote {len(rows)} samples and a {tok.get_vocab_size()}-token tokenizer to {OUT}")


if __name__ == "__main__":
    main()
