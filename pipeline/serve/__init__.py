"""An inference service over one artifact folder: the Open Inference Protocol (KServe v2, Triton's) over REST
and gRPC, with dynamic batching.

    trt-pipeline serve engines/resnet50-fp16 --port 8000 --grpc-port 8001     (or: make serve MODEL=resnet)

Modules: `config` (ServeConfig), `protocol` (the protocol's datatypes, the checks of a request against the
model, shared by both front ends), `rest` (REST bodies: JSON tensors and Triton's binary tensor data),
`grpc_service` (the gRPC front end), `service` (the runner, batcher and metrics both front ends feed),
`batcher` (gathers concurrent requests into one runner call), `metrics` (Prometheus), `schema` (OpenAPI),
`app` (the REST front end, FastAPI), `server` (both front ends on one event loop), `cli` (the `serve`
command).  Nothing is imported here, so `trt-pipeline --help` does not load the web or gRPC stacks.
"""
