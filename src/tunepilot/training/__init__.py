"""The training step every stage runs: build, step, generation, the preference loss, autocast."""
