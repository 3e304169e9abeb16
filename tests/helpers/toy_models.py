"""Tiny factories for tests across the project (export, parity, build, the loaders).

Each runs in milliseconds and is seeded, so two calls give the same weights and inputs.
Keep names and behaviour stable: other engineers' tests load these as
`tests.helpers.toy_models:<name>` through `models.load_model`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trt_pipeline.models.spec import DynamicAxis, ModelSpec

EXAMPLE_BATCH = 2  # not 1: exporters can specialise a batch of 1 into a constant
SEQ = DynamicAxis(name="seq", min=1, opt=12, max=64)


@contextlib.contextmanager
def _seeded(seed: int = 0) -> Iterator[None]:
    """Deterministic weights and inputs without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class _TinyCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


def tiny_cnn() -> ModelSpec:
    """Conv-BN-ReLU-pool-flatten-Linear on one 3x16x16 image input; output "logits"."""
    with _seeded():
        module = _TinyCnn()
        example = {"input": torch.randn(EXAMPLE_BATCH, 3, 16, 16)}
    return ModelSpec(name="tiny_cnn", module=module, example_inputs=example, output_names=["logits"])


class _TextClassifier(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.embed(input_ids)  # [B, S, 8]
        mask = attention_mask.unsqueeze(-1)
        # clamp: an all-padding row would divide by zero
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return {"logits": self.fc(pooled), "tokens": tokens}


def text_classifier() -> ModelSpec:
    """Two inputs (int64 ids, float mask) with a dynamic sequence axis "seq"; returns a dict of two outputs."""
    with _seeded():
        module = _TextClassifier()
        input_ids = torch.randint(0, 100, (EXAMPLE_BATCH, 12), dtype=torch.int64)
    attention_mask = torch.ones(EXAMPLE_BATCH, 12, dtype=torch.float32)
    attention_mask[1, 9:] = 0.0  # padding on the second row, so the mask really matters
    return ModelSpec(
        name="text_classifier",
        module=module,
        example_inputs={"input_ids": input_ids, "attention_mask": attention_mask},
        output_names=["logits", "tokens"],
        dynamic_axes={"input_ids": {1: SEQ}, "attention_mask": {1: SEQ}, "tokens": {1: SEQ}},
    )


class _BakedBatchCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The classic bug on purpose: the batch size is baked into the graph.
        return self.fc(self.conv(x).reshape(2, -1))


def baked_batch_cnn() -> ModelSpec:
    """A model whose forward hard-codes batch 2 (`x.reshape(2, -1)`); exports fine, breaks at other batches."""
    with _seeded():
        module = _BakedBatchCnn()
        example = {"input": torch.randn(EXAMPLE_BATCH, 3, 8, 8)}
    return ModelSpec(name="baked_batch_cnn", module=module, example_inputs=example, output_names=["logits"])


def dropout_mlp() -> tuple[nn.Module, torch.Tensor]:
    """(module, example input) with Dropout(0.5) and BatchNorm1d: outputs differ between train and eval mode."""
    with _seeded():
        module = nn.Sequential(
            nn.Linear(16, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(32, 4),
        )
        example = torch.randn(EXAMPLE_BATCH, 16)
    return module, example


class _BatchStatsCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
        # No running stats: normalises with the batch's own statistics even in eval mode,
        # so one sample's output depends on the others in its batch.
        self.bn = nn.BatchNorm2d(4, track_running_stats=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.bn(self.conv(x))), 1))


def batch_stats_cnn() -> ModelSpec:
    """A CNN with BatchNorm2d(track_running_stats=False): outputs depend on the batch, even in eval."""
    with _seeded():
        module = _BatchStatsCnn()
        example = {"input": torch.randn(EXAMPLE_BATCH, 3, 8, 8)}
    return ModelSpec(name="batch_stats_cnn", module=module, example_inputs=example, output_names=["logits"])


class _PlainModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def plain_module() -> nn.Module:
    """A bare nn.Module taking 3-channel images of any size: load it with an input_shape such as 3x16x16."""
    with _seeded():
        return _PlainModule()


