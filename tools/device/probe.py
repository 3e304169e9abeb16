"""On the GPU machine: does a TensorRT-RTX engine run on this GPU?  Writes probe.json into the folder given.

Two plans are tried, each through the raw runtime (the exact message if it fails) and through the
engine runner (outputs against ONNX Runtime on the same inputs):
  - the plan built ahead of time on a machine with no GPU, for TensorRT-RTX's default targets
    (carried in .devbundle/b/aot), loaded with check_target=False when this GPU is not among them;
  - a plan built here for the GPU at hand (TARGET=current).

    python tools/device/probe.py AOT_FOLDER OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from trt_pipeline.pipeline.core.compare import compare_outputs
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.core.trt_module import RecordingLogger, describe_gpu, import_trt
from trt_pipeline.pipeline.runners import load_runner
from trt_pipeline.pipeline.stages.sequence import make_engine


def deserialize(folder: Path) -> dict:
    """The raw runtime's answer: an engine, or None with what TensorRT logged."""
    trt = import_trt("tensorrt_rtx")
    logger = RecordingLogger.for_module(trt)
    mark = logger.mark()
    started = time.perf_counter()
    runtime = trt.Runtime(logger.trt_logger)
    engine = runtime.deserialize_cuda_engine((folder / "engine.plan").read_bytes())
    record = {"deserialized": engine is not None, "seconds": round(time.perf_counter() - started, 3)}
    record["messages"] = logger.since(mark, limit=50)
    if engine is not None:
        context = engine.create_execution_context()
        record["execution_context"] = context is not None
        record["messages"] = logger.since(mark, limit=50)
    return record


def run_through_runner(folder: Path) -> dict:
    """The engine runner (check_target=False) against ONNX Runtime on one random batch of 8."""
    feed = {"input": np.random.default_rng(0).standard_normal((8, 3, 16, 16), dtype=np.float32)}
    with load_runner(folder, "onnxruntime") as reference:
        expected = reference.infer(feed)
    record: dict = {}
    for layer in ("cuda-python", "pycuda"):
        try:
            with load_runner(folder, "tensorrt", check_target=False, device_memory=layer) as runner:
                actual = runner.infer(feed)
                results = compare_outputs(expected, actual, rtol=1e-2)
                record[layer] = {
                    "description": runner.description,
                    "ok": all(c.ok for c in results.values()),
                    "comparison": {name: c.as_record() for name, c in results.items()},
                }
        except Exception as error:  # recorded: the question is exactly whether and how this fails
            record[layer] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(-3)}
    return record


def auto_runner(folder: Path) -> dict:
    with load_runner(folder) as runner:
        return {"backend": runner.backend, "description": runner.description}


def attempt(name: str, step, *args) -> dict:
    try:
        return {"step": name, **step(*args)}
    except Exception as error:
        return {"step": name, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(-3)}


def build_here(root: Path) -> dict:
    settings = Settings(
        model="tests.helpers.toy_models:tiny_cnn",
        precision="fp32",
        builder="tensorrt_rtx",
        target="current",
        out_root=root,
    )
    started = time.perf_counter()
    folder = make_engine(settings)
    manifest = json.loads((folder / "manifest.json").read_text())
    return {"folder": str(folder), "seconds": round(time.perf_counter() - started, 1), "build": manifest["build"]}


def main(aot_folder: Path, out: Path) -> int:
    report: dict = {"gpu": describe_gpu(0)}
    trt = import_trt("tensorrt_rtx")
    report["tensorrt_rtx"] = trt.__version__
    report["aot_target"] = json.loads((aot_folder / "manifest.json").read_text())["build"]["target"]
    report["aot_deserialize"] = attempt("deserialize the ahead-of-time plan", deserialize, aot_folder)
    report["aot_runner"] = attempt("run it through the runner", run_through_runner, aot_folder)
    report["auto_runner"] = attempt("what load_runner(backend='auto') picks", auto_runner, aot_folder)
    built = attempt("build for the GPU at hand (TARGET=current)", build_here, Path("/tmp/probe-engines"))
    report["current_build"] = built
    if "folder" in built:
        here = Path(built["folder"])
        report["current_deserialize"] = attempt("deserialize the plan built here", deserialize, here)
        report["current_runner"] = attempt("run it through the runner", run_through_runner, here)
    (out / "probe.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
