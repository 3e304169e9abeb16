"""Calibration data: a folder of images, a .npy/.npz file, or a Python callable yielding batches.

Every reader ends in the same place: whole model inputs checked against the FP32 graph's inputs
(names, dims, dtype), cut to `samples` and split into batches of `batch`, with a sha256 over
exactly the arrays that calibration will see (the calibration cache is keyed by it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..models.preprocess import IMAGE_SUFFIXES, image_shape, load_image
from ..models.spec import ImagePreprocess
from ..pipeline.core.errors import PipelineError
from ..pipeline.core.mentions import command
from ..pipeline.core.settings import mention, mention_name
from ..pipeline.folder.graph_files import graph_without_weights
from ..pipeline.folder.graph_io import graph_io

if TYPE_CHECKING:
    import onnx

Feed = dict[str, np.ndarray]
# A callable returns an iterable of batches: {input name: array} or, for a one-input model, an array.
BatchSource = Callable[[], Iterable[Mapping[str, np.ndarray] | np.ndarray]]
CalibrationSource = Path | str | BatchSource


@dataclass(frozen=True)
class GraphInput:
    """One input of the FP32 graph: dims are ints or symbolic names (None where unnamed); for integer ids that index a
    table (token ids into an embedding), the Gather that looks them up and the table's rows."""

    name: str
    dims: tuple[int | str | None, ...]
    dtype: np.dtype
    lookup: tuple[str, int] | None = None

    def describe(self) -> str:
        dims = ", ".join(str(d) if isinstance(d, int) else "?" for d in self.dims)
        return f"{self.name!r} {self.dtype.name}[{dims}]"


@dataclass(frozen=True)
class CalibrationData:
    """Model-ready batches and what identifies them."""

    batches: list[Feed]
    samples: int
    digest: str
    description: str


def graph_inputs(onnx_path: Path) -> list[GraphInput]:
    """The graph's inputs as the ONNX file declares them (no weight is read)."""
    model = graph_without_weights(onnx_path)  # a graph of one file too: its weights are not read
    inputs = graph_io(model).inputs
    integer = {t.name for t in inputs if np.issubdtype(t.numpy_dtype, np.integer)}
    lookups = _lookup_tables(model.graph, integer) if integer else {}
    return [GraphInput(t.name, t.shape, t.numpy_dtype, lookups.get(t.name)) for t in inputs]


def _lookup_tables(graph: onnx.GraphProto, names: set[str]) -> dict[str, tuple[str, int]]:
    """{input: (Gather node, rows)} for the inputs in `names` that a Gather uses as indices into a weight table (the
    smallest table where several read one input).  An id outside it is no model input: ONNX Runtime stops the
    calibration run on it with "indices element out of data bounds"."""
    tables = {init.name: init.dims for init in graph.initializer}
    found: dict[str, tuple[str, int]] = {}
    for node in graph.node:
        if node.op_type != "Gather" or node.input[1] not in names or node.input[0] not in tables:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        dims = tables[node.input[0]]
        rows = int(dims[axis])
        if node.input[1] not in found or rows < found[node.input[1]][1]:
            found[node.input[1]] = (node.name, rows)
    return found


def is_image_folder(source: CalibrationSource) -> bool:
    """Whether `source` is a folder of images: the one kind of calibration data that needs the model's declared
    preprocessing (the others are model-ready)."""
    return not callable(source) and Path(source).is_dir()


def read_calibration_data(
    source: CalibrationSource,
    inputs: list[GraphInput],
    preprocess: ImagePreprocess | None,
    *,
    samples: int,
    batch: int,
) -> CalibrationData:
    """Read, check and batch calibration data from any supported source."""
    if callable(source):
        arrays = _arrays_from_callable(source, inputs, samples)
        description = f"callable {getattr(source, '__qualname__', repr(source))}"
    else:
        path = Path(source)
        if is_image_folder(path):
            arrays = _arrays_from_image_folder(path, inputs, preprocess, samples)
            description = f"image folder {path}"
        elif path.is_file() and path.suffix.lower() in (".npy", ".npz"):
            arrays = _arrays_from_numpy_file(path, inputs)
            description = f"{path.suffix.lower()[1:]} file {path}"
        else:
            raise PipelineError(
                f"calibration data {path} is neither a folder nor a .npy/.npz file"
                + ("" if path.exists() else " (it does not exist)"),
                f"give {mention(calib='<folder of .jpg/.png images>')} or {mention(calib='<file.npy|file.npz>')} "
                "of model-ready inputs",
            )
    _check_arrays(arrays, inputs, description)
    return _batched(arrays, samples, batch, description)


