"""The one comparison used by the parity stage, the runners' tests and the benchmark.

Tolerances are relative to the output's scale (its largest magnitude), because a
fixed absolute tolerance is meaningless across models whose logits are 0.1 or 1e4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    mean_abs: float
    scale: float
    max_rel: float  # max_abs / scale
    tolerance: float  # the largest max_abs that passes
    ok: bool

    def as_record(self) -> dict:
        return asdict(self)


def compare(reference: np.ndarray, actual: np.ndarray, *, rtol: float, atol: float = 0.0) -> Comparison:
    """Compare `actual` against `reference`; passes when max |a - r| <= atol + rtol * max |r|."""
    if reference.shape != actual.shape:
        raise ValueError(f"shape mismatch: reference {reference.shape}, actual {actual.shape}")
    ref = reference.astype(np.float64)
    diff = np.abs(actual.astype(np.float64) - ref)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    max_abs = float(np.max(diff)) if diff.size else 0.0
    tolerance = atol + rtol * scale
    finite = bool(np.all(np.isfinite(actual)))
    return Comparison(
        max_abs=max_abs,
        mean_abs=float(np.mean(diff)) if diff.size else 0.0,
        scale=scale,
        max_rel=max_abs / scale if scale > 0 else max_abs,
        tolerance=tolerance,
        ok=finite and max_abs <= tolerance,
    )


def compare_outputs(
    reference: dict[str, np.ndarray], actual: dict[str, np.ndarray], *, rtol: float, atol: float = 0.0
) -> dict[str, Comparison]:
    """Compare every named output; a missing output is a ValueError."""
    missing = sorted(set(reference) - set(actual))
    if missing:
        raise ValueError(f"outputs missing from the result: {missing}")
    return {name: compare(reference[name], actual[name], rtol=rtol, atol=atol) for name in reference}


def cosine(reference: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> float:
    """The cosine between all of `actual`'s outputs and all of `reference`'s, each flattened in the reference's
    order (1.0: the same direction; a scale-free summary beside max_abs); NaN where an output is not finite."""
    ref = np.concatenate([reference[name].astype(np.float64).ravel() for name in reference])
    got = np.concatenate([actual[name].astype(np.float64).ravel() for name in reference])
    if not np.all(np.isfinite(got)):
        return float("nan")
    norms = float(np.linalg.norm(ref) * np.linalg.norm(got))
    return float(ref @ got / norms) if norms > 0 else float(np.array_equal(ref, got))
