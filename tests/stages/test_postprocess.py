"""A YOLO-style detector (tests/helpers/detector_models.py) through `make engine ... POSTPROCESS=nms` at FP32, FP16 and
INT8 (calibrated on scenes like the detector's): the folder holds the raw head's graphs for the precision gates and the
NMS graphs that serve (pipeline/stages/postprocess.py), and every graph that serves here returns the reference NMS of
the head it computes, with detections that agree with PyTorch's head + the reference NMS, on every batch size of
the profile.  The NMS gate fails where the graph's NMS is not the reference's or its detections depart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from tests.helpers.detections import assert_same_detections
from tests.helpers.detector_models import IMAGE_SIZE, scenes, yolo_detector
from trt_pipeline import load_runner
from trt_pipeline.pipeline.bench.harness import agreement
from trt_pipeline.pipeline.cli import main as cli_main
from trt_pipeline.pipeline.core.cpu import int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.nms_config import NmsConfig
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import BatchProfile, Postprocess, Settings
from trt_pipeline.pipeline.evaluation import simulates_qdq
from trt_pipeline.pipeline.evaluation.detections import MIN_AGREEMENT, detection_agreement
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, artifact_names, folder_graphs
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.folder.records import GraphRecord, Target
from trt_pipeline.pipeline.postprocess.nms import OUTPUTS, reference_nms
from trt_pipeline.pipeline.postprocess.nms_graph import append_nms
from trt_pipeline.pipeline.serve.protocol import InputTensor, ModelIO, ServeError, decode_inputs
from trt_pipeline.pipeline.stages.postprocess import Judged, check_nms
from trt_pipeline.pipeline.stages.sequence import make_engine

MODEL = "tests.helpers.detector_models:yolo_detector"
BATCH = BatchProfile(1, 2, 8)
K = 20
NMS = {"postprocess": "nms", "nms_candidates": 200, "nms_max_detections": K}
CONFIG = NmsConfig(candidates=200, max_detections=K)
PRECISIONS = ["fp32", pytest.param("fp16", marks=pytest.mark.slow), pytest.param("int8", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 scenes like the ones served, model-ready: the detector has no weights to calibrate from, so the test makes
    its data (INT8 calibrates on it; FP16 scans it for overflow; both judge their detections on its held-out rows)."""
    path = tmp_path_factory.mktemp("calibration") / "scenes.npy"
    np.save(path, scenes(96, seed=1).numpy())
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, calibration: Path) -> dict[str, Path]:
    """precision -> its folder, built on first use (make_engine with POSTPROCESS=nms)."""
    out, folders = tmp_path_factory.mktemp("engines"), {}

    def folder(precision: str) -> Path:
        if precision not in folders:
            calib = {"calib": calibration} if precision != "fp32" else {}
            settings = Settings(model=MODEL, precision=precision, batch=BATCH, out_root=out, **NMS, **calib)
            folders[precision] = make_engine(settings.check())
        return folders[precision]

    return folder  # type: ignore[return-value]


@pytest.fixture(scope="module")
def module() -> torch.nn.Module:
    return yolo_detector().module


def _head_session(folder: Path, graph: GraphRecord):
    """The served graph as the ONNX Runtime runner runs it on this CPU, with its head exposed as one more output."""
    model = onnx.load(str(folder / graph.file))
    model.graph.output.append(onnx.ValueInfoProto(name="head"))
    return onnxruntime_session(model.SerializeToString(), simulate_qdq=simulates_qdq(graph))


