"""The model.py of a `trt-pipeline triton --backend python` repository: our runner inside Triton's Python backend.

This file is copied as it is into <repo>/<name>/1/model.py and runs in Triton's Python-backend stub, not
in this package (it imports `pipeline` only in initialize, after putting the writer's package path on
sys.path).  The model version folder holds the artifact folder's own files under artifacts/ (manifest.json
and the graphs/engine the runner loads, each checked against its sha256 when loaded), so the repository is
self-contained; pipeline.runners.load_runner picks the backend as everywhere else: the engine where it runs
(a GPU, the TensorRT that built it, TensorRT-RTX included), else ONNX Runtime (the INT8 CPU graph for an
int8 folder).  That is how Triton serves what its own backends cannot load.

Tensors cross the stub through DLPack (np.from_dlpack / Tensor.from_dlpack), not as_numpy()/Tensor(name,
array): the backend's pybind11 reads numpy's array structs as numpy 1 laid them out, and under numpy 2 it
reads the wrong bytes (seen with the nvidia-pytriton 0.7 wheel: inputs arrived as all ones, outputs as empty).
Tensor.from_dlpack takes the numpy capsule's memory correctly, but leaves the capsule under a name numpy's
capsule destructor does not expect, which then prints "PyCapsule_GetPointer called with incorrect name" as an
unraisable error for every output: that one message is silenced (_quiet_capsule_names), all others kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]
except ImportError:  # imported outside Triton's stub (the package's import check); only the stub runs this file
    pb_utils = None


class TritonPythonModel:
    """Triton's Python-backend interface: initialize once per instance, execute per batch of requests."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        package_root = parameters.get("trt_pipeline_path")
        if package_root and package_root not in sys.path:
            sys.path.insert(0, package_root)
        from trt_pipeline.pipeline.runners import load_runner

        sys.unraisablehook = _quiet_capsule_names(sys.unraisablehook)

        folder = Path(args["model_repository"]) / args["model_version"] / "artifacts"
        self.runner = load_runner(folder, backend=parameters.get("runner_backend", "auto"))
        self.output_names = [output["name"] for output in config["output"]]
        pb_utils.Logger.log_info(f"{config['name']}: {self.runner.description}")

    def execute(self, requests: list) -> list:
        """One runner call for the requests Triton's dynamic batcher gathered, when their shapes allow; a
        request whose inputs do not fit the others', or a batch that fails, is run alone, so a bad request
        fails alone."""
        feeds = [self._feed(request) for request in requests]
        if len(feeds) > 1 and _stackable(feeds):
            try:
                results = _split(self.runner.infer(_stack(feeds)), [_rows(feed) for feed in feeds])
            except Exception:  # noqa: BLE001 (the requests are answered one by one below, each with its error)
                results = None
            if results is not None:
                return [self._response(request, result) for request, result in zip(requests, results, strict=True)]
        responses = []
        for request, feed in zip(requests, feeds, strict=True):
            try:
                responses.append(self._response(request, self.runner.infer(feed)))
            except Exception as error:  # noqa: BLE001 (the client gets the runner's message, as from our service)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses

    def finalize(self) -> None:
        self.runner.close()

    def _feed(self, request: Any) -> dict[str, np.ndarray]:
        # Copied: the request's memory is Triton's and is released once execute returns.
        return {tensor.name(): np.array(np.from_dlpack(tensor)) for tensor in request.inputs()}

    def _response(self, request: Any, outputs: dict[str, np.ndarray]) -> Any:
        wanted = set(request.requested_output_names()) or set(self.output_names)
        tensors = [
            pb_utils.Tensor.from_dlpack(name, np.ascontiguousarray(outputs[name]))
            for name in self.output_names
            if name in wanted
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)


def _rows(feed: dict[str, np.ndarray]) -> int:
    return int(next(iter(feed.values())).shape[0])


def _stackable(feeds: list[dict[str, np.ndarray]]) -> bool:
    def layout(feed: dict[str, np.ndarray]) -> dict[str, tuple]:
        return {name: (array.shape[1:], array.dtype) for name, array in feed.items()}

    first = layout(feeds[0])
    return all(layout(feed) == first for feed in feeds[1:])


def _stack(feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([feed[name] for feed in feeds]) for name in feeds[0]}


def _split(outputs: dict[str, np.ndarray], rows: list[int]) -> list[dict[str, np.ndarray]]:
    edges = np.cumsum(rows)[:-1]
    parts = {name: np.split(array, edges) for name, array in outputs.items()}
    return [{name: parts[name][number] for name in parts} for number in range(len(rows))]


CAPSULE_NAME_ERROR = "PyCapsule_GetPointer called with incorrect name"


def _quiet_capsule_names(hook: Any) -> Any:
    """`hook` less the destructor message of a numpy capsule Tensor.from_dlpack consumed (see the docstring)."""

    def quiet(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, ValueError) and str(unraisable.exc_value) == CAPSULE_NAME_ERROR):
            hook(unraisable)

    return quiet
