"""The model registry, ResNet's torchvision compatibility, and the loaders for users' own models."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import toy_models
from trt_pipeline.models import canonical_name, known_models, load_model
from trt_pipeline.models.inputs import InputShape, parse_dynamic, parse_input_shape
from trt_pipeline.models.registry import ALIASES, REGISTRY
from trt_pipeline.models.resnet import RANDOM_INIT_NOTE, build_resnet
from trt_pipeline.models.spec import DynamicAxis, ImagePreprocess
from trt_pipeline.pipeline.core.errors import PipelineError

TOY = "tests.toy_models"

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def resnet18_state_dict() -> dict[str, torch.Tensor]:
    return build_resnet("resnet18").state_dict()


@pytest.fixture
def resnet18_weights(tmp_path: Path, resnet18_state_dict) -> Path:
    path = tmp_path / "resnet18.pth"
    torch.save(resnet18_state_dict, path)
    return path


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current directory of a user running the pipeline; sys.path and sys.modules restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [n for n, m in sys.modules.items() if str(getattr(m, "__file__", "")).startswith(str(tmp_path))]:
        del sys.modules[name]


def write_module(directory: Path, name: str, source: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


# ---------------------------------------------------------------- registry and names


def test_registry_holds_the_resnet_family_and_the_alias():
    resnets = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
    assert known_models()[:5] == resnets  # other models are added after them
    assert known_models() == list(REGISTRY)
    assert ALIASES == {"resnet": "resnet50"}
    assert all(callable(builder) for builder in REGISTRY.values())


def test_canonical_names(tmp_path: Path):
    checkpoint = tmp_path / "my net.v2.pt"
    checkpoint.write_bytes(b"not read by canonical_name")
    assert canonical_name("resnet") == "resnet50"
    assert canonical_name("ResNet18") == "resnet18"
    assert canonical_name("tests.toy_models:tiny_cnn") == "toy_models-tiny_cnn"
    assert canonical_name("pkg.sub.nets:Zoo.make") == "nets-Zoo.make"
    assert canonical_name(str(checkpoint)) == "my_net.v2"


def test_unknown_model_lists_known_models_and_other_forms():
    with pytest.raises(PipelineError) as caught:
        load_model("resnt50")
    message = str(caught.value)
    assert "unknown model 'resnt50'" in message
    for expected in ("resnet18", "resnet152", "resnet -> resnet50", "package.module:function", ".pt2", "TorchScript"):
        assert expected in message


def test_missing_model_file_is_named(tmp_path: Path):
    missing = tmp_path / "nowhere" / "model.pt"
    with pytest.raises(PipelineError, match="model.pt does not exist"):
        load_model(str(missing))


# ---------------------------------------------------------------- ResNet: torchvision names and init


def torchvision_resnet_keys(block: str, layers: list[int]) -> list[str]:
    """State_dict keys in torchvision.models.resnet's order, written from its architecture definition."""
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    keys = ["conv1.weight", *(f"bn1.{p}" for p in bn)]
    convs_per_block = 2 if block == "basic" else 3
    expansion = 1 if block == "basic" else 4
    inplanes = 64
    for stage, (blocks, planes) in enumerate(zip(layers, [64, 128, 256, 512], strict=True), start=1):
        for index in range(blocks):
            prefix = f"layer{stage}.{index}"
            for conv in range(1, convs_per_block + 1):
                keys += [f"{prefix}.conv{conv}.weight", *(f"{prefix}.bn{conv}.{p}" for p in bn)]
            # torchvision adds a downsample to a stage's first block when the stride or the width changes
            if index == 0 and (stage > 1 or inplanes != planes * expansion):
                keys += [f"{prefix}.downsample.0.weight", *(f"{prefix}.downsample.1.{p}" for p in bn)]
        inplanes = planes * expansion
    return keys + ["fc.weight", "fc.bias"]


def test_resnet18_keys_match_torchvision():
    state_dict = build_resnet("resnet18").state_dict()
    assert list(state_dict) == torchvision_resnet_keys("basic", [2, 2, 2, 2])
    assert len(state_dict) == 122  # 62 parameters + 60 BatchNorm buffers
    assert "layer1.0.downsample.1.weight" not in state_dict  # 64 -> 64 channels, stride 1: no downsample
    assert "layer2.0.downsample.1.weight" in state_dict
    assert state_dict["fc.weight"].shape == (1000, 512)
    # torchvision's documented parameter count for resnet18
    assert sum(p.numel() for p in build_resnet("resnet18").parameters()) == 11_689_512


