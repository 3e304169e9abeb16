"""pipeline/core/sessions.py: memory the build's sessions freed, given back between a stage's phases."""

import ctypes
import subprocess
import sys

import pytest

# Run alone in a fresh interpreter: the heap's state is its own.  4000 blocks of 64 KiB (under glibc's mmap threshold:
# on the heap) with a 2 KiB block kept between each (numpy caches none past 1 KiB), so the freed ones cannot go back
# from the heap's top; then RssAnon freed and after return_freed_memory, in MiB.
_FRAGMENTED_HEAP = """
import numpy as np
from trt_pipeline.pipeline.core.sessions import return_freed_memory

def anonymous():
    line = next(line for line in open("/proc/self/status") if line.startswith("RssAnon"))
    return int(line.split()[1]) // 1024

blocks, pins = [], []
for _ in range(4000):
    blocks.append(np.ones(8192))
    pins.append(np.ones(256))
del blocks
freed = anonymous()
return_freed_memory()
print(freed, anonymous())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="glibc's heap"
)
def test_memory_freed_on_the_heap_goes_back_to_the_system():
    """What the freed blocks held stays in the process's RSS until given back: then at least 200 of its 250 MiB go."""
    result = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    freed, returned = map(int, result.stdout.split())
    assert freed - returned >= 200, (freed, returned)


def _returns(value):
    return value


def test_a_child_returns_its_value_or_says_how_it_ended():
    from trt_pipeline.pipeline.core.sessions import ChildRun, run_in_child

    assert run_in_child(_returns, {"shapes": [1, 16]}) == ChildRun(returned=True, value={"shapes": [1, 16]})
    assert run_in_child(int, "not a number") == ChildRun()  # it raised: the caller does the work itself
    assert run_in_child(ctypes.string_at, 0) == ChildRun(crash="SIGSEGV")


def test_a_childs_value_past_the_pipes_buffer_comes_back_whole():
    """The parent reads while the child writes: a value larger than a pipe holds (64 KiB) does not block the child."""
    from trt_pipeline.pipeline.core.sessions import run_in_child

    assert run_in_child(_returns, "x" * (1 << 20)).value == "x" * (1 << 20)