def _served_here(folder: Path) -> list[GraphRecord]:
    """Every NMS graph this host may serve with ONNX Runtime: the engine-shaped ones and this CPU's int8 graph."""
    here = (Target.ENGINE, CPU_TARGETS[int8_cpu_kind()])
    return [graph for graph in open_folder(folder).graphs if graph.postprocess == "nms" and graph.target in here]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_served_graph_returns_the_reference_nms_at_every_batch_of_the_profile(built, module, precision: str):
    folder = built(precision)
    for graph in _served_here(folder):
        head_session = _head_session(folder, graph)
        pairs = []
        with load_runner(folder, backend="onnxruntime", graph=graph.file) as runner:
            for batch in range(BATCH.min, BATCH.max + 1):
                images = scenes(batch, seed=100 + batch)
                served = runner.infer({"images": images.numpy()})
                assert list(served) == list(OUTPUTS) and served["count"].shape == (batch, 1)
                # Exactly the reference NMS of the head this graph computes, at every batch...
                head = head_session.run(["head"], {"images": images.numpy()})[0]
                assert_same_detections(served, reference_nms(head, CONFIG).as_outputs())
                with torch.inference_mode():
                    expected = reference_nms(module(images).numpy(), CONFIG).as_outputs()
                if graph.precision == "fp32":
                    assert_same_detections(served, expected, box_atol=1e-3, score_atol=1e-5)
                pairs.append((expected, served))
        # ... and, over the 36 images, the detections PyTorch's head gives through the reference NMS, within the
        # precision's gate (a blank image and a busy one, more than K, in every batch of 3 or more).
        expected, served = (
            {name: np.concatenate([p[side][name] for p in pairs]) for name in OUTPUTS} for side in (0, 1)
        )
        matched = detection_agreement(expected, served)
        assert matched.passes(graph.precision), (graph.file, matched.summary())
        assert (expected["count"] == 0).sum() == BATCH.max - 1 and (expected["count"] == K).sum() >= BATCH.max - 2


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_folder_holds_the_raw_heads_graphs_and_the_nms_graphs_that_serve(built, precision: str):
    folder = built(precision)
    manifest = json.loads((folder / "manifest.json").read_text())
    graphs = [GraphRecord.from_json(graph) for graph in manifest["graphs"]]
    heads = [graph for graph in graphs if graph.postprocess == "none"]
    assert graphs == [
        *heads,
        *(graph for graph in folder_graphs(precision, Postprocess.NMS) if graph.postprocess == "nms"),
    ]
    assert [graph.file for graph in heads] == [graph.file for graph in folder_graphs(precision)]  # as without NMS
    assert set(manifest["artifacts"]) == set(artifact_names(graphs))
    assert manifest["outputs"] == [
        {"name": "boxes", "dtype": "float32", "shape": ["batch", K, 4]},
        {"name": "scores", "dtype": "float32", "shape": ["batch", K]},
        {"name": "classes", "dtype": "int32", "shape": ["batch", K]},
        {"name": "count", "dtype": "int32", "shape": ["batch", 1]},
    ]
    postprocess = manifest["postprocess"]
    assert postprocess["kind"] == "nms" and postprocess["config"]["max_detections"] == K
    assert [tensor["name"] for tensor in postprocess["head_outputs"]] == ["head"]
    opened = open_folder(folder)
    servable = opened.servable(int8_cpu_kind())
    assert {graph.postprocess for graph in (*servable.on_cpu, *servable.on_cuda)} == {"nms"}  # never the raw head
    assert opened.graph == f"model.{precision}.nms.onnx".replace("model.fp32.", "model.")  # the engine's graph
    assert manifest["build"]["io"][-1] == {"name": "count", "mode": "output", "dtype": "int32", "shape": [-1, 1]}
    for graph in (graph for graph in graphs if graph.postprocess == "nms"):
        gate = manifest[graph.gate]
        assert gate["batches"] == [1, 2, 5, 8]  # the parity batches and one between opt and max
        judged = {label for label, record in gate["detections"].items() if record["judged"]}
        if graph.precision == "fp32":
            assert judged == {"reference"}  # PyTorch + the reference NMS
        elif graph.target in (Target.ENGINE, CPU_TARGETS[int8_cpu_kind()]):
            assert "held-out calibration" in judged  # INT8 on random inputs is recorded, not judged
            assert ("reference" in judged) == (precision == "fp16")


def test_the_torch_runner_returns_the_detections_the_graphs_do(built):
    folder = built("fp32")
    images = scenes(4, seed=7).numpy()
    with load_runner(folder, backend="torch") as torch_runner, load_runner(folder, backend="onnxruntime") as served:
        assert_same_detections(torch_runner.infer({"images": images}), served.infer({"images": images}), 1e-3, 1e-5)


def test_a_raw_head_graph_is_not_served_from_an_nms_folder(built):
    with pytest.raises(PipelineError, match="graph='model.onnx' ends in 'none' post-processing") as refused:
        load_runner(built("fp32"), backend="onnxruntime", graph="model.onnx")
    assert "model.nms.onnx" in (refused.value.fix or "")