def test_resnet50_keys_match_torchvision():
    model = build_resnet("resnet50")
    state_dict = model.state_dict()
    assert list(state_dict) == torchvision_resnet_keys("bottleneck", [3, 4, 6, 3])
    assert len(state_dict) == 320  # 161 parameters + 159 BatchNorm buffers
    assert "layer4.2.bn3.running_var" in state_dict
    assert "layer1.0.downsample.0.weight" in state_dict  # 64 -> 256 channels needs a projection
    assert state_dict["layer1.0.downsample.0.weight"].shape == (256, 64, 1, 1)
    assert state_dict["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)  # the stride sits on the 3x3 (V1.5)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's documented count


def test_resnet_init_is_torchvision_init():
    model = build_resnet("resnet18")
    fan_out = 64 * 7 * 7  # kaiming normal, mode fan_out, relu gain: std = sqrt(2 / fan_out)
    assert model.conv1.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.1)
    assert torch.all(model.layer3[1].bn2.weight == 1)
    assert torch.all(model.layer3[1].bn2.bias == 0)


def test_resnet_batch_is_not_baked_in():
    model = build_resnet("resnet18").eval()
    with torch.no_grad():
        assert model(torch.randn(3, 3, 64, 64)).shape == (3, 1000)
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_registry_model_without_weights_is_random_with_a_note():
    spec = load_model("resnet18")
    assert spec.name == "resnet18"
    assert spec.notes == [RANDOM_INIT_NOTE]
    assert "randomly initialised" in RANDOM_INIT_NOTE
    assert list(spec.example_inputs) == ["input"]
    assert spec.example_inputs["input"].shape == (2, 3, 224, 224)
    assert spec.output_names == ["output"]
    assert spec.preprocess == ImagePreprocess()
    assert len(spec.fingerprint) == 64
    again = load_model("resnet18")  # seeded: the runner's reload must match the model the engine was built from
    assert torch.equal(again.module.layer2[0].conv1.weight, spec.module.layer2[0].conv1.weight)
    assert torch.equal(again.example_inputs["input"], spec.example_inputs["input"])
    assert again.fingerprint == spec.fingerprint


# ---------------------------------------------------------------- weights


def test_state_dict_round_trips_into_a_fresh_model(resnet18_weights: Path, resnet18_state_dict):
    spec = load_model("resnet18", weights=resnet18_weights)
    assert spec.notes == []
    loaded = spec.module.state_dict()
    assert loaded.keys() == resnet18_state_dict.keys()
    assert all(torch.equal(loaded[k], resnet18_state_dict[k]) for k in loaded)


@pytest.mark.parametrize("wrap", ["state_dict", "model", "module_prefix"])
def test_common_checkpoint_wrappings_load(tmp_path: Path, resnet18_state_dict, wrap: str):
    if wrap == "module_prefix":  # what nn.DataParallel saves
        content = {f"module.{k}": v for k, v in resnet18_state_dict.items()}
    else:
        content = {wrap: resnet18_state_dict, "epoch": 90}
    path = tmp_path / "checkpoint.pth"
    torch.save(content, path)
    loaded = load_model("resnet18", weights=path).module.state_dict()
    assert torch.equal(loaded["fc.weight"], resnet18_state_dict["fc.weight"])


def test_old_checkpoint_without_num_batches_tracked_loads(tmp_path: Path, resnet18_state_dict):
    path = tmp_path / "old.pth"
    torch.save({k: v for k, v in resnet18_state_dict.items() if "num_batches_tracked" not in k}, path)
    loaded = load_model("resnet18", weights=path).module.state_dict()
    assert torch.equal(loaded["layer4.1.bn2.running_var"], resnet18_state_dict["layer4.1.bn2.running_var"])


def test_fine_tuned_head_sets_the_class_count(tmp_path: Path, resnet18_state_dict):
    state_dict = dict(resnet18_state_dict)
    state_dict["fc.weight"], state_dict["fc.bias"] = torch.randn(10, 512), torch.randn(10)
    path = tmp_path / "ten_classes.pth"
    torch.save(state_dict, path)
    assert load_model("resnet18", weights=path).module.fc.out_features == 10


