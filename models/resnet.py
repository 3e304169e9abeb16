"""ResNet-18/34/50/101/152, written from scratch with torchvision's parameter names and init.

torchvision cannot be installed on the CPU machines (its wheel needs the CUDA build of
torch), so the architecture lives here.  Every parameter and buffer name matches
`torchvision.models.resnet` (`conv1`, `bn1`, `layer1.0.conv1`, `layer1.0.downsample.0`,
`fc`, ...) so a torchvision state_dict loads with `load_state_dict(strict=True)`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .inputs import InputShape, example_inputs_from_shapes, seeded
from .spec import ImagePreprocess, ModelSpec
from .state_dicts import apply_state_dict, read_state_dict

RANDOM_INIT_NOTE = "randomly initialised: no weights given; outputs are meaningless but timing and parity are valid"
IMAGENET_CLASSES = 1000


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision's "ResNet V1.5"), 1x1 expand (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        self._init_like_torchvision()

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int = 1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def _init_like_torchvision(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # flatten, never x.view(batch, -1): a reshape to a traced batch size bakes it into the graph
        return self.fc(torch.flatten(self.avgpool(x), 1))


ARCHITECTURES: dict[str, tuple[type[BasicBlock | Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
    "resnet101": (Bottleneck, [3, 4, 23, 3]),
    "resnet152": (Bottleneck, [3, 8, 36, 3]),
}


def build_resnet(arch: str, num_classes: int = IMAGENET_CLASSES) -> ResNet:
    """A randomly initialised ResNet of the named architecture (`resnet18` ... `resnet152`)."""
    block, layers = ARCHITECTURES[arch]
    return ResNet(block, layers, num_classes)


def resnet_spec(arch: str, weights: Path | None = None) -> ModelSpec:
    """The ModelSpec of a ResNet, with a torchvision state_dict loaded from `weights` if given."""
    notes = []
    if weights is None:
        # Seeded: a reload (the PyTorch runner, a rerun) must give the very weights the engine holds.
        with seeded():
            module = build_resnet(arch)
        notes.append(RANDOM_INIT_NOTE)
    else:
        state_dict = read_state_dict(weights)
        # A fine-tuned checkpoint has its own class count; read it off the head rather than refuse it.
        fc_weight = state_dict.get("fc.weight")
        num_classes = fc_weight.shape[0] if isinstance(fc_weight, torch.Tensor) else IMAGENET_CLASSES
        module = build_resnet(arch, num_classes)
        apply_state_dict(module, state_dict, weights)
    return ModelSpec(
        name=arch,
        module=module,
        example_inputs=example_inputs_from_shapes([InputShape("input", (3, 224, 224), torch.float32)]),
        output_names=["output"],
        preprocess=ImagePreprocess(),
        notes=notes,
    )


def resnet18_spec(weights: Path | None = None) -> ModelSpec:
    return resnet_spec("resnet18", weights)


def resnet34_spec(weights: Path | None = None) -> ModelSpec:
    return resnet_spec("resnet34", weights)


def resnet50_spec(weights: Path | None = None) -> ModelSpec:
    return resnet_spec("resnet50", weights)


def resnet101_spec(weights: Path | None = None) -> ModelSpec:
    return resnet_spec("resnet101", weights)


def resnet152_spec(weights: Path | None = None) -> ModelSpec:
    return resnet_spec("resnet152", weights)
