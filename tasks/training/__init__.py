"""Shards -> trained weights: data loading, the step, the loop, checkpoints, DDP (torch)."""
