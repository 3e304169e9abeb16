"""Outputs compared relative to their scale (pipeline/core/compare.py)."""

from __future__ import annotations

import numpy as np

from trt_pipeline.pipeline.core.compare import compare


def test_compare_is_relative_to_output_scale():
    reference = np.array([1000.0, -2000.0])
    assert compare(reference, reference + 1.0, rtol=1e-3).ok  # 1 / 2000 = 5e-4
    assert not compare(reference, reference + 3.0, rtol=1e-3).ok
    assert not compare(reference, np.array([np.nan, 0.0]), rtol=1.0).ok