# --------------------------------------------------------------------------- the three sources


def _arrays_from_image_folder(
    folder: Path, inputs: list[GraphInput], preprocess: ImagePreprocess | None, samples: int
) -> dict[str, np.ndarray]:
    if preprocess is None:
        raise PipelineError(
            f"{mention(calib=folder)} is a folder of images, but this model declares no image preprocessing",
            f"give model-ready inputs as {mention(calib='<file.npy|file.npz>')} instead (or set ModelSpec.preprocess "
            "in the model's factory)",
        )
    if len(inputs) != 1:
        raise PipelineError(
            f"an image folder feeds one input, but the model has {len(inputs)}: "
            + ", ".join(i.describe() for i in inputs),
            "give a .npz file with one array per input name",
        )
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise PipelineError(
            f"calibration folder {folder} contains no .jpg/.jpeg/.png images (searched recursively)",
            f"put representative images there, e.g. `{command('calibration-images')}` exports photographs to "
            "calibration/samples",
        )
    images = [load_image(p, preprocess) for p in _progress(paths[:samples], "reading images")]
    expected = image_shape(preprocess)
    (graph_input,) = inputs
    if not _dims_match(graph_input.dims[1:], expected):
        raise PipelineError(
            f"images preprocess to {list(expected)} but the model input is {graph_input.describe()}",
            "fix the model's ImagePreprocess (crop size, grayscale) to match its input",
        )
    return {graph_input.name: np.stack(images)}


def _arrays_from_numpy_file(path: Path, inputs: list[GraphInput]) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)  # no pickles: a data file must not run code
    except (OSError, ValueError, EOFError) as error:
        raise PipelineError(
            f"calibration file {path} cannot be read ({error})", "write it with numpy.save / numpy.savez"
        ) from None
    if isinstance(loaded, np.ndarray):
        return {_only_input(inputs, path).name: loaded}
    with loaded:
        stored = {name: loaded[name] for name in loaded.files}
    names = [i.name for i in inputs]
    if len(stored) == 1 and len(inputs) == 1:
        return {names[0]: next(iter(stored.values()))}
    missing = [n for n in names if n not in stored]
    if missing:
        raise PipelineError(
            f"{path} has arrays {sorted(stored)} but the model's inputs are {names} (missing {missing})",
            "save one array per model input, named after it: numpy.savez(path, **{name: array})",
        )
    return {n: stored[n] for n in names}


def _arrays_from_callable(source: BatchSource, inputs: list[GraphInput], samples: int) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {i.name: [] for i in inputs}
    count = 0
    for index, item in enumerate(source()):
        if isinstance(item, np.ndarray):
            feed = {_only_input(inputs, "the callable's batches").name: item}
        elif isinstance(item, Mapping):
            feed = dict(item)
        else:
            raise PipelineError(
                f"calibration callable yielded a {type(item).__name__} as batch {index}",
                "yield numpy arrays (one-input models) or dicts {input name: array}",
            )
        if set(feed) != set(parts):
            raise PipelineError(
                f"calibration batch {index} has inputs {sorted(feed)}, the model has {sorted(parts)}",
                "yield one array per model input, keyed by its name",
            )
        for name, array in feed.items():
            parts[name].append(np.asarray(array))
        count += len(next(iter(feed.values())))
        if count >= samples:
            break
    if count == 0:
        raise PipelineError("the calibration callable yielded no data", "yield at least one batch of inputs")
    _check_arrays({n: p[0] for n, p in parts.items()}, inputs, "the calibration callable")
    return {name: np.concatenate(p) for name, p in parts.items()}


# --------------------------------------------------------------------------- checks and batching


