"""Every message that crosses a process boundary is a proc/messages.py Message: one base, one
version, checked when it is read (issue 37: three bases each carried an unchecked version)."""

from __future__ import annotations

import importlib
import inspect

import pytest
from pydantic import BaseModel

from tunepilot.errors import TunepilotError
from tunepilot.proc.child import read_message, write_message
from tunepilot.proc.messages import MESSAGE_VERSION, Message

MODULES = ("tunepilot.scaling.messages", "tunepilot.restore.messages",
           "tunepilot.plan.trace.messages", "tunepilot.pilot.ranks", "tunepilot.pipeline.stage_process")


@pytest.mark.parametrize("name", MODULES)
def test_every_process_message_has_the_one_base(name):
    module = importlib.import_module(name)
    models = [c for _, c in inspect.getmembers(module, inspect.isclass)
              if issubclass(c, BaseModel) and c.__module__ == name]
    assert models and all(issubclass(c, Message) for c in models), name


def test_a_message_of_another_version_is_refused_naming_the_file(tmp_path):
    from tunepilot.restore.messages import DeterminismReport

    path = write_message(tmp_path / "report.json", DeterminismReport())
    assert read_message(DeterminismReport, path).version == MESSAGE_VERSION
    path.write_text(path.read_text().replace(f'"version": {MESSAGE_VERSION}',
                                             f'"version": {MESSAGE_VERSION + 1}'))
    with pytest.raises(TunepilotError, match="report.json is not a DeterminismReport"):
        read_message(DeterminismReport, path)
