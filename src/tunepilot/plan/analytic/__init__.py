"""The analytic plan: pure arithmetic over the architecture and the spec (no torch)."""
