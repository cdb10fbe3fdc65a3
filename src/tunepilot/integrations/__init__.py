"""The user's own run: their trainer's config (importers/), their loop (hf.py, lightning.py:
TunepilotCallback), any command (watch.py)."""
