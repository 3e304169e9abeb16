"""ONNX Runtime sessions with this project's options, shared by the runner (runtime) and the parity stages (build).

Kept apart from pipeline/parity.py so that serving an ONNX graph imports onnxruntime and nothing of the build.
"""

from __future__ import annotations

from pathlib import Path


def onnxruntime_session(
    graph: Path | bytes,
    providers: list[str] | None = None,
    *,
    intra_op_threads: int | None = None,
    allow_spinning: bool = True,
    simulate_qdq: bool = False,
):
    """An ONNX Runtime session on a graph file or a graph's bytes; the CPU provider unless told otherwise.

    intra_op_threads: None keeps ORT's default (one per physical core).  allow_spinning=False makes idle
    intra-op threads sleep instead of spinning, which frees the cores for other requests' threads.
    simulate_qdq: run every QuantizeLinear/DequantizeLinear as itself, in float, as TensorRT's Q/DQ semantics
    say, instead of letting ORT fuse DQ -> Conv -> Q into its own int8 kernels (which compute something else:
    on CPUs without VNNI their u8/s8 products saturate, issue 17).  For judging the TensorRT-shaped INT8 graph.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: ORT warns about every unused initializer
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if simulate_qdq:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    model = graph if isinstance(graph, bytes) else str(graph)
    return ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])
