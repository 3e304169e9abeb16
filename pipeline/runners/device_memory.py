"""Device memory for the engine runner behind one small interface.

pycuda is the default layer; cuda-python (NVIDIA's driver bindings, `cuda.bindings.driver`)
serves where pycuda cannot be built (it needs a CUDA toolkit at install time).  Both work on
the device's *primary* context, retained once and pushed/popped around every use: a context
pushed in the constructor is current only on the thread that created the runner, which is the
classic "invalid device context" failure of pycuda in threaded servers (inducer/pycuda#242).
The primary context is also the one PyTorch uses, so torch CUDA tensors' addresses are valid here.

Nothing here imports at module level: `import pipeline.runners.device_memory` needs no GPU.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.errors import PipelineError

# Preference order: pycuda is the default; cuda-python serves where pycuda is missing.
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


class DeviceMemory:
    """Alloc/free, pinned host buffers, async copies, streams and the context, on one GPU.

    Addresses are plain ints (what TensorRT's bindings take); host buffers are uint8 numpy arrays
    over page-locked memory, so copies from them are true asynchronous DMA.
    """

    name = ""

    def push(self) -> None:
        """Make this device's primary context current on the calling thread."""
        raise NotImplementedError

    def pop(self) -> None:
        raise NotImplementedError

    def alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def free(self, address: int) -> None:
        raise NotImplementedError

    def pinned(self, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def free_pinned(self, buffer: np.ndarray) -> None:
        raise NotImplementedError

    def stream(self) -> Any:
        raise NotImplementedError

    def destroy_stream(self, stream: Any) -> None:
        raise NotImplementedError

    def handle(self, stream: Any) -> int:
        """The stream's CUstream as an int (what execute_async_v3 takes)."""
        raise NotImplementedError

    def h2d_async(self, address: int, host: np.ndarray, nbytes: int, stream: Any) -> None:
        raise NotImplementedError

    def d2h_async(self, host: np.ndarray, address: int, nbytes: int, stream: Any) -> None:
        raise NotImplementedError

    def d2d_async(self, destination: int, source: int, nbytes: int, stream: Any) -> None:
        raise NotImplementedError

    def sync(self, stream: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the retained primary context (after everything allocated here was freed)."""
        raise NotImplementedError


class PycudaMemory(DeviceMemory):
    name = "pycuda"

    def __init__(self, ordinal: int):
        import pycuda.driver as cuda

        cuda.init()
        self._cuda = cuda
        # Not pycuda.autoinit: that creates a new context current on the importing thread only.
        self._context = cuda.Device(ordinal).retain_primary_context()
        self._allocations: dict[int, Any] = {}

    def push(self) -> None:
        self._context.push()

    def pop(self) -> None:
        self._cuda.Context.pop()

    def alloc(self, nbytes: int) -> int:
        allocation = self._cuda.mem_alloc(nbytes)
        self._allocations[int(allocation)] = allocation
        return int(allocation)

    def free(self, address: int) -> None:
        self._allocations.pop(address).free()

    def pinned(self, nbytes: int) -> np.ndarray:
        return self._cuda.pagelocked_empty(nbytes, np.uint8)

    def free_pinned(self, buffer: np.ndarray) -> None:
        allocation: Any = buffer.base  # the HostAllocation behind the array
        allocation.free()  # now, not at garbage collection

    def stream(self) -> Any:
        return self._cuda.Stream()

    def destroy_stream(self, stream: Any) -> None:
        """pycuda has no explicit destroy: a Stream is destroyed when the runner drops its last reference."""

    def handle(self, stream: Any) -> int:
        return int(stream.handle)

    def h2d_async(self, address: int, host: np.ndarray, nbytes: int, stream: Any) -> None:
        self._cuda.memcpy_htod_async(address, host[:nbytes], stream)

    def d2h_async(self, host: np.ndarray, address: int, nbytes: int, stream: Any) -> None:
        self._cuda.memcpy_dtoh_async(host[:nbytes], address, stream)

    def d2d_async(self, destination: int, source: int, nbytes: int, stream: Any) -> None:
        self._cuda.memcpy_dtod_async(destination, source, nbytes, stream)

    def sync(self, stream: Any) -> None:
        stream.synchronize()

    def close(self) -> None:
        self._context.detach()  # for a retained primary context: cuDevicePrimaryCtxRelease


class CudaPythonMemory(DeviceMemory):
    """The same through cuda-python's driver API: every call returns (CUresult, *values)."""

    name = "cuda-python"

    def __init__(self, ordinal: int):
        from cuda.bindings import driver

        self._driver = driver
        self._check("cuInit", driver.cuInit(0))
        self._device = self._check("cuDeviceGet", driver.cuDeviceGet(ordinal))
        self._context = self._check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(self._device))

    def _check(self, call: str, result: Any) -> Any:
        """The values after the CUresult, or a RuntimeError naming the call and the error."""
        status, *values = result if isinstance(result, tuple) else (result,)
        if status != self._driver.CUresult.CUDA_SUCCESS:
            _, text = self._driver.cuGetErrorString(status)
            raise RuntimeError(f"{call} failed: {status.name} ({text.decode() if text else 'no description'})")
        return values[0] if len(values) == 1 else None

    def push(self) -> None:
        self._check("cuCtxPushCurrent", self._driver.cuCtxPushCurrent(self._context))

    def pop(self) -> None:
        self._check("cuCtxPopCurrent", self._driver.cuCtxPopCurrent())

    def alloc(self, nbytes: int) -> int:
        return int(self._check("cuMemAlloc", self._driver.cuMemAlloc(nbytes)))

    def free(self, address: int) -> None:
        self._check("cuMemFree", self._driver.cuMemFree(address))

    def pinned(self, nbytes: int) -> np.ndarray:
        address = int(self._check("cuMemHostAlloc", self._driver.cuMemHostAlloc(nbytes, 0)))
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))

    def free_pinned(self, buffer: np.ndarray) -> None:
        self._check("cuMemFreeHost", self._driver.cuMemFreeHost(buffer.ctypes.data))

    def stream(self) -> Any:
        return self._check("cuStreamCreate", self._driver.cuStreamCreate(0))

    def destroy_stream(self, stream: Any) -> None:
        self._check("cuStreamDestroy", self._driver.cuStreamDestroy(stream))

    def handle(self, stream: Any) -> int:
        return int(stream)  # CUstream converts to its address

    def h2d_async(self, address: int, host: np.ndarray, nbytes: int, stream: Any) -> None:
        self._check("cuMemcpyHtoDAsync", self._driver.cuMemcpyHtoDAsync(address, host.ctypes.data, nbytes, stream))

    def d2h_async(self, host: np.ndarray, address: int, nbytes: int, stream: Any) -> None:
        self._check("cuMemcpyDtoHAsync", self._driver.cuMemcpyDtoHAsync(host.ctypes.data, address, nbytes, stream))

    def d2d_async(self, destination: int, source: int, nbytes: int, stream: Any) -> None:
        self._check("cuMemcpyDtoDAsync", self._driver.cuMemcpyDtoDAsync(destination, source, nbytes, stream))

    def sync(self, stream: Any) -> None:
        self._check("cuStreamSynchronize", self._driver.cuStreamSynchronize(stream))

    def close(self) -> None:
        self._check("cuDevicePrimaryCtxRelease", self._driver.cuDevicePrimaryCtxRelease(self._device))


_CLASSES: dict[str, Callable[[int], DeviceMemory]] = {"pycuda": PycudaMemory, "cuda-python": CudaPythonMemory}


def open_device_memory(layer: str = "auto", ordinal: int = 0) -> DeviceMemory:
    """The device-memory layer for GPU `ordinal`: "auto" (pycuda, else cuda-python), "pycuda" or "cuda-python"."""
    choices = ("auto", *LAYERS)
    if layer not in choices:
        raise PipelineError(f"unknown device-memory layer {layer!r}", f"use one of {', '.join(choices)}")
    available = available_layers()
    wanted = available[:1] if layer == "auto" else [layer]
    if not wanted or wanted[0] not in available:
        raise PipelineError(
            f"device-memory layer {layer!r} is not usable here (importable: {available or 'none'})",
            "pip install pycuda (builds against the CUDA toolkit: needs nvcc and the Python headers), "
            "or pip install cuda-python",
        )
    return _CLASSES[wanted[0]](ordinal)
