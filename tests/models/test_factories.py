"""Users' own model factories and modules, and the --input-shape and --dynamic grammars that describe their inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import toy_models
from tests.helpers.model_fixtures import TOY, write_module
from trt_pipeline.models import load_model
from trt_pipeline.models.inputs import InputShape, parse_dynamic, parse_input_shape
from trt_pipeline.models.spec import DynamicAxis
from trt_pipeline.pipeline.core.errors import PipelineError

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_cnn_factory():
    spec = load_model(f"{TOY}:tiny_cnn")
    assert spec.name == "toy_models-tiny_cnn"
    assert spec.example_inputs["input"].shape == (2, 3, 16, 16)
    assert spec.output_names == ["logits"]
    assert spec.preprocess is None
    assert spec.dynamic_axes == {}


def test_text_classifier_factory_shares_the_seq_axis():
    spec = load_model(f"{TOY}:text_classifier")
    ids, mask = spec.example_inputs["input_ids"], spec.example_inputs["attention_mask"]
    assert ids.dtype == torch.int64 and ids.shape == (2, 12) and ids.min() >= 0 and ids.max() <= 99
    assert mask.dtype == torch.float32 and mask.shape == (2, 12)
    seq = DynamicAxis("seq", 1, 12, 64)
    assert spec.dynamic_axes == {"input_ids": {1: seq}, "attention_mask": {1: seq}, "tokens": {1: seq}}
    assert spec.output_names == ["logits", "tokens"]
    outputs = spec.module(ids, mask)
    assert outputs["logits"].shape == (2, 4) and outputs["tokens"].shape == (2, 12, 8)


def test_baked_batch_cnn_runs_only_at_batch_two():
    spec = load_model(f"{TOY}:baked_batch_cnn")
    assert spec.module(spec.example_inputs["input"]).shape == (2, 10)
    with pytest.raises(RuntimeError):
        spec.module(torch.randn(3, 3, 8, 8))


def test_batch_stats_cnn_depends_on_the_batch_even_in_eval():
    spec = load_model(f"{TOY}:batch_stats_cnn")
    spec.module.eval()
    x = spec.example_inputs["input"]
    with torch.no_grad():
        together = spec.module(torch.cat([x, torch.randn(2, 3, 8, 8)]))[:2]
        alone = spec.module(x)
    assert not torch.allclose(together, alone)


def test_dropout_mlp_tuple_and_the_check_leaves_the_mode_alone():
    spec = load_model(f"{TOY}:dropout_mlp")
    assert list(spec.example_inputs) == ["input"] and spec.output_names == ["output"]
    assert spec.module.training  # eval mode is the prepare stage's job, not the loader's
    batch_norm = spec.module[1]
    assert torch.equal(batch_norm.running_mean, torch.zeros(32))  # the check ran in eval mode: stats untouched
    assert int(batch_norm.num_batches_tracked) == 0
    x = spec.example_inputs["input"]
    spec.module.eval()
    with torch.no_grad():
        assert torch.equal(spec.module(x), spec.module(x))


def test_plain_module_needs_an_input_shape():
    with pytest.raises(PipelineError, match="a factory returning a bare nn.Module, which does not say") as caught:
        load_model(f"{TOY}:plain_module")
    assert "Settings.input_shape" in str(caught.value) and "3x224x224" in str(caught.value)
    spec = load_model(f"{TOY}:plain_module", input_shape="3x16x16")
    assert spec.example_inputs["input"].shape == (2, 3, 16, 16)
    assert spec.output_names == ["output"]


def test_input_shape_that_does_not_fit_names_the_shape_and_torch_message():
    with pytest.raises(PipelineError) as caught:
        load_model(f"{TOY}:plain_module", input_shape="4x16x16")
    message = str(caught.value)
    assert 'Settings(input_shape="4x16x16") gave input=[2, 4, 16, 16] float32' in message
    assert "torch says:" in message and "channels" in message


def test_factory_forms_tuple_dict_and_modelspec(user_dir: Path):
    write_module(
        user_dir,
        "forms_factory",
        """
        import torch
        from trt_pipeline.models.spec import ModelSpec

        class Add(torch.nn.Module):
            def forward(self, a, b):
                return a + b, a - b

        def as_tuple():
            return Add(), (torch.randn(2, 3), torch.randn(2, 3))

        def as_dict():
            return Add(), {"left": torch.randn(2, 3), "right": torch.randn(2, 3)}

        def as_spec():
            examples = {"a": torch.randn(2, 3), "b": torch.ones(2, 3)}
            return ModelSpec(name="ignored", module=Add(), example_inputs=examples)
        """,
    )
    as_tuple = load_model("forms_factory:as_tuple")
    assert list(as_tuple.example_inputs) == ["a", "b"]  # named after forward()'s parameters
    assert as_tuple.output_names == ["output_0", "output_1"]
    with pytest.raises(
        PipelineError, match=r"example inputs \['left', 'right'\] are not parameters of forward\(a, b\)"
    ):
        load_model("forms_factory:as_dict")  # by position, "right" could feed "a": refused
    as_spec = load_model("forms_factory:as_spec")
    assert as_spec.name == "forms_factory-as_spec"  # one name scheme for artifact folders
    assert list(as_spec.example_inputs) == ["a", "b"]


def test_factory_returning_something_unusable(user_dir: Path):
    write_module(
        user_dir,
        "bad_factory",
        """
        import torch
        NOT_A_FUNCTION = 3
        def a_string():
            return "resnet"
        def scalar_example():
            return torch.nn.Identity(), torch.tensor(1.0)
        """,
    )
    with pytest.raises(PipelineError, match="returned a str, which is not a model"):
        load_model("bad_factory:a_string")
    with pytest.raises(PipelineError, match="is a scalar; dim 0 must be the batch"):
        load_model("bad_factory:scalar_example")
    with pytest.raises(PipelineError, match="is a int, not a function"):
        load_model("bad_factory:NOT_A_FUNCTION")
    with pytest.raises(PipelineError, match="has no attribute 'missing'") as caught:
        load_model("bad_factory:missing")
    assert "a_string" in str(caught.value)  # the fix lists what the module does have


def test_factory_module_that_cannot_be_imported(user_dir: Path):
    with pytest.raises(PipelineError, match="No module named 'no_such_package'"):
        load_model("no_such_package.nets:make")
    write_module(user_dir, "broken_factory", "import torch\nraise ValueError('half-written config')\n")
    with pytest.raises(PipelineError, match="ValueError: half-written config"):
        load_model("broken_factory:make")


HOSTILE = """
import os
import threading
import time

