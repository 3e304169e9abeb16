"""tests/ mirrors the code: a folder per package (a module's test is found by its path, e.g. runners/fastest.py's
in tests/runners/test_fastest.py), a few folders of tests that span packages, and helpers apart from tests.

A new test goes into the folder of the package it tests, never flat in tests/ (conftest.py alone stays there,
for the markers).  Every folder is a Python package, so two test files of the same name in two folders do not
clash."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# Folders of tests that no single package owns, and what each holds.
SPANNING = {
    "end_to_end": "the whole pipeline, the Makefile, the README and docs, the command line as a user runs it",
    "gpu": "the tests marked gpu, that need a real GPU",
    "package": "the installed package as a whole: imports, extras, the API, this layout",
    "bad_inputs": "the bad-input cases (cases.py), shared by their tests and tools/catalogue.py",
    "tools": "the scripts under tools/",
    "benchmarks": "the benchmarks under benchmarks/, run dry on the CPU",
    "helpers": "toy models, fixtures and comparisons the tests share: no tests",
}
DATA_MODULES = {"bad_inputs/cases.py"}  # tables of cases, not tests and not helpers
# A package's test files are named after its modules (tests/runners/test_fastest.py tests runners/fastest.py), besides
# its front, test_<package>.py (what its __init__.py offers, and what spans its modules), and these topics that span
# modules of one package.  A new topic is added here with its reason, not a name any file may take.
TOPICS = {
    "calibration/test_int8_cnn.py": "a trained ImageNet CNN through the whole INT8 stage",
    "calibration/test_int8_weights_on_disk.py": "smoothing and bias correction keeping the weights on disk",
    "postprocess/test_detector.py": "a user's detector exported by the stages, with NMS appended",
    "runners/test_run_errors.py": "what the ONNX Runtime runners say when a run fails",
    "serve/test_detector_serving.py": "a detector served over REST, gRPC and by Triton",
    "serve/test_limits.py": "clients that cost the service more than their requests",
    "serve/test_load.py": "the service under load and at its limits",
    "serve/test_mistakes.py": "what the service refuses, sent as clients send it",
}


def code_packages() -> list[str]:
    """The packages whose tests have a folder of their own: pipeline's subpackages, calibration and models."""
    pipeline = sorted(path.parent.name for path in (ROOT / "pipeline").glob("*/__init__.py"))
    return [*pipeline, "calibration", "models"]


def package_modules(package: str) -> set[str]:
    """The names of a code package's modules: pipeline/<package>/*.py, or calibration/ and models/ at the top."""
    code = ROOT / package if package in ("calibration", "models") else ROOT / "pipeline" / package
    return {path.stem for path in code.glob("*.py") if path.name != "__init__.py"}


def misnamed_test_files(tests: Path) -> list[str]:
    """The test files under tests/<package>/ named after no module of that package, its front, nor a topic."""
    return [
        path.relative_to(tests).as_posix()
        for package in code_packages()
        for path in sorted((tests / package).glob("test_*.py"))
        if path.stem.removeprefix("test_") not in {*package_modules(package), package}
        and path.relative_to(tests).as_posix() not in TOPICS
    ]


def test_every_package_has_its_folder_of_tests():
    missing = [name for name in code_packages() if not list((TESTS / name).glob("test_*.py"))]
    assert not missing, f"no tests/<package>/test_*.py for {missing}: put each package's tests in its folder"


def test_no_test_file_lies_flat_in_tests():
    flat = sorted(path.name for path in TESTS.glob("*.py") if path.name not in ("__init__.py", "conftest.py"))
    assert not flat, f"{flat} lie flat in tests/: move each into the folder of the package it tests"


def test_every_folder_is_a_package_named_after_code_or_a_spanning_theme():
    folders = sorted(path for path in TESTS.iterdir() if path.is_dir() and path.name != "__pycache__")
    unknown = [path.name for path in folders if path.name not in {*code_packages(), *SPANNING}]
    assert not unknown, f"tests/{unknown} names no package of the code and no folder of SPANNING in {__name__}"
    no_init = [path.name for path in folders if not (path / "__init__.py").is_file()]
    assert not no_init, f"tests/{no_init} lack __init__.py: test files of the same name would clash"


def test_helpers_live_apart_from_tests():
    modules = [path.relative_to(TESTS).as_posix() for path in TESTS.glob("*/*.py")]
    misplaced = [
        module
        for module in modules
        if not module.startswith("helpers/")
        and module not in DATA_MODULES
        and not Path(module).name.startswith("test_")
        and Path(module).name != "__init__.py"
    ]
    assert not misplaced, f"{misplaced} are no tests: move them to tests/helpers/"
    tests_in_helpers = [module for module in modules if module.startswith("helpers/test_")]
    assert not tests_in_helpers, f"{tests_in_helpers} are tests among the helpers"


def test_no_test_module_imports_another():
    """What two test files share is a helper: a test module imported by another is collected twice."""
    imports = re.compile(r"^\s*from (tests\.\w+\.test_\w+) import", re.MULTILINE)
    crossing = {
        path.relative_to(TESTS).as_posix(): name
        for path in TESTS.glob("*/*.py")
        for name in imports.findall(path.read_text())
        if name != ".".join(path.relative_to(ROOT).with_suffix("").parts)  # a child process importing its own file
    }
    assert not crossing, f"{crossing}: move what they share to tests/helpers/"


def test_a_package_test_file_is_named_after_a_module_of_its_package():
    misnamed = misnamed_test_files(TESTS)
    assert not misnamed, (
        f"{misnamed} name no module of their package: move each test into tests/<package>/test_<module>.py of the "
        f"module it calls and asserts on, into test_<package>.py where it spans modules, or add a topic to TOPICS"
    )
    gone = sorted(name for name in TOPICS if not (TESTS / name).is_file())
    assert not gone, f"TOPICS names {gone}, which no longer exist: remove them from TOPICS in {__name__}"


def test_the_naming_rule_refuses_a_file_named_after_no_module(tmp_path):
    for name in ("test_fastest.py", "test_runners.py", "test_run_errors.py", "test_fastest_paths.py"):
        (tmp_path / "runners").mkdir(exist_ok=True)
        (tmp_path / "runners" / name).write_text("")
    assert misnamed_test_files(tmp_path) == ["runners/test_fastest_paths.py"]
