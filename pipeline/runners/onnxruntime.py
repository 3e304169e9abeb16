"""The ONNX Runtime runner: the graph the engine was built from, on the CUDA provider where a GPU is present."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import PipelineError
from pipeline.parity import onnxruntime_session
from pipeline.precision import GRAPH_NAMES
from pipeline.runners.base import Runner

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def choose_providers(requested: list[str] | None) -> tuple[list[str], str]:
    """(providers, why): CUDA then CPU where a GPU is really present, else CPU alone.

    onnxruntime-gpu lists CUDA (and TensorRT) as *available* even on a machine with no GPU
    or driver: availability only says the provider was compiled in.  So the decision is taken
    from the driver (gpu_present), not from get_available_providers().
    """
    import onnxruntime as ort

    from pipeline.trt_module import gpu_present

    if requested:
        return list(requested), "providers as requested"
    if not gpu_present():
        return [CPU], "no NVIDIA GPU/driver present"
    if CUDA not in ort.get_available_providers():
        return [CPU], "a GPU is present but this onnxruntime build has no CUDA provider (install onnxruntime-gpu)"
    return [CUDA, CPU], "a GPU is present"


class OnnxRuntimeRunner(Runner):
    backend = "onnxruntime"

    def __init__(
        self,
        folder: Path,
        manifest: dict,
        *,
        providers: list[str] | None = None,
        split_large_batches: bool = True,
    ):
        import onnxruntime as ort

        super().__init__(folder, manifest, split_large_batches=split_large_batches)
        graph = self.folder / manifest.get("graph", GRAPH_NAMES["fp32"])
        if not graph.is_file():
            raise PipelineError(
                f"{graph} does not exist, so ONNX Runtime has nothing to run",
                f"rebuild the folder: make engine MODEL={manifest.get('settings', {}).get('model', '<model>')} "
                f"PRECISION={manifest.get('precision', '<precision>')}",
            )
        chosen, why = choose_providers(providers)
        self.session = onnxruntime_session(graph, chosen)
        self._output_names = [spec.name for spec in self.outputs]
        used = self.session.get_providers()
        # ORT falls back to the CPU silently when a requested provider fails to load; report what it really uses.
        self.description = f"onnxruntime {ort.__version__} running {graph.name} on {', '.join(used)} ({why})"

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        # InferenceSession.run is documented as safe to call concurrently on one session, so no lock here.
        results = self.session.run(self._output_names, feed if isinstance(feed, dict) else dict(feed))
        return dict(zip(self._output_names, results, strict=True))
