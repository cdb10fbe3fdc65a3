"""Breakages of one restore-proof component each, as hook objects for the proof's ``hook=``
(tunepilot.restore.worker: before_load / after_load in the fresh process, after_save in the
parent). Named in the tests as 'support.restore_faults:NAME'."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tunepilot.checkpoint import read_manifest, rng_state, set_rng_state


def _damage(component: str, action: str):
    def after_save(ckpt: Path) -> None:
        m = read_manifest(ckpt)
        target = ckpt / max(m.components[component], key=lambda r: m.files[r].bytes)
        data = bytearray(target.read_bytes())
        if action == "truncate":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    return after_save


def _perturb(state, stream, before) -> None:
    """The smallest possible change: one element of one state tensor, one ULP up."""
    import torch

    for per_param in state.optimizer.state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                flat = v.view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=v.dtype))
                return


DROP_RNG = SimpleNamespace(before_load=lambda state, stream: rng_state(),
                           after_load=lambda state, stream, before: set_rng_state(before))
DROP_DATA_POSITION = SimpleNamespace(
    before_load=lambda state, stream: stream.state_dict(),
    after_load=lambda state, stream, before: stream.load_state_dict(before))
RESET_SCHEDULER = SimpleNamespace(
    before_load=lambda state, stream: (state.scheduler.state_dict(),
                                       [g["lr"] for g in state.optimizer.param_groups]),
    after_load=lambda state, stream, before: (
        state.scheduler.load_state_dict(before[0]),
        [g.__setitem__("lr", lr) for g, lr in zip(state.optimizer.param_groups, before[1],
                                                  strict=True)]))
PERTURB_OPTIMIZER = SimpleNamespace(after_load=_perturb)
TRUNCATE_MODEL = SimpleNamespace(after_save=_damage("model", "truncate"))
FLIP_OPTIMIZER = SimpleNamespace(after_save=_damage("optimizer", "flip"))
