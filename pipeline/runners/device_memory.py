"""Device memory for the engine runner behind one small interface (pycuda, or cuda-python where pycuda is missing)."""

from __future__ import annotations

import importlib

# Preference order: pycuda is the default; cuda-python (NVIDIA's driver bindings) serves where pycuda cannot be built.
LAYERS = {"pycuda": "pycuda.driver", "cuda-python": "cuda.bindings.driver"}


def available_layers() -> list[str]:
    """The device-memory layers that import here, in preference order."""
    found = []
    for layer, module in LAYERS.items():
        try:
            importlib.import_module(module)
        except (ImportError, OSError):  # OSError: the package is there but libcuda is not
            continue
        found.append(layer)
    return found
