"""The model: architecture facts from a Hugging Face config (arch, no torch), building it on a
device (build, torch), and the run's FLOPs and optimizer-state arithmetic (flops, no torch)."""