import torch


class Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def nested(levels):
    module = torch.nn.Linear(4, 4)
    for _ in range(levels):
        module = Wrap(module)
    return module, torch.zeros(2, 4)


def deep():
    return nested(1200)


def deep_but_walkable():
    return nested(90)


class Recursing(torch.nn.Module):
    def forward(self, x, depth=5000):
        return x if depth == 0 else self.forward(x + 0, depth - 1)


def recursing():
    return Recursing(), torch.zeros(2, 4)


class Nothing(torch.nn.Module):
    def forward(self, x):
        return ()


def returns_nothing():
    return Nothing(), torch.zeros(2, 4)


def float64_default():
    torch.set_default_dtype(torch.float64)
    return torch.nn.Linear(4, 2), torch.zeros(2, 4)


def explicit_double():
    return torch.nn.Linear(4, 2).double(), torch.zeros(2, 4, dtype=torch.float64)


def changes_directory():
    os.chdir(os.environ["FACTORY_GOES_TO"])
    return torch.nn.Linear(4, 2), torch.zeros(2, 4)


def leaves_a_thread():
    threading.Thread(target=time.sleep, args=(3600,), name="poller").start()
    return torch.nn.Linear(4, 2), torch.zeros(2, 4)
"""


def test_models_that_break_the_exporter_or_the_graph_are_refused_at_load(user_dir: Path):
    # A 1200-deep nest of modules was a raw RecursionError from eval(); a forward() returning () reached ONNX
    # Runtime as "OrtValue indexes should have been populated"; deep recursion in forward() was called a shape
    # that does not fit.
    write_module(user_dir, "hostile_shapes", HOSTILE)
    with pytest.raises(PipelineError, match=r"nests modules 1200 deep \(inner\.inner.*, deeper than the 96 levels"):
        load_model("hostile_shapes:deep")
    assert load_model("hostile_shapes:deep_but_walkable").output_names == ["output"]
    with pytest.raises(PipelineError, match=r"forward\(\) went deeper than Python's recursion limit") as caught:
        load_model("hostile_shapes:recursing")
    assert "loop over its layers" in caught.value.fix
    with pytest.raises(PipelineError, match=r"the model returned \(\), which holds no tensor") as caught:
        load_model("hostile_shapes:returns_nothing")
    assert caught.value.fix == "return at least one tensor from forward()"


@pytest.mark.parametrize("factory", ["float64_default", "explicit_double"])
def test_a_float64_model_is_refused_and_a_changed_default_dtype_restored(user_dir: Path, factory, capsys):
    # Both gave "model.fp16.onnx: float16 graph, float32 I/O" for a graph DOUBLE from end to end.
    from trt_pipeline.pipeline import cli

    write_module(user_dir, f"hostile_{factory}", HOSTILE)
    argv = ["all", "--model", f"hostile_{factory}:{factory}", "--precision", "fp16", "--out", "engines"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "error: the model computes in float64 (3 float64 tensors: weight, bias, input)" in captured.err
    assert "module.float() and float32 example inputs" in captured.err
    changed = "the factory changed torch's default dtype to torch.float64; changed back to torch.float32"
    assert (changed in captured.out) == (factory == "float64_default")
    assert torch.get_default_dtype() == torch.float32
    assert not list((user_dir / "engines").glob("*/*.onnx"))


def test_a_factory_that_changes_directory_is_changed_back_and_the_build_lands_in_out(
    user_dir: Path, monkeypatch, capsys
):
    # Relative OUT was resolved from the factory's directory: "done <folder>" while the artifacts were elsewhere,
    # outside the folder's lock.
    from trt_pipeline.pipeline import cli

    write_module(user_dir, "hostile_directory", HOSTILE)
    elsewhere = user_dir / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("FACTORY_GOES_TO", str(elsewhere))
    argv = ["all", "--model", "hostile_directory:changes_directory", "--precision", "fp32", "--out", "engines"]
    assert cli.main([*argv, "--batch", "1:2:4"]) == 0
    out = capsys.readouterr().out
    assert f"the factory changed the working directory to {elsewhere}; changed back to {user_dir}" in out
    assert Path.cwd() == user_dir and (user_dir / "engines" / "hostile_directory-changes_directory-fp32").is_dir()
    assert not list(elsewhere.iterdir())


def test_a_thread_a_factory_leaves_running_is_named_and_the_command_exits(user_dir: Path):
    # `done` was printed and the process never exited: Python waits for every non-daemon thread.
    write_module(user_dir, "hostile_thread", HOSTILE)
    argv = ["all", "--model", "hostile_thread:leaves_a_thread", "--precision", "fp32", "--batch", "1:2:4"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "trt_pipeline", *argv, "--out", "engines"],
        cwd=user_dir,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "done " in done.stdout and "thread(s) ['poller'] still run" in done.stderr


# ---------------------------------------------------------------- INPUT_SHAPE grammar


def test_input_shape_grammar():
    assert parse_input_shape("3x224x224") == [InputShape("input", (3, 224, 224), torch.float32)]
    assert parse_input_shape("1X28x28:float16") == [InputShape("input", (1, 28, 28), torch.float16)]
    assert parse_input_shape("input_ids=128:int64, attention_mask=128:int64") == [
        InputShape("input_ids", (128,), torch.int64),
        InputShape("attention_mask", (128,), torch.int64),
    ]
    assert parse_input_shape("image=3x32x32,scale=1") == [
        InputShape("image", (3, 32, 32), torch.float32),
        InputShape("scale", (1,), torch.float32),
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("3x", "is not dims like 3x224x224"),
        ("three", "is not dims like 3x224x224"),
        ("3x224x224:int7", "unknown dtype 'int7'"),
        ("a=3,b", "'b' is not name=DIMS"),
        ("=3", "is not name=DIMS"),
        ("x=3,x=4", "names an input twice"),
        ("3x0x2", "zero-sized dim"),
    ],
)
def test_input_shape_errors(text: str, problem: str):
    with pytest.raises(PipelineError, match=problem.replace("[", r"\[")) as caught:
        load_model(f"{TOY}:plain_module", input_shape=text)
    assert "Settings(input_shape=" in str(caught.value)


def test_integer_inputs_get_small_valid_values():
    spec = load_model(f"{TOY}:text_classifier", input_shape="input_ids=30:int64,attention_mask=30")
    ids = spec.example_inputs["input_ids"]
    assert ids.shape == (2, 30) and ids.dtype == torch.int64
    assert ids.min() >= 0 and ids.max() <= 9
    assert spec.example_inputs["attention_mask"].dtype == torch.float32


def test_input_shape_overrides_a_registry_models_inputs():
    spec = load_model("resnet18", input_shape="3x64x64")
    assert spec.example_inputs["input"].shape == (2, 3, 64, 64)


# ---------------------------------------------------------------- DYNAMIC grammar


def test_dynamic_grammar_parses():
    requests = parse_dynamic("input_ids:1=1:64:128,attention_mask:1")
    assert [(r.input_name, r.axis, r.bounds) for r in requests] == [
        ("input_ids", 1, (1, 64, 128)),
        ("attention_mask", 1, None),
    ]


def test_same_axis_and_range_share_one_named_axis():
    spec = load_model(
        f"{TOY}:text_classifier",
        input_shape="input_ids=100:int64,attention_mask=100",
        dynamic="input_ids:1=1:64:128,attention_mask:1=1:64:128",
    )
    shared = DynamicAxis("input_ids_dim1", 1, 64, 128)
    # DYNAMIC replaces the factory's axes, the output's "seq" included
    assert spec.dynamic_axes == {"input_ids": {1: shared}, "attention_mask": {1: shared}}


def test_default_range_is_one_to_the_example_size():
    spec = load_model(f"{TOY}:text_classifier", dynamic="input_ids:1,attention_mask:1")
    shared = DynamicAxis("input_ids_dim1", 1, 12, 12)
    assert spec.dynamic_axes == {"input_ids": {1: shared}, "attention_mask": {1: shared}}


def test_different_ranges_get_different_names():
    spec = load_model(f"{TOY}:plain_module", input_shape="3x32x32", dynamic="input:2=16:32:64,input:3=8:32:64")
    assert spec.dynamic_axes == {
        "input": {2: DynamicAxis("input_dim2", 16, 32, 64), 3: DynamicAxis("input_dim3", 8, 32, 64)}
    }


@pytest.mark.parametrize(
    ("dynamic", "problem"),
    [
        ("input_ids:0", "axis 0 is the batch"),
        ("input_ids", "is not NAME:AXIS"),
        ("input_ids:x", "is not NAME:AXIS"),
        ("input_ids:1=1:64", "is not MIN:OPT:MAX"),
        ("input_ids:1=64:1:128", "not ordered"),
        ("input_ids:1,input_ids:1", "same axis twice"),
        ("pixels:1", "which the model does not have"),
        ("input_ids:2", "has 2 dims .batch included., no axis 2"),
        ("input_ids:1=1:8:10", "outside its range 1:8:10"),
        ("input_ids:1,attention_mask:1=1:12:12", None),  # same default range as written out: fine
    ],
)
def test_dynamic_errors(dynamic: str, problem: str | None):
    if problem is None:
        assert load_model(f"{TOY}:text_classifier", dynamic=dynamic).dynamic_axes["attention_mask"][1].max == 12
        return
    with pytest.raises(PipelineError, match=problem):
        load_model(f"{TOY}:text_classifier", dynamic=dynamic)


def test_shared_range_with_different_example_sizes_is_refused():
    with pytest.raises(PipelineError, match="example sizes differ .12 vs 10."):
        load_model(
            f"{TOY}:text_classifier",
            input_shape="input_ids=12:int64,attention_mask=10",
            dynamic="input_ids:1=1:12:64,attention_mask:1=1:12:64",
        )


def test_factory_axis_range_must_cover_an_overridden_input_shape():
    with pytest.raises(PipelineError, match="dynamic axis seq .* does not fit"):
        load_model(f"{TOY}:text_classifier", input_shape="input_ids=100:int64,attention_mask=100")


# ---------------------------------------------------------------- model files


def bfloat16_cnn():
    """As a user hands over a model kept in half precision: model.to(torch.bfloat16) with inputs to match."""
    spec = toy_models.tiny_cnn()
    spec.module.to(torch.bfloat16)
    spec.example_inputs = {name: tensor.bfloat16() for name, tensor in spec.example_inputs.items()}
    return spec


def test_a_half_precision_model_and_its_inputs_are_widened_to_float32_with_a_note():
    spec = load_model("tests.models.test_factories:bfloat16_cnn")
    tensors = [*spec.module.parameters(), *spec.module.buffers(), *spec.example_inputs.values()]
    assert {tensor.dtype for tensor in tensors if tensor.is_floating_point()} == {torch.float32}
    assert spec.notes == ["the model came in bfloat16: it and its inputs are widened to float32 (exactly)"]
    original = bfloat16_cnn()
    for widened, held in zip(spec.module.state_dict().values(), original.module.state_dict().values(), strict=True):
        assert torch.equal(widened, held.to(widened.dtype))  # exactly the weights it came with
