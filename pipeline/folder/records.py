"""The records manifest.json holds, typed, each with the validator that reads it back (a damaged entry is a
DamagedManifest naming it; pipeline/folder/manifest.py makes that a PipelineError with the rebuild command).

The graphs of a folder are records too (GraphRecord): what each file is (its precision, the target it is shaped
for, how the gates evaluate it, the stage whose pass it needs) is read from its record, never from its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ..core.precision import Precision, TextEnum
from ..core.settings import POSTPROCESSES, Postprocess
from .graph_io import GraphTensor


class DamagedManifest(Exception):
    """An entry of manifest.json that is not what the stages write (read_manifest makes it a PipelineError)."""


class StageRecord(Protocol):
    """A stage's typed result: the line the stage prints, and the record manifest.json keeps of it."""

    @property
    def summary(self) -> str: ...

    def as_json(self) -> dict: ...


class Target(TextEnum):
    """What a graph is shaped for.  ENGINE: the graph TensorRT builds engine.plan from, which ONNX Runtime runs
    too (on a GPU, and on a CPU for which the folder has no graph of its own).  CPU_*: shaped for ONNX Runtime's
    int8 kernels on a kind of CPU (pipeline.core.cpu: U8S8 saturates without VNNI, calibration/qdq_cpu.py)."""

    ENGINE = "engine"
    CPU_VNNI = "onnxruntime-cpu-vnni"
    CPU_NO_VNNI = "onnxruntime-cpu-no-vnni"


class Evaluation(TextEnum):
    """How the gates evaluate a graph so that they compute what serves it (pipeline/evaluation)."""

    PLAIN = "plain"  # ONNX Runtime as it is: float32 computes as the engine does
    FAITHFUL_FP16 = "faithful-float16"  # every float16 tensor rounded as the engine stores it
    SIMULATED_QDQ = "qdq-simulated"  # Q/DQ run in float as TensorRT computes them, not fused into ORT's kernels
    ONNXRUNTIME_INT8 = "onnxruntime-int8"  # ONNX Runtime's own int8 kernels: what its CPU provider serves


@dataclass(frozen=True)
class GraphRecord:
    """One graph of a folder: its file, the precision it computes in, the target it is shaped for, how the gates
    evaluate it, its gate (the manifest stage whose recorded pass it needs before it may serve), and the
    post-processing its outputs end in (core/settings.py Postprocess: NONE, the model's own outputs; NMS, the
    detections).  A folder serves only the graphs of its own post-processing: with POSTPROCESS=nms, the graphs of
    the raw head stay for the precision gates and diagnose, and the NMS graphs serve."""

    file: str
    precision: Precision
    target: Target
    evaluation: Evaluation
    gate: str
    postprocess: Postprocess = Postprocess.NONE

    @classmethod
    def from_json(cls, raw: Any) -> GraphRecord:
        names = [entry.name for entry in dataclasses.fields(cls)]
        if not isinstance(raw, dict) or not all(isinstance(raw.get(name), str) for name in names):
            raise DamagedManifest(f"its graphs hold {raw!r}, not a record of {', '.join(names)}")
        if raw["postprocess"] not in POSTPROCESSES:
            raise DamagedManifest(f"its graphs hold {raw!r}: post-processing {raw['postprocess']!r} is unknown")
        try:
            return cls(
                raw["file"],
                Precision(raw["precision"]),
                Target(raw["target"]),
                Evaluation(raw["evaluation"]),
                raw["gate"],
                Postprocess(raw["postprocess"]),
            )
        except ValueError as error:
            raise DamagedManifest(f"its graphs hold {raw!r}: {error}") from None


@dataclass(frozen=True)
class PostprocessRecord:
    """What the served graphs end in (POSTPROCESS=nms): the kind, its settings (NmsConfig's fields), and the raw
    head's outputs, which the graphs of the raw head keep and reference.npz holds."""

    kind: Postprocess
    config: dict
    head_outputs: tuple[GraphTensor, ...]

    def as_json(self) -> dict:
        return {
            "kind": self.kind.value,
            "config": self.config,
            "head_outputs": [t.as_record() for t in self.head_outputs],
        }

    @classmethod
    def from_json(cls, raw: Any) -> PostprocessRecord:
        outputs = raw.get("head_outputs") if isinstance(raw, dict) else None
        if (
            not isinstance(raw, dict)
            or raw.get("kind") not in POSTPROCESSES
            or not isinstance(raw.get("config"), dict)
            or not isinstance(outputs, list)
            or not all(isinstance(o, dict) and {"name", "dtype", "shape"} <= set(o) for o in outputs)
        ):
            raise DamagedManifest(f"its postprocess is {raw!r}, not a kind, its settings and the head's outputs")
        return cls(Postprocess(raw["kind"]), raw["config"], tuple(GraphTensor.from_record(o) for o in outputs))


