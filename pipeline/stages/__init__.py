"""The build stages, in the order `sequence.py` runs them over one artifact folder:
prepare (models/prepare.py: the PyTorch runner runs it too) -> export (or onnx_model, for a graph the user
exported) -> check -> simplify -> parity -> precision (float16 for FP16; calibration/ for INT8) -> build.
graph_io reads a graph's inputs and outputs for them."""