def test_key_mismatch_names_missing_and_unexpected_keys(tmp_path: Path, resnet18_state_dict):
    state_dict = dict(resnet18_state_dict)
    state_dict["head.extra"] = torch.zeros(1)
    path = tmp_path / "resnet18.pth"
    torch.save(state_dict, path)
    with pytest.raises(PipelineError) as caught:
        load_model("resnet34", weights=path)  # resnet34 has 3 blocks in layer1, resnet18 has 2
    message = str(caught.value)
    assert "does not fit the model" in message
    assert "missing keys: layer1.2.conv1.weight" in message
    assert "1 unexpected keys: head.extra" in message
    assert "same architecture" in message


def test_weights_that_are_a_pickled_object_are_refused(tmp_path: Path):
    path = tmp_path / "whole.pt"
    torch.save(toy_models.plain_module(), path)
    with pytest.raises(PipelineError, match="holds pickled Python objects .*_PlainModule.*not just tensors"):
        load_model("resnet18", weights=path)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"\x00not a torch file")
    with pytest.raises(PipelineError, match="garbage.pth is not a file torch.load can read"):
        load_model("resnet18", weights=garbage)


def test_missing_weights_file_is_named(tmp_path: Path):
    with pytest.raises(PipelineError, match="WEIGHTS file .*absent.pth does not exist"):
        load_model("resnet18", weights=tmp_path / "absent.pth")


def test_weights_load_into_a_factory_model(tmp_path: Path):
    trained = toy_models.tiny_cnn().module
    with torch.no_grad():
        trained.fc.bias.fill_(3.0)
    path = tmp_path / "tiny.pth"
    torch.save(trained.state_dict(), path)
    spec = load_model(f"{TOY}:tiny_cnn", weights=path)
    assert torch.all(spec.module.fc.bias == 3.0)


# ---------------------------------------------------------------- fingerprints


def test_fingerprint_is_stable_and_changes_with_weights(tmp_path: Path, resnet18_state_dict):
    path = tmp_path / "resnet18.pth"
    torch.save(resnet18_state_dict, path)
    first = load_model("resnet18", weights=path).fingerprint
    assert load_model("resnet18", weights=path).fingerprint == first
    changed = dict(resnet18_state_dict)
    changed["fc.bias"] = changed["fc.bias"] + 1
    torch.save(changed, path)
    assert load_model("resnet18", weights=path).fingerprint != first
    assert load_model("resnet18").fingerprint != first


def test_fingerprint_changes_with_model_input_shape_and_dynamic():
    base = load_model(f"{TOY}:text_classifier")
    fingerprints = {
        base.fingerprint,
        load_model(f"{TOY}:tiny_cnn").fingerprint,
        load_model(f"{TOY}:text_classifier", input_shape="input_ids=12:int64,attention_mask=12").fingerprint,
        load_model(f"{TOY}:text_classifier", dynamic="input_ids:1=1:12:64,attention_mask:1=1:12:64").fingerprint,
    }
    assert len(fingerprints) == 4
    assert load_model(f"{TOY}:text_classifier").fingerprint == base.fingerprint


def test_fingerprint_covers_the_factory_source(user_dir: Path):
    source = "import torch\ndef make():\n    return torch.nn.Linear(4, 2), torch.randn(2, 4)\n"
    write_module(user_dir, "fp_factory", source)
    first = load_model("fp_factory:make").fingerprint
    write_module(user_dir, "fp_factory", source + "# a comment is a change too\n")
    assert load_model("fp_factory:make").fingerprint != first


# ---------------------------------------------------------------- factories


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
    assert "INPUT_SHAPE" in str(caught.value) and "3x224x224" in str(caught.value)
    spec = load_model(f"{TOY}:plain_module", input_shape="3x16x16")
    assert spec.example_inputs["input"].shape == (2, 3, 16, 16)
    assert spec.output_names == ["output"]


def test_input_shape_that_does_not_fit_names_the_shape_and_torch_message():
    with pytest.raises(PipelineError) as caught:
        load_model(f"{TOY}:plain_module", input_shape="4x16x16")
    message = str(caught.value)
    assert "INPUT_SHAPE='4x16x16' gave input=[2, 4, 16, 16] float32" in message
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
    assert "INPUT_SHAPE" in str(caught.value)


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


