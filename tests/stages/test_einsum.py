"""Einsum equations in the letters TensorRT's ONNX parser reads (pipeline/stages/einsum.py, in the check stage)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.stages.einsum import lowercase_equation
from trt_pipeline.pipeline.stages.sequence import make_engine


@pytest.mark.parametrize(
    ("equation", "lowered"),
    [
        ("B G H I D, B G H J D -> B G H I J", "bghid,bghjd->bghij"),  # torchvision's MaxViT
        ("bij,bjk->bik", "bij,bjk->bik"),
        ("Bb,b->B", "ab,b->a"),  # B's own lowercase is taken: the first letter free
        ("...IJ, ...JK -> ...IK", "...ij,...jk->...ik"),
    ],
)
def test_an_equation_is_written_in_lowercase_letters_without_spaces(equation, lowered):
    assert lowercase_equation(equation) == lowered


def _attention_scores(path: Path) -> Path:
    """q [batch, 4, 8] and k [batch, 5, 8] -> their scores by an Einsum in MaxViT's capitals."""
    node = helper.make_node("Einsum", ["q", "k"], ["scores"], equation="B I D, B J D -> B I J", name="scores")
    graph = helper.make_graph(
        [node],
        "scores",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", 4, 8]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", 5, 8]),
        ],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 4, 5])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_graph_with_an_einsum_in_capitals_builds_an_engine_computing_the_same(tmp_path: Path):
    given = _attention_scores(tmp_path / "scores.onnx")
    folder = make_engine(
        Settings(model=str(given), precision="fp32", batch="1:2:4", out_root=tmp_path / "out", builder="tensorrt_rtx")
    )
    assert (folder / "engine.plan").is_file()
    (einsum,) = [node for node in onnx.load(str(folder / "model.onnx")).graph.node if node.op_type == "Einsum"]
    assert helper.get_attribute_value(einsum.attribute[0]) == b"bid,bjd->bij"
    check = json.loads((folder / "manifest.json").read_text())["check"]
    assert "1 Einsum equation(s) in lowercase letters" in check["summary"]
    rng = np.random.default_rng(0)
    feed = {"q": rng.standard_normal((3, 4, 8), np.float32), "k": rng.standard_normal((3, 5, 8), np.float32)}
    (served,) = ort.InferenceSession(str(folder / "model.onnx")).run(None, feed)
    np.testing.assert_allclose(served, np.einsum("bid,bjd->bij", feed["q"], feed["k"]), rtol=1e-5, atol=1e-5)
