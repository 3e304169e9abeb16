"""Which ONNX Runtime sessions a piece of code opens and which are still alive: the real sessions, run as ever."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import onnxruntime as ort


def record_sessions(monkeypatch, on_open: Callable[[ort.InferenceSession, object], None] | None = None) -> list:
    """A weak reference to each session opened from now on, in order; on_open(session, model), where given, called
    as each one opens (model: what InferenceSession was given, a path or a graph's bytes)."""
    opened: list[weakref.ref] = []
    open_session = ort.InferenceSession.__init__

    def open_and_record(self, model, *args, **kwargs):
        open_session(self, model, *args, **kwargs)
        opened.append(weakref.ref(self))
        if on_open is not None:
            on_open(self, model)

    monkeypatch.setattr(ort.InferenceSession, "__init__", open_and_record)
    return opened


def alive(opened: list) -> list[ort.InferenceSession]:
    """The sessions of `opened` (record_sessions') still alive once unreachable objects are collected."""
    gc.collect()
    return [session for reference in opened if (session := reference()) is not None]