def test_pickled_whole_module_needs_input_shape(tmp_path: Path):
    path = tmp_path / "plain.pt"
    module = toy_models.plain_module()
    torch.save(module, path)
    with pytest.raises(PipelineError, match="(?s)is a pickled nn.Module.*INPUT_SHAPE"):
        load_model(str(path), trust_model_file=True)
    spec = load_model(str(path), input_shape="3x16x16", trust_model_file=True)
    assert spec.name == "plain"
    x = spec.example_inputs["input"]
    with torch.no_grad():
        assert torch.equal(spec.module(x), module(x))


def test_state_dict_as_model_is_refused_with_the_fix(tmp_path: Path):
    path = tmp_path / "weights_only.pth"
    torch.save(toy_models.tiny_cnn().module.state_dict(), path)
    with pytest.raises(PipelineError, match="is a state_dict") as caught:
        load_model(str(path))
    assert f"MODEL=<registry name or package.module:factory> WEIGHTS={path}" in str(caught.value)


def test_file_that_is_not_a_model_is_refused(tmp_path: Path):
    path = tmp_path / "numbers.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(PipelineError, match="holds a list, not an nn.Module"):
        load_model(str(path))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a torch file")
    with pytest.raises(PipelineError, match="is not a file torch.load can read"):
        load_model(str(garbage))


def test_torchscript_file(tmp_path: Path):
    module = toy_models.plain_module()
    path = tmp_path / "scripted.ts"
    torch.jit.save(torch.jit.script(module), str(path))
    with pytest.raises(PipelineError, match="(?s)is a TorchScript file.*INPUT_SHAPE"):
        load_model(str(path))
    spec = load_model(str(path), input_shape="3x16x16")
    assert spec.name == "scripted" and spec.output_names == ["output"]
    x = spec.example_inputs["input"]
    with torch.no_grad():
        assert torch.allclose(spec.module(x), module(x))
    with pytest.raises(PipelineError, match="INPUT_SHAPE='5x16x16'"):
        load_model(str(path), input_shape="5x16x16")


def test_exported_program_derives_its_inputs_with_batch_two(tmp_path: Path):
    spec = toy_models.tiny_cnn()
    module = spec.module.eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (torch.randn(4, 3, 16, 16),), dynamic_shapes=({0: batch},))
    path = tmp_path / "tiny.pt2"
    torch.export.save(program, str(path))

    loaded = load_model(str(path))
    assert loaded.name == "tiny"
    assert list(loaded.example_inputs) == ["x"]  # the forward argument's name
    assert loaded.example_inputs["x"].shape == (2, 3, 16, 16)
    assert loaded.notes == []
    x = loaded.example_inputs["x"]
    loaded.module.eval()  # torch.export's own module raises here; the prepare stage calls it on every model
    assert not loaded.module.training
    with torch.no_grad():
        assert torch.allclose(loaded.module(x), module(x), atol=1e-6)
        assert loaded.module(torch.randn(5, 3, 16, 16)).shape == (5, 10)  # the batch stayed dynamic


def test_exported_program_with_a_static_batch_says_so(tmp_path: Path):
    module, example = toy_models.dropout_mlp()
    program = torch.export.export(module.eval(), (torch.randn(1, 16),))
    path = tmp_path / "static.pt2"
    torch.export.save(program, str(path))
    loaded = load_model(str(path))
    assert loaded.example_inputs["input"].shape == (1, 16)
    assert loaded.notes == ["static.pt2 was exported with a static batch of 1 on input: only that batch size will run"]
    with pytest.raises(PipelineError, match="INPUT_SHAPE='17'"):
        load_model(str(path), input_shape="17")


def test_model_file_fingerprint_covers_the_file(tmp_path: Path):
    path = tmp_path / "plain.pt"
    torch.save(toy_models.plain_module(), path)
    first = load_model(str(path), input_shape="3x16x16", trust_model_file=True).fingerprint
    changed = toy_models.plain_module()
    with torch.no_grad():
        changed.fc.bias.add_(1)
    torch.save(changed, path)
    assert load_model(str(path), input_shape="3x16x16", trust_model_file=True).fingerprint != first


# ---------------------------------------------------------------- inputs bound to forward() by name


class _OptionalInputs(torch.nn.Module):
    """forward(x, mask=None, scale=None): an input bound by position to the wrong parameter changes the result."""

    def forward(self, x, mask=None, scale=None):
        y = x * 2
        if mask is not None:
            y = y + mask * 100
        return y * scale if scale is not None else y


