"""What every runner shares: tensor specs from the manifest, input validation, batch chunking.

A runner reads one artifact folder (engines/<model>-<precision>/, opened by pipeline.folder.reader) and answers
`infer({name: array}) -> {name: array}` the same way whatever runs underneath, so a
service can swap ONNX Runtime for the engine without changing a line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import PipelineError
from ..core.settings import Postprocess, engine_command, mention, mention_name
from ..folder.graph_io import GraphTensor
from ..folder.manifest import Manifest
from ..folder.reader import ArtifactFolder
from ..folder.rebuild import rebuild_hint

DYNAMIC = -1
BATCH_AXIS = 0


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: its numpy dtype and shape, -1 for a dynamic dim."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    # (axis, min, max) for each named dynamic dim other than the batch (e.g. "seq"), from the manifest's
    # axis_ranges: the engine's profile accepts only those sizes, so every backend checks them alike.
    ranges: tuple[tuple[int, int, int], ...] = ()
    # (axis, size) of every fixed dim, precomputed so validating a call is one short loop.
    fixed: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fixed = tuple((axis, size) for axis, size in enumerate(self.shape) if size != DYNAMIC)
        object.__setattr__(self, "fixed", fixed)  # frozen dataclass: set once here

    @classmethod
    def from_manifest(cls, tensor: GraphTensor, axis_ranges: dict[str, tuple[int, int, int]]) -> TensorSpec:
        ranges = tuple(
            (axis, axis_ranges[d][0], axis_ranges[d][2])
            for axis, d in enumerate(tensor.shape)
            if axis != BATCH_AXIS and isinstance(d, str) and d in axis_ranges
        )
        return cls(tensor.name, tensor.numpy_dtype, tuple(tensor.sizes()), ranges)


def tensor_specs(manifest: Manifest, key: str) -> list[TensorSpec]:
    """The manifest's "inputs" or "outputs" as TensorSpecs."""
    records = manifest.inputs if key == "inputs" else manifest.outputs
    if not records:
        raise PipelineError(
            f"the manifest lists no {key} (the check stage did not finish)",
            f"rebuild the folder: {rebuild_hint(manifest)}",
        )
    return [TensorSpec.from_manifest(record, manifest.axis_ranges) for record in records]


def check_graph_agrees(
    folder: ArtifactFolder, graph: str, inputs: list[GraphTensor], outputs: list[GraphTensor]
) -> None:
    """The manifest's inputs and outputs are what every runner and the service check a request against: they must be
    the loaded graph's (names, dtypes, ranks, fixed sizes), or a correct request is refused in the manifest's name
    (an edited manifest blamed the caller: "has shape (8, 16), expected (-1, 32)")."""
    manifest = folder.manifest
    for key, declared, actual in (("inputs", manifest.inputs, inputs), ("outputs", manifest.outputs, outputs)):
        disagreement = _disagreement(key, declared, actual)
        if disagreement:
            raise PipelineError(
                f"the manifest of {folder.path} does not describe its graph {graph}: {disagreement}; the manifest was "
                "edited or is another build's, and requests checked against it "
                "would be refused or fail",
                f"rebuild the folder: {folder.rebuild_hint()}",
            )


def _disagreement(key: str, declared: Sequence[GraphTensor], actual: list[GraphTensor]) -> str | None:
    found = {tensor.name: tensor for tensor in actual}
    if sorted(found) != sorted(tensor.name for tensor in declared):
        return f"{key} {[tensor.name for tensor in declared]} in the manifest, {sorted(found)} in the graph"
    for tensor in declared:
        other = found[tensor.name]
        if tensor.dtype != other.dtype or not _sizes_agree(key, tensor.sizes(), other.sizes()):
            return (
                f"{key[:-1]} {tensor.name!r} is {_described(tensor)} in the manifest, {_described(other)} in the graph"
            )
    return None


