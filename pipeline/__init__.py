"""The stages, runners, service and benchmark of trt-pipeline; its API is `trt_pipeline` (trt_pipeline/__init__.py)."""
