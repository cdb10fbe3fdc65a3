"""A row of the dataset -> the text that is tokenized and the character spans that are trained.

    text               {"text": "..."}: every token trained (train_on: all)
    prompt-completion  {"prompt": "...", "completion": "..."}: plain, prompt + completion + EOS
                       (as TRL does for non-conversational data); or, with data.chat_template
                       set, a user turn and an assistant turn; prompt/completion may also be
                       lists of messages (conversational prompt-completion)
    messages           {"messages": [{"role": ..., "content": ...}, ...]} (ShareGPT's
                       from/value and human/gpt are read too), rendered with the chat template
    preference         {"prompt": ..., "chosen": ..., "rejected": ...} (TRL's preference rows;
                       each a string or a list of messages; without a prompt, chosen and
                       rejected are whole conversations whose shared first turns are the prompt;
                       or a conversation (``messages_field``) with chosen/rejected replies, as
                       LLaMA-Factory's ranking data): two samples per row, chosen then
                       rejected, each prompt + reply, the reply trained
    prompt             {"prompt": ...} (a string or a list of messages): generation's prompts,
                       nothing trained (the completions are generated)
Under ``train_on: completions`` only the completion / every assistant turn is trained; under
``all`` every token.
"""

from __future__ import annotations

from tunepilot.dataset.templates import ChatTemplate, Span, TemplateError
from tunepilot.spec import DataSpec

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool",
                   "user": "user", "assistant": "assistant", "function_call": "assistant",
                   "observation": "tool"}


