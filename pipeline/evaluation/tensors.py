"""Running a graph with its intermediate tensors exposed as outputs: what the FP16 overflow scan, the node-by-node
comparison, calibration's statistics (smoothing maxima, bias means, compute shapes) read.

The graph is a ModelProto: its weights in it, or (`weights`: the folder its references are relative to) a graph read
by pipeline.folder.graph_files.graph_without_weights, whose weights stay on disk and are mapped by ONNX Runtime,
never copied: the exposed copy is written beside them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..core.sessions import onnxruntime_session
from ..folder.graph_files import graph_beside, save_graph


def tensor_values(
    model: onnx.ModelProto, tensors: Iterable[str], feeds: Iterable[dict], *, weights: Path | None = None
) -> Iterator[dict]:
    """For each of `feeds`, {tensor: its value} for `tensors` of `model`, run on the CPU provider with them exposed
    as outputs of a copy of the graph (a graph input among them is the feed's own)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    fed = {value.name for value in exposed.graph.input}
    present = {value.name for value in exposed.graph.output}
    names = list(dict.fromkeys(tensors))
    wanted = [name for name in names if name not in fed]
    exposed.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted if name not in present)
    session = _session(exposed, weights=weights)
    for feed in feeds:
        values = dict(zip(wanted, session.run(wanted, feed), strict=True)) if wanted else {}
        yield {name: values[name] if name in values else feed[name] for name in names}


def run_exposing_tensors(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, simulate_qdq: bool = False, weights: Path | None = None
) -> dict[str, np.ndarray]:
    """Every float tensor a graph computes (node outputs, graph inputs), by name, for one run.
    simulate_qdq: Q/DQ run as TensorRT computes them (pipeline.core.sessions), for the TensorRT-shaped INT8 graph."""
    return ExposingSession(model, simulate_qdq=simulate_qdq, weights=weights).run(feeds)


class ExposingSession:
    """An ONNX Runtime session over a copy of the graph whose outputs are all its float node outputs; made
    once for many runs (a session per run costs more than the run on a small graph)."""

    def __init__(self, model: onnx.ModelProto, *, simulate_qdq: bool = False, weights: Path | None = None) -> None:
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
        self.session = _session(exposed, simulate_qdq=simulate_qdq, weights=weights)
        self.names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**feeds, **dict(zip(self.names, self.session.run(self.names, feeds), strict=True))}


def _session(exposed: onnx.ModelProto, *, simulate_qdq: bool = False, weights: Path | None = None):
    """A CPU session on `exposed`: written beside the weights it references (`weights`), which ONNX Runtime maps,
    or, with its weights in it, saved to a scratch folder (the session keeps the graph; the file can go)."""
    if weights is not None:
        with graph_beside(exposed, weights) as path:
            return onnxruntime_session(path, simulate_qdq=simulate_qdq, pack_weights=False)
    with tempfile.TemporaryDirectory(prefix="exposed.") as folder:
        path = Path(folder) / "exposed.onnx"
        save_graph(exposed, path, scratch=True)
        return onnxruntime_session(path, simulate_qdq=simulate_qdq)
