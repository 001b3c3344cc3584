"""Image files -> validated, resized uint8 arrays -> shards (no torch)."""