def _sizes_agree(key: str, manifest: list[int], graph: list[int]) -> bool:
    """Inputs exactly: requests are checked against them.  Outputs where both fix a size: the manifest has them from
    the check stage's shape inference, and simplifying can fix a dim it left open (Swin) or leave open one it sized
    (GPT-2), never change a fixed one."""
    if key == "inputs":
        return manifest == graph
    pairs = zip(manifest, graph, strict=False)
    return not graph or len(manifest) == len(graph) and all(DYNAMIC in (m, g) or m == g for m, g in pairs)


def _described(tensor: GraphTensor) -> str:
    return f"{tensor.dtype} {tensor.sizes()}"


def max_batch(manifest: Manifest) -> int:
    """The profile's max batch (read_manifest has refused a profile without a max of 1 or more)."""
    if manifest.batch_profile is None:
        raise PipelineError(
            "the manifest has no batch_profile (the export stage did not finish)",
            f"rebuild the folder: {rebuild_hint(manifest)}",
        )
    return manifest.batch_profile.max


def _dtype_and_shape(name: str, value: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, shape) of a value that is not exactly an np.ndarray: a subclass, or a mistake."""
    if isinstance(value, np.ndarray):
        return value.dtype, value.shape
    raise PipelineError(
        f"input {name!r} is a {type(value).__name__}, expected a numpy array",
        f"pass np.asarray(...) for {name!r}",
    )


def check_feed(feed: Mapping[str, Any], specs: list[TensorSpec], describe=_dtype_and_shape) -> int:
    """Validate names, dtypes, ranks and fixed dims of every input; return the common batch size.

    Plain numpy arrays take the fast path; anything else goes through `describe(name, value) ->
    (np.dtype, shape)`, which lets the engine runner accept torch CUDA tensors too.  This runs on
    every call, so it is kept to attribute reads and short loops (a few microseconds).
    """
    if not isinstance(feed, Mapping):
        _refuse_non_mapping(feed, specs)
    if len(feed) != len(specs) or any(spec.name not in feed for spec in specs):
        _refuse_names(feed, specs)
    batch = -1
    for spec in specs:
        value = feed[spec.name]
        if type(value) is np.ndarray:
            dtype, shape = value.dtype, value.shape
        else:
            dtype, shape = describe(spec.name, value)
        if dtype != spec.dtype:
            raise PipelineError(
                f"input {spec.name!r} has dtype {dtype}, expected {spec.dtype}",
                f"convert it first, e.g. array.astype(np.{spec.dtype})",
            )
        if len(shape) != len(spec.shape):
            _refuse_shape(spec, shape)
        for axis, size in spec.fixed:
            if shape[axis] != size:
                _refuse_shape(spec, shape)
        for axis, low, high in spec.ranges:
            if not low <= shape[axis] <= high:
                raise PipelineError(
                    f"input {spec.name!r} has size {shape[axis]} on axis {axis}, outside the range [{low}, {high}] "
                    "the artifacts were built for",
                    f"cut or pad it into that range, or rebuild with a wider {mention_name('dynamic')} range "
                    f"({engine_command(more=True)})",
                )
        if batch == -1:
            batch = shape[BATCH_AXIS]
        elif shape[BATCH_AXIS] != batch:
            raise PipelineError(
                f"input {spec.name!r} has batch {shape[BATCH_AXIS]} but {specs[0].name!r} has batch {batch}",
                "give every input the same number of rows (axis 0)",
            )
    if batch < 1:
        raise PipelineError("the inputs hold an empty batch (0 rows)", "send at least one row")
    return batch


def refuse_non_finite_images(feed: Mapping[str, Any], specs: list[TensorSpec]) -> None:
    """A detector's (POSTPROCESS=nms) float inputs must be finite.  Non-finite inputs otherwise pass to the model as
    sent, and a classifier's NaN outputs carry them back; NMS drops every candidate whose score is not a number (NaN
    is not above the threshold), so an image it could not score would come back as count 0, "nothing detected".
    Host arrays only: a device tensor (infer_on_device) stays on its device, unread."""
    for spec in specs:
        value = feed[spec.name]
        if spec.dtype.kind != "f" or not isinstance(value, np.ndarray) or np.isfinite(value).all():
            continue
        images = np.flatnonzero(~np.isfinite(value.reshape(len(value), -1)).all(axis=1))
        raise PipelineError(
            f"input {spec.name!r} holds NaN or infinity in image {', '.join(map(str, images[:8]))} (of {len(value)}): "
            "the detector's NMS drops every candidate whose score is not a number, so it would answer count 0 "
            "(nothing detected) for an image it could not score",
            "send finite values: a classifier's outputs carry a NaN back, a detector's count cannot",
        )


def _refuse_non_mapping(feed: object, specs: list[TensorSpec]) -> None:
    # An array would otherwise reach `name in feed`, which numpy answers by comparing every element.
    example = ", ".join(f"{spec.name!r}: array" for spec in specs)
    raise PipelineError(
        f"the inputs are a {type(feed).__name__}, not a dict of input name -> array",
        f"pass {{{example}}}",
    )


def _refuse_names(feed: Mapping[str, Any], specs: list[TensorSpec]) -> None:
    expected = [spec.name for spec in specs]
    missing = [name for name in expected if name not in feed]
    unexpected = [name for name in feed if name not in expected]
    parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else [])
    raise PipelineError(f"inputs {'; '.join(parts)}; the model takes {expected}", f"pass exactly {expected}")


def _refuse_shape(spec: TensorSpec, shape: tuple[int, ...]) -> None:
    raise PipelineError(
        f"input {spec.name!r} has shape {tuple(shape)}, expected {_shape_text(spec)}",
        "reshape it; dims shown as -1 may vary, the others are fixed by the model",
    )


def _shape_text(spec: TensorSpec) -> str:
    return "(" + ", ".join("-1" if d == DYNAMIC else str(d) for d in spec.shape) + ")"


class Runner:
    """The contract services use: `infer(feed) -> outputs`, context manager, specs and a description.

    Subclasses set `backend` and `description` and implement `_run(feed)` for one batch of at most
    `max_batch` rows that has already been validated, and `_free()` (or `close()`) to release what they hold.
    """

    backend: str = ""

    def __init__(self, folder: ArtifactFolder, *, split_large_batches: bool = True):
        self.folder = folder
        self.manifest = folder.manifest
        self.inputs = tensor_specs(self.manifest, "inputs")
        self.outputs = tensor_specs(self.manifest, "outputs")
        self.max_batch = max_batch(self.manifest)
        self.split_large_batches = split_large_batches
        self.description = ""
        self._closed = False

    def infer(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Validate the feed, run it (in chunks of max_batch rows when larger), return host arrays by name."""
        self._refuse_if_closed()
        batch = self._check(feed)
        if self.folder.postprocess is Postprocess.NMS:
            refuse_non_finite_images(feed, self.inputs)
        if batch <= self.max_batch:
            return self._run(feed)
        if not self.split_large_batches:
            raise PipelineError(
                f"a batch of {batch} rows is larger than the profile's max batch {self.max_batch}",
                f"send at most {self.max_batch} rows, load the runner with split_large_batches=True, or rebuild "
                f"with a larger {mention(batch='min:opt:max')} ({engine_command(more=True)})",
            )
        return self._run_chunked(feed, batch)

    def _refuse_if_closed(self) -> None:
        if self._closed:  # what it ran on is freed: every backend refuses alike, rather than fail somewhere inside
            raise PipelineError("this runner was closed", "load a new one with load_runner(...)")

    def _check(self, feed: Mapping[str, Any]) -> int:
        return check_feed(feed, self.inputs)

    def _run_chunked(self, feed: Mapping[str, Any], batch: int) -> dict[str, np.ndarray]:
        parts = [
            self._run({name: value[start : start + self.max_batch] for name, value in feed.items()})
            for start in range(0, batch, self.max_batch)
        ]
        return {name: np.concatenate([part[name] for part in parts], axis=BATCH_AXIS) for name in parts[0]}

    def _run(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the runner allocated (once; a second close does nothing); infer is refused afterwards."""
        if not self._closed:
            self._closed = True
            self._free()

    def _free(self) -> None:
        """What close() releases; the default has nothing to free."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.folder.path}: {self.description}>"
