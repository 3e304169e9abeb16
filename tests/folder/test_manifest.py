"""The manifest (pipeline/folder/manifest.py): typed when read, readable JSON when written."""

from __future__ import annotations

import json

from tests.helpers.folder_builds import FP32_RECORD
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.folder.layout import (
    artifact_names,
    folder_graphs,
)
from trt_pipeline.pipeline.folder.manifest import Manifest, read_manifest


def test_the_manifest_is_typed_and_stays_readable_json(built):
    manifest = read_manifest(built)
    assert manifest is not None and Manifest.from_json(manifest.as_json()) == manifest
    raw = json.loads((built / "manifest.json").read_text())
    assert raw["graphs"] == [FP32_RECORD]
    assert raw["batch_profile"] == {"min": 1, "opt": 2, "max": 4}
    assert raw["inputs"] == [{"name": "input", "dtype": "float32", "shape": ["batch", 3, 16, 16]}]
    assert raw["parity_fp32"]["max_rel"] == manifest.parity("parity_fp32").max_rel < 1e-4
    assert manifest.build is not None and raw["build"]["builder"]["module"] == manifest.builder().module
    assert list(raw["timings"])[-1] == "build"
    assert set(raw["artifacts"]) == set(artifact_names(folder_graphs(Precision.FP32)))
    # Text once, where JSON comes in: a Precision read, its value written.
    assert manifest.precision is Precision.FP32 and raw["precision"] == "fp32"
