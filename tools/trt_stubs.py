"""Make the tensorrt-stubs package usable by mypy: python tools/trt_stubs.py <target folder>.

tensorrt-stubs 10.13 ships `tensorrt/__init__.pyi` without a `py.typed` marker, so mypy
treats every TensorRT type as Any and checks nothing; its generated stub also has two
syntax errors (parameters named `in`, a required parameter after optional ones in
`add_scale_nd`).  This copies the stubs to a folder for MYPYPATH with those three
things repaired.  The copy is generated at set-up time, never committed.
"""

from __future__ import annotations

import re
import shutil
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("tensorrt", "tensorrt_bindings")


def repair(text: str) -> str:
    text = re.sub(r"([(,] *)in: ", r"\1in_: ", text)  # `in` is a keyword, not a parameter name
    return text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")


def main(target: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "tensorrt" / "__init__.pyi").is_file():
        sys.exit(f"tensorrt-stubs is not installed in {site}: pip install --no-deps tensorrt-stubs")
    for package in PACKAGES:
        destination = target / package
        shutil.rmtree(destination, ignore_errors=True)
        destination.mkdir(parents=True)
        for stub in (site / package).glob("*.pyi"):
            (destination / stub.name).write_text(repair(stub.read_text()))
        (destination / "py.typed").write_text("")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
