"""INT8 for transformer encoders: a BertModel (small config, no download) calibrated from a .npz of token inputs.

The whole pipeline runs (export → … → INT8 Q/DQ → agreement gate → TensorRT-RTX build); the TensorRT-shaped
graph is checked for the placement TensorRT fuses in attention and MLP blocks, and a CPU-shaped graph that
ONNX Runtime's quantizer cannot make is recorded, never raised, and never loses the TensorRT graph.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trt_pipeline.calibration.int8 import (
    CACHE_FOLDER,
    CalibrationConfig,
    make_int8_graph,
    written_cpu_graphs,
)
from trt_pipeline.models.spec import DynamicAxis, ModelSpec
from trt_pipeline.pipeline.manifest import GRAPHS, cpu_graphs
from trt_pipeline.pipeline.settings import Settings
from trt_pipeline.pipeline.stages import make_engine

pytest.importorskip("transformers")

SEQ, VOCAB = 16, 500
# Ops TensorRT keeps in higher precision inside attention and MLP blocks: no Q/DQ may feed them.  (A residual Add
# may read a shared DequantizeLinear, as in calibration/qdq.py: TensorRT fuses it.)
HIGHER_PRECISION = ("LayerNormalization", "Softmax", "Erf", "Div", "Mul", "Where", "ReduceMean")


class _LastHiddenState(torch.nn.Module):
    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def tiny_bert() -> ModelSpec:
    """BertModel from a 2-layer config (random weights, seeded), token inputs with a dynamic sequence axis."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    tokens = _tokens(2, seed=1)
    return ModelSpec(
        name="tiny_bert",
        module=_LastHiddenState(BertModel(config, add_pooling_layer=False)).eval(),
        example_inputs={name: torch.from_numpy(array) for name, array in tokens.items()},
        output_names=["last_hidden_state"],
        dynamic_axes={name: {1: DynamicAxis("sequence", 1, SEQ, 32)} for name in tokens},
    )


def _tokens(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids with padded tails of different lengths, as a tokenizer's padded batch has."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(1, VOCAB, (rows, SEQ), dtype=np.int64)
    attention_mask = np.ones((rows, SEQ), dtype=np.int64)
    for row, length in enumerate(rng.integers(SEQ // 2, SEQ + 1, rows)):
        attention_mask[row, length:] = 0
        input_ids[row, length:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture(scope="module")
def bert_int8(tmp_path_factory) -> Path:
    """The finished int8 folder of tiny_bert, calibrated (max) on 64 rows of tokens from a .npz."""
    root = tmp_path_factory.mktemp("bert")
    calib = root / "tokens.npz"
    np.savez(calib, **_tokens(64, seed=2))
    settings = Settings(
        model=f"{__name__}:tiny_bert", precision="int8", calib=calib, calib_method="max", out_root=root / "engines"
    )
    return make_engine(settings)


def test_bert_int8_builds_every_graph_and_passes_the_gate(bert_int8):
    manifest = json.loads((bert_int8 / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["graphs"] == GRAPHS["int8"]  # the CPU graphs are written for transformers too
    for graph in cpu_graphs("int8").values():
        assert (bert_int8 / graph).is_file()
    agreement = manifest["agreement_int8"]
    assert agreement["graphs"]["model.int8.onnx"]["outputs"]["last_hidden_state"]["error_mean"] <= agreement["gate"]


def test_bert_qdq_sits_where_tensorrt_fuses_it(bert_int8):
    graph = onnx.load(str(bert_int8 / "model.int8.onnx")).graph
    initializers = {init.name for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}

    def dequantized(name: str) -> bool:
        node = producers.get(name)
        return node is not None and node.op_type == "DequantizeLinear"

    matmuls = [node for node in graph.node if node.op_type in ("MatMul", "Gemm")]
    for node in matmuls:  # both operands, activations and weights alike, come through Q/DQ
        assert dequantized(node.input[0]) and dequantized(node.input[1]), node.name
    weighted = [node for node in matmuls if any(producers[name].input[0] in initializers for name in node.input[:2])]
    activation_pairs = [node for node in matmuls if node not in weighted]
    assert len(activation_pairs) == 4  # Q·Kᵀ and probabilities·V in each of the 2 layers
    for node in graph.node:
        if node.op_type in HIGHER_PRECISION:
            assert not any(dequantized(name) for name in node.input), f"Q/DQ feeds {node.op_type} {node.name}"
    # the attention-scale constants stay float: no DequantizeLinear reads a scalar initializer
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in initializers:
            weight = next(init for init in graph.initializer if init.name == node.input[0])
            assert len(weight.dims) == 2, f"{node.name} dequantizes a non-weight constant {node.input[0]!r}"


def test_a_cpu_graph_that_cannot_be_made_is_recorded_and_the_tensorrt_graph_kept(tmp_path):
    """The CPU graphs are optional: one that fails (here: its folder's place is taken by a file) is recorded and printed
    in the stage's summary, never raised, and the TensorRT graph is written."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["y"], name="matmul")],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    fp32 = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(fp32))
    calib = tmp_path / "x.npy"
    np.save(calib, np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32))
    (tmp_path / "taken").write_text("a file, not a folder")
    record = make_int8_graph(
        fp32,
        tmp_path / "model.int8.onnx",
        calib,
        preprocess=None,
        config=CalibrationConfig("max", 32, 16),
        cache_folder=tmp_path / CACHE_FOLDER,
        cpu_out_paths={kind: tmp_path / "taken" / name for kind, name in cpu_graphs("int8").items()},
    )
    assert (tmp_path / "model.int8.onnx").is_file()
    assert record["qdq"]["quantized_ops"] == 1
    assert written_cpu_graphs(record) == {}
    for kind, name in cpu_graphs("int8").items():
        assert record["qdq_onnxruntime_cpu"][kind]["failed"].startswith(("FileExistsError", "NotADirectoryError"))
        assert f"{name} ({kind}) not written" in record["summary"]
