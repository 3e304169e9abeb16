"""What every part shares: the user's-mistake error, the settings (and their command-line options), the extras check,
the one comparison, the CPU's instruction sets, ONNX Runtime sessions and the choice of TensorRT module."""
