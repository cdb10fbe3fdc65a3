"""The restore proof (stage 3): a checkpoint counts only if a fresh process resumes the run
exactly.

    proof     one process: train K, save, train M; a fresh process loads and trains the same M
    sharded   N ranks under torchrun save a sharded checkpoint; a fresh process group (N or N'
              ranks) loads it; per-rank components compared
    trainer   the user's own HF Trainer script, run twice through TunepilotCallback
    callbacks the callbacks' side of that proof (what each run records, ROLE.json)
    worker    what both sides run, and the fresh process (python -m tunepilot.restore.worker)
    compare   the verdict, component by component and step by step
"""

from tunepilot.restore.proof import verify_restore

__all__ = ["verify_restore"]
