"""Which TensorRT to use, and the small pieces the engine build and the runner share.

Two builders share one API: the full `tensorrt` (NVIDIA's index, builds on the GPU
it targets) and TensorRT for RTX, `tensorrt_rtx` (PyPI, builds ahead of time with
no GPU).  Neither is imported at module level, so `import pipeline` works on any
machine; callers get the module from `import_trt()`.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import sys
from collections import deque
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import PipelineError
from .extras import install_command

if TYPE_CHECKING:
    # Type stubs only (`tensorrt-stubs`); annotations name these so mypy checks TensorRT calls.
    import tensorrt

CHOICES = ("auto", "tensorrt", "tensorrt_rtx")


def _install_rtx() -> str:
    return f"{install_command('rtx')}  (TensorRT for RTX, from PyPI: builds engines without a GPU)"


def _install_full() -> str:
    return (
        "on a machine with an NVIDIA GPU and driver: pip install tensorrt --extra-index-url https://pypi.nvidia.com"
        "  (the full TensorRT; the `tensorrt` extra)"
    )


# TensorRT-RTX builds for these compute capabilities when none are set on the builder config
# (num_compute_capabilities == 0).  Documented, not queryable: "By default, an engine built by
# TensorRT-RTX can be run on GPU devices with compute capability 8.0, 8.6, 8.9, 12.0, and later";
# Turing (7.5) must be asked for explicitly.
# https://docs.nvidia.com/deeplearning/tensorrt-rtx/latest/inference-library/cpu-engines.html
RTX_DOCUMENTED_DEFAULT_TARGETS = ("8.0", "8.6", "8.9", "12.0")
# The GPUs TensorRT-RTX's runtime runs any engine on, as its refusal on an H100 lists them
# ("Supported compute capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0"; 7.5 when built for it).  Hopper
# (9.0: H100, H200) is not among them, whatever the build targets: docs/benchmarks/resnet50-h100.md.
RTX_RUNTIME_TARGETS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")


def rtx_runs_on(capability: str) -> bool:
    """Whether TensorRT-RTX's runtime runs engines on a GPU of this compute capability ("9.0")."""
    return capability in RTX_RUNTIME_TARGETS or parse_capability(capability) > parse_capability("12.0")


def parse_capability(text: str) -> tuple[int, ...]:
    """A compute capability as numbers that compare in order: "8.6" -> (8, 6)."""
    return tuple(int(part) for part in text.split("."))


_CUDA_SUCCESS = 0
# CUdevice_attribute values from cuda.h; stable since CUDA 2.x.
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the GPU, via the driver


