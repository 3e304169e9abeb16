"""Running a graph with its intermediate tensors exposed as outputs: what the FP16 overflow scan, the node-by-node
comparison, calibration's statistics (smoothing maxima, bias means, compute shapes) read."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..core.sessions import onnxruntime_session


def tensor_values(
    model: onnx.ModelProto, tensors: Iterable[str], feeds: Iterable[dict], *, level: str | None = None
) -> Iterator[dict]:
    """For each of `feeds`, {tensor: its value} for `tensors` of `model`, run on the CPU provider with them exposed
    as outputs of a copy of the graph (a graph input among them is the feed's own).  level: the optimization level
    to open that copy at, where the caller knows it (pipeline/core/sessions.py: the level a graph file already
    probed opens at); None: the highest that does not crash, probed in a child.  The session is opened here and
    the copy dropped; each run's values are held only by the caller, who holds one batch of intermediate tensors at
    a time by dropping each before asking for the next."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    fed = {value.name for value in exposed.graph.input}
    present = {value.name for value in exposed.graph.output}
    names = list(dict.fromkeys(tensors))
    wanted = [name for name in names if name not in fed]
    exposed.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted if name not in present)
    session = _session(exposed, level=level)
    return (_exposed_values(session, wanted, names, feed) for feed in feeds)


def _exposed_values(session, wanted: list[str], names: list[str], feed: dict) -> dict:
    """One run's {tensor: value} for `names`: the exposed outputs in `wanted`, the rest from the feed."""
    values = dict(zip(wanted, session.run(wanted, feed), strict=True)) if wanted else {}
    return {name: values[name] if name in values else feed[name] for name in names}


def run_exposing_tensors(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, simulate_qdq: bool = False
) -> dict[str, np.ndarray]:
    """Every float tensor a graph computes (node outputs, graph inputs), by name, for one run.
    simulate_qdq: Q/DQ run as TensorRT computes them (pipeline.core.sessions), for the TensorRT-shaped INT8 graph."""
    return ExposingSession(model, simulate_qdq=simulate_qdq).run(feeds)


class ExposingSession:
    """An ONNX Runtime session over a copy of the graph whose outputs are all its float node outputs; made
    once for many runs (a session per run costs more than the run on a small graph)."""

    def __init__(self, model: onnx.ModelProto, *, simulate_qdq: bool = False) -> None:
        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
        inferred = onnx.shape_inference.infer_shapes(exposed)
        known = {value.name: value for value in [*inferred.graph.value_info, *inferred.graph.output]}
        present = {output.name for output in exposed.graph.output}
        for node in exposed.graph.node:
            for name in node.output:
                value = known.get(name)
                if value is not None and name not in present and value.type.tensor_type.elem_type == TensorProto.FLOAT:
                    exposed.graph.output.append(value)
                    present.add(name)
        self.session = _session(exposed, simulate_qdq=simulate_qdq)
        self.names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**feeds, **dict(zip(self.names, self.session.run(self.names, feeds), strict=True))}


def _session(exposed: onnx.ModelProto, *, simulate_qdq: bool = False, level: str | None = None):
    """A CPU session on `exposed`, saved to a scratch file first (the session keeps the graph; the file can go)."""
    with tempfile.TemporaryDirectory(prefix="exposed.") as folder:
        path = Path(folder) / "exposed.onnx"
        onnx.save(exposed, str(path))
        return onnxruntime_session(path, simulate_qdq=simulate_qdq, level=level)
