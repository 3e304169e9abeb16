"""The precisions a folder is built at: one type, most accurate first."""

from __future__ import annotations

from enum import Enum


class Precision(str, Enum):
    """A folder's precision.  A str, so it compares equal to its value and is written to JSON as "fp16"."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def at_least_as_accurate(self) -> tuple[Precision, ...]:
        """The precisions as accurate as this one or more, most accurate first (an int8 folder may serve FP32)."""
        members = list(Precision)
        return tuple(members[: members.index(self) + 1])


PRECISIONS: tuple[str, ...] = tuple(precision.value for precision in Precision)