@dataclass(frozen=True)
class ModelRecord:
    name: str  # canonical (resnet50, toy_models-tiny_cnn)
    source: str  # as the user named it (MODEL=)
    fingerprint: str  # over code and weights: part of the reuse key
    notes: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, raw: Any) -> ModelRecord:
        if not isinstance(raw, dict) or not all(isinstance(raw.get(key), str) for key in ("name", "source")):
            raise DamagedManifest(f"its model is {raw!r}, not a record with a name and a source")
        return cls(raw["name"], raw["source"], str(raw.get("fingerprint", "")), tuple(raw.get("notes") or ()))


@dataclass(frozen=True)
class Artifact:
    """One file of the folder as the build recorded it."""

    sha256: str
    bytes: int

    @classmethod
    def from_json(cls, name: str, raw: Any) -> Artifact:
        if not isinstance(raw, dict) or not isinstance(raw.get("sha256"), str):
            raise DamagedManifest(f"its artifacts hold {raw!r} for {name!r}, not a sha256 and a size")
        return cls(raw["sha256"], int(raw.get("bytes", -1)))


@dataclass(frozen=True)
class Builder:
    module: str  # tensorrt or tensorrt_rtx
    version: str


@dataclass(frozen=True)
class BuildRecord:
    """The build stage's record: who built engine.plan for which GPUs, or why no engine was built."""

    skipped: str | None = None  # why no engine was built; None when one was
    builder: Builder | None = None
    target: dict = field(default_factory=dict)  # pipeline.core.trt_module.describe_target's record
    io: tuple[dict, ...] = ()  # the engine's tensors: {name, mode, dtype, shape (-1 for dynamic dims)}
    details: dict = field(default_factory=dict)  # the rest of the stage's record (profile, sizes, times)

    def as_json(self) -> dict:
        """The stage's record as build_engine wrote it ({"status": "skipped", "reason"} where none was built)."""
        return {
            **({"status": "skipped", "reason": self.skipped} if self.skipped is not None else {}),
            **({"builder": encode(self.builder)} if self.builder is not None else {}),
            **({"target": self.target} if self.target else {}),
            **({"io": list(self.io)} if self.io else {}),
            **self.details,
        }

    @classmethod
    def from_json(cls, raw: Any) -> BuildRecord:
        if not isinstance(raw, dict):
            raise DamagedManifest(f"its build is {raw!r}, not a record")
        builder = raw.get("builder")
        if builder is not None and not (isinstance(builder, dict) and {"module", "version"} <= set(builder)):
            raise DamagedManifest(f"its build's builder is {builder!r}, not a module and a version")
        return cls(
            skipped=str(raw.get("reason")) if raw.get("status") == "skipped" else None,
            builder=Builder(str(builder["module"]), str(builder["version"])) if builder else None,
            target=dict(raw.get("target") or {}),
            io=tuple(raw.get("io") or ()),
            details={k: v for k, v in raw.items() if k not in ("status", "reason", "builder", "target", "io")},
        )


@dataclass(frozen=True)
class ParityRecord:
    """A parity stage's result: the worst error against PyTorch over the reference cases."""

    max_abs: float
    max_rel: float  # of the output's scale
    rtol: float


@dataclass(frozen=True)
class CalibrationSplit:
    """Which calibration rows INT8's ranges were fit on and which its agreement gate judged (calibration/holdout.py):
    the rule in words, the row count, and the held-out rows (indices in the reader's order; the rest were fit on)."""

    rule: str
    rows: int
    held_out: tuple[int, ...] = ()

    def as_json(self) -> dict:
        counts = {"fit_rows": self.rows - len(self.held_out), "held_out_rows": len(self.held_out)}
        return {"rule": self.rule, "rows": self.rows, **counts, "held_out": list(self.held_out)}

    @classmethod
    def from_json(cls, raw: Any) -> CalibrationSplit:
        held_out = raw.get("held_out") if isinstance(raw, dict) else None
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("rule"), str)
            or not isinstance(raw.get("rows"), int)
            or not isinstance(held_out, list)
            or not all(isinstance(row, int) and 0 <= row < raw["rows"] for row in held_out)
        ):
            raise DamagedManifest(f"its calibration split {raw!r} is not a rule, a row count and held-out rows")
        return cls(raw["rule"], raw["rows"], tuple(held_out))


@dataclass(frozen=True)
class RowsAgreement:
    """One output of an INT8 graph against FP32 on a set of rows: each row's |int8 - fp32| / |fp32| and cosine."""

    rows: int
    error_mean: float
    error_max: float
    cosine_mean: float
    cosine_min: float

    @classmethod
    def from_json(cls, raw: Any) -> RowsAgreement:
        names = [entry.name for entry in dataclasses.fields(cls)]
        if not isinstance(raw, dict) or not all(isinstance(raw.get(name), (int, float)) for name in names):
            raise DamagedManifest(f"its INT8 agreement holds {raw!r}, not {', '.join(names)}")
        return cls(int(raw["rows"]), *(float(raw[name]) for name in names[1:]))


def worst_output(outputs: dict[str, RowsAgreement]) -> tuple[str, RowsAgreement]:
    """The output with the largest mean error, and its numbers: what INT8's gate decides on and its picks compare."""
    name = max(outputs, key=lambda output: outputs[output].error_mean)
    return name, outputs[name]


