"""The PyTorch runner: the model itself, loaded from the manifest's settings, eager, optionally AMP fp16 on CUDA; with
POSTPROCESS=nms, its head through the reference NMS (pipeline/postprocess/nms.py), so it returns what the graphs do."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..core.precision import Precision
from ..folder.reader import ArtifactFolder
from ..postprocess.nms import detections_of
from .base import Runner


class TorchRunner(Runner):
    backend = "torch"

    def __init__(
        self,
        folder: ArtifactFolder,
        *,
        device: str | None = None,
        amp: bool | None = None,
        split_large_batches: bool = True,
        trust_model_file: bool = False,
    ):
        """device: "cuda" where available, else "cpu"; amp (autocast to fp16): on by default for fp16 on CUDA.

        trust_model_file: the folder was built from a whole pickled nn.Module file, and you trust it: loading
        it runs the code it names.  Not taken from the manifest: a folder may come from someone else.
        """
        import torch

        from ... import models
        from ...models.prepare import prepare

        super().__init__(folder, split_large_batches=split_large_batches)
        self.device = _torch_device(device)  # before the model loads: a typo should not cost a model load
        settings = folder.manifest.settings or {}  # open_folder requires it
        spec = models.load_model(
            settings["model"],
            weights=settings.get("weights"),
            input_shape=settings.get("input_shape"),
            dynamic=settings.get("dynamic"),
            trust_model_file=trust_model_file,
        )
        prepare(spec)  # eval mode, gradients off, proven; the same stage the export ran
        if amp and self.device.type != "cuda":
            raise PipelineError("amp=True needs a CUDA device", "pass amp=False, or device='cuda' on a GPU machine")
        self.amp = self.device.type == "cuda" and (amp if amp is not None else folder.precision is Precision.FP16)
        self.module = spec.module.to(self.device)
        # The model's own outputs; with POSTPROCESS=nms the head becomes the detections, by the reference NMS.
        self._output_dtypes = {tensor.name: tensor.numpy_dtype for tensor in folder.manifest.head_outputs()}
        self._nms = folder.manifest.nms()
        mode = "AMP fp16" if self.amp else "fp32 eager"
        why = "a CUDA device is available" if self.device.type == "cuda" else "no CUDA device"
        self.description = f"torch {torch.__version__} {spec.name} on {self.device} ({mode}; {why})"

    def _free(self) -> None:
        del self.module  # the weights, on the GPU where it ran there

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        import torch

        from ...models.prepare import flatten_outputs
        from ...models.spec import call_module

        tensors = {
            spec.name: torch.from_numpy(np.ascontiguousarray(feed[spec.name])).to(self.device) for spec in self.inputs
        }
        autocast = torch.autocast("cuda", dtype=torch.float16) if self.amp else contextlib.nullcontext()
        # inference_mode and autocast are thread-local, and an eval-mode module mutates no state in forward,
        # so concurrent calls need no lock.
        with torch.inference_mode(), autocast:
            results = flatten_outputs(call_module(self.module, tensors))
        outputs = {
            name: result.detach().cpu().numpy().astype(self._output_dtypes[name], copy=False)
            for name, result in zip(self._output_dtypes, results, strict=True)
        }
        return outputs if self._nms is None else detections_of(outputs, self._nms)


def _torch_device(device: str | None) -> Any:
    """torch.device(device), by default CUDA where available; a name torch does not know, or CUDA where torch has no
    usable CUDA device, is refused here rather than when the weights are moved."""
    import torch

    try:
        chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise PipelineError(
            f"device={device!r} is no torch device ({error})", "give 'cpu', 'cuda' or 'cuda:<n>'"
        ) from None
    if chosen.type == "cuda" and not (torch.cuda.is_available() and (chosen.index or 0) < torch.cuda.device_count()):
        raise PipelineError(
            f"device={device!r}: torch {torch.__version__} has no such CUDA device here "
            f"({torch.cuda.device_count()} visible)",
            "give device='cpu', or run on a machine with that GPU and a CUDA build of torch",
        )
    return chosen
