"""The simplify stage (pipeline/stages/simplify.py): onnxsim's failure keeps the checked graph, the file system's
stops the build."""

from __future__ import annotations

import errno
import resource

import onnx
import pytest

from tests.helpers import toy_models
from tests.helpers.exported import exported
from trt_pipeline.pipeline.stages.simplify import simplify_onnx


def test_simplify_keeps_the_checked_graph_when_onnxsim_fails(tmp_path, capsys):
    graph, _ = exported(toy_models.tiny_cnn(), tmp_path)
    model = onnx.load(str(graph))
    # A node reading a tensor that nothing produces: onnxsim's own checker rejects the graph.
    model.graph.node.append(onnx.helper.make_node("Relu", ["nowhere"], ["dangling"]))
    broken = tmp_path / "custom.onnx"
    onnx.save(model, str(broken))
    record = simplify_onnx(broken, tmp_path / "out.onnx")
    assert record["status"] == "kept" and "onnxsim failed" in record["reason"]
    assert "kept the checked graph" in capsys.readouterr().out
    assert onnx.load(str(tmp_path / "out.onnx")).graph.node[-1].output == ["dangling"]


def test_simplify_stops_where_the_file_system_refuses_its_graph(tmp_path):
    """A full disk, or here a file size limit, is the user's to fix (the command line says how), not a reason to
    serve the graph unsimplified: onnxsim's write failing for it was kept as "onnxsim failed" and the build went on."""
    graph, _ = exported(toy_models.overflow_ffn(), tmp_path)
    before = graph.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    try:
        with pytest.raises(OSError) as refused:
            simplify_onnx(graph, graph)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert refused.value.errno == errno.EFBIG
    assert graph.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx", "reference.npz"]  # no temporaries


def test_a_linear_layer_on_a_sequence_stays_a_matmul_and_its_bias_add(tmp_path):
    """onnxsim's batched Gemm pass (Reshape, Gemm, Reshape) hides transformer layers from ONNX Runtime's fusions."""
    graph, _ = exported(toy_models.transformer_encoder(), tmp_path)
    simplify_onnx(graph, tmp_path / "simplified.onnx")
    before, after = (
        [node.op_type for node in onnx.load(str(path)).graph.node] for path in (graph, tmp_path / "simplified.onnx")
    )
    # The exporter's own Gemms (the attention's output projection, on rows it flattened) stay; no linear becomes one.
    assert after.count("Gemm") == before.count("Gemm") and after.count("MatMul") == before.count("MatMul")
