"""Each heavy stage of `tunepilot run` (pilot, restore, scale) in a process of its own, so none
inherits another's allocator cache: a GPU's reserve the pilot's process still held would be
memory the restore proof's fresh process could not have (and the parent never touches the GPU).

    parent: in_own_process(ctx, stage) -> python -m tunepilot.pipeline.stage_process JOB RESULT
            (proc/child.run_child), following the progress lines the child appends to
            RUN_DIR/logs/<stage>-progress.jsonl and saying them as the stage would have
    child:  the stage's own run function, its result written to RUN_DIR/<stage>.json; a UserError
            comes back as one (exit 2), anything else as the stage's failure
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunepilot.errors import UserError
from tunepilot.proc.messages import Message
from tunepilot.results.base import StageResult

if TYPE_CHECKING:
    from tunepilot.pipeline import Ctx, Say, Stage

STAGE_TIMEOUT_S = 12 * 3600


class StageJob(Message):
    """One stage of `tunepilot run` for its own process: the spec, the run directory, the
    catalog files and the run's options."""

    stage: str
    spec: dict[str, Any]
    run_dir: str
    catalog_paths: list[str]
    options: dict[str, Any]
    base_dir: str | None = None


class StageDone(Message):
    """The stage's file, written in the run directory."""

    file: str


def in_own_process(c: Ctx, stage: Stage) -> StageResult:
    """Run ``stage`` in a fresh ``python -m tunepilot.pipeline.stage_process`` process; its progress
    comes back through a file the parent follows; its result is the stage file it wrote."""
    from tunepilot.pipeline import RunOptions, _scale_ranks
    from tunepilot.proc.child import ChildFailed, run_child

    o = c.options
    paths = [str(p) for p in getattr(c.catalog, "_paths", ())]
    job = StageJob(stage=stage.name, spec=c.spec.model_dump(mode="json"),
                   run_dir=str(c.run.path), catalog_paths=paths,
                   options={k: getattr(o, k) for k in RunOptions.__dataclass_fields__
                            if k not in ("catalog", "base_dir")}
                   | ({"nproc": _scale_ranks(c)} if stage.name == "scale" else {}),
                   base_dir=str(o.base_dir) if o.base_dir is not None else None)
    logs = c.run.logs_dir()
    feed = logs / f"{stage.name}-progress.jsonl"
    feed.write_text("")
    tail = _ProgressTail(feed, c.say)
    tail.start()
    try:
        run_child("tunepilot.pipeline.stage_process", job, StageDone, timeout_s=STAGE_TIMEOUT_S,
                  what=f"the {stage.name} stage", log_path=logs / f"{stage.name}-stage.log")
    except ChildFailed as exc:
        if exc.error.get("error") in ("UserError", "SpecError"):
            raise UserError(exc.error.get("field"), exc.error.get("message", str(exc)),
                            exc.error.get("hint")) from None
        raise
    finally:
        tail.stop()
    return c.run.read(stage.result)


class _ProgressTail:
    """Follows the progress lines a stage's process writes ([message, done, total] as JSON)
    and says them here, as the stage would have in this process."""

    def __init__(self, path: Path, say: Say):
        import threading

        self.path, self.say, self.offset = path, say, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tunepilot-stage-progress")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._drain()

    def _drain(self) -> None:
        import json

        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                for line in iter(f.readline, ""):
                    if not line.endswith("\n"):
                        break  # the rest of this line is still being written
                    self.offset += len(line.encode())
                    msg, done, total = json.loads(line)
                    self.say(msg) if done is None and total is None else \
                        self.say(msg, done, total)
        except (OSError, ValueError):
            return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._drain()


def _stage_child(job: StageJob) -> StageDone:
    """The child side of in_own_process: run one stage, write its file."""
    import json

    from tunepilot.catalog import DEFAULT_CATALOG_PATH, load_catalog
    from tunepilot.pipeline import STAGES, Ctx, RunOptions
    from tunepilot.spec import spec_from_dict
    from tunepilot.store import RunDir

    user = [Path(p) for p in job.catalog_paths if Path(p) != DEFAULT_CATALOG_PATH]
    catalog = load_catalog(user[-1] if user else None)
    opts = dict(job.options)
    opts["restore_steps"] = tuple(opts["restore_steps"])
    options = RunOptions(**opts, catalog=catalog,
                         base_dir=Path(job.base_dir) if job.base_dir else None)
    feed = Path(job.run_dir) / "logs" / f"{job.stage}-progress.jsonl"

    def say(msg: str, done: int | None = None, total: int | None = None) -> None:
        with open(feed, "a", encoding="utf-8") as f:
            f.write(json.dumps([msg, done, total]) + "\n")

    spec = spec_from_dict(job.spec, source="the staged pilot's job")
    c = Ctx(spec, RunDir(job.run_dir), options, catalog, say)
    stage = next(s for s in STAGES if s.name == job.stage)
    result = stage.run(c)
    c.run.write(result, c.spec_hash)
    return StageDone(file=str(c.run.file(stage.name)))


if __name__ == "__main__":
    import sys

    from tunepilot.proc.child import child_main

    sys.exit(child_main(_stage_child, StageJob))
