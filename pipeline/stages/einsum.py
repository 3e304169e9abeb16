"""Einsum equations in the letters TensorRT's ONNX parser reads (part of the check stage).

ONNX lets an Einsum's equation use any letter, upper or lower case, and spaces; TensorRT's parser takes lowercase
letters only: torchvision's MaxViT writes "B G H I D, B G H J D -> B G H I J", and its 44 Einsums were each
refused ("Invalid character(s) in Einsum equation").  The same contraction with its subscripts renamed to
lowercase letters and the spaces dropped computes the same values, so the check stage rewrites the graph that way
(every later graph derives from it) where an equation changes.
"""

from __future__ import annotations

import string
from pathlib import Path

from ..folder.graph_files import atomic_graph, graph_without_weights, write_graph


def lowercase_einsums(onnx_path: Path) -> int:
    """Rewrite the graph at `onnx_path` so that each Einsum's equation has lowercase letters and no spaces; returns
    how many equations changed (the graph is rewritten only where one does)."""
    model = graph_without_weights(onnx_path)
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx"):
            continue
        for attribute in node.attribute:
            if attribute.name == "equation":
                equation = attribute.s.decode()
                lowered = lowercase_equation(equation)
                if lowered != equation:
                    attribute.s, changed = lowered.encode(), changed + 1
    if changed:
        with atomic_graph(onnx_path) as temporary:
            write_graph(model, onnx_path.parent, temporary)
    return changed


def lowercase_equation(equation: str) -> str:
    """`equation` without spaces, each letter renamed to a lowercase one: a lowercase letter keeps its name, an
    uppercase one takes its own lowercase where the equation does not use that already, else the first one free."""
    compact = equation.replace(" ", "")
    letters = list(dict.fromkeys(char for char in compact if char.isalpha()))
    taken = {letter for letter in letters if letter.islower()}
    names = {letter: letter for letter in taken}
    for letter in letters:
        if letter in names:
            continue
        name = (
            letter.lower() if letter.lower() not in taken else next(c for c in string.ascii_lowercase if c not in taken)
        )
        names[letter] = name
        taken.add(name)
    return "".join(names.get(char, char) for char in compact)
