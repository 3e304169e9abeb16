"""What precision costs: `trt-pipeline accuracy` (accuracy per precision) and `trt-pipeline diagnose` (where a
float16 or INT8 graph departs from FP32, node by node)."""
