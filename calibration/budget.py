"""INT8 to an accuracy budget: leave the most sensitive quantized layers in float until the loss fits.

The loss is measured by a caller-given function on calibration-like data (pipeline/quality/accuracy.py budget_loss:
top-1 points lost against the FP32 graph's on a labelled set; otherwise the larger of 100 x (1 - mean cosine to
FP32) and the percentage of samples whose top-1 really flips, near-ties excused).  It returns a record whose
"loss" the search reads; the rest (cosine, flips) goes into each step's row of the report.  Sensitivity is
leave-one-out: the whole graph quantized except one layer, one graph per layer (ranges from the cache, so
no recalibration); the layers whose exclusion lowers the loss most are left in float first, one more
each step, until the loss is within the budget or every layer is float.  Every step is recorded (layers
kept, loss, graph size), so the report shows the trade-off, not only the end point.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

from .qdq import quantize_qdq
from .qdq_write import QuantizedWeights
from .ranges import QUANTIZED_OPS

# A graph -> {"loss": float, and whatever else describes it (recorded in the step)}.
Loss = Callable[[Path], dict]


def quantized_layers(fp32_path: Path) -> list[str]:
    """The names of the nodes the INT8 graph quantizes (Conv/Gemm/MatMul), in graph order."""
    graph = onnx.load(str(fp32_path), load_external_data=False).graph
    return [node.name for node in graph.node if node.op_type in QUANTIZED_OPS]


def fit_budget(fp32_path: Path, out_path: Path, ranges, budget: float, loss: Loss) -> dict:
    """Write to `out_path` the INT8 graph with the fewest layers left in float whose loss is within `budget`;
    return the record: the budget, each layer's sensitivity, every step taken and the layers kept in float."""
    layers = quantized_layers(fp32_path)
    weights = QuantizedWeights()  # every trial's graph has the same weights: each quantized once
    with tempfile.TemporaryDirectory(prefix="budget.") as scratch:
        trial = Path(scratch) / "trial.onnx"

        def measure(excluded: list[str]) -> dict:
            quantize_qdq(fp32_path, trial, ranges, exclude=excluded, weights=weights)
            return {"kept_float": excluded, **loss(trial), "graph_bytes": trial.stat().st_size}

        steps: list[dict] = [measure([])]
        full_loss = steps[0]["loss"]
        sensitivity = {}
        if full_loss > budget:
            sensitivity = {layer: full_loss - measure([layer])["loss"] for layer in layers}
        order = sorted(sensitivity, key=lambda layer: -sensitivity[layer])
        kept: list[str] = []
        while steps[-1]["loss"] > budget and len(kept) < len(order):
            kept = order[: len(kept) + 1]
            steps.append(measure(kept))
    quantize_qdq(fp32_path, out_path, ranges, exclude=kept, weights=weights)
    final = steps[-1]
    return {
        "summary": f"{out_path.name}: {len(kept)} of {len(layers)} layers kept in float, loss {final['loss']:.3g} "
        f"(budget {budget:g}; all quantized: {full_loss:.3g})",
        "budget": budget,
        "within_budget": final["loss"] <= budget,
        "layers": len(layers),
        "kept_float": kept,
        "sensitivity": {layer: round(value, 6) for layer, value in sensitivity.items()},
        "steps": steps,
    }
