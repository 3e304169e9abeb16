"""What the output-dim tests share: an ONNX graph with an output only its data sizes, its inputs, and a graph's
output dims as the file declares them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.stages.sequence import make_engine

PROFILE = BatchProfile(1, 2, 4)


def output_dims(graph: Path) -> dict[str, list]:
    """Each output's dims as the graph file declares them: a dim_param's name, else its size."""
    model = onnx.load(str(graph), load_external_data=False)
    return {
        output.name: [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
        for output in model.graph.output
    }


def column_filter_graph(path: Path) -> Path:
    """x [batch, 16] -> kept [batch, columns]: the leading columns, as many as there are columns whose largest value
    passes 0.5 (a count only the values decide: NonZero's kind, in ops TensorRT-RTX builds, which NonZero is not),
    and total [batch, 1], each row's sum, an output the inputs size."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["column_max"], axes=[0], keepdims=0),
        helper.make_node("Greater", ["column_max", "threshold"], ["passes"]),
        helper.make_node("Cast", ["passes"], ["passes_int"], to=i64),
        helper.make_node("ReduceSum", ["passes_int", "zero"], ["count"], keepdims=1),
        helper.make_node("Slice", ["x", "zero", "count", "one"], ["kept"]),
        helper.make_node("ReduceSum", ["x", "one"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "column_filter",
        [helper.make_tensor_value_info("x", f, ["batch", 16])],
        [
            helper.make_tensor_value_info("kept", f, ["batch", "columns"]),
            helper.make_tensor_value_info("total", f, ["batch", 1]),
        ],
        initializer=[
            helper.make_tensor("threshold", f, [], [0.5]),
            helper.make_tensor("zero", i64, [1], [0]),
            helper.make_tensor("one", i64, [1], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def column_filter_folder(root: Path) -> Path:
    """The column filter built as MODEL=<file>.onnx, FP32."""
    source = column_filter_graph(root / "column_filter.onnx")
    return make_engine(Settings(model=str(source), precision="fp32", batch=PROFILE, out_root=root / "engines"))


def column_rows(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}
