"""The comparison of two sets of detections (count, classes, boxes, scores), shared by the NMS, detector and
serving tests."""

from __future__ import annotations

import numpy as np

from trt_pipeline.pipeline.postprocess.nms import OUTPUTS


def assert_same_detections(
    actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], box_atol: float = 1e-6, score_atol: float = 1e-7
) -> None:
    """Same count, classes and dtypes; boxes and scores within the tolerances (the same head: to the rounding)."""
    assert list(actual) == list(OUTPUTS)
    np.testing.assert_array_equal(actual["count"], expected["count"])
    np.testing.assert_array_equal(actual["classes"], expected["classes"])
    np.testing.assert_allclose(actual["boxes"], expected["boxes"], rtol=1e-6, atol=box_atol)
    np.testing.assert_allclose(actual["scores"], expected["scores"], rtol=1e-6, atol=score_atol)
    for name in OUTPUTS:
        assert actual[name].dtype == expected[name].dtype, name
