"""Stage 4: onnxsim with the batch axis kept symbolic; on failure keep the checked graph and say why."""

from __future__ import annotations

from pathlib import Path

import onnx

from ..core.errors import PipelineError
from ..folder.artifacts import atomic_path
from .check import check_onnx


def simplify_onnx(onnx_path: Path, out_path: Path) -> dict:
    """Write the simplified graph to `out_path`, or the checked one unchanged when simplifying fails."""
    model = onnx.load(str(onnx_path))
    before = len(model.graph.node)
    with atomic_path(out_path) as temporary:
        try:
            simplified = _run_onnxsim(model)
            onnx.save(simplified, str(temporary))
            check_onnx(temporary)  # the simplified graph must pass every check, batch axis included
        except PipelineError as error:
            reason = f"the simplified graph failed the checks: {error.problem}"
        except Exception as error:  # onnxsim raises anything from RuntimeError to protobuf errors
            reason = f"onnxsim failed: {type(error).__name__}: {error}"
        else:
            after = len(simplified.graph.node)
            return {"summary": f"onnxsim: {before} -> {after} nodes", "status": "simplified", "nodes": [before, after]}
        onnx.save(model, str(temporary))
    print(f"warning: kept the checked graph unsimplified; {reason}")
    return {"summary": f"kept unsimplified ({reason})", "status": "kept", "reason": reason}


def _run_onnxsim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxsim

    # No overwrite_input_shapes, so the dynamic dims stay symbolic.  check_n=0 because our
    # own parity stage compares the result against PyTorch right after.
    simplified, ok = onnxsim.simplify(model, check_n=0)
    if not ok:
        raise RuntimeError("onnxsim reported that the simplified graph does not match the original")
    return simplified