def _load_libcuda() -> ctypes.CDLL | None:
    """The CUDA driver library, or None where no NVIDIA driver is installed."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _initialised_libcuda() -> ctypes.CDLL | None:
    libcuda = _load_libcuda()
    # cuInit fails (e.g. CUDA_ERROR_NO_DEVICE, or a driver too old) where the library exists but no
    # GPU is usable; every other driver call needs it first.  Calling it again is harmless.
    if libcuda is None or libcuda.cuInit(0) != _CUDA_SUCCESS:
        return None
    return libcuda


def gpu_present() -> bool:
    """Whether an NVIDIA GPU and its driver are usable from this process."""
    libcuda = _initialised_libcuda()
    if libcuda is None:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) == _CUDA_SUCCESS and count.value > 0


def describe_gpu(ordinal: int = 0) -> dict | None:
    """Name and compute capability of one visible GPU, or None where there is none."""
    libcuda = _initialised_libcuda()
    if libcuda is None:
        return None
    device = ctypes.c_int(0)
    if libcuda.cuDeviceGet(ctypes.byref(device), ordinal) != _CUDA_SUCCESS:
        return None
    name = ctypes.create_string_buffer(256)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    calls = (
        libcuda.cuDeviceGetName(name, len(name), device),
        libcuda.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
        libcuda.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
    )
    if any(status != _CUDA_SUCCESS for status in calls):
        return None
    return {
        "ordinal": ordinal,
        "name": name.value.decode(errors="replace"),
        "compute_capability": f"{major.value}.{minor.value}",
    }


# --------------------------------------------------------------------------- picking the module


def is_real_tensorrt(module: ModuleType) -> bool:
    """True for an importable TensorRT API, False for e.g. the stubs' empty namespace package.

    `tensorrt-stubs` installs a `tensorrt/` folder holding only `__init__.pyi`; Python imports
    such a folder as an empty namespace package, so a successful `import tensorrt` proves nothing.
    """
    return all(hasattr(module, name) for name in ("__version__", "Builder", "OnnxParser"))


def _try_import(name: str) -> tuple[ModuleType | None, str]:
    """(module, "") when `name` is a usable TensorRT, else (None, why not)."""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        return None, f"`import {name}` failed ({error})"
    except OSError as error:  # its shared libraries are missing or cannot load (e.g. no CUDA runtime)
        return None, f"`import {name}` could not load its libraries ({error})"
    if not is_real_tensorrt(module):
        where = list(getattr(module, "__path__", [])) or getattr(module, "__file__", None)
        return None, f"`{name}` imports but is not TensorRT (an empty package at {where}, e.g. type stubs only)"
    return module, ""


def import_trt(choice: str = "auto") -> ModuleType:
    """The TensorRT module to build with: "auto", "tensorrt" or "tensorrt_rtx".

    auto takes the full TensorRT where it really imports and a GPU is present (it builds for,
    and times kernels on, the GPU it runs on); otherwise TensorRT for RTX.
    """
    if choice not in CHOICES:
        raise PipelineError(f"unknown builder {choice!r}", f"use one of {', '.join(CHOICES)}")
    if choice == "tensorrt_rtx":
        return _require_rtx()
    if choice == "tensorrt":
        return _require_full()
    full, full_why = _try_import("tensorrt")
    if full is not None and gpu_present():
        return full
    rtx, rtx_why = _try_import("tensorrt_rtx")
    if rtx is not None:
        return rtx
    if full is not None:
        full_why = "the full TensorRT is installed but no NVIDIA GPU/driver is usable, and it builds only on a GPU"
    raise PipelineError(
        f"no TensorRT builder is usable: {full_why}; {rtx_why}",
        f"{_install_rtx()}; or, {_install_full()}",
    )


def _require_rtx() -> ModuleType:
    module, why = _try_import("tensorrt_rtx")
    if module is None:
        raise PipelineError(f"builder 'tensorrt_rtx' was asked for but {why}", _install_rtx())
    return module


def _require_full() -> ModuleType:
    module, why = _try_import("tensorrt")
    if module is None:
        raise PipelineError(
            f"builder 'tensorrt' was asked for but {why}",
            f"{_install_full()}; or use builder 'tensorrt_rtx' / 'auto' ({_install_rtx()})",
        )
    if not gpu_present():
        raise PipelineError(
            "builder 'tensorrt' was asked for but no NVIDIA GPU/driver is usable "
            "(libcuda.so.1 missing, or cuInit failed)",
            "run on a machine with an NVIDIA GPU, or use builder 'tensorrt_rtx', which builds without one",
        )
    return module


def is_rtx(trt: ModuleType) -> bool:
    return trt.__name__.split(".")[0] == "tensorrt_rtx"


def module_record(trt: ModuleType) -> dict:
    return {"module": trt.__name__, "version": str(trt.__version__)}


# --------------------------------------------------------------------------- logging


@dataclass(frozen=True)
class LogEntry:
    number: int
    severity: str
    message: str


class RecordingLogger:
    """The process's TensorRT logger: keeps WARNING and above so failures can quote them.

    TensorRT reports *why* `build_serialized_network` returned None only through the logger, so
    an exception without these messages would say nothing useful.  There is one per TensorRT
    module (`for_module`), because TensorRT keeps one logger per process: a Builder or Runtime
    created while another is alive ignores its own logger and logs to the first one ("The logger
    passed into createInferBuilder differs from one already registered ... the current new logger
    is ignored").  Callers take `mark()` before a step and `since(mark)` after it, which also
    drops noise from earlier steps (TensorRT-RTX logs an INTERNAL_ERROR "Thread context has not
    been set" from some config calls that still succeed).  Everything also goes to Python
    logging (`pipeline.core.trt_module`).  Messages of concurrent builds in threads would interleave.
    """

    _instances: dict[str, RecordingLogger] = {}

    def __init__(self, trt: ModuleType, keep: int = 1000):
        self.trt_logger: tensorrt.ILogger = _logger_class(trt)(self)
        self.entries: deque[LogEntry] = deque(maxlen=keep)  # bounded: a service logs for days
        self.count = 0

    @classmethod
    def for_module(cls, trt: ModuleType) -> RecordingLogger:
        if trt.__name__ not in cls._instances:
            cls._instances[trt.__name__] = cls(trt)
        return cls._instances[trt.__name__]

    def record(self, severity: str, message: str, keep: bool) -> None:
        log.log(_PY_LEVELS.get(severity, logging.DEBUG), "%s", message)
        if keep:
            self.entries.append(LogEntry(self.count, severity, message))
            self.count += 1

    def mark(self) -> int:
        return self.count

    def since(self, mark: int, limit: int = 20) -> list[str]:
        """The kept messages after `mark`, the last `limit` of them, as "SEVERITY: message"."""
        recent = [entry for entry in self.entries if entry.number >= mark][-limit:]
        return [f"{entry.severity}: {entry.message.strip()}" for entry in recent]


_PY_LEVELS = {
    "INTERNAL_ERROR": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARNING": logging.WARNING,
    "INFO": logging.DEBUG,  # TensorRT's INFO is per-build chatter; keep it out of a user's console
    "VERBOSE": logging.DEBUG,
}

_LOGGER_CLASSES: dict[str, type] = {}


def _logger_class(trt: ModuleType) -> type:
    """An ILogger subclass for this module (each module has its own ILogger base class)."""
    if trt.__name__ not in _LOGGER_CLASSES:
        base: Any = trt.ILogger
        warning = trt.ILogger.Severity.WARNING

        class _Forwarder(base):
            def __init__(self, sink: RecordingLogger):
                # pybind11 trampolines need the base __init__ called explicitly.
                base.__init__(self)
                self.sink = sink

            def log(self, severity: Any, msg: str) -> None:
                # Severity values grow less severe: INTERNAL_ERROR=0 ... VERBOSE=4.
                self.sink.record(severity.name, msg, keep=severity <= warning)

        _LOGGER_CLASSES[trt.__name__] = _Forwarder
    return _LOGGER_CLASSES[trt.__name__]


# --------------------------------------------------------------------------- the build target


def describe_target(trt: ModuleType, config: tensorrt.IBuilderConfig) -> dict:
    """What the engine is built for.

    The full TensorRT builds for the GPU it runs on (the current CUDA device, ordinal 0 of the
    visible devices unless the process chose another); an engine runs only on that architecture.
    TensorRT-RTX builds ahead of time for a list of compute capabilities, set on the config;
    with none set it uses its documented default set.
    """
    if not is_rtx(trt):
        return {"kind": "gpu", "gpu": describe_gpu(0)}
    # num_compute_capabilities / get_compute_capability exist only in tensorrt_rtx, which ships
    # no type stubs; the TensorRT stubs do not describe them, hence the Any.
    rtx_config: Any = config
    chosen = [rtx_config.get_compute_capability(i).name for i in range(rtx_config.num_compute_capabilities)]
    record: dict[str, Any] = {
        "kind": "ahead-of-time",
        "compute_capabilities": chosen or "default",
        "documented_default": list(RTX_DOCUMENTED_DEFAULT_TARGETS) if not chosen else None,
        "gpu_present": gpu_present(),
    }
    if "CURRENT" in chosen:  # names no architecture: the GPU at hand is what it means
        record["gpu"] = describe_gpu(0)
    return record


def dims(shape: tensorrt.Dims) -> list[int]:
    """A TensorRT Dims as a list (-1 for a dynamic dim); Dims indexes but has no __iter__ in the stubs."""
    return [shape[i] for i in range(len(shape))]


_DTYPE_NAMES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "UINT8": "uint8",
    "BOOL": "bool",
    "FP8": "float8_e4m3",
}


def dtype_name(dtype: tensorrt.DataType) -> str:
    """numpy-style name of a TensorRT DataType (TensorRT's own names: FLOAT, HALF, ...)."""
    return _DTYPE_NAMES.get(dtype.name, dtype.name.lower())