def _check_arrays(arrays: dict[str, np.ndarray], inputs: list[GraphInput], description: str) -> None:
    lengths = set()
    for graph_input in inputs:
        array = arrays[graph_input.name]
        if array.dtype != graph_input.dtype:
            raise PipelineError(
                f"{description}: input {graph_input.name!r} is {array.dtype.name}, the model wants "
                f"{graph_input.dtype.name}",
                f"convert it first, e.g. array.astype(numpy.{graph_input.dtype.name})",
            )
        if array.ndim != len(graph_input.dims) or not _dims_match(graph_input.dims[1:], array.shape[1:]):
            raise PipelineError(
                f"{description}: input {graph_input.name!r} has shape {list(array.shape)}, the model wants "
                f"{graph_input.describe()} (batch first)",
                "give model-ready inputs: the same layout, dims and preprocessing as inference",
            )
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise PipelineError(f"{description}: input {graph_input.name!r} contains NaN or inf", "clean the data")
        _check_ids(array, graph_input, description)
        lengths.add(len(array))
    if len(lengths) > 1:
        raise PipelineError(
            f"{description}: inputs have different numbers of samples {sorted(lengths)}",
            "give every input the same number of samples",
        )


def _check_ids(array: np.ndarray, graph_input: GraphInput, description: str) -> None:
    """Ids must index the table they look up (ONNX's Gather takes -rows..rows-1)."""
    if graph_input.lookup is None or array.size == 0:
        return
    node, rows = graph_input.lookup
    low, high = int(array.min()), int(array.max())
    if low < -rows or high >= rows:
        raise PipelineError(
            f"{description}: input {graph_input.name!r} holds ids from {low} to {high}, but the graph looks them up "
            f"in a table of {rows} rows ({node})",
            f"give ids from 0 to {rows - 1}: the ids the model's own tokenizer (vocabulary) produces",
        )


def _batched(arrays: dict[str, np.ndarray], samples: int, batch: int, description: str) -> CalibrationData:
    available = len(next(iter(arrays.values())))
    count = min(available, samples)
    if count < batch:
        raise PipelineError(
            f"{description} gives {count} calibration sample(s), fewer than one batch of {batch}",
            "add more data (a few hundred representative samples is typical), or lower the calibration batch "
            f"({mention_name('calib_batch')}) and samples ({mention_name('calib_samples')}) so a batch fits",
        )
    return _identified({name: array[:count] for name, array in arrays.items()}, batch, description)


def rows_of(data: CalibrationData, rows: np.ndarray, batch: int, part: str) -> CalibrationData:
    """The rows `rows` (indices, in the reader's order) of `data`, in batches of up to `batch`, with the sha256 of
    exactly those rows (calibration/holdout.py: the rows ranges are fit on key the calibration cache)."""
    arrays = {name: np.concatenate([feed[name] for feed in data.batches])[rows] for name in data.batches[0]}
    return _identified(arrays, batch, f"{data.description}, {part}")


def _identified(arrays: dict[str, np.ndarray], batch: int, description: str) -> CalibrationData:
    """The arrays cut into batches, with a sha256 over exactly their bytes, names, dtypes and shapes."""
    used = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    count = len(next(iter(used.values())))
    digest = hashlib.sha256()
    for name in sorted(used):
        digest.update(f"{name}:{used[name].dtype.str}:{used[name].shape}:".encode())
        digest.update(used[name].tobytes())
    batches = [{name: array[start : start + batch] for name, array in used.items()} for start in range(0, count, batch)]
    return CalibrationData(batches, count, digest.hexdigest(), description)


def _dims_match(declared: Iterable[int | str | None], actual: Iterable[int]) -> bool:
    """Fixed dims must be equal; symbolic (dynamic) dims accept any size."""
    declared, actual = list(declared), list(actual)
    if len(declared) != len(actual):
        return False
    return all(not isinstance(d, int) or d == a for d, a in zip(declared, actual, strict=True))


def _only_input(inputs: list[GraphInput], where: object) -> GraphInput:
    if len(inputs) != 1:
        raise PipelineError(
            f"{where} gives one unnamed array, but the model has {len(inputs)} inputs",
            "use a .npz file (or dicts) with one array per input name: " + ", ".join(i.name for i in inputs),
        )
    return inputs[0]


def _progress(items: list, label: str) -> Iterator:
    from tqdm import tqdm

    # delay: a bar only for runs longer than a couple of seconds; small reads stay quiet.
    yield from tqdm(items, desc=label, unit="img", delay=2.0, leave=False)
