"""Each convolution's bias as an Add of its own, for ONNX Runtime's CUDA provider.

cuDNN adds a convolution's bias in a kernel of its own, and a slow one: on an H100, ResNet-50's FP16 graph at batch
32 spent 1.27 ms of its 3.36 ms of kernels a call there (53 calls of `op_generic_tensor_kernel`, 24 us each, where
ONNX Runtime's Relu over the same tensors took 8).  ONNX Runtime's own Add, broadcasting the bias per channel, took
0.62 ms for the same 53, and the runner with CUDA graphs went from 3.45 to 2.79 ms device-resident (batch 8: 1.23
to 1.04); docs/benchmarks/resnet50-h100-cuda.md.  ONNX Runtime's ConvAddFusion folds such an Add back into the
Conv, so a session on the split graph opens with it off (KEEP_BIAS_ADD).

The rewrite reads and writes the graph alone: its weights stay where they are (a data file beside it is neither
read nor rewritten, except for the biases, which are small).
"""

from __future__ import annotations

from pathlib import Path

# ONNX Runtime's rewrite that folds a constant Add after a Conv into the Conv's bias: the split undone.
KEEP_BIAS_ADD = ["ConvAddFusion"]
# An INT8 graph's Convs sit between DequantizeLinear and QuantizeLinear, which ONNX Runtime fuses into its int8
# kernels only as that exact pattern: an Add in between would leave them in float.  Such graphs are left as they are
# (by pipeline.runners.attention too).
QUANTIZED = {"QuantizeLinear", "DequantizeLinear"}


def split_conv_bias(graph: Path) -> int:
    """Rewrite the graph file `graph` in place: each Conv whose weights and bias are initializers computes without
    the bias, and an Add after it adds the bias (shaped to broadcast over the spatial axes), so the outputs are the
    same.  Returns how many Convs were split (0: the file is untouched, e.g. a graph without convolutions or with
    Q/DQ nodes)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph), load_external_data=False)
    if any(node.op_type in QUANTIZED for node in model.graph.node):
        return 0
    weights = {tensor.name: tensor for tensor in model.graph.initializer}
    nodes, split = [], 0
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type != "Conv" or len(node.input) < 3 or not {node.input[1], node.input[2]} <= weights.keys():
            continue
        spatial = len(weights[node.input[1]].dims) - 2
        bias = numpy_helper.to_array(weights[node.input[2]], base_dir=str(graph.parent))
        shaped = f"{node.output[0]}_bias"
        model.graph.initializer.append(numpy_helper.from_array(bias.reshape(-1, *[1] * spatial), shaped))
        output = node.output[0]
        node.output[0] = f"{output}_before_bias"
        nodes.append(helper.make_node("Add", [node.output[0], shaped], [output], name=f"{output}_bias_add"))
        del node.input[2]
        split += 1
    if not split:
        return 0
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    read = {name for node in model.graph.node for name in node.input}
    kept = [tensor for tensor in model.graph.initializer if tensor.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    onnx.save(model, str(graph))
    return split