def optional_inputs_dict():
    return _OptionalInputs(), {"scale": torch.full((2, 3), 3.0), "x": torch.ones(2, 3)}


def optional_inputs_tuple():
    return _OptionalInputs(), (torch.ones(2, 3), torch.zeros(2, 3))


def optional_inputs_unnamed():
    return _OptionalInputs(), {"a": torch.ones(2, 3), "b": torch.ones(2, 3)}


def test_dict_inputs_are_bound_by_name_through_export_and_parity(tmp_path: Path):
    """{"x", "scale"} for forward(x, mask=None, scale=None): scale must not feed mask, in PyTorch or in ONNX."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from trt_pipeline.pipeline.core.settings import Settings
    from trt_pipeline.pipeline.stages.sequence import make_engine

    folder = make_engine(Settings(model=f"{__name__}:optional_inputs_dict", precision="fp32", out_root=tmp_path))
    graph = folder / "model.onnx"
    assert [value.name for value in onnx.load(str(graph)).graph.input] == ["x", "scale"]  # forward()'s order
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    x, scale = np.ones((4, 3), np.float32), np.full((4, 3), 3.0, np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x, "scale": scale})[0], x * 2 * scale)
    from trt_pipeline.pipeline.runners import load_runner

    with load_runner(folder, "torch") as runner:  # the torch runner binds them by name too
        np.testing.assert_allclose(runner.infer({"x": x, "scale": scale})["output"], x * 2 * scale)


def test_tuple_inputs_take_forward_parameter_names():
    spec = load_model(f"{__name__}:optional_inputs_tuple")
    assert list(spec.example_inputs) == ["x", "mask"]


def one_input_tuple():
    return _OptionalInputs(), (torch.ones(2, 3),)


def test_a_one_input_tuple_takes_the_forward_parameter_name_too():
    """One rule for tuples of any length: (x,) is `x`, so DYNAMIC names it as forward() does (it was input_0)."""
    spec = load_model(f"{__name__}:one_input_tuple", dynamic="x:1=1:3:6")
    assert list(spec.example_inputs) == ["x"] and spec.dynamic_axes["x"][1].max == 6


def test_several_inputs_not_named_after_forward_are_refused():
    with pytest.raises(PipelineError, match=r"example inputs \['a', 'b'\] are not parameters of forward\(x, mask"):
        load_model(f"{__name__}:optional_inputs_unnamed")


# ---------------------------------------------------------------- MODEL=<file>.onnx


def _export_text_classifier(path: Path, *, opset: int = 17, sequence: str | None = "seq") -> Path:
    """The toy text classifier as a user would export it: batch named, the sequence named or left fixed."""
    spec = toy_models.text_classifier()
    axes = {name: {0: "batch", **({1: sequence} if sequence else {})} for name in spec.example_inputs}
    torch.onnx.export(
        spec.module.eval(),
        tuple(spec.example_inputs.values()),
        str(path),
        input_names=list(spec.example_inputs),
        output_names=["logits", "tokens"],
        dynamic_axes={**axes, "logits": {0: "batch"}, "tokens": {0: "batch", **({1: sequence} if sequence else {})}},
        opset_version=opset,
        dynamo=False,
    )
    return path


def _onnx_settings(model: Path, tmp_path: Path, **overrides):
    from trt_pipeline.pipeline.core.settings import BatchProfile, Settings

    defaults = {"precision": "fp16", "batch": BatchProfile(1, 2, 4), "out_root": tmp_path / "engines"}
    return Settings(model=str(model), **{**defaults, "builder": "tensorrt_rtx", **overrides})


def test_an_onnx_file_starts_at_check_with_its_own_fp32_outputs_as_the_reference(tmp_path: Path):
    from trt_pipeline.pipeline.folder.manifest import MANIFEST
    from trt_pipeline.pipeline.stages.onnx_model import REFERENCE_SOURCE
    from trt_pipeline.pipeline.stages.sequence import make_engine

    graph = _export_text_classifier(tmp_path / "classifier.onnx", opset=13)  # converted to 17 on the way in
    folder = make_engine(_onnx_settings(graph, tmp_path, dynamic="input_ids:1=1:12:24,attention_mask:1=1:12:24"))
    manifest = json.loads((folder / MANIFEST).read_text())  # as written on disk
    assert manifest["reference_source"] == REFERENCE_SOURCE
    assert manifest["import"]["source_opset"] == 13
    assert manifest["axis_ranges"] == {"seq": [1, 12, 24]}  # the file's dim_param is the profile's axis
    assert [i["shape"] for i in manifest["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    assert "prepare" not in manifest and "export" not in manifest  # no PyTorch model was loaded
    assert manifest["parity_fp16"]["max_rel"] < 3e-2
    assert manifest["build"]["engine_bytes"] > 0


def test_an_onnx_files_symbolic_dims_need_a_range_or_a_size(tmp_path: Path):
    import onnx

    from trt_pipeline.pipeline.stages.sequence import make_engine

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    with pytest.raises(PipelineError) as error:
        make_engine(_onnx_settings(graph, tmp_path))
    assert "input_ids axis 1 ('seq')" in error.value.problem
    assert "DYNAMIC=input_ids:1=" in (error.value.fix or "")
    # INPUT_SHAPE fixes the sequence at 10 instead.
    shape = "input_ids=10:int64,attention_mask=10:float32"
    folder = make_engine(_onnx_settings(graph, tmp_path, precision="fp32", input_shape=shape))
    dims = [
        [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in onnx.load(str(folder / "model.onnx")).graph.input
    ]
    assert dims == [["batch", 10], ["batch", 10]]


def test_an_onnx_file_with_a_fixed_batch_is_refused(tmp_path: Path):
    from trt_pipeline.pipeline.stages.sequence import make_engine

    spec = toy_models.tiny_cnn()
    graph = tmp_path / "fixed.onnx"
    torch.onnx.export(spec.module.eval(), tuple(spec.example_inputs.values()), str(graph), dynamo=False)
    with pytest.raises(PipelineError) as error:
        make_engine(_onnx_settings(graph, tmp_path))
    assert "dim 0 2" in error.value.problem and "dynamic_axes=" in (error.value.fix or "")


# ---------------------------------------------------------------- an ONNX Runtime crash is contained


def _segfault() -> None:
    """A real SIGSEGV (reading address 0 through ctypes), standing in for a crash inside ONNX Runtime's C++."""
    import ctypes

    ctypes.string_at(0)


