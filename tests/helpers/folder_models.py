"""Toy models for the artifact-folder tests: another model with tiny_cnn's inputs and outputs, and tiny_cnn
behind a gate that holds its build until the test says go."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from tests.helpers.toy_models import tiny_cnn
from trt_pipeline.models.spec import ModelSpec

GATE_TIMEOUT_S = 120  # only a safety net against a test that never opens the gate


def other_tiny_cnn() -> ModelSpec:
    """tiny_cnn with other weights: the same inputs and outputs, other numbers."""
    spec = tiny_cnn()
    with torch.no_grad():
        spec.module.fc.bias.add_(1.0)
    return spec


def gated_tiny_cnn() -> ModelSpec:
    """tiny_cnn, returned once the file $GATE_GO exists, after touching $GATE_READY (at once without a gate).

    make_engine takes the folder's build lock before it loads the model, so while this waits the build holds
    the lock.
    """
    ready, go = os.environ.get("GATE_READY"), os.environ.get("GATE_GO")
    if ready and go:
        Path(ready).touch()
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not Path(go).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{go} did not appear within {GATE_TIMEOUT_S} s")
            time.sleep(0.05)
    return tiny_cnn()
