"""data: the whole dataset's length profile."""

from __future__ import annotations

from tunepilot.cli import app
from tunepilot.cli.common import JsonOpt, OutOpt, SpecArg, load_run_spec, out_dir, show


@app.command()
def data(spec: SpecArg, out: OutOpt = None, as_json: JsonOpt = False) -> None:
    """Tokenize the whole dataset once (cached by content hash) and profile it: samples, tokens
    and trained tokens, length percentiles and histogram, truncation at the sequence length, and
    the padding of the spec's micro-batches, padded and packed. Writes RUN_DIR/data.json, which
    the pilot, the quote and the report read.

    Example: tunepilot data examples/tiny-chat.yaml
    """
    from tunepilot.dataset.profile import profile_dataset
    from tunepilot.model.arch import resolve_arch
    from tunepilot.store import RunDir
    from tunepilot.views.progress import progress

    run_spec = load_run_spec(spec)
    arch = resolve_arch(run_spec, spec.parent)
    run = RunDir(out_dir(out, run_spec))
    run.check_spec(run_spec.spec_hash())
    with progress("data") as say:
        result = profile_dataset(run_spec, arch.vocab_size, spec.parent,
                                 progress=lambda done, total: say("tokenize", done, total))
    run.write(result, run_spec.spec_hash())
    from tunepilot.views.data import render_profile

    show(result, as_json, lambda r: render_profile(r, run.file("data")))
