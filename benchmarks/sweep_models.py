"""The models benchmarks/gpu_models.py sweeps, with random (seeded) weights: no download, as on the GPU machine.

Each is what users deploy, made from its library's own definition: torchvision's CNNs, transformers' configs (ViT,
Swin, a Whisper encoder, a ViT-g-sized 1B-parameter model), BERT and DistilBERT as `save_pretrained` writes them,
and a YOLO-style detector on torchvision's ResNet-18.  A factory is loaded as MODEL=benchmarks.sweep_models:<name>;
a folder writer writes the folder MODEL= then names.  The tiny ones are what the dry run on a CPU builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

Factory = tuple[nn.Module, Any]


def _trained_like(model: nn.Module) -> nn.Module:
    """Biases and norm scales drawn near where training leaves them (transformers initializes every bias at 0 and
    every LayerNorm scale at 1): with zero biases the exporters and onnxsim drop the bias Adds, and the graph served
    is not the one a trained checkpoint gives (ONNX Runtime's attention fusion found no attention in it)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
            elif parameter.dim() == 1 and bool((parameter == 1).all()):  # a norm's scale
                parameter.copy_(1 + torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def _batchnorm_settled(model: nn.Module, images: torch.Tensor) -> nn.Module:
    """Each BatchNorm's running statistics set to its input's over a batch of `images` (drawn as the build's checks
    draw an image: standard normal), as training leaves them (torchvision initializes them at mean 0, variance 1
    whatever the input).  Unsettled, the activations shrink or grow layer by layer: EfficientNet-B0's outputs came
    out 4e-14 in size and MobileNetV3's 8e-10, below float16's range, so their FP16 graphs computed zeros and failed
    the gate, which a trained model's would not.  Settled on images of another spread (uniform in [0, 1]), the
    detector's class scores saturated at 1.0 on every anchor, and its NMS kept ties that float rounding decides."""
    norms = [module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the batches seen: here one
    model.train()
    with torch.no_grad():
        model(images)
    for norm, momentum in zip(norms, momenta, strict=True):
        norm.momentum = momentum
    return model.eval()


def _torchvision(name: str, size: int = 224, settled: bool = False) -> Factory:
    """torchvision's model `name` with its own random init; `settled`: its BatchNorms settled (_batchnorm_settled),
    where that init leaves the outputs past float16's range."""
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    if settled:
        model = _batchnorm_settled(model, torch.randn(8, 3, size, size))
    return model.eval(), torch.randn(1, 3, size, size)


def resnet50() -> Factory:
    """Unsettled: its outputs are in float16's range (scale about 110) and its FP16 gate passes (0.0007 of that
    scale).  Settled, each of its random residual blocks adds a branch of unit variance, float16's rounding grows
    through them (0.036 of the output's scale, past the gate's 0.03), which a trained ResNet-50's does not."""
    return _torchvision("resnet50")


def convnext_tiny() -> Factory:
    return _torchvision("convnext_tiny")


def efficientnet_b0() -> Factory:
    return _torchvision("efficientnet_b0", settled=True)


def mobilenet_v3_large() -> Factory:
    return _torchvision("mobilenet_v3_large", settled=True)


def vit_base() -> Factory:
    """ViT-B/16 (transformers' ViTConfig defaults: 12 layers, hidden 768), 224x224 images."""
    import transformers

    torch.manual_seed(0)
    model = _trained_like(transformers.ViTModel(transformers.ViTConfig()))
    return model.eval(), {"pixel_values": torch.randn(1, 3, 224, 224)}


def swin_tiny() -> Factory:
    """Swin-T (transformers' SwinConfig defaults: depths 2/2/6/2, window 7), 224x224 images."""
    import transformers

    torch.manual_seed(0)
    model = _trained_like(transformers.SwinModel(transformers.SwinConfig()))
    return model.eval(), {"pixel_values": torch.randn(1, 3, 224, 224)}


def whisper_encoder() -> Factory:
    """Whisper-base's encoder (6 layers, width 512, 8 heads): 80 mel bins x 3000 frames (30 s) in."""
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048, num_mel_bins=80
    )
    return _trained_like(WhisperEncoder(config)).eval(), {"input_features": torch.randn(1, 80, 3000)}


def vit_giant() -> Factory:
    """ViT-g/14 sized (40 layers, hidden 1408, 16 heads, MLP 6144): 1.01G parameters, 4.0 GB in FP32, past protobuf's
    2 GB, so its graphs keep their weights in data files beside them."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=1408, num_hidden_layers=40, num_attention_heads=16, intermediate_size=6144, patch_size=14
    )
    return _trained_like(transformers.ViTModel(config)).eval(), {"pixel_values": torch.randn(1, 3, 224, 224)}


class YoloStyleDetector(nn.Module):
    """A trunk's features at strides 8 (`stem`), 16 and 32 (`deeper`) with an anchor-free head per level, decoded in
    the graph as YOLOv8 exports it: [batch, 4 + classes, anchors] (8400 at 640x640), boxes as cx, cy, w, h in
    pixels, class scores after their sigmoid (POSTPROCESS=nms's input)."""

    def __init__(self, stem: nn.Module, deeper: list[nn.Module], widths: tuple[int, ...], classes: int = 80) -> None:
        super().__init__()
        self.stem, self.deeper = stem, nn.ModuleList(deeper)
        self.heads = nn.ModuleList([nn.Conv2d(width, 4 + classes, 1) for width in widths])
        for head in self.heads:
            nn.init.constant_(head.bias[4:], -4.0)  # YOLO's prior: most anchors see nothing

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = [self.stem(images)]
        for stage in self.deeper:
            features.append(stage(features[-1]))
        levels = [
            _decode(head(level), 8 * 2**index)
            for index, (head, level) in enumerate(zip(self.heads, features, strict=True))
        ]
        return torch.cat(levels, dim=2)


def _decode(raw: torch.Tensor, stride: int) -> torch.Tensor:
    height, width = raw.shape[2:]
    ys = (torch.arange(height, dtype=raw.dtype) + 0.5) * stride
    xs = (torch.arange(width, dtype=raw.dtype) + 0.5) * stride
    centre_y, centre_x = torch.meshgrid(ys, xs, indexing="ij")
    distances = nn.functional.softplus(raw[:, :4]) * stride
    x1, y1 = centre_x - distances[:, 0], centre_y - distances[:, 1]
    x2, y2 = centre_x + distances[:, 2], centre_y + distances[:, 3]
    boxes = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=1)
    return torch.cat([boxes, torch.sigmoid(raw[:, 4:])], dim=1).flatten(2)


def yolo_detector() -> Factory:
    """On torchvision's ResNet-18 trunk, 3x640x640 images.  Settled (_batchnorm_settled): about 50 detections an
    image on the checks' images; with torchvision's init every image reached the 100 the NMS keeps, and a gate of
    capped images does not see what the NMS dropped."""
    import torchvision

    torch.manual_seed(0)
    trunk = torchvision.models.resnet18(weights=None)
    stem = nn.Sequential(trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool, trunk.layer1, trunk.layer2)
    model = YoloStyleDetector(stem, [trunk.layer3, trunk.layer4], (128, 256, 512))
    return _batchnorm_settled(model, torch.randn(4, 3, 640, 640)), torch.rand(1, 3, 640, 640)


def _save_pretrained(model_class: str, config: Any, into: Path) -> Path:
    import transformers

    if not (into / "config.json").is_file():
        torch.manual_seed(0)
        _trained_like(getattr(transformers, model_class)(config)).save_pretrained(into)
    return into


def bert_base_folder(into: Path) -> Path:
    import transformers

    return _save_pretrained("BertModel", transformers.BertConfig(), into)


def distilbert_folder(into: Path) -> Path:
    import transformers

    return _save_pretrained("DistilBertModel", transformers.DistilBertConfig(), into)


# ---------------------------------------------------------------- the dry run's (CPU, seconds to build)


class _TinyCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AvgPool2d(2))
        self.classifier = nn.Linear(8 * 16 * 16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def tiny_cnn() -> Factory:
    torch.manual_seed(0)
    return _TinyCnn().eval(), torch.randn(1, 3, 32, 32)


def _tiny_stage(inputs: int, outputs: int) -> nn.Sequential:
    conv = nn.Conv2d(inputs, outputs, 3, stride=2, padding=1, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(outputs), nn.ReLU())


def tiny_detector() -> Factory:
    """The sweep's detector on a trunk of five strided convolutions, 3 classes, 3x64x64 images (84 anchors)."""
    torch.manual_seed(0)
    stem = nn.Sequential(_tiny_stage(3, 8), _tiny_stage(8, 16), _tiny_stage(16, 16))
    model = YoloStyleDetector(stem, [_tiny_stage(16, 32), _tiny_stage(32, 32)], (16, 32, 32), classes=3)
    with torch.no_grad():
        for head in model.heads:
            head.weight[4:] *= 6  # about 14 of the 84 anchors score over NMS's 0.25: detections for the gate to judge
    return _batchnorm_settled(model, torch.randn(4, 3, 64, 64)), torch.rand(1, 3, 64, 64)


def tiny_bert_folder(into: Path) -> Path:
    import transformers

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    return _save_pretrained("BertModel", config, into)