def _crash_at_full_optimization(path: Path, level: str):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, _open

    if level == OPTIMIZATION_LEVELS[0]:
        _segfault()
    return _open(path, None, level)


class _CrashingRun:
    """A real session on the graph whose run segfaults, standing in for an ONNX Runtime kernel crash (none known
    in ORT 1.31/1.32) at the levels in `crashing`."""

    def __init__(self, path: Path, level: str, crashing: tuple[str, ...]):
        from trt_pipeline.pipeline.core.sessions import _open

        self.session, self.crashes = _open(path, None, level), level in crashing

    def run(self, names, feed):
        if self.crashes:
            _segfault()
        return self.session.run(names, feed)


def test_a_native_crash_kills_only_the_child():
    from trt_pipeline.pipeline.core.sessions import crash_in_child

    assert crash_in_child(_segfault) == "SIGSEGV"
    assert crash_in_child(len, "exits normally") is None
    assert crash_in_child(int, "not a number") is None  # a Python error is not a crash


def test_a_graph_that_crashes_at_full_optimization_opens_one_level_lower(tmp_path: Path, capsys):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, level_that_opens

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    assert level_that_opens(graph, lambda level: _crash_at_full_optimization(graph, level)) == OPTIMIZATION_LEVELS[1]
    assert "crashed on classifier.onnx (SIGSEGV at ORT_ENABLE_ALL)" in capsys.readouterr().out


def test_a_graph_whose_first_run_crashes_is_probed_with_the_feed_and_opens_lower(tmp_path: Path, capsys):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS, level_that_opens

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    feed = {"input_ids": np.ones((1, 12), np.int64), "attention_mask": np.ones((1, 12), np.int64)}
    crashing = OPTIMIZATION_LEVELS[:2]
    # Opening alone does not crash, so a probe without the feed keeps the highest level...
    assert level_that_opens(graph, lambda level: _CrashingRun(graph, level, crashing)) == OPTIMIZATION_LEVELS[0]
    # ...and the run on the feed is what finds the level that works.
    level = level_that_opens(graph, lambda level: _CrashingRun(graph, level, crashing), feed)
    assert level == OPTIMIZATION_LEVELS[2]
    assert "SIGSEGV at ORT_ENABLE_ALL; SIGSEGV at ORT_ENABLE_EXTENDED" in capsys.readouterr().out


