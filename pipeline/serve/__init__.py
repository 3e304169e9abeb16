"""An HTTP inference service over one artifact folder, with dynamic batching.

    python -m pipeline serve engines/resnet50-fp16 --port 8000      (or: make serve MODEL=resnet)

Modules: `config` (ServeConfig), `codec` (request bodies <-> arrays, and the checks that give a
client a 4xx naming what was expected), `batcher` (gathers concurrent requests into one runner
call), `metrics` (Prometheus), `app` (the FastAPI app), `cli` (the `serve` command).  Nothing is
imported here, so `python -m pipeline --help` does not load the web stack.
"""
