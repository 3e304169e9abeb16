"""trt-pipeline's code, one folder per job (its API is `trt_pipeline`, trt_pipeline/__init__.py):

- `stages/`   the build stages in order, model -> model.onnx -> FP16/INT8 graphs -> engine.plan (stages/sequence.py)
- `folder/`   the artifact folder they write: manifest.json's record and file names, safe writes, the reader
- `postprocess/`  what a graph's raw outputs become before they are served: NMS for a detector's head
- `runners/`  the runtime: `load_runner` over the engine, ONNX Runtime and PyTorch
- `serve/`    the runtime as a service: KServe v2 / Triton's protocol over REST and gRPC
- `bench/`, `quality/`, `triton/`   the tools around them: latency, accuracy and diagnosis, Triton repositories
- `core/`     what all of them share (errors, settings, sessions, ...); `cli.py` the command line `make` wraps
"""
