"""`import trt_pipeline` and every module work with no GPU and no TensorRT, pycuda or CUDA bindings; serving an ONNX
graph imports nothing of the build."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from trt_pipeline.pipeline.core.settings import BatchProfile, Settings
from trt_pipeline.pipeline.stages.sequence import make_engine

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter where the GPU-only packages cannot be imported at all.
BARE_IMPORT = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    BLOCKED = ("tensorrt", "tensorrt_rtx", "pycuda", "cuda", "cupy")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: this test proves it is not needed at import time")

    sys.meta_path.insert(0, Blocker())
    import trt_pipeline
    from trt_pipeline import pipeline
    assert "torch" not in sys.modules, "import trt_pipeline must stay light (torch loads on first use)"
    imported = []
    for package_name in ("trt_pipeline.pipeline", "trt_pipeline.models", "trt_pipeline.calibration"):
        package = importlib.import_module(package_name)
        for module in pkgutil.walk_packages(package.__path__, package_name + "."):
            if module.name.endswith("__main__"):
                continue  # running it would start the command line
            importlib.import_module(module.name)
            imported.append(module.name)
    print(len(imported), "modules")
    """
)


def test_every_module_imports_without_gpu_packages():
    result = subprocess.run([sys.executable, "-c", BARE_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) >= 10


# Runs in a fresh interpreter: load the ONNX Runtime runner, run one inference, list what the build would import.
RUNTIME = textwrap.dedent(
    """
    import sys
    import numpy as np
    from trt_pipeline.pipeline.runners import load_runner

    with load_runner(sys.argv[1], backend="onnxruntime") as runner:
        logits = runner.infer({"input": np.zeros((2, 3, 16, 16), np.float32)})["logits"]
    assert logits.shape == (2, 10)
    BUILD_PACKAGES = ("torch", "onnx", "onnxsim")
    BUILD_SUBPACKAGES = ("trt_pipeline.models", "trt_pipeline.calibration")
    BUILD_SUBPACKAGES = (*BUILD_SUBPACKAGES, "trt_pipeline.pipeline.stages")  # every build stage lives there
    loaded = [m for m in sys.modules if m.split(".")[0] in BUILD_PACKAGES or m.startswith(BUILD_SUBPACKAGES)]
    print(" ".join(sorted(loaded)))
    """
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engines")
    settings = Settings(
        model="tests.helpers.toy_models:tiny_cnn", precision="fp32", batch=BatchProfile(1, 2, 4), out_root=out
    )
    return make_engine(settings)


def test_the_onnxruntime_runner_imports_no_build_stage(tiny_folder):
    result = subprocess.run(
        [sys.executable, "-c", RUNTIME, str(tiny_folder)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"the runtime imported: {result.stdout}"


# The code's folders; trt_pipeline/ joins them into one package with links (setuptools follows them into the
# wheel), and its own __init__.py and __main__.py are the only files whose imports cross those links.
CODE_FOLDERS = ("pipeline", "models", "calibration")
# Copied as it is into a Triton model repository, where it imports the installed package by its full name.
RUNS_OUTSIDE_THE_PACKAGE = {"pipeline/triton/python_model.py"}


def _code_files() -> list[Path]:
    files = [p for folder in CODE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in files if p.relative_to(ROOT).as_posix() not in RUNS_OUTSIDE_THE_PACKAGE]


def _target(path: Path, node: ast.ImportFrom) -> tuple[Path, list[str]]:
    """Where a relative import points, from the importing file's own folder: the folder and the dotted rest."""
    base = path.parent
    for _ in range(node.level - 1):
        base = base.parent
    return base, (node.module or "").split(".") if node.module else []


def _file_of(base: Path, parts: list[str]) -> Path | None:
    """The file a module path names from `base`, or None.  The checkout's root stands for the package's root, whose
    own names live in trt_pipeline/__init__.py."""
    where = base.joinpath(*parts)
    candidates = [where.with_suffix(".py"), where / "__init__.py"] if parts else [where / "__init__.py"]
    if not parts and base == ROOT:
        candidates.append(ROOT / "trt_pipeline" / "__init__.py")
    return next((c for c in candidates if c.is_file()), None)


def _unresolved(path: Path) -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            problems += [f"import {a.name}" for a in node.names if a.name.startswith("trt_pipeline.")]
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if (node.module or "").split(".")[0] == "trt_pipeline":
                problems.append(f"from {node.module} import ...: absolute; name the file from where it stands")
            continue
        base, parts = _target(path, node)
        module = _file_of(base, parts)
        # `from . import name` may name a module beside it rather than a name in the package's __init__.py.
        names = [] if module and parts else [a.name for a in node.names if not _file_of(base, [*parts, a.name])]
        if module is None and (parts or names):
            problems.append(f"from {'.' * node.level}{node.module or ''} import ...: no file {base.joinpath(*parts)}")
        elif module is not None and any(
            p.is_symlink() for p in [module, *(ROOT / p for p in module.relative_to(ROOT).parents)]
        ):
            problems.append(f"from {'.' * node.level}{node.module or ''}: reached through a link")
    return [f"{path.relative_to(ROOT)}:{problem}" for problem in problems]


def test_every_internal_import_names_a_file_of_the_checkout_by_path_alone():
    """An import inside the code leads a reader (or a tool that does not follow links) to its file: relative, from
    the importing file's own folder."""
    files = _code_files()
    assert len(files) > 50
    assert [problem for path in files for problem in _unresolved(path)] == []


# --------------------------------------------------------------------------- the package's import graph


@dataclass(frozen=True)
class Import:
    """One import statement of a module: where, whether it runs inside a function, the package's modules it loads
    (dotted, from the checkout's root: pipeline.stages.parity) and the other modules it names (numpy, onnx.helper)."""

    where: str
    in_function: bool
    internal: tuple[str, ...]
    external: tuple[str, ...]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _internal_targets(path: Path, node: ast.ImportFrom) -> list[str]:
    """The package's modules a relative import loads: `from .x import y` names x, or x.y where y is a module.  A name
    of the distribution's own __init__ (trt_pipeline/__init__.py: `from .. import __version__`) is outside the code
    folders, and left out."""
    base, parts = _target(path, node)
    targets = []
    for alias in node.names:
        module = _file_of(base, [*parts, alias.name]) or (_file_of(base, parts) if base != ROOT or parts else None)
        if module is not None:
            targets.append(_module_name(module))
    return sorted(set(targets))


class _Imports(ast.NodeVisitor):
    """Every import statement of a module that runs (those under `if TYPE_CHECKING:` never do)."""

    def __init__(self, path: Path) -> None:
        self.path, self.depth, self.found = path, 0, []

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        checking = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for child in node.orelse if checking else [node.test, *node.body, *node.orelse]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self._add(node, [], [alias.name for alias in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self._add(node, _internal_targets(self.path, node), [])
        else:
            self._add(node, [], [node.module or ""])

    def _add(self, node: ast.stmt, internal: list[str], external: list[str]) -> None:
        where = f"{self.path.relative_to(ROOT)}:{node.lineno}"
        self.found.append(Import(where, self.depth > 0, tuple(internal), tuple(external)))


def _package_imports() -> dict[str, list[Import]]:
    files = _code_files()
    imports = {}
    for path in files:
        visitor = _Imports(path)
        visitor.visit(ast.parse(path.read_text()))
        imports[_module_name(path)] = visitor.found
    return imports


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected group of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)


def _arrows() -> dict[str, dict[str, str]]:
    """The package's import graph: module -> {module it imports: where}, each relative import counted wherever it
    stands, inside a function or under `if TYPE_CHECKING:` (mypy reads those: modules whose types name each other
    still need each other)."""
    arrows: dict[str, dict[str, str]] = {}
    for path in _code_files():
        found = arrows.setdefault(_module_name(path), {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                for target in _internal_targets(path, node):
                    found.setdefault(target, f"{path.relative_to(ROOT)}:{node.lineno}")
        found.pop(_module_name(path), None)
    return arrows


def test_the_package_imports_no_module_that_imports_it_back():
    """No import cycle among the package's modules, counting the imports inside functions and the type-only ones too
    (a cycle a deferred or a type-only import hides is still a cycle: two modules that each need the other are one
    module, or a third owns what they share)."""
    arrows = _arrows()
    assert len(arrows) > 50 and _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({module: set(targets) for module, targets in arrows.items()}) == []


def _floor(module: str) -> str:
    """The folder a module stands in: models, calibration, pipeline.core, pipeline.stages, ... (pipeline/cli.py and
    pipeline/__init__.py stand alone)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pipeline" else parts[0]


def test_no_two_folders_import_each_other():
    """Each piece two folders share lives on a floor below both (core <-> postprocess was the NMS settings' type,
    calibration <-> models the image preprocessing): the folders' import graph has no cycle either."""
    between: dict[str, set[str]] = {}
    for module, targets in _arrows().items():
        between.setdefault(_floor(module), set()).update(_floor(t) for t in targets if _floor(t) != _floor(module))
    assert {"models", "calibration", "pipeline.core", "pipeline.stages", "pipeline.cli"} <= set(between)
    assert _cycles(between) == []


def test_the_ground_floor_imports_nothing_above_it():
    """core/ is what every other folder stands on, so it imports only itself."""
    upward = [
        f"{where}: {module} -> {target}"
        for module, targets in _arrows().items()
        if _floor(module) == "pipeline.core"
        for target, where in targets.items()
        if _floor(target) != "pipeline.core"
    ]
    assert upward == []


# The runtime: what a service installs and runs.  A build stage (pipeline/stages) loads torch, onnx and the builders;
# what the runtime shares with the build lives below both (core/, models/).
RUNTIME_FOLDERS = ("pipeline.runners", "pipeline.serve", "pipeline.bench")


def test_the_runtime_reaches_no_build_stage():
    """No module of runners/, serve/ or bench/ imports a build stage, directly or through the modules it imports
    (deferred and type-only imports counted)."""
    arrows = _arrows()
    reached = []
    for start in (module for module in arrows if _floor(module) in RUNTIME_FOLDERS):
        came_from: dict[str, str] = {start: ""}
        pending = [start]
        while pending:
            module = pending.pop()
            for target in arrows[module]:
                if target not in came_from:
                    came_from[target], pending = module, [*pending, target]
        for stage in sorted(m for m in came_from if _floor(m) == "pipeline.stages"):
            chain = [stage]
            while came_from[chain[-1]]:
                chain.append(came_from[chain[-1]])
            reached.append(" <- ".join(chain))
    assert sum(_floor(module) in RUNTIME_FOLDERS for module in arrows) > 20
    assert reached == []


# The base dependency (pyproject.toml's [project] dependencies); every other installed package comes with an extra.
BASE_DEPENDENCIES = ("numpy",)
# The build side: the modules `load_runner` and `import trt_pipeline` must never load (test_the_onnxruntime_runner_...).
BUILD_SIDE = ("pipeline.stages", "calibration", "models")


def _loads(modules: set[str], imports: dict[str, list[Import]]) -> set[str]:
    """What importing `modules` loads that is heavy: each third-party module (dotted, and the packages above it) other
    than the base dependency's, and "the build side" where it loads one of its modules."""
    seen, pending = set(), list(modules)
    while pending:
        module = pending.pop()
        if module not in seen:
            seen.add(module)
            pending += [target for i in imports[module] if not i.in_function for target in i.internal]
    named = {name for module in seen for i in imports[module] if not i.in_function for name in i.external}
    heavy = {prefix for name in named for prefix in _prefixes(name) if _heavy(prefix)}
    return heavy | ({"the build side"} if any(module.startswith(BUILD_SIDE) for module in seen) else set())


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: end + 1]) for end in range(len(parts))]


def _heavy(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in BASE_DEPENDENCIES


def test_an_import_inside_a_function_is_there_only_to_keep_a_heavy_module_out():
    """The rule: an import inside a function must keep something heavy out of what importing its module loads.
    Moved to the top of its module, it would make that module load (through the module-level imports of the
    package's modules it reaches) a heavy module the module does not load now: a third-party module other than the
    base dependency's (numpy), torch, onnx, onnxsim, onnxruntime, tensorrt, transformers, matplotlib, ... each
    coming with an extra, and a submodule counting for itself (torch._inductor where torch is loaded already); or,
    for a module that loads none of it yet, the build side (pipeline/stages, calibration, models).  Any other
    import belongs at the top of its module: a standard-library module, a light module of the package, or a heavy
    one the module loads anyway.  (Imports under `if TYPE_CHECKING:` never run and are not counted; nor are names of
    the distribution's own __init__, trt_pipeline/__init__.py, which is outside the code folders.)"""
    imports = _package_imports()
    needless = []
    for module, found in imports.items():
        now = _loads({module}, imports)
        for deferred in (i for i in found if i.in_function and (i.internal or i.external)):
            moved = _loads({module, *deferred.internal}, imports)
            moved |= {prefix for name in deferred.external for prefix in _prefixes(name) if _heavy(prefix)}
            if not moved - now:
                needless.append(f"{deferred.where} {', '.join(deferred.internal + deferred.external)}")
    assert sum(i.in_function for found in imports.values() for i in found) > 20
    assert needless == []
