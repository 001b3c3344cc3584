"""Serving: the production ONNX model (hash-verified) behind FastAPI; `make serve` / `python -m serving`."""
