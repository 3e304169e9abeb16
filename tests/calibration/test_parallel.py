import os
import threading

import numpy as np
import pytest

from trt_pipeline.calibration.parallel import per_tensor


def test_each_tensor_is_computed_alone_on_the_cores_and_returned_in_the_feeds_order():
    """On a thread per usable core (two at once at least); each result as computed one at a time, in the order
    the tensors came in (the histograms' and the ranges' order follow the calibrated tensors')."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one usable core: nothing to spread the tensors over")
    rng = np.random.default_rng(0)
    values = {f"t{i}": rng.standard_normal(size).astype(np.float32) for i, size in enumerate([10, 2_000_000, 300, 50])}
    started: list[str] = []
    threads: set[int] = set()
    both_running = threading.Barrier(2, timeout=10)

    def summed(name: str, value: np.ndarray) -> float:
        started.append(name)
        threads.add(threading.get_ident())
        if len(started) <= 2:
            both_running.wait()  # the first two run at once, or this waits out its timeout and raises
        return float(np.sort(value).sum(dtype=np.float64))

    found = per_tensor(summed, values)
    assert list(found) == list(values)
    assert found == {name: float(np.sort(value).sum(dtype=np.float64)) for name, value in values.items()}
    assert len(threads) >= 2
