"""What this CPU offers ONNX Runtime's int8 kernels: its x86 instruction sets, read from /proc/cpuinfo.

ONNX Runtime multiplies uint8 activations by int8 weights (U8S8) with VNNI where the CPU has it
(AVX-512 VNNI, AVX-VNNI; AMX on top) and with AVX2's VPMADDUBSW elsewhere, which saturates: the
INT8 graph for a CPU without VNNI stores uint8 weights instead (U8U8), see calibration/qdq_cpu.py.
"""

from __future__ import annotations

import platform
from pathlib import Path

# Linux /proc/cpuinfo flag names.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")
# The two kinds of CPU an INT8 graph for ONNX Runtime is written for.
VNNI, NO_VNNI = "vnni", "no-vnni"


def cpu_instruction_sets() -> dict[str, bool] | None:
    """Which of ISA_FLAGS this CPU has, or None where /proc/cpuinfo cannot say (not Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return {flag: flag in flags for flag in ISA_FLAGS}
    return None  # no x86 flags line (e.g. an Arm CPU)


def cpu_model() -> str:
    """This CPU's model name as /proc/cpuinfo gives it, else what the platform module says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def instruction_sets_text(isa: dict[str, bool] | None) -> str:
    """ "avx2 yes, avx512f no, ..." for a report."""
    if isa is None:
        return "instruction sets unknown"
    return ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in isa.items())


def int8_cpu_kind(isa: dict[str, bool] | None = None) -> str:
    """VNNI where ONNX Runtime's U8S8 kernels are exact (and fastest), else NO_VNNI."""
    isa = cpu_instruction_sets() if isa is None else isa
    return VNNI if isa and any(isa.get(flag) for flag in VNNI_FLAGS) else NO_VNNI
