"""Running a graph with its intermediate tensors exposed as outputs: what the FP16 overflow scan, the node-by-node
comparison, calibration's statistics (smoothing maxima, bias means, compute shapes) read.

The graph is a ModelProto: its weights in it, or (`weights`: the folder its references are relative to) a graph read
by pipeline.folder.graph_files.graph_without_weights, whose weights stay on disk and are mapped by ONNX Runtime,
never copied: the exposed copy is written beside them.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..core.sessions import onnxruntime_session
from ..folder.graph_files import INLINE_TENSOR_BYTES, graph_beside, set_location
from ..folder.onnx_wire import tensor_bytes

FLOAT = TensorProto.FLOAT


def tensor_values(
    model: onnx.ModelProto,
    tensors: Iterable[str],
    feeds: Iterable[dict],
    *,
    weights: Path | None = None,
    level: str | None = None,
) -> Iterator[dict]:
    """For each of `feeds`, {tensor: its value} for `tensors` of `model`, run on the CPU provider with them exposed
    as outputs of a copy of the graph (a graph input among them is the feed's own).  level: the optimization level
    to open that copy at, where the caller knows it (pipeline/core/sessions.py: the level a graph file already
    probed opens at); None: the highest that does not crash, probed in a child.  The session is opened here and
    the copy dropped; each run's values are held only by the caller, who holds one batch of intermediate tensors at
    a time by dropping each before asking for the next."""
    names = list(dict.fromkeys(tensors))
    with _weightless_copy(model, weights) as (exposed, folder):
        fed = {value.name for value in exposed.graph.input}
        present = {value.name for value in exposed.graph.output}
        wanted = [name for name in names if name not in fed]
        exposed.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted if name not in present)
        session = _session(exposed, folder, level=level)
    return (_exposed_values(session, wanted, names, feed) for feed in feeds)


def _exposed_values(session, wanted: list[str], names: list[str], feed: dict) -> dict:
    """One run's {tensor: value} for `names`: the exposed outputs in `wanted`, the rest from the feed."""
    values = dict(zip(wanted, session.run(wanted, feed), strict=True)) if wanted else {}
    return {name: values[name] if name in values else feed[name] for name in names}


def run_exposing_tensors(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    *,
    simulate_qdq: bool = False,
    weights: Path | None = None,
    only: Collection[str] | None = None,
    level: str | None = None,
) -> dict[str, np.ndarray]:
    """Every float tensor a graph computes (node outputs, graph inputs), by name, for one run; `only`: of the node
    outputs, those it names (ExposingSession).
    simulate_qdq: Q/DQ run as TensorRT computes them (pipeline.core.sessions), for the TensorRT-shaped INT8 graph.
    level: as tensor_values'."""
    return ExposingSession(model, simulate_qdq=simulate_qdq, weights=weights, only=only, level=level).run(feeds)


class ExposingSession:
    """An ONNX Runtime session over a copy of the graph whose outputs are all its float node outputs (`only`: those
    it names, where a caller reads no others: a run holds every output it exposes, and an INT8 graph's own
    DequantizeLinear outputs are its weights in float); made once for many runs (a session per run costs more
    than the run on a small graph)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        *,
        simulate_qdq: bool = False,
        weights: Path | None = None,
        only: Collection[str] | None = None,
        level: str | None = None,
    ) -> None:
        with _weightless_copy(model, weights) as (exposed, folder):
            inferred = onnx.shape_inference.infer_shapes(exposed)
            known = {value.name: value for value in [*inferred.graph.value_info, *inferred.graph.output]}
            present = {output.name for output in exposed.graph.output}
            for node in exposed.graph.node:
                for name in node.output:
                    if only is not None and name not in only:
                        continue
                    value = known.get(name)
                    if value is not None and name not in present and value.type.tensor_type.elem_type == FLOAT:
                        exposed.graph.output.append(value)
                        present.add(name)
            self.session = _session(exposed, folder, simulate_qdq=simulate_qdq, level=level)
        self.names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**feeds, **dict(zip(self.names, self.session.run(self.names, feeds), strict=True))}


def _session(exposed: onnx.ModelProto, folder: Path, *, simulate_qdq: bool = False, level: str | None = None):
    """A CPU session on `exposed`, written beside the weights it references (in `folder`), which ONNX Runtime maps
    and packs none of (the session keeps the graph; the file can go)."""
    with graph_beside(exposed, folder) as path:
        return onnxruntime_session(path, simulate_qdq=simulate_qdq, level=level, pack_weights=False)


@contextlib.contextmanager
def _weightless_copy(model: onnx.ModelProto, weights: Path | None) -> Iterator[tuple[onnx.ModelProto, Path]]:
    """(a copy of `model` whose large initializers reference their bytes on disk, the folder they are in): `model`'s
    own references where it was read without its weights (`weights`: their folder); else its weights written to a
    scratch folder's data file one tensor at a time, never copied in memory (each tensor's bytes are taken out of
    `model` while it is copied, and put back).  A copy of a model with its weights in it, and shape inference on
    one, held them two and three times over."""
    if weights is not None:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        yield copy, weights
        return
    # Sized from type and dims: reading raw_data to measure it would copy it.
    large = [t for t in model.graph.initializer if t.HasField("raw_data") and tensor_bytes(t) >= INLINE_TENSOR_BYTES]
    with tempfile.TemporaryDirectory(prefix="exposed.") as folder:
        data = Path(folder) / "weights.data"
        places, aside = [], []
        try:
            with open(data, "wb") as out:
                for tensor in large:
                    raw = tensor.raw_data
                    tensor.ClearField("raw_data")
                    aside.append((tensor, raw))
                    places.append((out.tell(), len(raw)))
                    out.write(raw)
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
        finally:
            for tensor, raw in aside:
                tensor.raw_data = raw
        positions = {tensor.name: place for tensor, place in zip(large, places, strict=True)}
        for tensor in copy.graph.initializer:
            if tensor.name in positions:
                set_location(tensor, data.name, *positions[tensor.name])
        yield copy, Path(folder)
