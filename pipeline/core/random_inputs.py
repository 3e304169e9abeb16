"""Random inputs for a graph's input records, one way for the build and the runtime alike: the reference inputs
(stages/export.py, stages/onnx_model.py) and the benchmark's (bench/harness.py) are drawn here.  numpy only."""

from __future__ import annotations

import numpy as np

from .errors import PipelineError
from .settings import mention


def random_inputs(
    inputs: list[dict],
    batch: int,
    seed: int,
    *,
    axis_sizes: dict[str, int],
    int_ranges: dict[str, tuple[int, int]],
    end_tokens: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Random arrays for input records {name, dtype, shape}: dim 0 is `batch`, named dims take `axis_sizes`.

    Floats are standard normal, integers uniform within int_ranges[name] (inclusive), booleans coin flips; an
    integer input in end_tokens ends each row with its token (see end_token).
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
            end = (end_tokens or {}).get(name)
            if end is not None and len(shape) == 2 and shape[1]:
                feed[name][:, -1] = end
    return feed


def end_token(rows: list[np.ndarray]) -> int | None:
    """The token every row of these integer [rows, tokens] arrays ends with, where it is one value that occurs
    nowhere else in them, over two rows at least: the end-of-sequence token a tokenizer closes each row with.  The
    draws keep it there (random_inputs), and draw the other tokens in the range of the rest: BART's classifier reads
    its state at each row's EOS and refuses rows with different counts of it, so ids drawn at random over the EOS's
    value could not run.  None where the rows show no such token (a single row cannot tell one from chance)."""
    rows = [array for array in rows if array.ndim == 2 and array.shape[1] >= 2]
    if sum(len(array) for array in rows) < 2:
        return None
    last = {int(value) for array in rows for value in array[:, -1]}
    if len(last) != 1:
        return None
    token = last.pop()
    return None if any((array[:, :-1] == token).any() for array in rows) else token


def integer_range(rows: list[np.ndarray], end: int | None) -> tuple[int, int]:
    """[low, high] of integer arrays' values, less their last column where they end with the token `end`."""
    values = [array[:, :-1] if end is not None else array for array in rows]
    return min(int(v.min()) for v in values), max(int(v.max()) for v in values)


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
