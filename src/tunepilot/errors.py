"""Errors that reach the user.

A ``UserError`` is something the person can fix (a spec field, a flag, a file); the CLI prints its
message as one paragraph and exits with code 2, never with a traceback. ``TunepilotError`` is a
failure of the run itself (a gate that failed, a crashed rank) and exits with code 1.
"""

from __future__ import annotations


class TunepilotError(Exception):
    """A failure tunepilot detected and can explain; exit code 1."""

    exit_code = 1


class UserError(TunepilotError):
    """Bad input: names the field, what was wrong and how to fix it; exit code 2."""

    exit_code = 2

    def __init__(self, field: str | None, message: str, hint: str | None = None):
        self.field = field
        self.message = message
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = f"{self.field}: " if self.field else ""
        text = f"{where}{self.message}"
        if self.hint:
            text += f" {self.hint}"
        return text

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "field": self.field, "message": self.message,
                "hint": self.hint}


class SpecError(UserError):
    """A run spec that cannot be used as written."""


class DoesNotFit(TunepilotError):
    """The run does not fit the device (a real or simulated out-of-memory)."""


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """A short 'did you mean X?' phrase, or a list of the valid choices when nothing is close."""
    import difflib

    close = difflib.get_close_matches(value, list(choices), n=3, cutoff=0.5)
    if close:
        return "Did you mean " + " or ".join(repr(c) for c in close) + "?"
    shown = ", ".join(sorted(choices)[:30])
    return f"Valid values: {shown}."


def os_error_kind(exc: OSError) -> tuple[str, str]:
    """What an OSError means for whoever writes a file: ("full" | "unwritable" | "other", the
    words for it). The callers add where it happened and their own fix."""
    import errno

    if exc.errno == errno.ENOSPC:
        return "full", "the disk is full (no space left on device)"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "unwritable", f"not writable ({exc.strerror})"
    return "other", f"{exc.strerror or exc}"