def test_a_graph_that_crashes_at_every_level_is_a_clear_error_through_the_command_line(tmp_path: Path):
    """The check stage's session on a graph whose every opening segfaults: exit 2, the graph named, no traceback."""
    import subprocess
    import sys

    graph = _export_text_classifier(tmp_path / "classifier.onnx")
    script = textwrap.dedent(
        f"""
        import sys
        from trt_pipeline.pipeline import cli
        from trt_pipeline.pipeline.core import sessions
        from tests.test_models import _segfault
        real = sessions.level_that_opens
        sessions.level_that_opens = lambda path, open_at, feed=None: real(path, lambda level: _segfault(), feed)
        sys.exit(cli.main(["check", "--model", {str(graph)!r}, "--out", {str(tmp_path / "engines")!r},
                           "--dynamic", "input_ids:1=1:12:24,attention_mask:1=1:12:24"]))
        """
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trt_pipeline",
            "export",
            "--model",
            str(graph),
            "--out",
            str(tmp_path / "engines"),
            "--dynamic",
            "input_ids:1=1:12:24,attention_mask:1=1:12:24",
        ],
        check=True,
        capture_output=True,
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "ONNX Runtime crashed opening" in done.stderr and "model.onnx at every optimization level" in done.stderr
    assert "SIGSEGV at ORT_DISABLE_ALL" in done.stderr and "Traceback" not in done.stderr


def _crash_before(open_at, level: str):
    from trt_pipeline.pipeline.core.sessions import OPTIMIZATION_LEVELS

    if level == OPTIMIZATION_LEVELS[0]:
        _segfault()
    return open_at(level)


def test_the_level_a_build_fell_back_to_is_recorded_and_the_runner_opens_at_it(tmp_path: Path):
    """A build whose graphs crash ONNX Runtime at full optimization (the stand-in as above): the manifest records
    the level that worked for each graph the folder serves, and the runner opens the graph's bytes at it."""
    import subprocess

    import onnxruntime

    from trt_pipeline import load_runner
    from trt_pipeline.pipeline.folder.manifest import read_manifest

    out = tmp_path / "engines"
    script = textwrap.dedent(
        f"""
        import sys
        from trt_pipeline.pipeline import cli
        from trt_pipeline.pipeline.core import sessions
        from tests.test_models import _crash_before
        real = sessions.level_that_opens
        sessions.level_that_opens = lambda path, open_at, feed=None: real(
            path, lambda level: _crash_before(open_at, level), feed
        )
        sys.exit(cli.main(["engine", "--model", "tests.toy_models:tiny_cnn", "--precision", "fp32",
                           "--out", {str(out)!r}, "--batch", "1:2:4"]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "opened it at ORT_ENABLE_EXTENDED instead" in done.stdout
    folder = out / "toy_models-tiny_cnn-fp32"
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.onnxruntime_levels == {"model.onnx": "ORT_ENABLE_EXTENDED"}
    with load_runner(folder, "onnxruntime", providers=["CPUExecutionProvider"]) as runner:
        level = runner.session.get_session_options().graph_optimization_level
        assert level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        assert runner.infer({"input": np.zeros((2, 3, 16, 16), np.float32)})["logits"].shape == (2, 10)


# ---------------------------------------------------------------- a static token sequence is worth a warning


def test_a_static_token_sequence_is_warned_about_with_the_dynamic_that_fixes_it(tmp_path: Path, capsys):
    from trt_pipeline.pipeline.stages.export import export_onnx, static_token_sequences

    dynamic = load_model("tests.toy_models:text_classifier")
    assert static_token_sequences(dynamic) is None  # its sequence axis is declared
    static = load_model("tests.toy_models:text_classifier", dynamic="none")
    record = export_onnx(static, tmp_path / "model.onnx")
    printed = capsys.readouterr().out
    # input_ids is an integer token input; the float attention_mask is not
    assert "integer token input(s) input_ids (12) have a static sequence axis" in printed
    assert "DYNAMIC=input_ids:1=1:12:512 makes it dynamic" in printed
    assert record["warnings"] == [printed.strip().removeprefix("warning: ")]
