"""The device-memory layers (pycuda, cuda-python) on a real GPU, without TensorRT: copies through pinned
buffers, use from another thread, and the primary context shared with torch.  Skipped where no GPU is usable."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trt_pipeline.pipeline.runners.device_memory import LAYERS, DeviceMemory, available_layers, open_device_memory

pytestmark = pytest.mark.gpu

NBYTES = 3 << 20


@pytest.fixture(params=list(LAYERS))
def memory(request):
    if request.param not in available_layers():
        pytest.skip(f"{request.param} does not import here (both are tried on the GPU machine: tools/device/run.sh)")
    opened = open_device_memory(request.param)
    yield opened
    opened.close()


def _round_trip(memory: DeviceMemory, data: np.ndarray, address: int | None = None) -> np.ndarray:
    """data -> pinned -> device (at `address`, or a fresh allocation) -> pinned -> a copy."""
    memory.push()
    try:
        device = address if address is not None else memory.alloc(data.nbytes)
        source, sink, stream = memory.pinned(data.nbytes), memory.pinned(data.nbytes), memory.stream()
        np.copyto(source, data)
        memory.h2d_async(device, source, data.nbytes, stream)
        memory.d2h_async(sink, device, data.nbytes, stream)
        memory.sync(stream)
        result = sink.copy()
        memory.free_pinned(source)
        memory.free_pinned(sink)
        memory.destroy_stream(stream)
        stream = None  # pycuda destroys a Stream with its last reference: here, while the context is current
        if address is None:
            memory.free(device)
        return result
    finally:
        memory.pop()


def test_bytes_come_back_unchanged(memory):
    data = np.random.default_rng(0).integers(0, 256, NBYTES, dtype=np.uint8)
    assert np.array_equal(_round_trip(memory, data), data)


def test_another_thread_uses_the_same_primary_context(memory):
    data = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    results: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: results.append(_round_trip(memory, data)))
    worker.start()
    worker.join()
    assert np.array_equal(results[0], data)


def test_torch_reads_what_the_layer_wrote(memory):
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    data = np.random.default_rng(2).integers(0, 256, NBYTES, dtype=np.uint8)
    _round_trip(memory, data, address=tensor.data_ptr())
    torch.cuda.synchronize()
    assert np.array_equal(tensor.cpu().numpy(), data)
