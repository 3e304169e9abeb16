"""A runner's options checked before anything loads (pipeline/runners/options.py): each one's type and count."""

from __future__ import annotations

import re

import pytest

from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.runners import load_runner

BAD_OPTIONS = {
    # Each was a raw AttributeError or TypeError from inside a runner, or (a string of providers) split into letters.
    "device-int": ("onnxruntime-cuda", {"device": 0}, "device=0 is an int; the onnxruntime-cuda runner takes a string"),
    "device-none": ("onnxruntime-cuda", {"device": None}, "device=None is None; the onnxruntime-cuda runner takes a"),
    "sessions-str": ("onnxruntime-cuda", {"device": "cpu", "sessions": "2"}, "sessions='2' is a str; the"),
    "sessions-zero": ("onnxruntime-cuda", {"device": "cpu", "sessions": 0}, "sessions=0: a number of sessions is 1"),
    "threads-str": ("onnxruntime", {"intra_op_threads": "2"}, "takes a whole number or None"),
    "threads-bool": ("onnxruntime", {"intra_op_threads": True}, "intra_op_threads=True is a bool"),
    "threads-zero": ("onnxruntime", {"intra_op_threads": 0}, "a number of intra-op threads is 1 or more"),
    "providers-str": ("onnxruntime", {"providers": "CPUExecutionProvider"}, "takes a list of strings or None"),
    "providers-empty": ("onnxruntime", {"providers": []}, "providers=[] names no provider"),
    "providers-unknown": ("onnxruntime", {"providers": ["Nosuch"]}, "['Nosuch'] are not ONNX Runtime provider names"),
    "split-str": ("auto", {"split_large_batches": "no"}, "split_large_batches='no' is a str"),
    "contexts-zero": ("tensorrt", {"contexts": 0}, "contexts=0: a number of execution contexts is 1 or more"),
    "trt-device-str": ("tensorrt", {"device": "cuda:0"}, "device='cuda:0' is a str; the tensorrt runner takes a whole"),
    "torch-device-int": ("torch", {"device": 3}, "device=3 is an int; the torch runner takes a string or None"),
    "torch-device-unknown": ("torch", {"device": "nonsense"}, "device='nonsense' is no torch device"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_load_runner_checks_every_options_type_and_count(folders, case):
    backend, options, message = BAD_OPTIONS[case]
    with pytest.raises(PipelineError, match=re.escape(message)) as caught:
        load_runner(folders["tiny_cnn"], backend, **options)
    assert caught.value.fix
