"""Chat templates: messages -> one string, and the character spans of the assistant turns (what
``train_on: completions`` trains).

A named default (``chatml``, ``llama-3``) is rendered here directly, so its spans are exact. A
Jinja template (the tokenizer's ``chat_template``, or a file) is compiled once in a sandbox the way
transformers compiles it, and its assistant spans are found by rendering prefixes: the text of
turn i is what ``messages[:i+1]`` adds to ``messages[:i]`` + the generation prompt (the approach
TRL used before ``{% generation %}`` markers; a template where a prefix does not render as a prefix
is refused with the fix).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tunepilot.errors import UserError

Span = tuple[int, int]  # [start, end) characters of the rendered text


class TemplateError(ValueError):
    """A conversation the template cannot render (the caller names the row)."""


@dataclass(frozen=True)
class _Named:
    name: str
    begin: str  # once, before the first turn
    head: str  # before a turn's content, with {role}
    tail: str  # after a turn's content, trained with an assistant turn (the end-of-turn token)
    sep: str  # after the tail, not trained

    def render(self, messages: list[dict], *, spans: bool) -> tuple[str, list[Span]]:
        parts, out, pos = [self.begin], [], len(self.begin)
        for m in messages:
            head = self.head.format(role=m["role"])
            body = m["content"] + self.tail
            if m["role"] == "assistant":
                out.append((pos + len(head), pos + len(head) + len(body)))
            parts += [head, body, self.sep]
            pos += len(head) + len(body) + len(self.sep)
        return "".join(parts), out


NAMED = {
    "chatml": _Named("chatml", "", "<|im_start|>{role}\n", "<|im_end|>", "\n"),
    "llama-3": _Named("llama-3", "<|begin_of_text|>", "<|start_header_id|>{role}"
                      "<|end_header_id|>\n\n", "<|eot_id|>", ""),
}


class ChatTemplate:
    """Renders a conversation and says which characters are the assistant's."""

    def __init__(self, name: str, source: str | None = None, special: dict | None = None):
        self.name = name
        self._named = NAMED.get(name) if source is None else None
        self._jinja = None if source is None else _compile(source)
        self._special = special or {}

    def render(self, messages: list[dict]) -> tuple[str, list[Span]]:
        if self._named is not None:
            return self._named.render(messages, spans=True)
        full = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True)
            upto = self._render(messages[: i + 1], False)
            if not upto.startswith(before) or not full.startswith(upto):
                raise TemplateError(
                    f"the chat template {self.name!r} does not render turn {i} as a "
                    "continuation of the turns before it, so the assistant's tokens cannot be "
                    "told apart")
            spans.append((len(before), len(upto)))
        return full, spans

    def render_prompt(self, messages: list[dict]) -> str:
        """The conversation so far and the assistant's header: what generation continues."""
        if self._named is not None:
            text, _ = self._named.render(messages, spans=False)
            return text + self._named.head.format(role="assistant")
        return self._render(messages, True)

    def _render(self, messages: list[dict], generation: bool) -> str:
        try:
            return self._jinja.render(messages=messages, add_generation_prompt=generation,
                                      **self._special)
        except TemplateError:
            raise
        except Exception as exc:  # a template's own raise_exception, or a Jinja error
            raise TemplateError(f"the chat template {self.name!r} failed: "
                                f"{str(exc).splitlines()[0][:200]}") from None


def _compile(source: str):
    """Compiled as transformers compiles chat templates (its sandbox, globals and filters);
    a plain Jinja sandbox where that helper is not available."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the same sandbox, without its extra globals
        _compile_jinja_template = _sandboxed
    try:
        return _compile_jinja_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError("data.chat_template", f"the chat template is not valid Jinja: "
                        f"{exc.message} (line {exc.lineno}).") from None


def _sandboxed(source: str):
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(str(message))

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, **kw)
    return env.from_string(source)


def resolve_template(setting: str | None, tokenizer, base_dir: Path | None
                     ) -> tuple[ChatTemplate, str | None]:
    """The template ``data.chat_template`` names, and a note when a default was chosen."""
    special = {k: v for k, v in (("bos_token", tokenizer.bos_token),
                                 ("eos_token", tokenizer.eos_token),
                                 ("pad_token", tokenizer.pad_token)) if v is not None}
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if setting is None:
        if own:
            return ChatTemplate("tokenizer", own, special), None
        return ChatTemplate("chatml"), ("the tokenizer has no chat template: messages are "
                                        "rendered with the chatml default (set "
                                        "data.chat_template to choose another)")
    if setting in NAMED:
        return ChatTemplate(setting), None
    if setting == "tokenizer":
        if not own:
            raise UserError("data.chat_template", "the tokenizer has no chat template.",
                            f"Use one of {', '.join(NAMED)}, or the path of a Jinja file.")
        return ChatTemplate("tokenizer", own, special), None
    path = Path(setting)
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    if not path.is_file():
        raise UserError("data.chat_template", f"{setting!r} is neither a named template "
                        f"({', '.join(NAMED)}, tokenizer) nor a Jinja file.",
                        "Name a default, or give the path of a .jinja file.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError("data.chat_template", f"cannot read {str(path)!r}: {exc}.") from None
    return ChatTemplate(path.name, text, special), None