class RowError(ValueError):
    """A row that cannot be used: which field, and what is wrong with it."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


class Formatter:
    """Turns rows of one format into (text, trained spans)."""

    def __init__(self, data: DataSpec, template: ChatTemplate | None, eos_text: str):
        self.data = data
        self.format = data.data_format
        self.completions = data.supervise == "completions"
        self.template = template
        self.eos_text = eos_text
        self.plain = self.format in ("prompt-completion", "preference", "prompt") and \
            data.chat_template is None

    @property
    def columns(self) -> list[str]:
        d = self.data
        return {"text": [d.text_field], "prompt-completion": [d.prompt_field, d.completion_field],
                "messages": [d.messages_field], "prompt": [d.prompt_field, d.messages_field],
                "preference": [d.prompt_field, d.chosen_field, d.rejected_field,
                               d.messages_field]}[self.format]

    @property
    def samples_per_row(self) -> int:
        return 2 if self.format == "preference" else 1

    def samples(self, row: object) -> list[tuple[str, list[Span]]]:
        """The samples of one row: (text, trained spans) - two for a preference row."""
        if not isinstance(row, dict):
            raise RowError("(row)", "is not a JSON object")
        if self.format == "preference":
            return self._pair(row)
        if self.format == "prompt":
            return [(self._prompt_text(row), [])]
        return [self(row)]

    def _pair(self, row: dict) -> list[tuple[str, list[Span]]]:
        d = self.data
        chosen, rejected = row.get(d.chosen_field), row.get(d.rejected_field)
        for name, v in ((d.chosen_field, chosen), (d.rejected_field, rejected)):
            if v is None:
                raise RowError(name, "is missing (a preference row has prompt, chosen and "
                               "rejected)")
        prompt = row.get(d.prompt_field, row.get(d.messages_field))
        if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str) \
                and self.plain:
            out = []
            for reply in (chosen, rejected):
                text = prompt + reply + self.eos_text  # TRL appends EOS to chosen/rejected
                out.append((text, [(len(prompt), len(text))] if self.completions else
                            [(0, len(text))]))
            return out
        c_msgs, r_msgs = _reply(chosen, d.chosen_field), _reply(rejected, d.rejected_field)
        if prompt is None:  # implicit prompt: the turns chosen and rejected share
            n = 0
            while n < min(len(c_msgs), len(r_msgs)) - 1 and c_msgs[n] == r_msgs[n]:
                n += 1
            p_msgs, c_msgs, r_msgs = c_msgs[:n], c_msgs[n:], r_msgs[n:]
        else:
            p_msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
                _messages(prompt, d.prompt_field)
        return [self._reply_sample(p_msgs, msgs) for msgs in (c_msgs, r_msgs)]

    def _reply_sample(self, prompt: list[dict], reply: list[dict]) -> tuple[str, list[Span]]:
        if self.template is None:
            raise RowError(self.data.chosen_field, "holds messages, which need a chat template")
        text, spans = self._chat(prompt + reply)
        if not self.completions:
            return text, spans
        start = len(self.template.render_prompt(prompt)) if prompt else 0
        return text, [(max(a, start), b) for a, b in spans if b > start]

    def _prompt_text(self, row: dict) -> str:
        d = self.data
        prompt = row.get(d.prompt_field, row.get(d.messages_field))
        if isinstance(prompt, str) and self.plain:
            if not prompt:
                raise RowError(d.prompt_field, "is empty: there is nothing to generate from")
            return prompt
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            _messages(prompt, d.prompt_field if d.prompt_field in row else d.messages_field)
        if self.template is None:
            raise RowError(d.prompt_field, "holds messages, which need a chat template")
        try:
            return self.template.render_prompt(msgs)
        except TemplateError as exc:
            raise RowError(d.prompt_field, str(exc)) from None

    def __call__(self, row: object) -> tuple[str, list[Span]]:
        if not isinstance(row, dict):
            raise RowError("(row)", "is not a JSON object")
        if self.format == "text":
            text = _string(row, self.data.text_field)
            return text, [(0, len(text))]
        if self.format == "prompt-completion":
            return self._prompt_completion(row)
        return self._chat(_messages(row.get(self.data.messages_field), self.data.messages_field))

    def _prompt_completion(self, row: dict) -> tuple[str, list[Span]]:
        d = self.data
        prompt, completion = row.get(d.prompt_field), row.get(d.completion_field)
        if isinstance(prompt, list) or isinstance(completion, list):  # conversational
            msgs = _messages(prompt, d.prompt_field) + _messages(completion, d.completion_field)
            return self._chat(msgs)
        prompt, completion = _string(row, d.prompt_field), _string(row, d.completion_field)
        if not completion:
            raise RowError(d.completion_field, "is empty: there is nothing to train on")
        if not self.plain:
            return self._chat([{"role": "user", "content": prompt},
                               {"role": "assistant", "content": completion}])
        text = prompt + completion + self.eos_text
        return text, [(len(prompt), len(text))] if self.completions else [(0, len(text))]

    def _chat(self, messages: list[dict]) -> tuple[str, list[Span]]:
        if self.completions and not any(m["role"] == "assistant" for m in messages):
            raise RowError(self.data.messages_field, "has no assistant turn, so nothing is "
                           "trained under train_on: completions")
        try:
            text, spans = self.template.render(messages)
        except TemplateError as exc:
            raise RowError(self.data.messages_field, str(exc)) from None
        return text, spans if self.completions else [(0, len(text))]


def _reply(value: object, name: str) -> list[dict]:
    """chosen / rejected as messages: a string is one assistant turn; a single message (as
    LLaMA-Factory's {"from": "gpt", "value": ...}) one turn; a list a conversation."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        return _messages([value], name)
    return _messages(value, name)


def _string(row: dict, name: str) -> str:
    if name not in row or row[name] is None:
        keys = ", ".join(repr(k) for k in list(row)[:8])
        raise RowError(name, f"is missing (the row has {keys or 'no fields'})")
    value = row[name]
    if not isinstance(value, str):
        raise RowError(name, f"is a {type(value).__name__}, not a string")
    return value


def _messages(value: object, name: str) -> list[dict]:
    if value is None:
        raise RowError(name, "is missing")
    if not isinstance(value, list) or not value:
        raise RowError(name, "is not a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(f"{name}[{i}]", "is not an object with role and content")
        role, content = (m.get("role"), m.get("content")) if "role" in m else \
            (_SHAREGPT_ROLES.get(m.get("from"), m.get("from")), m.get("value"))
        if role is None:
            raise RowError(f"{name}[{i}].role", "is missing")
        if role not in ROLES:
            raise RowError(f"{name}[{i}].role", f"{str(role)[:40]!r} is not one of "
                           f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            what = "missing" if content is None else f"a {type(content).__name__}, not a string"
            raise RowError(f"{name}[{i}].content", f"is {what}")
        out.append({"role": role, "content": content})
    return out
