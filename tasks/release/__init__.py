"""ONNX model -> scores, parity checks, INT8, the production model and the gate's verdict (no torch)."""
