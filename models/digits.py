"""A small CNN trained on scikit-learn's bundled handwritten digits: the trained model accuracy checks use.

scikit-learn ships the 1797 8x8 digit images (UCI optdigits test set) inside its wheel, so the data
and the labelled held-out split need no download.  The split is stratified with a fixed seed; the
weights (`digits.pt`, a state_dict of about 47 KB) are trained on the training part only:

    python -m models.digits --train        # a few seconds on a CPU; rewrites models/digits.pt

Pixels are 0..16 counts; they are read as the 0..1 intensities an 8-bit image of the digit would
give, then normalised by the model's ImagePreprocess, the same way calibration and inference do.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..pipeline.core.errors import PipelineError
from ..pipeline.folder.artifacts import sha256_file
from .preprocess import normalize
from .spec import ImagePreprocess, ModelSpec
from .state_dicts import apply_state_dict, read_state_dict

WEIGHTS = Path(__file__).with_name("digits.pt")
PREPROCESS = ImagePreprocess(resize=8, crop=8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), grayscale=True)
HELD_OUT_FRACTION = 0.2
SEED = 0
PIXEL_MAX = 16.0  # sklearn's digits are counts of set pixels in 4x4 blocks: 0..16
EXAMPLE_BATCH = 2  # not 1: exporters can specialise a batch of 1 into a constant


class DigitsCnn(nn.Module):
    """Conv-BN-ReLU stem, one residual block (so INT8 placement meets a residual add), pool, linear head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.down = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU()
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        residual = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        x = self.down(self.relu(x + residual))
        return self.fc(torch.flatten(self.pool(x), 1))


@dataclass(frozen=True)
class DigitsSplit:
    """Model-ready inputs (N, 1, 8, 8) float32 and int64 labels."""

    train_inputs: np.ndarray
    train_labels: np.ndarray
    held_out_inputs: np.ndarray
    held_out_labels: np.ndarray


def load_split() -> DigitsSplit:
    """The fixed, stratified train / held-out split of sklearn's digits, preprocessed for the model."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    intensities = (digits.images / PIXEL_MAX).astype(np.float32)[..., np.newaxis]  # N, 8, 8, 1 in 0..1
    inputs = np.stack([normalize(image, PREPROCESS) for image in intensities])
    labels = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        inputs, labels, test_size=HELD_OUT_FRACTION, random_state=SEED, stratify=labels
    )
    return DigitsSplit(train_x, train_y, test_x, test_y)


def digits_spec(weights: Path | None = None) -> ModelSpec:
    """The trained digits CNN (models/digits.pt unless WEIGHTS names another state_dict)."""
    source = weights or WEIGHTS
    if not Path(source).is_file():
        raise PipelineError(f"digits weights {source} do not exist", "train them: python -m models.digits --train")
    module = DigitsCnn()
    apply_state_dict(module, read_state_dict(Path(source)), source)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        example = torch.randn(EXAMPLE_BATCH, 1, 8, 8)
    notes = [] if weights else [f"trained weights {WEIGHTS.name} (sklearn digits, seed {SEED})"]
    # The loader hashes this file's source and a WEIGHTS file, not the default weights: hash those
    # here, so retraining invalidates cached artifacts.
    fingerprint = "" if weights else sha256_file(WEIGHTS)
    return ModelSpec(
        name="digits",
        module=module,
        example_inputs={"input": example},
        output_names=["logits"],
        preprocess=PREPROCESS,
        notes=notes,
        fingerprint=fingerprint,
    )


def train(epochs: int = 20, batch: int = 64, seed: int = SEED) -> tuple[DigitsCnn, float]:
    """Train on the training split with a fixed seed; returns the model and its held-out top-1 (%)."""
    split = load_split()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsCnn()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=3e-3, total_steps=epochs * -(-len(split.train_labels) // batch)
        )
        inputs, labels = torch.from_numpy(split.train_inputs), torch.from_numpy(split.train_labels)
        for _ in range(epochs):
            model.train()
            for index in torch.randperm(len(labels)).split(batch):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs[index]), labels[index]).backward()
                optimizer.step()
                schedule.step()
    model.eval()
    with torch.no_grad():
        predictions = model(torch.from_numpy(split.held_out_inputs)).argmax(1).numpy()
    return model, float((predictions == split.held_out_labels).mean() * 100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.digits", description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="train and save the weights")
    parser.add_argument("--out", type=Path, default=WEIGHTS, help="where to save the state_dict")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args(argv)
    if not args.train:
        parser.print_help()
        return 0
    started = time.perf_counter()
    model, accuracy = train(args.epochs)
    torch.save(model.state_dict(), args.out)
    print(
        f"trained in {time.perf_counter() - started:.1f} s: held-out top-1 {accuracy:.2f}% "
        f"-> {args.out} ({args.out.stat().st_size} bytes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
