"""Stage 4: onnxsim with the batch axis kept symbolic; on failure keep the checked graph and say why (where the file
system refuses the write, stop: the command line names the fix).

onnxsim is handed the graph's path and writes its result to a path: its C++ core then reads and writes the
weights itself, external data past 2 GB included, where a ModelProto handed over from Python is serialized and
parsed again on each side of the call (at 1.2 GB of weights: 33 s and 6.7 GB of peak memory by the ModelProto,
8 s and 2.7 GB by path; docs/benchmarks/scale.md).
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import PipelineError
from ..folder.graph_files import EXTERNAL_DATA_BYTES, atomic_graph, copy_graph, gather_weights, graph_without_weights
from .check import check_onnx

# onnxsim's pass that turns a linear layer on rank-3 activations (MatMul, then the bias's Add) into Reshape, Gemm,
# Reshape: ONNX Runtime's transformer fusions (attention, bias GELU) match MatMul and Add and find none after it (a
# DistilBERT graph: 6 attentions fused without it, 0 with it); its own note says it is not known to be faster, and ONNX
# Runtime's CPU provider ran that graph at batch 8 in 421 against 449 ms without it.
KEEP_MATMUL_ADD = ["fuse_matmul_add_bias_into_gemm_batched"]


def simplify_onnx(onnx_path: Path, out_path: Path) -> dict:
    """Write the simplified graph to `out_path`, or the checked one unchanged when simplifying fails."""
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    try:
        return _simplify(onnx_path, out_path)
    except PipelineError as error:
        reason = f"the simplified graph failed the checks: {error.problem}"
    except OSError:  # the file system said no (a full disk, a size limit): the user's to fix, not onnxsim's failure
        raise
    except Exception as error:  # onnxsim raises anything from RuntimeError to protobuf errors
        reason = f"onnxsim failed: {type(error).__name__}: {error}"
    _keep(onnx_path, out_path)
    print(f"warning: kept the checked graph unsimplified; {reason}")
    return {"summary": f"kept unsimplified ({reason})", "status": "kept", "reason": reason}


def _simplify(onnx_path: Path, out_path: Path) -> dict:
    import onnxsim

    before = len(graph_without_weights(onnx_path).graph.node)
    with atomic_graph(out_path) as temporary:
        # No overwrite_input_shapes, so the dynamic dims stay symbolic.  check_n=0 because our own parity stage
        # compares the result against PyTorch right after.
        simplified, ok = onnxsim.simplify(
            str(onnx_path),
            check_n=0,
            output_path=str(temporary),
            external_data_threshold=f"{EXTERNAL_DATA_BYTES}B",
            skipped_optimizers=KEEP_MATMUL_ADD,
        )
        if not ok:
            raise RuntimeError("onnxsim reported that the simplified graph does not match the original")
        after = len(simplified.graph.node)
        gather_weights(temporary)  # the folder's rule for external data, whatever onnxsim's is
        check_onnx(temporary)  # the simplified graph must pass every check, batch axis included
    return {"summary": f"onnxsim: {before} -> {after} nodes", "status": "simplified", "nodes": [before, after]}


def _keep(onnx_path: Path, out_path: Path) -> None:
    """The checked graph as the stage's output: where it is already, else copied with its data file."""
    if out_path.resolve() != onnx_path.resolve():
        copy_graph(onnx_path, out_path)
