"""Params, paths, file I/O, stage entry, metrics and plots: what every stage shares (no torch)."""