class _OverflowFfn(nn.Module):
    """Two layers, a residual feed-forward block and a head.  The block's hidden activations reach about 3e5,
    beyond float16's 65504, as the feed-forward outputs of T5-style transformers do; it holds a fifth of the
    weights, the rest is fine in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.up = nn.Linear(64, 16)
        self.down = nn.Linear(16, 64)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():  # the product of the two is unchanged: only the hidden values grow
            self.up.weight.mul_(3e5)
            self.up.bias.mul_(3e5)
            self.down.weight.div_(3e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        return self.head(h + self.down(torch.relu(self.up(h))))


def overflow_ffn() -> ModelSpec:
    """_OverflowFfn on one (batch, 16) input; output "logits"."""
    with _seeded():
        module = _OverflowFfn()
        example = {"input": torch.randn(EXAMPLE_BATCH, 16)}
    return ModelSpec(name="overflow_ffn", module=module, example_inputs=example, output_names=["logits"])


class _TransformerEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def transformer_encoder() -> ModelSpec:
    """torch's own nn.TransformerEncoder on (batch, 8, 16): in eval mode it takes a fast path no ONNX opset has."""
    with _seeded():
        module = _TransformerEncoder()
        example = {"x": torch.randn(EXAMPLE_BATCH, 8, 16)}
    return ModelSpec(name="transformer_encoder", module=module, example_inputs=example, output_names=["y"])


