"""The calibration cache: collected ranges kept beside the artifacts so a rebuild skips calibration.

A cache file is named after its key, the sha256 of everything that decides the ranges: the FP32
graph's bytes, the bytes of the calibration rows the ranges are fit on (calibration/holdout.py: not
the rows held out for the gate, so ranges fit on all rows, or on another split, are never reused),
the method and its options (smoothing's alpha among them), and the onnxruntime version.  The file
stores the ranges as ORT's own JSON text, and as JSON text the smoothing scales (calibration/smooth.py)
and the weights' input means (calibration/bias.py), which the same pass over the same rows measures, so
a hit skips that pass whole; plus the sha256 of the three: a truncated or edited file fails the check
and is recomputed, never trusted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..pipeline.folder.artifacts import write_json

CACHE_FORMAT = 3  # 2: the smoothing scales beside the ranges; 3: the input means, all from one unoptimized pass


@dataclass(frozen=True)
class CacheLookup:
    """The ranges, smoothing scales and input means found (None on a miss) and why: "hit", "miss", "recalibrate"
    or "corrupted: ..."."""

    ranges: object | None
    status: str
    smoothing: dict[str, np.ndarray] | None = None
    means: dict[str, np.ndarray] | None = None


def cache_key(graph_sha256: str, data_sha256: str, options: dict) -> str:
    import onnxruntime

    payload = {
        "format": CACHE_FORMAT,
        "graph": graph_sha256,
        "data": data_sha256,
        "options": options,
        "onnxruntime": onnxruntime.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_path(folder: Path, method: str, key: str) -> Path:
    return Path(folder) / f"{method}-{key[:16]}.json"


def load_ranges(path: Path, key: str, *, recalibrate: bool = False) -> CacheLookup:
    """The cached TensorsData for `key`, or None with the reason it cannot be used."""
    if recalibrate:
        return CacheLookup(None, "recalibrate")
    if not path.is_file():
        return CacheLookup(None, "miss")
    from onnxruntime.quantization.calibrate import TensorsData

    try:
        stored = json.loads(path.read_text())
        ranges_text, smoothing_text, means_text = stored["ranges"], stored["smoothing"], stored["means"]
        if _digest(ranges_text, smoothing_text, means_text) != stored["sha256"]:
            return CacheLookup(None, "corrupted: the ranges do not match their sha256")
        if stored["key"] != key:
            return CacheLookup(None, "corrupted: the file's key is not the one its name says")
        smoothing = {name: np.asarray(s, dtype=np.float32) for name, s in json.loads(smoothing_text).items()}
        means = {name: np.asarray(m, dtype=np.float64) for name, m in json.loads(means_text).items()}
        return CacheLookup(TensorsData.from_dict(json.loads(ranges_text)), "hit", smoothing, means)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        # json.JSONDecodeError is a ValueError; a missing field or a mangled structure lands here too.
        return CacheLookup(None, f"corrupted: {type(error).__name__}: {error}")


def save_ranges(
    path: Path,
    key: str,
    ranges,
    record: dict,
    smoothing: dict[str, np.ndarray] | None = None,
    means: dict[str, np.ndarray] | None = None,
) -> None:
    """Write the ranges (ORT's JSON form), the smoothing scales, the input means, their sha256, the key and a
    readable record, atomically."""
    from onnxruntime.quantization.calibrate import CalibrationCacheEncoder

    ranges_text = json.dumps(ranges.to_dict(), cls=CalibrationCacheEncoder, sort_keys=True)
    smoothing_text = json.dumps({name: s.tolist() for name, s in (smoothing or {}).items()}, sort_keys=True)
    means_text = json.dumps({name: m.tolist() for name, m in (means or {}).items()}, sort_keys=True)
    write_json(
        path,
        {
            "key": key,
            "record": record,
            "sha256": _digest(ranges_text, smoothing_text, means_text),
            "ranges": ranges_text,
            "smoothing": smoothing_text,
            "means": means_text,
        },
    )


def _digest(*texts: str) -> str:
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()


def read_cache(path: Path) -> CacheLookup:
    """The ranges, smoothing scales and input means of a cache file just written or checked by the INT8 stage (its
    own key)."""
    lookup = load_ranges(path, json.loads(path.read_text())["key"])
    if lookup.ranges is None or lookup.smoothing is None:
        raise RuntimeError(f"the calibration cache {path} was just written and is {lookup.status}")
    return lookup
