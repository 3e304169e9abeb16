"""Writing artifacts safely: a temporary name first, then an atomic rename.

An interrupted run therefore never leaves a file under a final name that looks
finished but is not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it to `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        yield temporary
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


def write_bytes(final: Path, data: bytes) -> None:
    with atomic_path(final) as temporary:
        temporary.write_bytes(data)


def write_json(final: Path, record: dict) -> None:
    write_bytes(final, (json.dumps(record, indent=2, sort_keys=False, default=str) + "\n").encode())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