class _BakedSequence(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # int() makes the traced graph keep the example's sequence length as a constant
        return x.reshape(x.shape[0], int(x.shape[1]), 2, 4).sum(-1)


def baked_sequence_model() -> ModelSpec:
    """Runs at any sequence length in PyTorch, but its ONNX graph only at the example's (6), though DYNAMIC
    declares the axis."""
    example = {"x": torch.zeros(EXAMPLE_BATCH, 6, 8)}
    axes = {"x": {1: DynamicAxis(name="seq", min=1, opt=6, max=12)}}
    return ModelSpec(name="baked_sequence", module=_BakedSequence(), example_inputs=example, dynamic_axes=axes)


class _NestedOutputs(nn.Module):
    """A dict that holds a tuple, as Hugging Face outputs hold hidden states: three tensors, two at one key."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        hidden = torch.relu(self.body(x))
        return {"logits": self.head(hidden), "aux": (hidden, hidden.sum(-1, keepdim=True))}


def nested_outputs() -> ModelSpec:
    with _seeded():
        module, example = _NestedOutputs(), {"x": torch.randn(EXAMPLE_BATCH, 6)}
    return ModelSpec(name="nested_outputs", module=module, example_inputs=example)


class _ScoreFilter(nn.Module):
    """Keeps the scores past a threshold, as a detector's post-processing does: how many depends on the values."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return scores[scores.sigmoid() > 0.5]


def score_filter() -> ModelSpec:
    with _seeded():
        return ModelSpec(name="score_filter", module=_ScoreFilter(), example_inputs={"scores": torch.randn(2, 16)})


class _GroupedQueryAttention(nn.Module):
    """Four query heads over two key/value heads through SDPA's enable_gqa, which the TorchScript-based exporter
    does not convert; keys and values come out of one projection by chunk() (opset 18's Split(num_outputs))."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(16, 16)
        self.key_value = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        query = self.query(x).view(batch, sequence, 4, 4).transpose(1, 2)
        key, value = self.key_value(x).view(batch, sequence, 2, 8).transpose(1, 2).chunk(2, dim=-1)
        attended = nn.functional.scaled_dot_product_attention(query, key, value, enable_gqa=True)
        return attended.transpose(1, 2).reshape(batch, sequence, 16)


def grouped_query_attention() -> ModelSpec:
    with _seeded():
        module, example = _GroupedQueryAttention(), {"x": torch.randn(EXAMPLE_BATCH, 8, 16)}
    axes = {"x": {1: DynamicAxis(name="seq", min=1, opt=8, max=16)}}
    return ModelSpec(name="grouped_query_attention", module=module, example_inputs=example, dynamic_axes=axes)


class _OpsChangedInOpset18(nn.Module):
    """Operators opset 18 changed, as a conv net uses them: Pad (F.pad), Reduce* (mean, amax, var), Resize
    (F.interpolate) and Split (split, chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.norm = nn.GroupNorm(1, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(nn.functional.pad(image, (1, 1, 1, 1), mode="reflect")))
        y = y - y.mean(dim=(2, 3), keepdim=True) + y.amax(dim=1, keepdim=True)
        y = nn.functional.interpolate(y, scale_factor=2.0, mode="bilinear", align_corners=False)
        first, rest = y.split([1, 4], dim=1)
        low, high = rest.chunk(2, dim=1)  # along a static axis: chunk() of a dynamic one specializes it
        return torch.cat([first.softmax(-1), rest.var(dim=-1, keepdim=True).expand_as(rest), high - low], dim=1)


def ops_changed_in_opset_18() -> ModelSpec:
    with _seeded():
        module, example = _OpsChangedInOpset18(), {"image": torch.randn(EXAMPLE_BATCH, 3, 16, 16)}
    side = DynamicAxis(name="side", min=8, opt=16, max=32)
    return ModelSpec(
        name="ops_changed_in_opset_18",
        module=module,
        example_inputs=example,
        dynamic_axes={"image": {2: side, 3: side}},
    )


class _SequenceEncoder(nn.Module):
    """Token and position embeddings, one attention-like mix and a LayerNorm, as a BERT layer: the positions are a
    slice of a table as long as the longest sequence, so the exporter cannot tell that the output's axis 1 is the
    input's sequence (it names it after the LayerNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(30, 16)
        self.positions = nn.Parameter(torch.randn(1, SEQ.max, 16))
        self.mix = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(input_ids) + self.positions[:, : input_ids.shape[1]]
        weights = (hidden @ hidden.transpose(1, 2)).softmax(-1)
        return self.norm(hidden + self.mix(weights @ hidden))


def sequence_encoder() -> ModelSpec:
    """input_ids [batch, seq] -> hidden [batch, seq, 16], the sequence axis declared on the input only."""
    with _seeded():
        module = _SequenceEncoder()
        input_ids = torch.randint(0, 30, (EXAMPLE_BATCH, 12), dtype=torch.int64)
    return ModelSpec(
        name="sequence_encoder",
        module=module,
        example_inputs={"input_ids": input_ids},
        output_names=["hidden"],
        dynamic_axes={"input_ids": {1: SEQ}},
    )


HEIGHT = DynamicAxis(name="height", min=8, opt=16, max=32)


class _ComputedDims(nn.Module):
    """Outputs whose sizes are computed from input dims: a strided convolution over a dynamic height, and a
    sequence joined to itself."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv(image), torch.cat([tokens, tokens], dim=1)


def computed_dims() -> ModelSpec:
    """image [batch, 3, height, 16] -> features [batch, 4, (height - 1) // 2 + 1, 8]; tokens [batch, seq, 4] ->
    doubled [batch, 2 * seq, 4]."""
    with _seeded():
        module = _ComputedDims()
        example = {"image": torch.randn(EXAMPLE_BATCH, 3, 16, 16), "tokens": torch.randn(EXAMPLE_BATCH, 12, 4)}
    return ModelSpec(
        name="computed_dims",
        module=module,
        example_inputs=example,
        output_names=["features", "doubled"],
        dynamic_axes={"image": {2: HEIGHT}, "tokens": {1: SEQ}},
    )


class _PlusIdentity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.eye(x.shape[1]).unsqueeze(0)  # exported as EyeLike on the sequence's dims


def plus_identity() -> ModelSpec:
    """Each [n, n] square plus the identity: its graph has an EyeLike on dynamic dims, which TensorRT's parser
    refuses (XLNet's relative attention has one), while ONNX Runtime runs it."""
    example = {"x": torch.zeros(EXAMPLE_BATCH, 4, 4)}
    axis = DynamicAxis(name="n", min=1, opt=4, max=8)
    return ModelSpec(
        name="plus_identity", module=_PlusIdentity(), example_inputs=example, dynamic_axes={"x": {1: axis, 2: axis}}
    )
