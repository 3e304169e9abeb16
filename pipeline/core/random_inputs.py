"""Random inputs for a graph's input records, one way for the build and the runtime alike: the reference inputs
(stages/export.py, stages/onnx_model.py) and the benchmark's (bench/harness.py) are drawn here.  numpy only."""

from __future__ import annotations

import numpy as np

from .errors import PipelineError
from .settings import mention


def random_inputs(
    inputs: list[dict], batch: int, seed: int, *, axis_sizes: dict[str, int], int_ranges: dict[str, tuple[int, int]]
) -> dict[str, np.ndarray]:
    """Random arrays for input records {name, dtype, shape}: dim 0 is `batch`, named dims take `axis_sizes`.

    Floats are standard normal, integers uniform within int_ranges[name] (inclusive), booleans coin flips.
    """
    rng = np.random.default_rng([seed, batch])
    feed: dict[str, np.ndarray] = {}
    for record in inputs:
        name, dtype = record["name"], np.dtype(record["dtype"])
        dims = record["shape"]
        shape = tuple(
            batch if axis == 0 else (d if isinstance(d, int) else axis_sizes[d]) for axis, d in enumerate(dims)
        )
        _refuse_huge_batch(name, shape, dtype)
        if dtype.kind == "f":
            feed[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feed[name] = rng.random(shape) > 0.5
        else:
            low, high = int_ranges[name]
            feed[name] = rng.integers(low, high + 1, shape).astype(dtype)
    return feed


# The largest random batch of one input: the reference runs the profile's max batch through PyTorch and ONNX Runtime.
RANDOM_MAX_BYTES = 1 << 30


def _refuse_huge_batch(name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    nbytes = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if nbytes > RANDOM_MAX_BYTES:
        raise PipelineError(
            f"a batch of {shape[0]} rows of input {name!r} {list(shape)} would take {nbytes / 2**30:.3g} GiB",
            f"lower the max of {mention(batch='min:opt:max')}: a batch may take at most {RANDOM_MAX_BYTES >> 30} GiB "
            "per input",
        )
