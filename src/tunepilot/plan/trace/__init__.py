"""The traced plan: the spec's real training step on fake tensors on a CPU, in a child process."""
