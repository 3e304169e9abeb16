"""What the numbers were measured on: CPU, GPU, driver, CUDA, library versions, threads, load, command."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ..core.cpu import cpu_instruction_sets, cpu_model
from ..folder.provenance import package_versions

VERSIONED_PACKAGES = ("torch", "onnxruntime-gpu", "onnxruntime", "numpy", "tensorrt", "tensorrt-rtx-cu13")


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings share a core's math units, so they do not count)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return usable
    cores: set[tuple[str, str]] = set()
    physical_id = ""
    for line in cpuinfo.read_text().splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    return max(1, min(usable, len(cores) or usable))


def load_average() -> list[float] | None:
    """1/5/15-minute load: other jobs on a shared machine show up here, and in the tail latencies."""
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def command_line() -> str:
    """The command as typed: `python -m trt_pipeline bench ...` rather than the path of __main__.py."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).parts[-2:] == ("trt_pipeline", "__main__.py"):
        return shlex.join(["python", "-m", "trt_pipeline", *argv[1:]])
    return shlex.join(argv)


def gpu_record() -> dict:
    """GPU name, driver and the CUDA version torch was built for; {"present": False} without one."""
    import torch

    if not torch.cuda.is_available():
        return {"present": False, "reason": "torch.cuda.is_available() is False: no NVIDIA GPU or driver usable"}
    properties = torch.cuda.get_device_properties(0)
    return {
        "present": True,
        "name": properties.name,
        "compute_capability": f"{properties.major}.{properties.minor}",
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "driver": _nvidia_driver(),
        "cuda_torch": torch.version.cuda,
    }


def _nvidia_driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    result = subprocess.run(
        [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None


def describe_environment(threads: int) -> dict:
    return {
        "cpu": {
            "model": cpu_model(),
            "physical_cores": physical_cores(),
            "logical_cpus": os.cpu_count(),
            "instruction_sets": cpu_instruction_sets(),
        },
        "gpu": gpu_record(),
        "threads": threads,
        "platform": platform.platform(),
        "versions": package_versions(VERSIONED_PACKAGES),
        "command": command_line(),
        "cwd": os.getcwd(),
    }
