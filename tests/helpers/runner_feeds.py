"""Shared by the runner tests (ONNX Runtime, PyTorch, the engine's and ONNX Runtime CUDA's): random feeds for the toy
models (tests/helpers/toy_models.py tiny_cnn and text_classifier) and the check that two runners' outputs agree."""

from __future__ import annotations

import numpy as np

from trt_pipeline.pipeline.core.compare import compare_outputs


def cnn_batch(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).standard_normal((rows, 3, 16, 16), dtype=np.float32)}


def text_batch(rows: int, seq: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = (rng.random((rows, seq)) > 0.2).astype(np.float32)
    return {"input_ids": rng.integers(0, 100, (rows, seq), dtype=np.int64), "attention_mask": mask}


def assert_close(expected: dict, actual: dict, rtol: float) -> None:
    results = compare_outputs(expected, actual, rtol=rtol)
    assert all(c.ok for c in results.values()), {n: c.as_record() for n, c in results.items()}