# --------------------------------------------------------------------------- the gate fails where it should


def _scaled_scores(fp32_graph: Path, factor: float) -> onnx.ModelProto:
    """The detector's graph with its class scores times `factor` before the head output: detections that are wrong."""
    model = onnx.load(str(fp32_graph))
    producer = next(node for node in model.graph.node if "head" in node.output)
    producer.output[list(producer.output).index("head")] = "head_before"
    scale = np.array([1, 1, 1, 1, factor, factor, factor], np.float32).reshape(1, 7, 1)
    model.graph.initializer.append(numpy_helper.from_array(scale, "score_scale"))
    model.graph.node.append(helper.make_node("Mul", ["head_before", "score_scale"], ["head"]))
    return model


def _record(precision: str, gate: str = "nms_test") -> GraphRecord:
    evaluation = "plain" if precision != "int8" else "qdq-simulated"
    return GraphRecord.from_json(
        {"file": "x", "precision": precision, "target": "engine", "evaluation": evaluation, "gate": gate}
        | {"postprocess": "nms"}
    )


def test_the_gate_refuses_an_nms_that_is_not_the_reference_nms_of_its_own_head(built, tmp_path: Path):
    folder = built("fp32")
    other = tmp_path / "other.nms.onnx"
    onnx.save(append_nms(folder / "model.onnx", NmsConfig(candidates=200, max_detections=K, iou_threshold=0.8)), other)
    with pytest.raises(PipelineError, match="departs from the reference NMS of its own head") as refused:
        check_nms(other, folder / "reference.npz", CONFIG, "head", graph=_record("fp32"), batch=BATCH)
    assert "of the reference inputs: image " in refused.value.problem and "postprocess" in (refused.value.fix or "")
    record = check_nms(
        folder / "model.nms.onnx", folder / "reference.npz", CONFIG, "head", graph=_record("fp32"), batch=BATCH
    )
    assert record["max_rel"] <= 1e-5 and record["detections"]["reference"]["agreement"] == 1.0


def test_a_gate_that_saw_no_detection_refuses_the_build(built, module, tmp_path: Path):
    """Inputs on which the head scores nothing above the threshold (black images here; any image at
    NMS_SCORE_THRESHOLD=5, refused by NmsConfig since): 0 of 0 expected detections found, agreement 1.000, a gate
    that could not have failed.  It passed, and the detector was built."""
    folder = built("fp32")
    blank = torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.inference_mode():
        head = module(blank).numpy()
    reference = tmp_path / "reference.npz"
    np.savez(reference, **{"case0/in/images": blank.numpy(), "case0/out/head": head})
    with pytest.raises(PipelineError, match="model.nms.onnx's gate saw no detection on the reference inputs") as caught:
        check_nms(folder / "model.nms.onnx", reference, CONFIG, "head", graph=_record("fp32"), batch=BATCH)
    assert "the threshold 0.25): a gate with nothing to judge checks nothing" in caught.value.problem
    assert "nms_score_threshold=<below 0.0" in (caught.value.fix or "") and "calib=" in (caught.value.fix or "")


def test_the_gate_refuses_detections_that_depart_from_pytorchs_and_judges_int8_on_held_out_rows(
    built, module, tmp_path: Path
):
    folder = built("fp32")
    wrong = tmp_path / "wrong.nms.onnx"
    onnx.save(append_nms(_scaled_scores(folder / "model.onnx", 0.6), CONFIG), wrong)
    reference = folder / "reference.npz"
    with pytest.raises(PipelineError, match="detections depart from the reference NMS of PyTorch's head") as refused:
        check_nms(wrong, reference, CONFIG, "head", graph=_record("fp16"), batch=BATCH)
    assert "keep_fp32" in (refused.value.fix or "")
    # INT8 on the random reference inputs is recorded only; on rows like the served ones it is judged.
    assert not check_nms(wrong, reference, CONFIG, "head", graph=_record("int8"), batch=BATCH)["detections"][
        "reference"
    ]["judged"]
    images = scenes(8, seed=3)
    with torch.inference_mode():
        rows = [Judged("held-out calibration", {"images": images.numpy()}, module(images).numpy())]
    with pytest.raises(PipelineError, match="on the held-out calibration inputs"):
        check_nms(wrong, reference, CONFIG, "head", graph=_record("int8"), batch=BATCH, held_out=rows)


