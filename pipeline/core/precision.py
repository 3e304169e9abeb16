"""The precisions a folder is built at: one type, most accurate first; and the enum of words it is made from."""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """An enum of words: a str, so it compares equal to its value and is written to JSON as it, and printed and
    formatted as its value (enum.StrEnum, which Python 3.10 lacks).  Precision, Postprocess, Target, Evaluation."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Precision(TextEnum):
    """A folder's precision ("fp16" in JSON and in words)."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"

    def at_least_as_accurate(self) -> tuple[Precision, ...]:
        """The precisions as accurate as this one or more, most accurate first (an int8 folder may serve FP32)."""
        members = list(Precision)
        return tuple(members[: members.index(self) + 1])


PRECISIONS: tuple[str, ...] = tuple(precision.value for precision in Precision)