@dataclass(frozen=True)
class GraphAgreement:
    """One INT8 graph against FP32, by output: in-sample (the rows its ranges were fit on) and held out (rows they
    never saw; empty where none could be held out) side by side.  The gate judges the held-out rows."""

    in_sample: dict[str, RowsAgreement]
    held_out: dict[str, RowsAgreement] = field(default_factory=dict)
    left_out: str | None = None  # why an optional graph past the gate was left out of the folder

    @property
    def judged_on(self) -> str:
        return "held_out" if self.held_out else "in_sample"

    def worst(self) -> tuple[str, RowsAgreement]:
        """The output the gate decides on (the largest mean error on the judged rows) and its numbers there."""
        return worst_output(self.held_out or self.in_sample)

    def held_out_ratio(self) -> float | None:
        """The worst output's held-out error over its in-sample error; None where nothing is held out."""
        if not self.held_out:
            return None
        name, held_out = self.worst()
        return held_out.error_mean / max(self.in_sample[name].error_mean, 1e-12)

    def as_json(self) -> dict:
        if not self.in_sample:  # left out before it was measured: its reason stands alone
            return {"left_out": self.left_out}
        name, worst = self.worst()
        ratio = self.held_out_ratio()
        judged = {"rows": self.judged_on, "output": name, "error_mean": worst.error_mean}
        judged |= {"cosine_mean": worst.cosine_mean, "held_out_vs_in_sample": ratio}
        outputs = {output: {"in_sample": encode(rows)} for output, rows in self.in_sample.items()}
        for output, rows in self.held_out.items():
            outputs[output]["held_out"] = encode(rows)
        return {"judged": judged, "outputs": outputs, **({"left_out": self.left_out} if self.left_out else {})}

    @classmethod
    def from_json(cls, raw: Any) -> GraphAgreement:
        if isinstance(raw, dict) and set(raw) == {"left_out"} and isinstance(raw["left_out"], str):
            return cls({}, left_out=raw["left_out"])
        outputs = raw.get("outputs") if isinstance(raw, dict) else None
        if not isinstance(outputs, dict) or not outputs or not all(isinstance(o, dict) for o in outputs.values()):
            raise DamagedManifest(f"its INT8 agreement holds {raw!r}, not a record of each output")
        held_out = {name: o["held_out"] for name, o in outputs.items() if "held_out" in o}
        if held_out and len(held_out) != len(outputs):
            raise DamagedManifest(f"its INT8 agreement has held-out numbers for some outputs only: {sorted(held_out)}")
        return cls(
            in_sample={name: RowsAgreement.from_json(o.get("in_sample")) for name, o in outputs.items()},
            held_out={name: RowsAgreement.from_json(record) for name, record in held_out.items()},
            left_out=optional_field(raw, "left_out", str),
        )


@dataclass(frozen=True)
class Int8Agreement:
    """The INT8 agreement gate's record (stage agreement_int8, pipeline/stages/parity.py): the split of the calibration
    data, each graph's in-sample and held-out numbers, the gate and the ratio past which held-out error counts as
    much worse than in-sample, and the warning the build printed (the set cannot stand for served data)."""

    gate: float
    much_worse_ratio: float
    split: CalibrationSplit
    graphs: dict[str, GraphAgreement]
    warning: str | None = None
    details: dict = field(default_factory=dict)  # summary, evaluation, seconds

    @property
    def summary(self) -> str:
        return str(self.details.get("summary", ""))

    def as_json(self) -> dict:
        record = {"gate": self.gate, "much_worse_ratio": self.much_worse_ratio, "split": self.split.as_json()}
        record["graphs"] = {name: graph.as_json() for name, graph in self.graphs.items()}
        return {**self.details, **record, **({"warning": self.warning} if self.warning else {})}

    @classmethod
    def from_json(cls, raw: Any) -> Int8Agreement:
        graphs = raw.get("graphs") if isinstance(raw, dict) else None
        if not isinstance(graphs, dict) or not all(isinstance(raw.get(k), float) for k in ("gate", "much_worse_ratio")):
            raise DamagedManifest(f"its agreement_int8 is {raw!r}, not the INT8 gate's record")
        known = {"gate", "much_worse_ratio", "split", "graphs", "warning"}
        return cls(
            gate=raw["gate"],
            much_worse_ratio=raw["much_worse_ratio"],
            split=CalibrationSplit.from_json(raw.get("split")),
            graphs={name: GraphAgreement.from_json(graph) for name, graph in graphs.items()},
            warning=optional_field(raw, "warning", str),
            details={key: value for key, value in raw.items() if key not in known},
        )


def encode(value: Any) -> Any:
    """A record as manifest.json writes it (records with an as_json of their own keep their form)."""
    if isinstance(value, GraphTensor):
        return value.as_record()
    if hasattr(value, "as_json"):
        return value.as_json()
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {entry.name: encode(getattr(value, entry.name)) for entry in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    return value


def optional_field(raw: dict, key: str, kind: type) -> Any:
    """raw[key] where it is a `kind` or absent (None); anything else is damage."""
    value = raw.get(key)
    if value is not None and not isinstance(value, kind):
        raise DamagedManifest(f"its {key} is {value!r}, not a {kind.__name__}")
    return value
