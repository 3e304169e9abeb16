"""pipeline/folder/graph_io.py: the size of an output dim named by an expression of input dims."""

from __future__ import annotations

from trt_pipeline.pipeline.folder.graph_io import dim_size


def test_dim_size_reads_expressions_and_never_runs_python():
    assert dim_size("sequence", {"sequence": 7}) == 7
    assert dim_size("2*sequence", {"sequence": 7}) == 14
    assert dim_size("floor(height/2 - 1/2) + 1", {"height": 9}) == 5
    assert dim_size("Min(64, sequence) + Mod(sequence, 3)", {"sequence": 70}) == 65
    assert dim_size("sequence**2", {"sequence": 3}) == 9
    assert dim_size("sequence/2", {"sequence": 3}) is None  # not a whole size
    assert dim_size("LayerNormalizationlast_hidden_state_dim_1", {"sequence": 3}) is None
    assert dim_size("__import__('os').getpid()", {}) is None
    assert dim_size("sequence.real", {"sequence": 3}) is None
    assert dim_size("2**sequence", {"sequence": 99999}) is None
