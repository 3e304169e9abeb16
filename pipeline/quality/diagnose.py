"""`trt-pipeline diagnose <folder>`: where a float16 or INT8 graph departs from the FP32 graph, layer by layer.

Both graphs run on the same inputs (an INT8 folder's calibration sample, else the first case of reference.npz),
compared tensor by tensor as pipeline/evaluation/layers.py does it (the float16 graph as the engine stores it, the
INT8 graph with its Q/DQ as TensorRT computes them).  The report names the first node past the precision's
tolerance and the 10 worst, and lands in the folder as diagnosis.json / diagnosis.md; a failing gate quotes its
first line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ...calibration.int8 import calibration_sample
from ..core.errors import PipelineError
from ..core.precision import Precision
from ..core.settings import mention
from ..evaluation import node_tolerance
from ..evaluation.layers import compare_layers, first_past
from ..folder.artifacts import write_bytes, write_json
from ..folder.graph_io import load_reference
from ..folder.layout import FP32_GRAPH, REFERENCE, graph_record
from ..folder.manifest import require_manifest

WORST = 10


# --------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder", type=Path, help="an artifact folder built for fp16 or int8 (engines/<model>-<precision>)"
    )


def main(args: argparse.Namespace) -> int:
    report = diagnose_folder(args.folder)
    print(markdown(report))
    return 0


def diagnose_folder(folder: Path) -> dict:
    """Compare the folder's graph with its FP32 graph (on _inputs); write diagnosis.json/.md."""
    manifest = require_manifest(folder)
    precision = manifest.precision
    if precision not in (Precision.FP16, Precision.INT8):
        raise PipelineError(
            f"{folder} holds a {precision or 'unknown'} graph: there is no lower precision to compare with FP32",
            f"diagnose a folder built with {mention(precision=Precision.FP16)} or {mention(precision=Precision.INT8)}",
        )
    inputs, data = _inputs(folder, precision)
    graph = graph_record(precision)
    errors = compare_layers(folder / FP32_GRAPH, folder / graph.file, inputs, graph)
    first = first_past(errors, node_tolerance(precision))
    report = {
        "folder": str(folder),
        "precision": precision,
        "rtol": node_tolerance(precision),
        "data": data,
        "batch": int(next(iter(inputs.values())).shape[0]),
        "compared": len(errors),
        "first_past_tolerance": first.as_record() if first else None,
        "worst": [error.as_record() for error in sorted(errors, key=lambda e: -e.rel)[:WORST]],
    }
    write_json(Path(folder) / "diagnosis.json", report)
    write_bytes(Path(folder) / "diagnosis.md", markdown(report).encode())
    return report


def _inputs(folder: Path, precision: Precision) -> tuple[dict[str, np.ndarray], str]:
    """(inputs, what they are): an INT8 folder's calibration sample, where it kept one (reference.npz's inputs are
    random, and the input's Q/DQ clips what lies outside the calibrated range), else the first reference case."""
    sample = calibration_sample(folder) if precision is Precision.INT8 else None
    if sample is not None:
        return sample, "the first calibration rows the INT8 gate judged (held out from calibration where it could)"
    return load_reference(Path(folder) / REFERENCE)[0][0], "the first reference case"


def markdown(report: dict) -> str:
    first = report["first_past_tolerance"]
    lines = [
        f"# Diagnosis: {report['folder']} ({report['precision']} against FP32)",
        "",
        f"{report['compared']} tensors compared on {report['data']} (batch {report['batch']}); "
        f"tolerance {report['rtol']:g} of each tensor's FP32 scale.",
        "",
        f"First node past the tolerance: **{first['node']}** ({first['op']}), {first['rel']:.3g} of its scale."
        if first
        else "No node is past the tolerance.",
        "",
        f"| the {WORST} worst | op | tensor | max abs error | FP32 scale | relative |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {e['node']} | {e['op']} | {e['tensor']} | {e['max_abs']:.3g} | {e['scale']:.3g} | {e['rel']:.3g} |"
        for e in report["worst"]
    ]
    return "\n".join(lines) + "\n"
