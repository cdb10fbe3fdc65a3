"""Regenerate the shipped tiny text set, chat set and tokenizers (src/tunepilot/resources/tiny/).

    train.jsonl           256 plain-text samples ({"text": ...}) for `data.source: tiny-text`
    tokenizer/            a 512-token byte-level BPE trained on them (no chat template)
    chat.jsonl            400 chat samples ({"messages": [...]}: system/user/assistant, some
                          multi-turn, long-tailed lengths) for `data.source: tiny-chat`
    chat-tokenizer/       a 512-token BPE with <|im_start|>/<|im_end|> and a ChatML template
    preference.jsonl      300 conversational preference rows ({"prompt": [user turn], "chosen":
                          [assistant turn], "rejected": [assistant turn]}, TRL's format) for
                          `data.source: tiny-preference` (the chat tokenizer)
    prompts.jsonl         200 prompt-only rows ({"prompt": [system?, user turn]}) for GRPO,
                          `data.source: tiny-prompts` (the chat tokenizer)

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


QUESTIONS = ["Why does {s} need {o}?", "How often {s} {v} {o}?", "What happens when {s} {v} {o}?",
             "Can {s} {v} {o} {t}", "Explain how {s} {v} {o}."]
SYSTEMS = ["You are a careful assistant for people renting accelerators.",
           "Answer briefly and name the unit of every number."]


def conversation(rng: random.Random) -> dict:
    """One chat sample: an optional system turn, 1-3 user/assistant exchanges; answers of
    1-12 sentences (rarely up to 24: the long tail)."""
    msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        q = rng.choice(QUESTIONS).format(s=rng.choice(SUBJECTS), v=rng.choice(VERBS),
                                         o=rng.choice(OBJECTS), t=rng.choice(TAILS))
        n = rng.choice([1, 2, 3, 4, 6, 8, 12]) if rng.random() < 0.92 else rng.randint(16, 24)
        msgs.append({"role": "user", "content": q[0].upper() + q[1:]})
        msgs.append({"role": "assistant", "content": " ".join(sentence(rng) for _ in range(n))})
    return {"messages": msgs}


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_files() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(20261203)
    rows = [conversation(rng) for _ in range(400)]
    with open(OUT / "chat.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    texts = [f"{m['role']}\n{m['content']}" for r in rows for m in r["messages"]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tdir = OUT / "chat-tokenizer"
    tdir.mkdir(exist_ok=True)
    tok.save(str(tdir / "tokenizer.json"))
    (tdir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "<|im_end|>", "model_max_length": 512,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "chat_template": CHATML},
        indent=2) + "\n")
    print(f"wrote {len(rows)} chat samples and a {tok.get_vocab_size()}-token chat tokenizer")


def preference_files() -> None:
    """Preference pairs and prompt-only rows (the objectives' tiny data); they reuse the chat
    tokenizer, so the chat files above stay as they are."""
    rng = random.Random(20261204)

    def question() -> str:
        q = rng.choice(QUESTIONS).format(s=rng.choice(SUBJECTS), v=rng.choice(VERBS),
                                         o=rng.choice(OBJECTS), t=rng.choice(TAILS))
        return q[0].upper() + q[1:]

    def answer(n: int) -> str:
        return " ".join(sentence(rng) for _ in range(n))

    with open(OUT / "preference.jsonl", "w") as f:
        for _ in range(300):
            n = rng.choice([1, 2, 3, 4, 6, 8]) if rng.random() < 0.93 else rng.randint(12, 20)
            row = {"prompt": [{"role": "user", "content": question()}],
                   "chosen": [{"role": "assistant", "content": answer(n)}],
                   "rejected": [{"role": "assistant", "content": answer(rng.randint(1, n))}]}
            f.write(json.dumps(row) + "\n")
    with open(OUT / "prompts.jsonl", "w") as f:
        for _ in range(200):
            msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] \
                if rng.random() < 0.3 else []
            msgs.append({"role": "user", "content": " ".join(question() for _ in range(
                rng.choice([1, 1, 2, 3])))})
            f.write(json.dumps({"prompt": msgs}) + "\n")
    print("wrote 300 preference rows and 200 prompts")


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
    chat_files()
    preference_files()


if __name__ == "__main__":
    main()