def test_the_bench_compares_detections_not_relative_error(module):
    images = scenes(6, seed=5)
    with torch.inference_mode():
        head = module(images).numpy()
    expected = reference_nms(head, CONFIG).as_outputs()
    moved = reference_nms(head * np.array([1.001, 1, 1, 1, 1, 1, 1], np.float32)[:, None], CONFIG).as_outputs()
    assert agreement(expected, moved, Precision.FP16, detections=True)["status"] == "ok"  # boxes a pixel off: the same
    scaled = head.copy()
    scaled[:, 4:] *= 0.6
    wrong = agreement(expected, reference_nms(scaled, CONFIG).as_outputs(), Precision.FP16, detections=True)
    assert wrong["status"] == "mismatch" and wrong["agreement"] < MIN_AGREEMENT[Precision.FP16]


def test_the_calibration_scenes_give_the_detector_detections_to_judge(module):
    """The data the FP16/INT8 detections are judged on holds detections (else the gate would judge nothing)."""
    images = scenes(16, seed=1)
    assert images.shape[-1] == IMAGE_SIZE
    with torch.inference_mode():
        counts = reference_nms(module(images).numpy(), CONFIG).count[:, 0]
    assert counts.sum() > 16 and (counts == 0).any() and (counts == K).any()


def test_postprocess_nms_on_a_model_without_a_detection_head_is_refused_with_the_fix(tmp_path: Path, capsys):
    out = tmp_path / "engines"
    argv = ["engine", "--model", "tests.helpers.toy_models:tiny_cnn", "--precision", "fp32", "--postprocess", "nms"]
    assert cli_main([*argv, "--batch", "1:2:4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: NMS needs a float head [batch, 4 + classes, anchors]; 'logits' is ['batch', 10]" in err
    assert "fix: append NMS to the raw detection head" in err and "Traceback" not in err
    assert not list(out.rglob("*.nms.onnx"))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_an_image_that_is_not_finite_is_refused_not_answered_with_no_detection(built, bad: float):
    """A classifier returns NaN for such an image (the service's policy: passed to the model as sent); a detector's NMS
    dropped every candidate and answered count 0, "nothing detected".  Refused instead, by the runner and the
    service alike, naming the image."""
    folder = built("fp32")
    images = scenes(3, seed=5).numpy()
    images[1] = bad
    with load_runner(folder, "onnxruntime") as runner:
        with pytest.raises(PipelineError, match=r"input 'images' holds NaN or infinity in image 1 \(of 3\)") as caught:
            runner.infer({"images": images})
        assert "would answer count 0 (nothing detected)" in caught.value.problem
        assert runner.infer({"images": images[[0, 2]]})["count"].shape == (2, 1)  # the finite ones are answered
    model = ModelIO.from_manifest(open_folder(folder).manifest)
    sent = InputTensor("images", "FP32", list(images.shape), raw=images.tobytes())
    with pytest.raises(ServeError, match="holds NaN or infinity in image 1") as refused:
        decode_inputs(model, [sent])
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("model", "given", "problem", "fix"),
    [
        (
            "tests.helpers.toy_models:text_classifier",
            [],
            "POSTPROCESS=nms needs to know which output is the detection head; the model has 2 outputs "
            "(logits, tokens)",
            "name it: NMS_HEAD=logits or NMS_HEAD=tokens",
        ),
        (
            MODEL,
            ["--nms-head", "boxes"],
            "NMS_HEAD=boxes names no output of the model; its outputs are head",
            "NMS_HEAD=head",
        ),
    ],
    ids=["several-outputs", "no-such-output"],
)
def test_the_nms_head_is_checked_before_any_stage_in_the_front_ends_words(
    model, given, problem, fix, tmp_path: Path, monkeypatch, capsys
):
    # The fix named NmsConfig(head=...) under make, once the FP16 stage had run.
    monkeypatch.setenv("TRT_PIPELINE_FRONT_END", "make")
    out = tmp_path / "engines"
    argv = ["engine", "--model", model, "--precision", "fp16", "--postprocess", "nms", *given, "--out", str(out)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {problem}" in err and fix in err and "NmsConfig" not in err and "Traceback" not in err, err
    assert not out.exists()  # no stage ran
