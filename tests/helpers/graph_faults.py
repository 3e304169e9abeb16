"""Graphs of a built folder made to fail in ONNX Runtime, recorded in the manifest as if the build had written them
(the folder's sha256 checks pass, and what follows is ONNX Runtime's to say): the faults auto must survive."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx

from trt_pipeline.pipeline.folder.provenance import describe_artifacts


def recorded(folder: Path, graph: str, model: onnx.ModelProto) -> None:
    """`model` saved as the folder's `graph`, its sha256 recorded in the manifest."""
    onnx.save(model, str(folder / graph))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["artifacts"][graph] = dataclasses.asdict(describe_artifacts(folder, [graph])[graph])
    (folder / "manifest.json").write_text(json.dumps(manifest))


def unopenable(folder: Path, graph: str) -> None:
    """The graph with a node of an operator ONNX Runtime does not have: it refuses to open it."""
    model = onnx.load(str(folder / graph))
    output = model.graph.output[0].name
    model.graph.node.append(onnx.helper.make_node("NoSuchOperator", [output], ["unused"]))
    recorded(folder, graph, model)


def fails_when_run(folder: Path, graph: str, rows: int = 3) -> None:
    """The graph's output (10 values a row) reshaped to `rows` rows and back: it opens, and a call of a batch whose
    10 x batch values do not fill `rows` rows fails in ONNX Runtime's Reshape (for 3: every batch of 1, 4 or 8)."""
    model = onnx.load(str(folder / graph))
    output = model.graph.output[0]
    inner = f"{output.name}_before"
    for node in model.graph.node:
        node.output[:] = [inner if name == output.name else name for name in node.output]
    shapes = [
        onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [2], values)
        for name, values in (("fixed_rows", [rows, -1]), ("its_rows", [-1, 10]))
    ]
    model.graph.initializer.extend(shapes)
    model.graph.node.extend(
        [
            onnx.helper.make_node("Reshape", [inner, "fixed_rows"], ["in_fixed_rows"]),
            onnx.helper.make_node("Reshape", ["in_fixed_rows", "its_rows"], [output.name]),
        ]
    )
    recorded(folder, graph, model)
