"""Model factories that misbehave: MODEL=tests.helpers.bad_factories:<name> in the bad-input tests.

The catalogue (tools/catalogue.py) copies this file beside its bad files as catalogue_factories.py, so that the
same factories reach any checkout it measures, older ones included.
"""

from __future__ import annotations

import os
import sys

import torch


def raises():
    raise ValueError("no weights here")


def returns_none():
    return None


def returns_text():
    return "a model"


def returns_bad_tuple():
    return (torch.nn.Linear(4, 2),)


def returns_module_and_text():
    return torch.nn.Linear(4, 2), "not a tensor"


def exits():
    sys.exit(0)


def exits_nonzero():
    sys.exit(5)


def needs_argument(width):
    return torch.nn.Linear(width, 2), torch.zeros(2, width)


def nan_model():
    class Nan(torch.nn.Module):
        def forward(self, x):
            return x * float("nan")

    return Nan(), torch.zeros(2, 4)


class Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def deep():
    module = torch.nn.Linear(4, 4)
    for _ in range(1200):
        module = Wrap(module)
    return module, torch.zeros(2, 4)


def deep_sequential():
    module = torch.nn.Linear(4, 4)
    for _ in range(1200):
        module = torch.nn.Sequential(module)
    return module, torch.zeros(2, 4)


class Recursing(torch.nn.Module):
    def forward(self, x, depth=5000):
        return x if depth == 0 else self.forward(x + 0, depth - 1)


def recursing():
    return Recursing(), torch.zeros(2, 4)


class Returns(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value


def returns_empty_tuple():
    return Returns(()), torch.zeros(2, 4)


def returns_empty_dict():
    return Returns({}), torch.zeros(2, 4)


def float64_default():
    torch.set_default_dtype(torch.float64)
    return torch.nn.Linear(4, 2), torch.zeros(2, 4)


def explicit_double():
    return torch.nn.Linear(4, 2).double(), torch.zeros(2, 4, dtype=torch.float64)


def changes_directory():
    import tempfile

    os.chdir(tempfile.mkdtemp(prefix="factory-went-here-"))
    return torch.nn.Linear(4, 2), torch.zeros(2, 4)


def leaves_a_thread():
    import threading
    import time

    threading.Thread(target=time.sleep, args=(3600,), name="poller").start()
    return torch.nn.Linear(4, 2), torch.zeros(2, 4)


def killed():
    """Ends its process as the kernel's out-of-memory killer does: SIGKILL, which nothing can catch."""
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def crashes():
    """A real crash in native code: ctypes reads address 0 (SIGSEGV)."""
    import ctypes

    ctypes.string_at(0)
