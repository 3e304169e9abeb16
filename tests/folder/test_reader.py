"""The artifact folder's rules on real folders (pipeline/folder/reader.py): readers load only a finished folder of
this layout and only its own files with the sha256 the build recorded, pass over a lock that is no plain file, and
give one answer to what may serve on a host."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.folder_builds import FP32_RECORD, LOCK_KINDS, OTHER, REBUILD, edit_manifest, feed, lock_as, settings
from tests.helpers.runner_folders import copy_folder
from trt_pipeline.pipeline.core.cpu import NO_VNNI, VNNI, int8_cpu_kind
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import Postprocess
from trt_pipeline.pipeline.folder.artifacts import LOCK, build_lock, running_build, temporary_name
from trt_pipeline.pipeline.folder.layout import (
    ARTIFACT_LAYOUT,
    CPU_TARGETS,
    graph_record,
)
from trt_pipeline.pipeline.folder.manifest import read_manifest
from trt_pipeline.pipeline.folder.provenance import describe_artifacts
from trt_pipeline.pipeline.folder.reader import open_folder
from trt_pipeline.pipeline.runners import BACKENDS, load_runner
from trt_pipeline.pipeline.runners.fastest import find_candidates
from trt_pipeline.pipeline.runners.onnxruntime import CPU
from trt_pipeline.pipeline.stages.sequence import make_engine, run_stage


@pytest.fixture
def folder(built: Path, tmp_path: Path) -> Path:
    return copy_folder(built, tmp_path)


# --------------------------------------------------------------------------- what readers refuse


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unfinished_folder_is_refused_by_every_backend_with_the_rerun(folder, backend):
    # As a rebuild killed after its parity stage leaves it: the earlier build's files, complete false.
    timings = json.loads((folder / "manifest.json").read_text())["timings"]
    edit_manifest(folder, complete=False, timings={k: v for k, v in timings.items() if k != "build"})
    with pytest.raises(PipelineError, match="holds an unfinished build") as caught:
        load_runner(folder, backend)
    assert "it stopped after the parity_fp32 stage" in caught.value.problem
    assert f"finish the build: {REBUILD}" in str(caught.value.fix)


def test_a_folder_being_built_now_is_refused_naming_the_builder(folder):
    with build_lock(folder):  # this process is the build
        edit_manifest(folder, complete=False)
        with pytest.raises(PipelineError, match=f"process {os.getpid()} is building {folder} now") as caught:
            load_runner(folder, "onnxruntime")
    assert f"wait for process {os.getpid()} to finish" in str(caught.value.fix)


def test_a_skipped_engine_build_is_named_in_the_refusal(folder):
    edit_manifest(folder, complete=False, build={"status": "skipped", "reason": "no TensorRT module imports"})
    with pytest.raises(PipelineError, match="the engine build was skipped: no TensorRT module imports"):
        load_runner(folder, "onnxruntime")


def test_another_models_graph_with_the_same_io_is_refused(folder, root):
    other = make_engine(settings(root, OTHER))
    shutil.copy(other / "model.onnx", folder / "model.onnx")
    with load_runner(other, "onnxruntime") as runner:  # a sound graph, with the same inputs and outputs
        assert runner.infer(feed())["logits"].shape == (2, 10)
    for backend in ("onnxruntime", "auto"):
        with pytest.raises(PipelineError, match="model.onnx is not the file this folder's build wrote") as caught:
            load_runner(folder, backend)
        assert "truncated, corrupted or replaced" in caught.value.problem
        assert REBUILD in str(caught.value.fix)


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_manifest_graph_outside_the_folder_is_refused(folder, tmp_path, where):
    outside = tmp_path / "elsewhere" / "model.onnx"
    outside.parent.mkdir()
    shutil.copy(folder / "model.onnx", outside)
    name = str(outside) if where == "absolute" else "../elsewhere/model.onnx"
    # Even with a matching sha256 recorded under that name: only the folder's own files are loaded.
    recorded = dataclasses.asdict(describe_artifacts(outside.parent, ["model.onnx"])["model.onnx"])
    artifacts = {**json.loads((folder / "manifest.json").read_text())["artifacts"], name: recorded}
    edit_manifest(folder, graphs=[{**FP32_RECORD, "file": name}], artifacts=artifacts)
    with pytest.raises(PipelineError, match="which is not a file name inside the folder") as caught:
        load_runner(folder, "onnxruntime")
    assert f"names {name!r} as its graph" in caught.value.problem


def test_a_folder_of_an_older_layout_is_refused_with_rebuild(folder):
    edit_manifest(folder, layout=ARTIFACT_LAYOUT - 1)
    with pytest.raises(PipelineError, match=f"layout {ARTIFACT_LAYOUT - 1}; this version reads layout") as caught:
        load_runner(folder, "onnxruntime")
    assert f"rebuild it: {REBUILD}" in str(caught.value.fix)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["layout"]  # written before the manifest recorded its layout
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match=f"a layout before {ARTIFACT_LAYOUT}"):
        open_folder(folder)


def test_a_folder_the_previous_version_wrote_is_refused_and_its_rebuild_command_rebuilds_it(folder, tmp_path, capsys):
    """Layout 6's manifest, as the previous version wrote it ("graphs": {target: file}, no record of what each graph
    is): readers refuse it with the command that writes it again, and that build rebuilds it rather than reuse it."""
    raw = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**raw, "layout": 6, "graphs": {"engine": "model.onnx"}}))
    for backend in ("onnxruntime", "auto"):
        with pytest.raises(PipelineError, match=f"layout 6; this version reads layout {ARTIFACT_LAYOUT}") as caught:
            load_runner(folder, backend)
        assert f"rebuild it: {REBUILD}" in str(caught.value.fix)
    assert make_engine(settings(tmp_path)) == folder  # what the command runs: the same settings, the same folder
    assert "up to date" not in capsys.readouterr().out
    rebuilt = open_folder(folder)
    assert rebuilt.manifest.layout == ARTIFACT_LAYOUT and [graph.file for graph in rebuilt.graphs] == ["model.onnx"]


@pytest.mark.parametrize(
    ("entry", "value", "says"),
    [
        ("inputs", [{"name": "input", "dtype": "float32"}], "its inputs hold"),
        ("model", "tiny", "its model is 'tiny'"),
        ("graphs", {"engine": "model.onnx"}, "its graphs are"),
        ("graphs", [{**FP32_RECORD, "evaluation": "by eye"}], "its graphs hold"),
        ("precision", "fp8", "its precision is 'fp8'"),
        ("artifacts", {"model.onnx": {"bytes": 1}}, "its artifacts hold"),
        (
            "agreement_int8",
            {"gate": 0.2, "much_worse_ratio": 2.0, "split": {"rule": "r", "rows": 4, "held_out": [9]}, "graphs": {}},
            "its calibration split",
        ),
    ],
)
def test_a_damaged_manifest_entry_is_named_with_the_rebuild(folder, entry, value, says):
    edit_manifest(folder, **{entry: value})
    with pytest.raises(PipelineError, match="the manifest .* is damaged") as caught:
        load_runner(folder, "onnxruntime")
    assert says in caught.value.problem
    assert f"rebuild the folder: {REBUILD}" in str(caught.value.fix)


def test_the_runner_on_a_cpu_takes_the_graph_the_manifest_lists_for_its_kind_of_cpu(folder):
    # The table, not the precision, decides: an fp32 folder listing a graph for this CPU's target gets it run.
    shutil.copy(folder / "model.onnx", folder / "model.cpu.onnx")
    raw = json.loads((folder / "manifest.json").read_text())
    recorded = {n: dataclasses.asdict(a) for n, a in describe_artifacts(folder, ["model.cpu.onnx"]).items()}
    shaped = {**FP32_RECORD, "file": "model.cpu.onnx", "target": CPU_TARGETS[int8_cpu_kind()]}
    graphs = [*raw["graphs"], {**shaped, "evaluation": "onnxruntime-int8"}]
    edit_manifest(folder, graphs=graphs, artifacts={**raw["artifacts"], **recorded})
    with load_runner(folder, "onnxruntime") as runner:
        assert "running model.cpu.onnx (the fp32 graph for ONNX Runtime's CPU kernels" in runner.description
        assert runner.infer(feed())["logits"].shape == (2, 10)
    edit_manifest(folder, graphs=raw["graphs"])
    with load_runner(folder, "onnxruntime") as runner:
        assert "running model.onnx (the engine's graph)" in runner.description


def test_a_finished_folder_opens_and_each_graph_is_read_checked(built):
    opened = open_folder(built)
    assert opened.precision is Precision.FP32 and opened.postprocess is Postprocess.NONE
    assert (opened.model, opened.precision, opened.graph, opened.engine) == (
        "toy_models-tiny_cnn",
        "fp32",
        "model.onnx",
        "engine.plan",
    )
    assert opened.read("model.onnx") == (built / "model.onnx").read_bytes()
    with pytest.raises(PipelineError, match="'manifest.json' is not an artifact of"):
        opened.read("manifest.json")
    with load_runner(opened, "onnxruntime") as runner:  # an opened folder is taken as it is
        assert runner.infer(feed())["logits"].shape == (2, 10)


def test_a_graph_the_temporary_folder_has_no_room_to_copy_is_refused_with_tmpdir(folder):
    """The runner loads a private copy of the graph from the system's temporary folder; where that copy does not fit
    the fix is TMPDIR, not a rebuild (a 16 MB /tmp gave "ONNX Runtime cannot load ...: rebuild the folder")."""
    raw = json.loads((folder / "manifest.json").read_text())
    recorded = raw["artifacts"]["model.onnx"]
    edit_manifest(folder, artifacts={**raw["artifacts"], "model.onnx": {**recorded, "bytes": 1 << 60}})
    with pytest.raises(PipelineError, match=r"does not fit: it needs 1152921504.61 GB, [0-9.]+ GB are free") as no_room:
        load_runner(folder, "onnxruntime")
    assert "point TMPDIR at a folder on a disk with room" in no_room.value.fix
    edit_manifest(folder, artifacts=raw["artifacts"])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (recorded["bytes"] // 2, hard))  # filled while copying
    try:
        with pytest.raises(PipelineError, match=r"does not fit: \[Errno 27\] File too large") as filled:
            load_runner(folder, "onnxruntime")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "point TMPDIR at a folder on a disk with room" in filled.value.fix


# --------------------------------------------------------------------------- what a build holds


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_a_reader_passes_over_a_lock_that_is_no_plain_file(kind, folder, tmp_path):
    (folder / LOCK).unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text(str(os.getpid()))  # a live pid behind a link is no build of this folder
    lock_as(kind, folder / LOCK, victim)
    assert running_build(folder) is None
    edit_manifest(folder, complete=False)
    with pytest.raises(PipelineError, match="holds an unfinished build"):
        open_folder(folder)


def test_make_engine_says_what_it_removed(built, capsys):
    stale = built / ".engine.plan.999999999.tmp"  # above Linux's largest pid: never a living process
    stale.write_bytes(b"half written")
    make_engine(settings(built.parent))
    out = capsys.readouterr().out
    assert "cleaned      1 temporary file(s) left by killed runs: .engine.plan.999999999.tmp" in out
    assert "up to date" in out and not stale.exists()


def test_a_stage_run_alone_leaves_the_folder_unfinished(tmp_path):
    from trt_pipeline.pipeline.stages.sequence import run_stage

    folder = make_engine(settings(tmp_path))
    run_stage(settings(tmp_path), "simplify")  # model.onnx rewritten: no longer the file the manifest lists
    with pytest.raises(PipelineError, match="holds an unfinished build"):
        load_runner(folder, "onnxruntime")


# --------------------------------------------------------------------------- what may serve on a host


@pytest.fixture(scope="module")
def int8_built(root: Path) -> Path:
    """tiny_cnn in INT8, calibrated on 32 random images: model.onnx, model.int8.onnx and one graph per kind of CPU."""
    np.save(root / "calib.npy", np.random.default_rng(1).standard_normal((32, 3, 16, 16), dtype=np.float32))
    int8 = dataclasses.replace(settings(root), precision="int8", calib=root / "calib.npy", calib_samples=32)
    return make_engine(dataclasses.replace(int8, calib_batch=16))


def _files(graphs) -> list[str]:
    return [graph.file for graph in graphs]


def test_what_may_serve_a_host_is_one_answer_for_the_reader_auto_and_the_runner(int8_built, tmp_path):
    folder = open_folder(int8_built)
    vnni, no_vnni = folder.servable(VNNI), folder.servable(NO_VNNI)
    # On the CPU provider the graph shaped for the host's kind of CPU stands for the engine's; on CUDA, the engine's.
    assert _files(vnni.on_cpu) == ["model.onnx", "model.int8.ort.onnx"]
    assert _files(no_vnni.on_cpu) == ["model.onnx", "model.int8.ort-u8u8.onnx"]
    assert _files(vnni.on_cuda) == _files(no_vnni.on_cuda) == ["model.onnx", "model.int8.onnx"]
    assert vnni.refused == no_vnni.refused == ()
    assert folder.servable_anywhere() == [
        "model.onnx",
        "model.int8.onnx",
        "model.int8.ort.onnx",
        "model.int8.ort-u8u8.onnx",
    ]
    here = folder.servable(int8_cpu_kind())
    candidates, refused = find_candidates(folder, [CPU])
    assert [candidate.graph for candidate in candidates] == _files(here.on_cpu) and refused == []
    with load_runner(folder, "onnxruntime", providers=[CPU]) as runner:
        assert runner.graph == here.on_cpu[-1].file

    # The CPU graph's gate unrecorded: it may serve nowhere, and the engine's INT8 graph, its Q/DQ simulated as
    # TensorRT computes them, stands in for it on this CPU for auto and the runner alike.
    copy = Path(shutil.copytree(int8_built, tmp_path / int8_built.name))
    shaped = here.on_cpu[-1]
    raw = json.loads((copy / "manifest.json").read_text())
    del raw[shaped.gate]
    (copy / "manifest.json").write_text(json.dumps(raw))
    gated = open_folder(copy).servable(int8_cpu_kind())
    assert _files(gated.on_cpu) == ["model.onnx", "model.int8.onnx"]
    assert gated.refused == (f"{shaped.file}: no pass of its gate ({shaped.gate}) in the manifest",)
    assert [candidate.graph for candidate in find_candidates(open_folder(copy), [CPU])[0]] == _files(gated.on_cpu)
    with load_runner(copy, "onnxruntime", providers=[CPU]) as runner:
        assert runner.graph == "model.int8.onnx" and "its Q/DQ simulated in float" in runner.description


def test_a_cpu_graph_a_rebuild_cannot_make_leaves_no_earlier_graph_behind(int8_built, tmp_path):
    """The INT8 stage run again, one CPU graph failing (here: the place of the folder it is written in is taken
    by a file): its record says why, and the earlier build's graph of that name is gone from the folder (listed
    nowhere, it still passed for this build's to whoever opened the folder's files)."""
    copy = Path(shutil.copytree(int8_built, tmp_path / int8_built.name))
    failing, kept = (graph_record(Precision.INT8, CPU_TARGETS[kind]).file for kind in (VNNI, NO_VNNI))
    (copy / temporary_name(copy / failing)).write_text("taken")
    int8 = dataclasses.replace(
        settings(tmp_path), precision="int8", calib=int8_built.parent / "calib.npy", calib_samples=32, calib_batch=16
    )
    run_stage(int8, "precision")
    record = json.loads((copy / "manifest.json").read_text())["int8"]["qdq_onnxruntime_cpu"]
    assert record[VNNI]["failed"].startswith("FileExistsError") and "failed" not in record[NO_VNNI]
    assert not (copy / failing).exists() and (copy / kept).is_file()
    assert [graph.file for graph in read_manifest(copy).graphs] == ["model.onnx", "model.int8.onnx", kept]
