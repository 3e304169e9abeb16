"""The model registry and its names, ResNet's torchvision compatibility, weights files and fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import toy_models
from tests.helpers.model_fixtures import TOY, write_module
from trt_pipeline.models import canonical_name, known_models, load_model
from trt_pipeline.models.registry import ALIASES, REGISTRY
from trt_pipeline.models.resnet import RANDOM_INIT_NOTE, build_resnet
from trt_pipeline.models.spec import ImagePreprocess
from trt_pipeline.pipeline.core.errors import PipelineError

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def resnet18_state_dict() -> dict[str, torch.Tensor]:
    return build_resnet("resnet18").state_dict()


@pytest.fixture
def resnet18_weights(tmp_path: Path, resnet18_state_dict) -> Path:
    path = tmp_path / "resnet18.pth"
    torch.save(resnet18_state_dict, path)
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
    assert canonical_name("tests.helpers.toy_models:tiny_cnn") == "toy_models-tiny_cnn"
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
    with pytest.raises(PipelineError, match="weights file .*absent.pth does not exist"):
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
