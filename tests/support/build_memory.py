"""One rank of the sharded-build memory test (tests/test_build.py), started by torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/support/build_memory.py SPEC OUT

Each rank builds the spec's model sharded (training/build.py: meta device, one unit at a time)
under the StorageTracker, with its host RSS high-water mark reset first, and writes OUT/rankR.json:
the tracked peak of the build, its shard's bytes after it, the largest unit's unsharded bytes
(a decoder layer, or the root's own modules), and the RSS growth. ``python build_memory.py
--save SPEC DIR`` writes the spec's (unsharded) model as a safetensors checkpoint first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def unit_bytes(model) -> list[int]:
    """Unsharded bytes of each FSDP unit of a meta model: every decoder layer, then the root's
    modules outside the layers (parameters and buffers; a tied tensor once)."""
    from tunepilot.model.shard import decoder_layers

    def size(tensors) -> int:
        seen = {}
        for t in tensors:
            seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    layers = decoder_layers(model)
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    root = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in inside]
    return [size([*layer.parameters(), *layer.buffers()]) for layer in layers] + [size(root)]


def local_bytes(model) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        local = getattr(t, "_local_tensor", t)
        st = local.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def differences(model, spec, base: Path) -> list[str]:
    """Names of the parameters whose gathered (unsharded) values differ from the reference: the
    checkpoint's tensors (model.weights), or the spec's model built whole on one device."""
    import torch
    import torch.distributed as dist

    from tunepilot.model.build import build_model, weights_path
    from tunepilot.model.materialize import SafetensorsWeights, canonical_name

    path = weights_path(spec, base)
    rank0 = dist.get_rank() == 0
    ref = None
    if rank0 and path is None:
        one = spec.with_changes(parallel={"strategy": "single", "devices": 1})
        ref = dict(build_model(one, "cpu", base_dir=base).named_parameters())
    source = SafetensorsWeights(path) if path is not None else None
    bad = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # every rank: a collective
        if not rank0:
            continue
        want = ref[name] if ref is not None else torch.empty_like(full)
        if source is not None:
            source.copy_into(canonical_name(name), want)
        if not torch.equal(full.detach(), want.detach()):
            bad.append(name)
    return bad


def main() -> None:
    import torch

    from tunepilot.model.build import build_meta_model, build_model
    from tunepilot.spec import load_spec

    if sys.argv[1] == "--save":
        spec = load_spec(sys.argv[2])
        spec = spec.with_changes(model=dict(spec.model.model_dump(), weights="random"),
                                 parallel={"strategy": "single", "devices": 1})
        model = build_model(spec, "cpu", base_dir=Path(sys.argv[2]).parent)
        model.save_pretrained(sys.argv[3], safe_serialization=True)
        return
    import psutil
    import torch.distributed as dist

    from tunepilot.device import MemorySampler
    from tunepilot.plan.trace.tracker import StorageTracker
    from tunepilot.training.build import Shard, build_policy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_spec(sys.argv[1])
    base = Path(sys.argv[1]).parent
    out = Path(sys.argv[2])
    units = unit_bytes(build_meta_model(spec, base))  # imports everything the build needs, too
    dist.barrier()
    proc = psutil.Process()
    sampler = MemorySampler("rss", lambda: proc.memory_info().rss).start()  # VmHWM reset
    tracker = StorageTracker(1, device_type="cpu")
    with tracker, tracker.track_resizes(), torch.no_grad():
        model = build_policy(spec, torch.device("cpu"), base, None, Shard())
    reading = sampler.stop()
    rss_growth = reading.peak_minus_baseline_bytes
    record = {"rank": rank, "world": world, "build_peak_bytes": tracker.peak_bytes,
              "shard_bytes": local_bytes(model), "unit_bytes": units,
              "rss_growth_bytes": rss_growth, "rss_exact": reading.hwm_bytes is not None,
              "whole_bytes": sum(units)}
    record["differ"] = differences(model, spec, base) if spec.parallel.fsdp_version == 2 \
        else None
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, as the product's ranks do (see the end of
    # scaling/worker.py): a gloo worker thread still joinable when torch's statics are destroyed
    # aborts the rank ("terminate called without an active exception") after its work is on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
