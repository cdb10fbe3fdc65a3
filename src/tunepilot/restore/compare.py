"""The verdict of a restore proof: component by component (per rank for sharded checkpoints),
then step by step, the first failed component being the one to fix."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tunepilot.checkpoint import DATA, MODEL, OPTIMIZER, PROGRESS, RNG, SCALER, SCHEDULER
from tunepilot.results.restore import ComponentCheck, Determinism, StepRecord

if TYPE_CHECKING:
    from tunepilot.restore.messages import DeterminismReport, ProcessReport

CHECKSUMS, FRESH, BATCHES, LR, LOSS = "checksums", "fresh_process", "batches", "lr", "loss"
# on a GPU without deterministic kernels, losses may differ by reduction order; beyond this
# relative difference it is not reduction order (bf16 has ~3 significant digits, fp32 ~7)
GPU_LOSS_RTOL = 1e-3
# a checkpoint loaded on another rank count reduces in another order: within this relative
# difference of the loss the continuation still matches (resharding is not bit-exact)
RESHARD_LOSS_RTOL = 1e-3


def component_names(has_scaler: bool) -> list[str]:
    return [CHECKSUMS, MODEL, OPTIMIZER, SCHEDULER] + ([SCALER] if has_scaler else []) + \
        [RNG, DATA, PROGRESS, BATCHES, LR, LOSS]


def state_checks(a: dict, b: dict, rank: int | None = None) -> list[ComponentCheck]:
    """Each component of a saved digest against the restored one (tunepilot.restore.worker
    state_digest): tensors by SHA-256, the scheduler and LR, the RNG streams, the data position,
    the step."""
    checks = [_hashes(MODEL, a[MODEL], b[MODEL], "tensors", rank),
              _hashes(OPTIMIZER, a[OPTIMIZER], b[OPTIMIZER], "entries", rank),
              _scheduler(a[SCHEDULER], b[SCHEDULER], rank)]
    if a.get(SCALER) is not None:
        checks.append(_plain(SCALER, a[SCALER], b[SCALER], "GradScaler state", rank))
    checks.append(_hashes(RNG, a[RNG], b[RNG], "streams", rank))
    checks.append(_plain(DATA, a[DATA], b[DATA], "data position", rank, describe_position))
    checks.append(_plain(PROGRESS, a[PROGRESS], b[PROGRESS], "step and useful tokens", rank))
    return checks


def load_failure(fresh: ProcessReport, names: list[str]) -> list[ComponentCheck]:
    """The checks when the fresh process could not load the checkpoint: the cause first."""
    if fresh.crashed is not None:
        checks = [ComponentCheck(name=FRESH, passed=False, detail=fresh.crashed)]
        return checks + [ComponentCheck(name=n, passed=False, detail="not checked: the fresh "
                                        "process failed") for n in names]
    err = fresh.error or {}
    culprit = err.get("component") or CHECKSUMS
    problems = err.get("problems") or []
    checks = []
    for n in names:
        if n == CHECKSUMS:
            detail = "; ".join(_problem_text(p) for p in problems) if problems else \
                "every SHA-256 matches the manifest"
            checks.append(ComponentCheck(name=n, passed=not problems, detail=detail))
        elif n == culprit or any(p["component"] == n for p in problems):
            rank = next((p.get("rank") for p in problems if p["component"] == n),
                        err.get("rank"))
            checks.append(ComponentCheck(name=n, passed=False, rank=rank,
                                         detail=f"did not load: {err['message']}"))
        else:
            checks.append(ComponentCheck(name=n, passed=False,
                                         detail="not checked: the checkpoint did not load"))
    if culprit not in names:  # e.g. the manifest itself
        checks.insert(1, ComponentCheck(name=culprit, passed=False, detail=err["message"]))
    return sorted(checks, key=lambda c: not (c.name == culprit or (c.name == CHECKSUMS and
                                                                   problems)))


def _problem_text(p: dict) -> str:
    rank = f", rank {p['rank']}" if p.get("rank") is not None else ""
    return f"{p['file'] or p['component']} ({p['component']}{rank}): {p['problem']}"


def _hashes(name: str, a: dict, b: dict, what: str, rank: int | None) -> ComponentCheck:
    missing = [k for k in a if k not in b]
    extra = [k for k in b if k not in a]
    differ = [k for k in a if k in b and a[k] != b[k]]
    if not (missing or extra or differ):
        return ComponentCheck(name=name, passed=True, rank=rank,
                              detail=f"{len(a)} {what} identical (SHA-256)")
    parts = []
    if differ:
        parts.append(f"{len(differ)} of {len(a)} {what} differ (first: {differ[0]})")
    if missing:
        parts.append(f"{len(missing)} missing after restore (first: {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} not in the saved state (first: {extra[0]})")
    return ComponentCheck(name=name, passed=False, rank=rank, detail="; ".join(parts))


def _scheduler(a: dict, b: dict, rank: int | None) -> ComponentCheck:
    if a == b:
        return ComponentCheck(name=SCHEDULER, passed=True, rank=rank,
                              detail=f"state identical (last_epoch {a['last_epoch']}), current LR "
                                     f"{float.fromhex(a['lr'][0]):.6g} bit-identical")
    diffs = [k for k in a if a[k] != b.get(k)]
    return ComponentCheck(name=SCHEDULER, passed=False, rank=rank,
                          detail="differs in " + ", ".join(diffs) + f": saved last_epoch "
                                 f"{a['last_epoch']}, LR {_hex_list(a['lr'])}; restored "
                                 f"last_epoch {b['last_epoch']}, LR {_hex_list(b['lr'])}")


def _plain(name: str, a: Any, b: Any, what: str, rank: int | None, show=None
           ) -> ComponentCheck:
    show = show or _short
    if a == b:
        return ComponentCheck(name=name, passed=True, rank=rank,
                              detail=f"{what} identical: {show(a)}")
    if show(a) == show(b):  # the summary hides the difference: show the raw values
        show = _short
    return ComponentCheck(name=name, passed=False, rank=rank,
                          detail=f"{what} differs: saved {show(a)}; restored {show(b)}")


def describe_position(p: dict) -> str:
    """'epoch 0, 16 samples in (4 batches), iterator open' from a data_position() dict."""
    stream = p.get("stream", {})
    loader = stream.get("loader", {}) or {}
    it = loader.get("_sampler_iter_state") or {}
    samples = it.get("samples_yielded")
    sampler = (it.get("sampler_state") or {}).get("yielded")
    text = f"epoch {stream.get('epoch')}, {samples} samples in ({loader.get('_num_yielded')} " \
           f"batches)" if samples is not None else f"epoch {stream.get('epoch')}, at the start"
    if sampler is not None and sampler != samples:
        text += f", sampler at {sampler}"
    return text + (", iterator open" if p.get("iterator_open") else "")


def _step_diff(r: StepRecord, g: StepRecord, rtol: float | None) -> tuple[list[str], bool]:
    """What differs between two records of the same step; whether the loss is within rtol."""
    what = []
    if r.fingerprints != g.fingerprints or r.useful_tokens != g.useful_tokens:
        what.append(BATCHES)
    if r.lr_bits != g.lr_bits:
        what.append(LR)
    close = True
    if r.loss_bits != g.loss_bits:
        close = rtol is not None and abs(r.loss - g.loss) <= rtol * max(1.0, abs(r.loss))
        if not close:
            what.append(LOSS)
    return what, close


def compare_steps(ref: list[StepRecord], got: list[StepRecord], rtol: float | None,
                  why_tolerance: str = "") -> tuple[list[ComponentCheck], dict | None, float]:
    """The continued steps, step by step: batches and LR identical, losses bit-identical (or
    within ``rtol`` where ``why_tolerance`` says bits cannot match)."""
    n = len(ref)
    first: dict | None = None
    bad = {BATCHES: 0, LR: 0, LOSS: 0}
    max_diff = 0.0
    for i in range(max(n, len(got))):
        if i >= len(got) or i >= n:
            what = [BATCHES, LR, LOSS]
        else:
            max_diff = max(max_diff, abs(ref[i].loss - got[i].loss))
            what, _ = _step_diff(ref[i], got[i], rtol)
        for w in what:
            bad[w] += 1
        if what and first is None:
            first = {"step": ref[i].step if i < n else got[i].step, "index": i, "diverged": what,
                     "original": ref[i].model_dump() if i < n else None,
                     "restored": got[i].model_dump() if i < len(got) else None}
    fp = first and f" (first at step {first['step']})"
    checks = [
        ComponentCheck(name=BATCHES, passed=bad[BATCHES] == 0,
                       detail=f"{n} steps: batch fingerprints identical" if not bad[BATCHES]
                       else f"{bad[BATCHES]} of {n} steps saw other data{fp}"),
        ComponentCheck(name=LR, passed=bad[LR] == 0, detail=f"{n} steps: LR bit-identical"
                       if not bad[LR] else f"{bad[LR]} of {n} steps had another LR{fp}")]
    if bad[LOSS]:
        detail = f"{bad[LOSS]} of {n} steps differ; max |diff| {max_diff:.3g}{fp}"
    elif max_diff == 0.0:
        detail = f"{n} steps: losses bit-identical"
    else:
        detail = f"{n} steps: max |diff| {max_diff:.3g} ({why_tolerance}; within relative " \
                 f"{rtol:g})"
    checks.append(ComponentCheck(name=LOSS, passed=bad[LOSS] == 0, detail=detail))
    return checks, first, max_diff


def determinism(*reports: DeterminismReport | None) -> Determinism:
    ops = sorted({op for r in reports if r for op in r.nondeterministic_ops})
    strict = all(r.strict for r in reports if r) and any(r for r in reports)
    return Determinism(requested=True, held=not ops, nondeterministic_ops=ops, strict=strict)


def tolerance(gpu_nondeterministic: bool, det: Determinism) -> str:
    """What the continuation was compared to: bit-exact, or - where a GPU ran kernels without a
    deterministic version - the loss within GPU_LOSS_RTOL, with the ops that made it so."""
    if gpu_nondeterministic:
        ops = ", ".join(det.nondeterministic_ops) or "some op"
        return (f"loss within rtol {GPU_LOSS_RTOL:g} of the original at every continued step "
                f"(GPU: {ops} ran without a deterministic kernel, so bit-exactness is "
                "impossible); batches, LR and every restored component still exact")
    how = "forced" if det.strict else "on"
    return f"bit-exact: every component and every continued loss (deterministic algorithms {how})"


def _hex_list(xs: list[str]) -> str:
    return ", ".join(f"{float.fromhex(x):.6g}" for x in xs)


def _short(v: Any) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 160 else text[:157] + "..."
