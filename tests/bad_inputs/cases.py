# ruff: noqa: E501  (a table: the case scripts are data, kept whole on their line)
"""The catalogue's cases: bad input and faults for the command line, `make`, the runner, the Triton writer and
the service (see tools/catalogue.py for how each is run and classified).

Placeholders in arguments and scripts: {work} (the case's own scratch folder), {marker} (the file an injection
would create), {files} (tools/catalogue_fixtures.py's bad files), {image} and {text} (finished folders),
{full} (a full file system), {readonly} (a read-only one).
"""

from __future__ import annotations

import gzip
import http.client
import json
import select
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLI_LIMIT_S = 180
PY_LIMIT_S = 90
HTTP_LIMIT_S = 20
SLOW_CLIENT_LIMIT_S = 15
VENV = Path(sys.prefix)


@dataclass
class Outcome:
    rc: int | None = None
    out: str = ""
    err: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    status: int | None = None
    body: str = ""
    transport_error: str = ""
    server_died: bool = False
    wrong: str = ""


@dataclass
class Case:
    id: str
    area: str
    what: str
    run_with: Callable[[Any, Case], Outcome]
    expect: str = "error"  # error | success | either
    names: tuple[str, ...] = ()  # words the error must contain: the problem named
    needs: tuple[str, str] | None = None  # (file, text) the checkout must hold for the case to apply
    server: str | None = None  # "image" or "text": a service case
    statuses: tuple[int, ...] = ()  # the statuses that are right for a service case (any 4xx when empty)
    plain_ok: bool = False  # a protocol-level 4xx from the HTTP server may be plain text
    mount: str | None = None  # "full" or "readonly": needs that tmpfs fixture
    forbidden: tuple[str, ...] = ()  # words a clear error must not hold: a second finding contradicting the first
    servers: dict = field(default_factory=dict, repr=False)

    def run(self, context: Any) -> Outcome:
        return self.run_with(context, self)

    def not_applicable(self, code: Path, fixtures: Any) -> str:
        if self.needs is not None:
            path, text = self.needs
            if not (code / path).is_file() or text not in (code / path).read_text():
                return f"this checkout has no {text!r} in {path}"
        if self.mount and getattr(fixtures, self.mount) is None:
            return f"no {self.mount} tmpfs could be mounted here"
        return ""


# ---------------------------------------------------------------- how cases run


def _cli(argv: list[str], limit: float = CLI_LIMIT_S, fsize: int | None = None) -> Callable[[Any, Case], Outcome]:
    def run(context: Any, case: Case) -> Outcome:
        filled = [context.fill(arg) for arg in argv]
        return context.run([sys.executable, "-m", "trt_pipeline", *filled], limit, fsize)

    return run


def _make(target: str, assignments: list[str], limit: float = CLI_LIMIT_S) -> Callable[[Any, Case], Outcome]:
    def run(context: Any, case: Case) -> Outcome:
        stamp = VENV / ".installed"
        argv = ["make", "-s", "-o", str(stamp), f"VENV={VENV}", target, f"OUT={context.work}/engines"]
        return context.run([*argv, *(context.fill(a) for a in assignments)], limit)

    return run


def _python(body: str, limit: float = PY_LIMIT_S) -> Callable[[Any, Case], Outcome]:
    def run(context: Any, case: Case) -> Outcome:
        return context.python(body, limit)

    return run


def cli(id: str, what: str, argv: list[str], expect: str = "error", names: tuple[str, ...] = (), **kw: Any) -> Case:
    limits = {key: kw.pop(key) for key in ("limit", "fsize") if key in kw}
    area = id.split("-")[0] if id.startswith(("triton", "serve", "bench")) else "cli"
    return Case(id, area, what, _cli(argv, **limits), expect, names, **kw)


def build_argv(options: list[str], out: str) -> list[str]:
    """The command line's `all` with options, into `out`: tiny_cnn in FP32 unless the options name another (an
    option given twice is refused, so each default stands only where the options leave it out)."""
    given = {word.partition("=")[0] for word in options if word.startswith("--")}
    defaults = {"--out": out, "--model": "tests.helpers.toy_models:tiny_cnn", "--precision": "fp32"}
    return [
        "all",
        *[word for option, value in defaults.items() if option not in given for word in (option, value)],
        *options,
    ]


def build(id: str, what: str, options: list[str], expect: str = "error", names: tuple[str, ...] = (), **kw) -> Case:
    """`python -m trt_pipeline all` with options, into the case's own folder."""
    return cli(id, what, build_argv(options, "{work}/engines"), expect, names, **kw)


def make(id: str, what: str, assignments: list[str], expect: str = "error", names=(), target="engine", **kw) -> Case:
    return Case(id, "make", what, _make(target, assignments), expect, names, **kw)


def py(id: str, area: str, what: str, body: str, expect: str = "error", names=(), **kw) -> Case:
    return Case(id, area, what, _python(body), expect, names, **kw)


# ---------------------------------------------------------------- service requests


def _request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, length: bool = True
) -> bytes:
    given = {key.lower() for key in (headers or {})}
    lines = [f"{method} {path} HTTP/1.1"] + ([] if "host" in given else ["Host: 127.0.0.1"])
    if length and "content-length" not in given and "transfer-encoding" not in given:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{key}: {value}" for key, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _exchange(server: Any, data: bytes, timeout: float = HTTP_LIMIT_S) -> Outcome:
    """Send `data` as a careful client does: in pieces, stopping to read as soon as the server answers (a 413
    can come before the whole body is sent), then read the answer."""
    started = time.monotonic()
    outcome = Outcome()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as connection:
            _send_until_answered(connection, data)
            response = http.client.HTTPResponse(connection)
            response.begin()
            outcome.status = response.status
            outcome.body = response.read().decode("utf-8", "replace")
    except TimeoutError:
        outcome.timed_out = True
    except (OSError, http.client.HTTPException) as error:
        outcome.transport_error = f"{type(error).__name__}: {error}"
    outcome.seconds = time.monotonic() - started
    outcome.server_died = not server.alive
    return outcome


def _send_until_answered(connection: socket.socket, data: bytes, piece: int = 1 << 16) -> None:
    for start in range(0, len(data), piece):
        if select.select([connection], [], [], 0)[0]:
            return  # the server has answered (or closed): read that
        try:
            connection.sendall(data[start : start + piece])
        except (BrokenPipeError, ConnectionResetError):
            return


def _infer_path(server: Any) -> str:
    return f"/v2/models/{server.model}/infer"


def _json_body(inputs: Any, **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}, allow_nan=True).encode()


def image_input(rows: int = 1, data: Any = None, **changes: Any) -> dict:
    tensor = {"name": "input", "datatype": "FP32", "shape": [rows, 3, 16, 16], "data": data or [0.5] * (rows * 768)}
    tensor.update(changes)
    return tensor


def text_inputs(ids: list[int], datatype: str = "INT64") -> list[dict]:
    return [
        {"name": "input_ids", "datatype": datatype, "shape": [1, len(ids)], "data": ids},
        {"name": "attention_mask", "datatype": "FP32", "shape": [1, len(ids)], "data": [1.0] * len(ids)},
    ]


def _http(server_name: str, build_request: Callable[[Any], bytes], check: Callable[[str], str] | None = None):
    def run(context: Any, case: Case) -> Outcome:
        server = case.servers[server_name]
        outcome = _exchange(server, build_request(server))
        if check is not None and outcome.status == 200:
            outcome.wrong = check(outcome.body)
        return outcome

    return run


def served(id: str, what: str, build_request: Callable[[Any], bytes], expect="error", names=(), **kw: Any) -> Case:
    server = kw.pop("server", "image")
    check = kw.pop("check", None)
    return Case(id, "service", what, _http(server, build_request, check), expect, names, server=server, **kw)


def infer(body: bytes, headers: dict[str, str] | None = None) -> Callable[[Any], bytes]:
    return lambda server: _request(
        "POST", _infer_path(server), body, {"Content-Type": "application/json", **(headers or {})}
    )


def image_header(shape: list[int], binary_data_size: int) -> dict:
    """The binary-data header of one FP32 "input" of `shape` whose bytes are said to be `binary_data_size` long."""
    parameters = {"binary_data_size": binary_data_size}
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": shape, "parameters": parameters}]}


def binary_infer(header: dict, binary: bytes, header_length: str | None = None) -> Callable[[Any], bytes]:
    text = json.dumps(header).encode()
    length = header_length if header_length is not None else str(len(text))
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": length}
    return lambda server: _request("POST", _infer_path(server), text + binary, headers)


def _has_outputs(body: str) -> str:
    try:
        outputs = json.loads(body).get("outputs")
    except ValueError:
        return "the answer is not JSON"
    return "" if outputs else "no outputs in the answer"


def _custom(server_name: str, flow: Callable[[Any], Outcome]):
    def run(context: Any, case: Case) -> Outcome:
        server = case.servers[server_name]
        started = time.monotonic()
        outcome = flow(server)
        outcome.seconds = time.monotonic() - started
        outcome.server_died = not server.alive
        return outcome

    return run


def _metric_lines(server: Any) -> list[str]:
    outcome = _exchange(server, _request("GET", "/metrics"))
    return [line for line in outcome.body.splitlines() if "status=" in line and not line.startswith("#")]


def _disconnect_mid_body(server: Any) -> Outcome:
    before = _metric_lines(server)
    body = _json_body([image_input()])
    data = _request("POST", _infer_path(server), body, {"Content-Type": "application/json"})
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_LIMIT_S) as connection:
        connection.sendall(data[: len(data) - len(body) // 2])
    time.sleep(1.0)
    after = [line for line in _metric_lines(server) if line not in before]
    counted = " ".join(after)
    status = 500 if 'status="500"' in counted else 499 if 'status="499"' in counted else 200
    what = f"/metrics counted: {counted or 'nothing'}"
    return Outcome(status=status, body=json.dumps({"error": what}))


def _slow_client(server: Any) -> Outcome:
    """A client sending its request head a byte a second: is it cut off before SLOW_CLIENT_LIMIT_S?"""
    data = _request("GET", "/v2/health/live")
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_LIMIT_S) as connection:
        for byte in data[:-4]:
            if time.monotonic() - started > SLOW_CLIENT_LIMIT_S:
                return Outcome(timed_out=True)
            try:
                connection.sendall(bytes([byte]))
                connection.settimeout(1.0)
                if connection.recv(1024) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
    return Outcome(status=408, body=json.dumps({"error": f"closed after {time.monotonic() - started:.0f} s"}))


def _bad_then_good(server: Any) -> Outcome:
    """A forged request, then a good one on the same connection: the connection must still serve (or close)."""
    bad = _request("POST", _infer_path(server), b"{nope", {"Content-Type": "application/json"})
    good = _request("POST", _infer_path(server), _json_body([image_input()]), {"Content-Type": "application/json"})
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_LIMIT_S) as connection:
        connection.sendall(bad)
        first = http.client.HTTPResponse(connection)
        first.begin()
        first.read()
        connection.sendall(good)
        second = http.client.HTTPResponse(connection)
        second.begin()
        return Outcome(status=second.status, body=second.read().decode())


def _health_during_huge_json(server: Any) -> Outcome:
    """A 60 MB JSON body sent while /v2/health/live is timed: the slowest health answer is reported."""
    import threading

    values = [0.25] * (60 * 1024 * 1024 // 6)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [len(values)], "data": values}]})
    result: dict[str, Outcome] = {}
    sender = threading.Thread(
        target=lambda: result.setdefault("big", _exchange(server, infer(body.encode())(server), timeout=120))
    )
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        started = time.monotonic()
        _exchange(server, _request("GET", "/v2/health/live"), timeout=60)
        slowest = max(slowest, time.monotonic() - started)
    sender.join()
    big = result["big"]
    note = f"health answered within {slowest:.1f} s at worst; the 60 MB body got {big.status}"
    status = big.status if slowest < 2.0 else 200  # a stalled event loop is the failure, whatever the status
    return Outcome(status=status, body=json.dumps({"error": note, "answer": big.body[:100]}))


# ---------------------------------------------------------------- the catalogue


def cases() -> list[Case]:
    return [
        *_cli_cases(),
        *_make_cases(),
        *_runner_cases(),
        *_triton_cases(),
        *_folder_cases(),
        *_model_cases(),
        *_service_cases(),
        *_service_client_cases(),
    ]


@dataclass(frozen=True)
class BadSetting:
    """A setting the command line refuses before anything runs, and the words its error must hold."""

    id: str
    what: str
    options: tuple[str, ...]
    names: tuple[str, ...]
    limit: float = CLI_LIMIT_S


# Run in-process by tests/bad_inputs/test_bad_inputs.py, and by the catalogue as a user runs them.
BAD_SETTINGS = (
    BadSetting(
        "shape-huge",
        "INPUT_SHAPE=3x100000x100000 (a 240 GB batch)",
        ("--model", "resnet18", "--input-shape", "3x100000x100000"),
        ("would take 224 GiB",),
    ),
    BadSetting(
        "batch-negative",
        "BATCH=-1:2:3 (argparse reads it as an option)",
        ("--model", "resnet18", "--batch=-1:2:3"),
        ("--batch=-1:2:3 is not of the form min:opt:max",),
    ),
    BadSetting(
        "keep-fp32-unknown",
        "KEEP_FP32=NoSuchOp",
        ("--precision", "fp16", "--keep-fp32", "NoSuchOp"),
        ("--keep-fp32 names ['NoSuchOp']",),
    ),
    BadSetting(
        "target-unknown", "TARGET=h100", ("--precision", "fp16", "--target", "h100"), ("unknown build target 'h100'",)
    ),
    BadSetting(
        "batch-huge",
        "BATCH=1:1:100000000 (max far beyond memory)",
        ("--batch", "1:1:100000000"),
        ("would take 286 GiB",),
        limit=240,
    ),
    BadSetting(
        "nms-score-above-1",
        "NMS_SCORE_THRESHOLD=5 (scores are after a sigmoid: nothing could ever be detected)",
        (
            "--model",
            "tests.helpers.detector_models:yolo_detector",
            "--postprocess",
            "nms",
            "--nms-score-threshold",
            "5",
        ),
        ("NMS score threshold 5 is not in [0, 1): the head's scores are after their sigmoid",),
    ),
    BadSetting(
        "dynamic-fixed-axis",
        "DYNAMIC=input:1 on the channels a Conv fixes (the folder advertised 1:3:3 and failed at run time)",
        ("--dynamic", "input:1"),
        ("fix: the model fixes an axis declared dynamic, input:1 (1:3:3, run at 1): leave it out of --dynamic",),
    ),
    BadSetting("model-empty", "MODEL='' (read as the current directory)", ("--model", ""), ("--model is empty",)),
    BadSetting("model-blank", "MODEL=' '", ("--model", " "), ("--model is empty",)),
    # recorded in the manifest and ignored: with no CALIB there is nothing for it to read
    BadSetting(
        "calib-samples-without-calib",
        "PRECISION=fp16 CALIB_SAMPLES=8 (no CALIB)",
        ("--precision", "fp16", "--calib-samples", "8"),
        ("--calib-samples says how --calib is read, and no --calib was given",),
    ),
    BadSetting(
        "recalibrate-without-calib",
        "PRECISION=fp16 RECALIBRATE=1 (no CALIB)",
        ("--precision", "fp16", "--recalibrate"),
        ("--recalibrate says how --calib is read",),
    ),
)


# The fix load_session added to the reader's own refusal of a graph: the opposite of the reader's finding (issue 39).
SECOND_FINDING = ("sha256 matches",)


def _cli_cases() -> list[Case]:
    f = "{files}"
    return [
        # the command line itself
        cli("cli-no-arguments", "no stage at all", [], names=("stage",)),
        cli("cli-unknown-stage", "a stage that does not exist", ["deploy"], names=("deploy",)),
        cli("cli-unknown-option", "an option that does not exist", ["all", "--nosuch", "1"], names=("--nosuch",)),
        build(
            "cli-option-twice",
            "--precision int8 --precision fp32 (the last was kept without a word)",
            ["--precision", "int8", "--precision", "fp32"],
            names=("--precision is given twice",),
        ),
        *(build(s.id, s.what, list(s.options), names=s.names, limit=s.limit) for s in BAD_SETTINGS),
        # PRECISION
        build("precision-int4", "PRECISION=int4", ["--precision", "int4"], names=("int4",)),
        build("precision-empty", "PRECISION=''", ["--precision", ""], names=("precision",)),
        build("precision-upper", "PRECISION=FP16 (upper case)", ["--precision", "FP16"], names=("FP16",)),
        # BATCH
        build("batch-zero", "BATCH=0:1:1", ["--batch", "0:1:1"], names=("0:1:1",)),
        build("batch-unordered", "BATCH=4:2:8 (min > opt)", ["--batch", "4:2:8"], names=("4:2:8",)),
        build("batch-two-parts", "BATCH=1:8", ["--batch", "1:8"], names=("1:8",)),
        build("batch-words", "BATCH=a:b:c", ["--batch", "a:b:c"], names=("a:b:c",)),
        build("batch-four-parts", "BATCH=1:8:32:64", ["--batch", "1:8:32:64"], names=("1:8:32:64",)),
        build("batch-fraction", "BATCH=1.5:2:3", ["--batch", "1.5:2:3"], names=("1.5:2:3",)),
        build("batch-empty", "BATCH=''", ["--batch", ""], names=("batch",)),
        # INPUT_SHAPE
        build("shape-zero", "INPUT_SHAPE=0x16x16", ["--input-shape", "0x16x16"], names=("0x16x16",)),
        build("shape-negative", "INPUT_SHAPE=-3x16x16", ["--input-shape=-3x16x16"], names=("-3x16x16",)),
        build("shape-words", "INPUT_SHAPE=3xax16", ["--input-shape", "3xax16"], names=("3xax16",)),
        build("shape-only-x", "INPUT_SHAPE=x", ["--input-shape", "x"], names=("input",)),
        build(
            "shape-bad-dtype",
            "INPUT_SHAPE=3x16x16:float128",
            ["--input-shape", "3x16x16:float128"],
            names=("float128",),
        ),
        build(
            "shape-unknown-name",
            "INPUT_SHAPE names the one input otherwise (the graph's input takes that name)",
            ["--input-shape", "nosuch=3x16x16"],
            expect="either",
        ),
        build(
            "shape-duplicate-name",
            "INPUT_SHAPE names one input twice",
            ["--input-shape", "input=3x16x16,input=3x8x8"],
            names=("input",),
        ),
        build("shape-wrong-rank", "INPUT_SHAPE=16x16 for a conv net (rank 3 input)", ["--input-shape", "16x16"]),
        build("shape-64-dims", "INPUT_SHAPE with 64 dims", ["--input-shape", "x".join(["1"] * 64)]),
        build("shape-channels", "INPUT_SHAPE=4x16x16 for a 3-channel conv", ["--input-shape", "4x16x16"]),
        # EXPORTER, and what no exporter can make
        build("exporter-unknown", "EXPORTER=nosuch", ["--exporter", "nosuch"], names=("nosuch",)),
        build(
            "export-data-dependent-size",
            "an output whose size depends on the input values (x[x > 0.5])",
            ["--model", "tests.helpers.toy_models:score_filter"],
            names=("depends on the input values", "topk"),
        ),
        build(
            "export-both-exporters-bake",
            "a sequence int() bakes for TorchScript and dynamo alike",
            ["--model", "tests.helpers.toy_models:baked_sequence_model"],
            names=("torchscript:", "dynamo:"),
        ),
        # DYNAMIC
        build("dynamic-unknown-input", "DYNAMIC names no input", ["--dynamic", "nosuch:1"], names=("nosuch",)),
        build("dynamic-batch-axis", "DYNAMIC on axis 0 (the batch)", ["--dynamic", "input:0"], names=("0",)),
        build("dynamic-axis-out-of-range", "DYNAMIC axis 9 of a 4-d input", ["--dynamic", "input:9"], names=("9",)),
        build("dynamic-unordered", "DYNAMIC range 5:2:1", ["--dynamic", "input:2=5:2:1"], names=("5:2:1",)),
        build("dynamic-words", "DYNAMIC range a:b:c", ["--dynamic", "input:2=a:b:c"], names=("a:b:c",)),
        build("dynamic-garbage", "DYNAMIC=garbage", ["--dynamic", "garbage"], names=("garbage",)),
        # WEIGHTS
        build(
            "weights-missing",
            "WEIGHTS= a file that does not exist",
            ["--model", "resnet18", "--weights", "/nonexistent/w.pth"],
            names=("/nonexistent/w.pth",),
        ),
        build(
            "weights-directory",
            "WEIGHTS= a folder",
            ["--model", "resnet18", "--weights", f"{f}/dir.pth"],
            names=("dir.pth",),
        ),
        build(
            "weights-text",
            "WEIGHTS= a text file",
            ["--model", "resnet18", "--weights", f"{f}/text.pth"],
            names=("text.pth",),
        ),
        build(
            "weights-empty",
            "WEIGHTS= an empty file",
            ["--model", "resnet18", "--weights", f"{f}/empty.pth"],
            names=("empty.pth",),
        ),
        build(
            "weights-truncated",
            "WEIGHTS= a truncated state_dict",
            ["--model", "resnet18", "--weights", f"{f}/truncated.pth"],
            names=("truncated.pth",),
        ),
        build(
            "weights-other-model",
            "WEIGHTS= another model's state_dict",
            ["--model", "resnet18", "--weights", f"{f}/wrong_model.pth"],
            names=("weights",),
        ),
        build(
            "weights-partial",
            "WEIGHTS= a state_dict missing most keys",
            ["--model", "resnet18", "--weights", f"{f}/partial.pth"],
        ),
        build(
            "weights-npy",
            "WEIGHTS= a .npy array",
            ["--model", "resnet18", "--weights", f"{f}/array.pth.npy"],
            names=("array.pth.npy",),
        ),
        build(
            "weights-crafted-pickle",
            "WEIGHTS= a pickle that runs a shell command",
            ["--model", "resnet18", "--weights", f"{f}/crafted_torch.pt"],
        ),
        build(
            "weights-for-factory",
            "WEIGHTS= given with a factory model",
            ["--weights", f"{f}/wrong_model.pth"],
            expect="either",
        ),
        # MODEL: names and factories
        build("model-unknown-registry", "MODEL=resnet9000", ["--model", "resnet9000"], names=("resnet9000",)),
        build("model-no-module", "MODEL=nosuchpkg.mod:f", ["--model", "nosuchpkg.mod:f"], names=("nosuchpkg",)),
        build(
            "model-no-attribute",
            "MODEL=tests.helpers.toy_models:nosuch",
            ["--model", "tests.helpers.toy_models:nosuch"],
            names=("nosuch",),
        ),
        build(
            "model-not-callable",
            "MODEL= a module constant",
            ["--model", "tests.helpers.toy_models:EXAMPLE_BATCH"],
            names=("EXAMPLE_BATCH",),
        ),
        build(
            "model-module-only",
            "MODEL=tests.helpers.toy_models: (no factory)",
            ["--model", "tests.helpers.toy_models:"],
            names=("tests.helpers.toy_models",),
        ),
        build(
            "factory-raises",
            "a factory that raises ValueError",
            ["--model", "catalogue_factories:raises"],
            names=("no weights here",),
        ),
        build(
            "factory-returns-none",
            "a factory that returns None",
            ["--model", "catalogue_factories:returns_none"],
            names=("returns_none",),
        ),
        build(
            "factory-returns-text",
            "a factory that returns a string",
            ["--model", "catalogue_factories:returns_text"],
            names=("returns_text",),
        ),
        build(
            "factory-bad-tuple",
            "a factory that returns a 1-tuple",
            ["--model", "catalogue_factories:returns_bad_tuple"],
            names=("returns_bad_tuple",),
        ),
        build(
            "factory-text-input",
            "a factory whose example input is a string",
            ["--model", "catalogue_factories:returns_module_and_text"],
            names=("returns_module_and_text",),
        ),
        build(
            "factory-needs-argument",
            "a factory that takes an argument",
            ["--model", "catalogue_factories:needs_argument"],
            names=("needs_argument",),
        ),
        build(
            "factory-exits-0",
            "a factory that calls sys.exit(0)",
            ["--model", "catalogue_factories:exits"],
            names=("exits",),
        ),
        build(
            "factory-exits-5",
            "a factory that calls sys.exit(5)",
            ["--model", "catalogue_factories:exits_nonzero"],
            names=("exits_nonzero",),
        ),
        build(
            "factory-nan-output",
            "a model whose output is NaN",
            ["--model", "catalogue_factories:nan_model", "--input-shape", "4"],
            names=("nan",),
        ),
        # MODEL: files
        build(
            "model-file-missing",
            "MODEL=/nonexistent/model.pt",
            ["--model", "/nonexistent/model.pt"],
            names=("/nonexistent/model.pt",),
        ),
        build("model-file-empty", "MODEL= an empty .pt", ["--model", f"{f}/empty.pt"], names=("empty.pt",)),
        build("model-file-text", "MODEL= a text file named .pt", ["--model", f"{f}/text.pt"], names=("text.pt",)),
        build(
            "model-file-truncated-script",
            "MODEL= a truncated TorchScript file",
            ["--model", f"{f}/truncated_script.pt"],
            names=("truncated_script.pt",),
        ),
        build(
            "model-file-corrupt-pt2", "MODEL= a corrupt .pt2", ["--model", f"{f}/corrupt.pt2"], names=("corrupt.pt2",)
        ),
        build("model-file-onnx", "MODEL= an .onnx file", ["--model", f"{f}/model.onnx"], names=("model.onnx",)),
        build("model-file-directory", "MODEL= a folder", ["--model", f"{f}/dir.pth"], names=("dir.pth",)),
        build(
            "model-file-crafted-pickle",
            "MODEL= a plain pickle that runs a shell command",
            ["--model", f"{f}/crafted.pt"],
        ),
        build(
            "model-file-crafted-torch",
            "MODEL= a torch.save'd object that runs a shell command",
            ["--model", f"{f}/crafted_torch.pt"],
        ),
        build(
            "model-file-crafted-module",
            "MODEL= a pickle holding a module, then a shell command",
            ["--model", f"{f}/crafted_module.pt", "--input-shape", "2"],
        ),
        build(
            "model-file-script-no-shape",
            "MODEL= a TorchScript file without INPUT_SHAPE",
            ["--model", f"{f}/scripted.pt"],
            names=("--input-shape",),
        ),
        build("model-shell-semicolon", "MODEL='x; touch marker'", ["--model", "x; touch {marker}"]),
        build("model-shell-substitution", "MODEL='$(touch marker)'", ["--model", "$(touch {marker})"]),
        build("model-shell-backticks", "MODEL='`touch marker`'", ["--model", "`touch {marker}`"]),
        build(
            "model-python-injection", "MODEL=\"os:system('touch marker')\"", ["--model", "os:system('touch {marker}')"]
        ),
        build(
            "model-os-system",
            "MODEL=os:getcwd (a callable that is no factory)",
            ["--model", "os:getcwd"],
            names=("getcwd",),
        ),
        build("model-path-traversal", "MODEL=../../etc/passwd", ["--model", "../../etc/passwd"], names=("passwd",)),
        build("model-newline", "MODEL with a newline", ["--model", "resnet18\nrm -rf /"], names=("resnet18",)),
        build("model-very-long", "MODEL of 5000 characters", ["--model", "m" * 5000], names=("mmmm",)),
        build("model-unicode", "MODEL=modèle", ["--model", "modèle"], names=("modèle",)),
        # OUT
        build(
            "out-under-a-file", "OUT= a path under a file", ["--out", f"{f}/text.pth/engines"], names=("not a folder",)
        ),
        build("out-is-a-file", "OUT= a file", ["--out", f"{f}/text.pth"], names=("text.pth",)),
        build(
            "out-read-only",
            "OUT= on a read-only file system",
            ["--out", "{readonly}/engines"],
            names=("read-only",),
            mount="read_only",
        ),
        build("out-dev-null", "OUT=/dev/null/engines", ["--out", "/dev/null/engines"], names=("/dev/null",)),
        build("out-proc", "OUT=/proc/engines", ["--out", "/proc/engines"], names=("/proc",)),
        build(
            "out-full-disk",
            "OUT= on a full disk (a 64 KiB tmpfs)",
            ["--out", "{full}/engines"],
            names=("space",),
            mount="full_disk",
        ),
        build(
            "out-file-size-limit",
            "OUT= with a 64 KiB file size limit (RLIMIT_FSIZE)",
            [],
            fsize=64 * 1024,
            names=("large",),
        ),
        build("out-empty", "OUT='' (the current directory?)", ["--out", ""], names=("empty",)),
        # builder options
        build("workspace-negative", "--workspace-mib -1", ["--workspace-mib", "-1"], names=("workspace",)),
        build("workspace-words", "--workspace-mib abc", ["--workspace-mib", "abc"], names=("abc",)),
        build("workspace-zero", "--workspace-mib 0", ["--workspace-mib", "0"], names=("workspace",)),
        build("builder-unknown", "--builder nosuch", ["--builder", "nosuch"], names=("nosuch",)),
        build("target-sm0", "TARGET=sm0", ["--precision", "fp16", "--target", "sm0"], names=("sm0",)),
        build("target-trailing-comma", "TARGET=sm86,", ["--precision", "fp16", "--target", "sm86,"], names=("sm86,",)),
        build(
            "target-current-no-gpu",
            "TARGET=current on a machine without a GPU",
            ["--precision", "fp16", "--target", "current"],
            names=("GPU",),
        ),
        build(
            "keep-fp32-with-fp32",
            "KEEP_FP32 with PRECISION=fp32 (means nothing)",
            ["--keep-fp32", "Conv"],
            expect="either",
        ),
        # calibration
        build(
            "int8-no-calib", "PRECISION=int8 without CALIB", ["--precision", "int8"], expect="either", names=("CALIB",)
        ),
        build(
            "calib-missing",
            "CALIB= a path that does not exist",
            ["--precision", "int8", "--calib", "/nonexistent/calib"],
            names=("/nonexistent/calib",),
        ),
        build(
            "calib-empty-folder",
            "CALIB= an empty folder",
            ["--precision", "int8", "--calib", f"{f}/calib-empty"],
            names=("calib-empty",),
        ),
        build(
            "calib-not-images",
            "CALIB= a folder of text files named .jpg (an image model)",
            ["--model", "resnet18", "--precision", "int8", "--calib", f"{f}/calib-not-images"],
            names=("jpg",),
        ),
        build(
            "calib-wrong-shape",
            "CALIB= a .npy of the wrong shape",
            ["--precision", "int8", "--calib", f"{f}/calib-wrong-shape.npy"],
            names=("shape",),
        ),
        build(
            "calib-nan",
            "CALIB= a .npy of NaN",
            ["--precision", "int8", "--calib", f"{f}/calib-nan.npy"],
            names=("nan",),
        ),
        build(
            "calib-int",
            "CALIB= int64 data for a float input",
            ["--precision", "int8", "--calib", f"{f}/calib-int.npy"],
            expect="either",
        ),
        build(
            "calib-no-arrays",
            "CALIB= an .npz with no arrays",
            ["--precision", "int8", "--calib", f"{f}/calib-no-arrays.npz"],
            names=("calib-no-arrays",),
        ),
        build(
            "calib-corrupt",
            "CALIB= a corrupt .npy",
            ["--precision", "int8", "--calib", f"{f}/calib-corrupt.npy"],
            names=("calib-corrupt",),
        ),
        build(
            "calib-object-pickle",
            "CALIB= an object .npy (a pickle)",
            ["--precision", "int8", "--calib", f"{f}/calib-object.npy"],
            names=("calib-object",),
        ),
        build(
            "calib-text-file",
            "CALIB= a text file",
            ["--precision", "int8", "--calib", f"{f}/text.pth"],
            names=("text.pth",),
        ),
        build(
            "calib-samples-zero",
            "--calib-samples 0",
            ["--precision", "int8", "--calib", f"{f}/calib-nan.npy", "--calib-samples", "0"],
            names=("samples",),
        ),
        build(
            "calib-samples-negative",
            "--calib-samples -5",
            ["--precision", "int8", "--calib", f"{f}/calib-nan.npy", "--calib-samples=-5"],
            names=("samples",),
        ),
        build(
            "calib-batch-zero",
            "--calib-batch 0",
            ["--precision", "int8", "--calib", f"{f}/calib-nan.npy", "--calib-batch", "0"],
            names=("batch",),
        ),
        build(
            "calib-method-unknown",
            "CALIB_METHOD=nosuch",
            ["--precision", "int8", "--calib-method", "nosuch"],
            names=("nosuch",),
        ),
        # stages alone, other commands
        cli(
            "stage-build-alone",
            "the build stage on a folder no earlier stage wrote",
            ["build", "--model", "tests.helpers.toy_models:tiny_cnn", "--out", "{work}/engines"],
            names=("earlier stages",),
        ),
        cli(
            "stage-parity-alone",
            "the parity stage with nothing exported",
            ["parity", "--model", "tests.helpers.toy_models:tiny_cnn", "--out", "{work}/engines"],
        ),
        cli(
            "bench-missing-folder",
            "bench on a folder that does not exist",
            ["bench", "--folder", "{work}/nothing"],
            names=("nothing",),
        ),
        cli(
            "bench-unknown-backend",
            "bench --backends nosuch",
            ["bench", "--folder", "{image}", "--backends", "nosuch", "--report-dir", "{work}"],
            names=("nosuch",),
        ),
        cli(
            "bench-batch-zero",
            "bench --batches 0",
            ["bench", "--folder", "{image}", "--batches", "0", "--report-dir", "{work}"],
            names=("0",),
        ),
        cli(
            "bench-batch-words",
            "bench --batches a",
            ["bench", "--folder", "{image}", "--batches", "a", "--report-dir", "{work}"],
            names=("a",),
        ),
        cli(
            "bench-iterations-negative",
            "bench --iterations -1",
            ["bench", "--folder", "{image}", "--iterations=-1", "--report-dir", "{work}"],
            names=("iterations",),
        ),
        cli(
            "accuracy-unknown-model",
            "accuracy --model nosuch",
            ["accuracy", "--model", "nosuch", "--out", "{work}/engines"],
            names=("nosuch",),
        ),
        cli(
            "diagnose-missing-folder",
            "diagnose on a folder that does not exist",
            ["diagnose", "{work}/nothing"],
            names=("nothing",),
        ),
        cli(
            "serve-missing-folder",
            "serve a folder that does not exist",
            ["serve", "{work}/nothing", "--grpc-port", "0"],
            names=("nothing",),
            limit=60,
        ),
        cli(
            "serve-port-negative",
            "serve --port -1",
            ["serve", "{image}", "--port=-1", "--grpc-port", "0"],
            names=("port",),
            limit=60,
        ),
        cli(
            "serve-port-too-big",
            "serve --port 70000",
            ["serve", "{image}", "--port", "70000", "--grpc-port", "0"],
            names=("70000",),
            limit=60,
        ),
        cli("serve-port-words", "serve --port abc", ["serve", "{image}", "--port", "abc"], names=("abc",), limit=60),
        cli(
            "serve-max-batch-zero",
            "serve --max-batch 0",
            ["serve", "{image}", "--max-batch", "0", "--grpc-port", "0"],
            names=("max batch",),
            limit=60,
        ),
        cli(
            "serve-queue-zero",
            "serve --queue-size 0",
            ["serve", "{image}", "--queue-size", "0", "--grpc-port", "0"],
            names=("queue",),
            limit=60,
        ),
        cli(
            "serve-timeout-zero",
            "serve --timeout-s 0",
            ["serve", "{image}", "--timeout-s", "0", "--grpc-port", "0"],
            names=("timeout",),
            limit=60,
        ),
        cli(
            "serve-body-negative",
            "serve --max-body-mib -1",
            ["serve", "{image}", "--max-body-mib=-1", "--grpc-port", "0"],
            names=("body",),
            limit=60,
        ),
        cli(
            "serve-bad-host",
            "serve --host not-a-host",
            ["serve", "{image}", "--host", "not a host", "--grpc-port", "0"],
            names=("not a host",),
            limit=60,
        ),
        cli(
            "serve-unfinished-folder",
            "serve a folder with only a manifest",
            ["serve", "{files}/dir.pth", "--grpc-port", "0"],
            names=("dir.pth",),
            limit=60,
        ),
    ]


def _make_cases() -> list[Case]:
    marker = "{marker}"
    factory = ["MODEL=tests.helpers.toy_models:tiny_cnn", "PRECISION=fp32"]
    return [
        make("make-model-shell-quote", "MODEL=x'; touch marker; echo '", [f"MODEL=x'; touch {marker}; echo '"]),
        make("make-model-make-shell", "MODEL=$(shell touch marker)", [f"MODEL=$(shell touch {marker})"]),
        make("make-model-backticks", "MODEL=`touch marker`", [f"MODEL=`touch {marker}`"]),
        make("make-model-dollar-paren", "MODEL=$$(touch marker)", [f"MODEL=$$(touch {marker})"]),
        make("make-model-double-quote", 'MODEL=x"; touch marker; echo "', [f'MODEL=x"; touch {marker}; echo "']),
        make(
            "make-shape-injection",
            "INPUT_SHAPE='3x16x16; touch marker'",
            [*factory, f"INPUT_SHAPE=3x16x16; touch {marker}"],
        ),
        make("make-force-injection", "FORCE='1; touch marker'", [*factory, f"FORCE=1; touch {marker}", "BATCH=0:0:0"]),
        make(
            "make-trust-injection",
            "TRUST_MODEL_FILE=$(shell touch marker)",
            [*factory, f"TRUST_MODEL_FILE=$(shell touch {marker})", "BATCH=0:0:0"],
        ),
        make(
            "make-keep-fp32-newline",
            "KEEP_FP32 holding a newline and a command",
            [*factory, f"KEEP_FP32=Conv\ntouch {marker}", "PRECISION=fp16"],
        ),
        make("make-batch-negative", "BATCH=-1:2:3", [*factory, "BATCH=-1:2:3"], names=("-1:2:3",)),
        make(
            "make-precision-bad",
            "PRECISION=int4",
            ["MODEL=tests.helpers.toy_models:tiny_cnn", "PRECISION=int4"],
            names=("int4",),
        ),
        make(
            "make-failing-pipeline", "a failing pipeline fails make (MODEL=nosuch)", ["MODEL=nosuch"], names=("nosuch",)
        ),
        make("make-out-quote", "OUT=.../it's (a quote in a path)", [*factory, "OUT={work}/it's"], expect="success"),
        make(
            "make-nms-head-several",
            "POSTPROCESS=nms on a model of two outputs without NMS_HEAD (the fix named NmsConfig(head=...))",
            ["MODEL=tests.helpers.toy_models:text_classifier", "PRECISION=fp16", "POSTPROCESS=nms"],
            names=("NMS_HEAD=logits",),
            forbidden=("NmsConfig",),
        ),
        make(
            "make-bench-injection",
            "make bench BACKENDS='x; touch marker'",
            [f"BACKENDS=x; touch {marker}", "MODEL=nosuch"],
            target="bench",
        ),
        make(
            "make-serve-port-injection",
            "make serve PORT='1; touch marker'",
            [f"PORT=1; touch {marker}", "MODEL=nosuch"],
            target="serve",
        ),
    ]


def _runner_cases() -> list[Case]:
    load = "from trt_pipeline.pipeline.runners import load_runner\n"
    good = load + "runner = load_runner(IMAGE, 'onnxruntime')\n"
    return [
        py(
            "runner-missing-folder",
            "runner",
            "load_runner on a folder that does not exist",
            load + "load_runner(WORK / 'nothing')",
            names=("nothing",),
        ),
        py(
            "runner-empty-folder",
            "runner",
            "load_runner on an empty folder",
            load + "(WORK / 'empty').mkdir()\nload_runner(WORK / 'empty')",
            names=("manifest",),
        ),
        py(
            "runner-file-not-folder",
            "runner",
            "load_runner on a file",
            load + "load_runner(IMAGE / 'manifest.json')",
            names=("manifest.json",),
        ),
        py(
            "runner-manifest-not-json",
            "runner",
            "manifest.json is not JSON",
            load + "f = copy(IMAGE)\n(f / 'manifest.json').write_text('{oops')\nload_runner(f)",
            names=("manifest.json",),
        ),
        py(
            "runner-manifest-list",
            "runner",
            "manifest.json holds a list",
            load + "f = copy(IMAGE)\n(f / 'manifest.json').write_text('[1, 2]')\nload_runner(f)",
            names=("manifest.json",),
        ),
        py(
            "runner-manifest-not-utf8",
            "runner",
            "manifest.json is not UTF-8",
            load + "f = copy(IMAGE)\n(f / 'manifest.json').write_bytes(b'\\xff\\xfe')\nload_runner(f)",
            names=("manifest.json",),
        ),
        py(
            "runner-manifest-empty",
            "runner",
            "manifest.json is empty",
            load + "f = copy(IMAGE)\n(f / 'manifest.json').write_text('')\nload_runner(f)",
            names=("manifest.json",),
        ),
        py(
            "runner-manifest-no-inputs",
            "runner",
            "the manifest lost its inputs",
            load + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.pop('inputs'))\nload_runner(f, 'onnxruntime')",
            names=("inputs",),
        ),
        py(
            "runner-manifest-inputs-not-list",
            "runner",
            "the manifest's inputs are a string",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.update(inputs='input'))\nr = load_runner(f, 'onnxruntime')\nr.infer(image_batch(1))",
            names=("inputs",),
        ),
        py(
            "runner-manifest-bad-dtype",
            "runner",
            "the manifest's input dtype is nosuch",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m['inputs'][0].update(dtype='nosuch'))\nload_runner(f, 'onnxruntime')",
            names=("nosuch",),
        ),
        py(
            "runner-batch-profile-zero",
            "runner",
            "batch_profile max 0",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.update(batch_profile={'min': 1, 'opt': 1, 'max': 0}))\nload_runner(f, 'onnxruntime')",
            names=("batch_profile",),
        ),
        py(
            "runner-batch-profile-missing",
            "runner",
            "no batch_profile",
            load + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.pop('batch_profile'))\nload_runner(f, 'onnxruntime')",
            names=("batch_profile",),
        ),
        py(
            "runner-batch-profile-words",
            "runner",
            "batch_profile max 'many'",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.update(batch_profile={'max': 'many'}))\nload_runner(f, 'onnxruntime')",
            names=("batch_profile",),
        ),
        py(
            "runner-graph-swapped",
            "runner",
            "model.onnx replaced by another model's graph",
            load
            + "f = copy(IMAGE)\nimport json\ng = engine_graph(f)\nother = engine_graph(TEXT)\nshutil.copy(TEXT / other, f / g)\nr = load_runner(f, 'onnxruntime')\nr.infer(image_batch(1))",
            # a graph of another size is refused on its size, before any byte is hashed
            names=("is not the file this folder's build wrote", "bytes where the build wrote"),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-same-io-swapped",
            "runner",
            "the graph replaced by one with the same inputs, other weights",
            load
            + "f = copy(IMAGE)\nimport json, onnx\ng = engine_graph(f)\nm = onnx.load(str(f / g))\nw = m.graph.initializer[0]\nimport numpy\nfrom onnx import numpy_helper\na = numpy_helper.to_array(w) * 0\nw.CopyFrom(numpy_helper.from_array(a, w.name))\nonnx.save(m, str(f / g))\nr = load_runner(f, 'onnxruntime')\nr.infer(image_batch(1))",
            names=("sha256",),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-truncated",
            "runner",
            "model.onnx truncated",
            load
            + "f = copy(IMAGE)\nimport json\ng = f / engine_graph(f)\ng.write_bytes(g.read_bytes()[:100])\nr = load_runner(f, 'onnxruntime')\nr.infer(image_batch(1))",
            names=("onnx",),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-missing",
            "runner",
            "model.onnx deleted",
            load
            + "f = copy(IMAGE)\nimport json\n(f / engine_graph(f)).unlink()\nr = load_runner(f, 'onnxruntime')\nr.infer(image_batch(1))",
            names=("onnx",),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-outside",
            "runner",
            "the manifest names a graph outside the folder",
            load
            + "f = copy(IMAGE)\nimport json\ng = engine_graph(f)\nshutil.copy(f / g, WORK / 'outside.onnx')\nedit_manifest(f, lambda m: [r.update(file='../outside.onnx') for r in m['graphs'] if r['file'] == g])\nr = load_runner(f, 'onnxruntime')\nr.infer(image_batch(1))",
            names=("outside.onnx",),
        ),
        py(
            "runner-layout-old",
            "runner",
            "a folder of another artifact layout",
            load + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.update(layout=1))\nload_runner(f, 'onnxruntime')",
            names=("layout",),
            needs=("pipeline/folder/reader.py", "layout"),
        ),
        py(
            "runner-unfinished",
            "runner",
            "a folder whose build did not finish",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.update(complete=False))\nload_runner(f, 'onnxruntime')",
            names=("unfinished",),
            needs=("pipeline/folder/reader.py", "complete"),
        ),
        py("runner-unknown-backend", "runner", "backend='cuda'", load + "load_runner(IMAGE, 'cuda')", names=("cuda",)),
        py(
            "runner-tensorrt-no-gpu",
            "runner",
            "backend='tensorrt' on a machine without a GPU",
            load + "r = load_runner(IMAGE, 'tensorrt')\nr.infer(image_batch(1))",
            names=("GPU",),
        ),
        py(
            "runner-unknown-option",
            "runner",
            "load_runner(..., nosuch=1)",
            load + "load_runner(IMAGE, 'onnxruntime', nosuch=1)",
            names=("nosuch",),
        ),
        py(
            "infer-wrong-name",
            "runner",
            "infer with an input of another name",
            good + "runner.infer({'image': image_batch(1)['input']})",
            names=("image",),
        ),
        py(
            "infer-extra-input",
            "runner",
            "infer with an extra input",
            good + "runner.infer({**image_batch(1), 'extra': np.zeros(1)})",
            names=("extra",),
        ),
        py("infer-empty-dict", "runner", "infer({})", good + "runner.infer({})", names=("input",)),
        py(
            "infer-float64",
            "runner",
            "infer with float64",
            good + "runner.infer({'input': image_batch(1)['input'].astype(np.float64)})",
            names=("float64",),
        ),
        py(
            "infer-int",
            "runner",
            "infer with int32",
            good + "runner.infer({'input': np.zeros((1, 3, 16, 16), np.int32)})",
            names=("int32",),
        ),
        py(
            "infer-string-dtype",
            "runner",
            "infer with a string array",
            good + "runner.infer({'input': np.full((1, 3, 16, 16), 'a')})",
            names=("dtype",),
        ),
        py(
            "infer-object-dtype",
            "runner",
            "infer with an object array",
            good + "runner.infer({'input': np.empty((1, 3, 16, 16), object)})",
            names=("object",),
        ),
        py(
            "infer-wrong-rank",
            "runner",
            "infer with a 3-d array",
            good + "runner.infer({'input': np.zeros((3, 16, 16), np.float32)})",
            names=("shape",),
        ),
        py(
            "infer-wrong-dim",
            "runner",
            "infer with 4 channels",
            good + "runner.infer({'input': np.zeros((1, 4, 16, 16), np.float32)})",
            names=("shape",),
        ),
        py(
            "infer-zero-rows",
            "runner",
            "infer with 0 rows",
            good + "runner.infer({'input': np.zeros((0, 3, 16, 16), np.float32)})",
            names=("0 rows",),
        ),
        py(
            "infer-list",
            "runner",
            "infer with a nested list",
            good + "runner.infer({'input': image_batch(1)['input'].tolist()})",
            names=("list",),
        ),
        py(
            "infer-array-not-dict",
            "runner",
            "infer(array) instead of a dict",
            good + "runner.infer(image_batch(1)['input'])",
            names=("dict",),
        ),
        py("infer-none", "runner", "infer(None)", good + "runner.infer(None)", names=("dict",)),
        py(
            "infer-torch-tensor",
            "runner",
            "infer with a torch tensor on ONNX Runtime",
            good + "import torch\nrunner.infer({'input': torch.zeros(1, 3, 16, 16)})",
            names=("Tensor",),
        ),
        py(
            "infer-after-close",
            "runner",
            "infer after close()",
            good + "runner.close()\nrunner.infer(image_batch(1))",
            names=("closed",),
        ),
        py(
            "infer-close-twice",
            "runner",
            "close() twice, then a new runner works",
            good
            + "runner.close()\nrunner.close()\nr = load_runner(IMAGE, 'onnxruntime')\nout = r.infer(image_batch(2))\nprint('OK', {k: v.shape for k, v in out.items()})",
            expect="success",
        ),
        py(
            "infer-too-many-rows-no-split",
            "runner",
            "33 rows with split_large_batches=False (max 32)",
            load + "r = load_runner(IMAGE, 'onnxruntime', split_large_batches=False)\nr.infer(image_batch(33))",
            names=("32",),
        ),
        py(
            "infer-too-many-rows-split",
            "runner",
            "70 rows split into chunks: same as one by one",
            good
            + "b = image_batch(70)\nwhole = runner.infer(b)['logits']\nparts = np.concatenate([runner.infer({'input': b['input'][i:i+1]})['logits'] for i in range(70)])\nif not np.allclose(whole, parts, atol=1e-4): wrong('chunked rows differ')\nprint('OK')",
            expect="success",
        ),
        py(
            "infer-non-contiguous",
            "runner",
            "a non-contiguous view gives the same answer",
            good
            + "b = np.random.default_rng(1).standard_normal((2, 16, 16, 3), dtype=np.float32).transpose(0, 3, 1, 2)\nif not np.allclose(runner.infer({'input': b})['logits'], runner.infer({'input': np.ascontiguousarray(b)})['logits'], atol=1e-5): wrong('view differs')\nprint('OK')",
            expect="success",
        ),
        py(
            "infer-read-only-array",
            "runner",
            "a read-only array",
            good
            + "b = image_batch(1)['input']\nb.setflags(write=False)\nprint('OK', runner.infer({'input': b})['logits'].shape)",
            expect="success",
        ),
        py(
            "infer-nan",
            "runner",
            "NaN passes through as NaN",
            good
            + "b = np.full((1, 3, 16, 16), np.nan, np.float32)\nif not np.isnan(runner.infer({'input': b})['logits']).any(): wrong('NaN in, no NaN out')\nprint('OK')",
            expect="success",
        ),
        py(
            "infer-text-ids-out-of-range",
            "runner",
            "token ids -5 and 10**6 (embedding of 100)",
            load
            + "r = load_runner(TEXT, 'onnxruntime')\nr.infer({'input_ids': np.array([[-5, 10**6, 3]], np.int64), 'attention_mask': np.ones((1, 3), np.float32)})",
            expect="either",
        ),
        py(
            "infer-text-seq-too-long",
            "runner",
            "a sequence beyond the folder's range (65 > 64)",
            load
            + "r = load_runner(TEXT, 'onnxruntime')\nr.infer({'input_ids': np.zeros((1, 65), np.int64), 'attention_mask': np.ones((1, 65), np.float32)})",
            names=("65",),
        ),
        py(
            "infer-text-mismatched-batch",
            "runner",
            "two inputs with different batches",
            load
            + "r = load_runner(TEXT, 'onnxruntime')\nr.infer({'input_ids': np.zeros((2, 5), np.int64), 'attention_mask': np.ones((3, 5), np.float32)})",
            names=("batch",),
        ),
        py(
            "torch-runner-registry",
            "runner",
            "backend='torch' on a factory model's folder",
            load
            + "r = load_runner(IMAGE, 'torch')\no = r.infer(image_batch(2))['logits']\nref = load_runner(IMAGE, 'onnxruntime').infer(image_batch(2))['logits']\nif not np.allclose(o, ref, atol=1e-4): wrong('torch and ONNX Runtime differ')\nprint('OK')",
            expect="success",
        ),
        py(
            "torch-runner-untrusted-file",
            "runner",
            "backend='torch' on a folder whose manifest names a crafted model file",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m['settings'].update(model=str(Path(sys.argv[1]).parents[1] / 'files' / 'crafted_torch.pt')))\nr = load_runner(f, 'torch')\nr.infer(image_batch(1))",
        ),
        py(
            "torch-runner-untrusted-module",
            "runner",
            "backend='torch' on a folder whose manifest names a crafted module file",
            load
            + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m['settings'].update(model=str(Path(sys.argv[1]).parents[1] / 'files' / 'crafted_module.pt')))\nr = load_runner(f, 'torch')\nr.infer(image_batch(1))",
        ),
    ]


def _triton_cases() -> list[Case]:
    return [
        cli(
            "triton-missing-folder",
            "triton on a folder that does not exist",
            ["triton", "{work}/nothing", "--repo", "{work}/repo"],
            names=("nothing",),
        ),
        cli(
            "triton-name-escapes",
            "triton --name ../escaped",
            ["triton", "{image}", "--repo", "{work}/repo", "--name", "../escaped"],
            names=("../escaped",),
        ),
        cli(
            "triton-name-absolute",
            "triton --name /tmp/abs",
            ["triton", "{image}", "--repo", "{work}/repo", "--name", "{work}/abs"],
            names=("abs",),
        ),
        cli(
            "triton-name-slash",
            "triton --name a/b",
            ["triton", "{image}", "--repo", "{work}/repo", "--name", "a/b"],
            names=("a/b",),
        ),
        cli(
            "triton-name-empty",
            "triton --name ''",
            ["triton", "{image}", "--repo", "{work}/repo", "--name", ""],
            names=("name",),
        ),
        cli(
            "triton-name-dot",
            "triton --name .",
            ["triton", "{image}", "--repo", "{work}/repo", "--name", "."],
            names=("name",),
        ),
        cli(
            "triton-name-newline",
            "triton --name with a newline",
            ["triton", "{image}", "--repo", "{work}/repo", "--name", "a\nb"],
            names=("name",),
        ),
        cli(
            "triton-repo-under-file",
            "triton --repo under a file",
            ["triton", "{image}", "--repo", "{files}/text.pth/repo"],
            names=("not a folder",),
        ),
        cli(
            "triton-repo-read-only",
            "triton --repo on a read-only file system",
            ["triton", "{image}", "--repo", "{readonly}/repo"],
            names=("read-only",),
            mount="read_only",
        ),
        cli(
            "triton-instances-zero",
            "triton --instances 0",
            ["triton", "{image}", "--repo", "{work}/repo", "--instances", "0"],
            names=("instances",),
        ),
        cli(
            "triton-instances-negative",
            "triton --instances -1",
            ["triton", "{image}", "--repo", "{work}/repo", "--instances=-1"],
            names=("instances",),
        ),
        cli(
            "triton-queue-delay-negative",
            "triton --max-queue-delay-us -1",
            ["triton", "{image}", "--repo", "{work}/repo", "--max-queue-delay-us=-1"],
            names=("delay",),
        ),
        cli(
            "triton-cpu-with-plan",
            "triton --backend tensorrt_plan --instance-kind cpu",
            ["triton", "{image}", "--repo", "{work}/repo", "--backend", "tensorrt_plan", "--instance-kind", "cpu"],
            names=("TensorRT-RTX",),
        ),
        cli(
            "triton-plan-from-rtx",
            "triton --backend tensorrt_plan on a TensorRT-RTX plan",
            ["triton", "{image}", "--repo", "{work}/repo", "--backend", "tensorrt_plan"],
            expect="either",
        ),
        py(
            "triton-truncated-graph",
            "triton",
            "triton on a folder whose graph is truncated",
            "import json, subprocess\nf = copy(IMAGE)\ng = f / engine_graph(f)\ng.write_bytes(g.read_bytes()[:100])\n"
            "done = subprocess.run([sys.executable, '-m', 'trt_pipeline', 'triton', str(f), '--repo', str(WORK / 'repo'), '--backend', 'onnxruntime'], capture_output=True, text=True)\n"
            "sys.stderr.write(done.stderr)\nsys.exit(done.returncode)",
            names=("onnx",),
        ),
        py(
            "triton-unfinished-folder",
            "triton",
            "triton on a folder with only a manifest",
            "import subprocess\nf = WORK / 'half'\nf.mkdir()\nshutil.copy(IMAGE / 'manifest.json', f)\n"
            "done = subprocess.run([sys.executable, '-m', 'trt_pipeline', 'triton', str(f), '--repo', str(WORK / 'repo')], capture_output=True, text=True)\n"
            "sys.stderr.write(done.stderr)\nsys.exit(done.returncode)",
            names=("half",),
        ),
        py(
            "triton-repo-file-in-the-way",
            "triton",
            "triton --repo where <repo>/<name> is a file",
            "import subprocess\nrepo = WORK / 'repo'\nrepo.mkdir()\n(repo / IMAGE.name).write_text('x')\n"
            "done = subprocess.run([sys.executable, '-m', 'trt_pipeline', 'triton', str(IMAGE), '--repo', str(repo)], capture_output=True, text=True)\n"
            "sys.stderr.write(done.stderr)\nsys.exit(done.returncode)",
            names=("not a folder",),
        ),
    ]


def _service_cases() -> list[Case]:
    json_type = {"Content-Type": "application/json"}
    good = _json_body([image_input()])
    return [
        served(
            "http-unknown-path",
            "GET /nowhere",
            lambda s: _request("GET", "/nowhere"),
            names=("not found",),
            statuses=(404,),
        ),
        served("http-wrong-method", "GET on /infer", lambda s: _request("GET", _infer_path(s)), statuses=(405,)),
        served(
            "http-unknown-model",
            "infer on a model not served",
            lambda s: _request("POST", "/v2/models/nosuch/infer", good, json_type),
            names=("nosuch",),
            statuses=(404,),
        ),
        served(
            "http-unknown-version",
            "infer on version 7",
            lambda s: _request("POST", f"/v2/models/{s.model}/versions/7/infer", good, json_type),
            names=("7",),
            statuses=(404,),
        ),
        served("http-good-request", "a good JSON request", infer(good), expect="success", check=_has_outputs),
        served("http-malformed-json", "a body of '{nope'", infer(b"{nope"), names=("JSON",), statuses=(400,)),
        served("http-empty-body", "an empty body", infer(b""), statuses=(400,)),
        served("http-null-body", "a body of 'null'", infer(b"null"), statuses=(400,)),
        served("http-json-list", "a JSON list", infer(b"[1, 2]"), statuses=(400,)),
        served("http-no-inputs", "no inputs key", infer(b'{"id": "1"}'), names=("inputs",), statuses=(400,)),
        served(
            "http-inputs-not-list",
            "inputs is an object",
            infer(b'{"inputs": {"name": "input"}}'),
            names=("inputs",),
            statuses=(400,),
        ),
        served("http-inputs-empty", "inputs is []", infer(b'{"inputs": []}'), names=("input",), statuses=(400,)),
        served(
            "http-input-wrong-name",
            "an input named image",
            infer(_json_body([image_input(name="image")])),
            names=("image",),
            statuses=(400,),
        ),
        served(
            "http-input-twice",
            "the same input twice",
            infer(_json_body([image_input(), image_input()])),
            names=("input",),
            statuses=(400,),
        ),
        served(
            "http-datatype-fp64",
            "datatype FP64 for an FP32 input",
            infer(_json_body([image_input(datatype="FP64")])),
            names=("FP64",),
            statuses=(400,),
        ),
        served(
            "http-datatype-unknown",
            "datatype FP128",
            infer(_json_body([image_input(datatype="FP128")])),
            names=("FP128",),
            statuses=(400,),
        ),
        served(
            "http-datatype-missing",
            "no datatype",
            infer(_json_body([{k: v for k, v in image_input().items() if k != "datatype"}])),
            names=("datatype",),
            statuses=(400,),
        ),
        served(
            "http-shape-mismatch-data",
            "shape [1,3,16,16] with 10 values",
            infer(_json_body([image_input(data=[0.0] * 10)])),
            names=("10",),
            statuses=(400,),
        ),
        served(
            "http-shape-negative",
            "shape [-1,3,16,16]",
            infer(_json_body([image_input(shape=[-1, 3, 16, 16])])),
            names=("shape",),
            statuses=(400,),
        ),
        served(
            "http-shape-huge",
            "shape [2**62,3,16,16]",
            infer(_json_body([image_input(shape=[2**62, 3, 16, 16])])),
            names=("items",),
            statuses=(400, 413),
        ),
        served(
            "http-shape-strings",
            "shape of strings",
            infer(_json_body([image_input(shape=["a", 3, 16, 16])])),
            names=("shape",),
            statuses=(400,),
        ),
        served(
            "http-shape-wrong-dims",
            "shape [1,4,16,16] with 1024 values",
            infer(_json_body([image_input(shape=[1, 4, 16, 16], data=[0.0] * 1024)])),
            names=("shape",),
            statuses=(400,),
        ),
        served(
            "http-shape-zero-rows",
            "shape [0,3,16,16]",
            infer(_json_body([image_input(shape=[0, 3, 16, 16], data=[])])),
            names=("row",),
            statuses=(400,),
        ),
        served(
            "http-data-strings", "data of strings", infer(_json_body([image_input(data=["a"] * 768)])), statuses=(400,)
        ),
        served(
            "http-data-nested-ragged",
            "ragged nested data",
            infer(_json_body([image_input(data=[[0.0] * 3, [0.0]])])),
            statuses=(400,),
        ),
        served(
            "http-data-bools",
            "data of booleans for FP32",
            infer(_json_body([image_input(data=[True] * 768)])),
            expect="either",
            statuses=(400,),
        ),
        served(
            "http-data-object", "data is an object", infer(_json_body([image_input(data={"a": 1})])), statuses=(400,)
        ),
        served(
            "http-nan",
            "NaN in JSON data (passed as sent)",
            infer(_json_body([image_input(data=[float("nan")] * 768)])),
            expect="success",
        ),
        served(
            "http-infinity",
            "Infinity in JSON data (passed as sent)",
            infer(_json_body([image_input(data=[float("inf")] * 768)])),
            expect="success",
        ),
        served(
            "http-beyond-fp32",
            "1e300 for an FP32 input",
            infer(_json_body([image_input(data=[1e300] * 768)])),
            names=("FP32",),
            statuses=(400,),
        ),
        served(
            "http-fp32-wide-integer",
            "2**70 as a JSON integer for an FP32 input (a float32: called 'not numbers')",
            infer(_json_body([image_input(data=[2**70] + [0.5] * 767)])),
            expect="success",
            check=_has_outputs,
        ),
        served(
            "http-fp32-integer-beyond-float64",
            "2**1100 as a JSON integer for an FP32 input",
            infer(_json_body([image_input(data=[2**1100] + [0.5] * 767)])),
            names=("beyond FP32's range",),
            statuses=(400,),
        ),
        served(
            "http-unknown-key",
            "an unknown top-level key",
            infer(_json_body([image_input()], nosuch=1)),
            expect="either",
            names=("nosuch",),
            statuses=(400,),
        ),
        served(
            "http-unknown-output",
            "an output that does not exist",
            infer(_json_body([image_input()], outputs=[{"name": "nosuch"}])),
            names=("nosuch",),
            statuses=(400,),
        ),
        served(
            "http-outputs-not-list",
            "outputs is a string",
            infer(_json_body([image_input()], outputs="logits")),
            names=("outputs",),
            statuses=(400,),
        ),
        served(
            "http-parameters-not-object",
            "parameters is a list",
            infer(_json_body([image_input()], parameters=[1])),
            names=("parameters",),
            statuses=(400,),
        ),
        served(
            "http-id-number",
            "id is a number",
            infer(_json_body([image_input()], id=5)),
            expect="either",
            names=("id",),
            statuses=(400,),
        ),
        served(
            "http-over-max-batch",
            "70 rows (profile max 32): split, or refused naming the limit",
            infer(_json_body([image_input(rows=70)])),
            expect="either",
            names=("32",),
        ),
        served(
            "http-content-type-text",
            "JSON sent as text/plain",
            lambda s: _request("POST", _infer_path(s), good, {"Content-Type": "text/plain"}),
            expect="either",
            statuses=(400, 415),
        ),
        served(
            "http-content-type-missing",
            "no Content-Type",
            lambda s: _request("POST", _infer_path(s), good),
            expect="either",
            statuses=(400, 415),
        ),
        served(
            "http-content-type-xml",
            "Content-Type application/xml",
            lambda s: _request("POST", _infer_path(s), good, {"Content-Type": "application/xml"}),
            expect="either",
            statuses=(400, 415),
        ),
        served(
            "http-body-too-big",
            "a 70 MiB body (limit 64)",
            lambda s: _request("POST", _infer_path(s), b" " * (70 << 20), json_type),
            names=("limit",),
            statuses=(413,),
        ),
        served(
            "http-content-length-lies-low",
            "Content-Length smaller than the body",
            lambda s: _request("POST", _infer_path(s), good, {**json_type, "Content-Length": "10"}),
            statuses=(400,),
        ),
        served(
            "http-content-length-negative",
            "Content-Length: -5",
            lambda s: _request("POST", _infer_path(s), good, {**json_type, "Content-Length": "-5"}),
            statuses=(400,),
            plain_ok=True,
        ),
        served(
            "http-content-length-words",
            "Content-Length: many",
            lambda s: _request("POST", _infer_path(s), good, {**json_type, "Content-Length": "many"}),
            statuses=(400,),
            plain_ok=True,
        ),
        served(
            "http-content-length-huge",
            "Content-Length: 10**12 with a short body",
            lambda s: _request("POST", _infer_path(s), good, {**json_type, "Content-Length": str(10**12)}),
            names=("limit",),
            statuses=(413, 408),
        ),
        served(
            "http-smuggling",
            "both Content-Length and Transfer-Encoding",
            lambda s: _request(
                "POST",
                _infer_path(s),
                b"5\r\nhello\r\n0\r\n\r\n",
                {**json_type, "Content-Length": "4", "Transfer-Encoding": "chunked"},
            ),
            statuses=(400,),
            plain_ok=True,
        ),
        served(
            "http-bad-chunk",
            "a chunked body with a bad chunk size",
            lambda s: _request(
                "POST", _infer_path(s), b"zz\r\nhello\r\n0\r\n\r\n", {**json_type, "Transfer-Encoding": "chunked"}
            ),
            statuses=(400,),
            plain_ok=True,
        ),
        served(
            "http-header-huge",
            "a 4 MB header",
            lambda s: _request("GET", "/v2/health/live", b"", {"X-Big": "a" * 4_000_000}),
            statuses=(400, 431),
            plain_ok=True,
        ),
        served(
            "http-forged-host",
            "a forged Host header",
            lambda s: _request("GET", "/v2/health/live", b"", {"Host": "evil.example"}),
            expect="success",
        ),
        served(
            "http-gzip-garbage",
            "Content-Encoding: gzip on a plain body",
            infer(good, {"Content-Encoding": "gzip"}),
            names=("gzip",),
            statuses=(400,),
        ),
        served(
            "http-gzip-bomb",
            "a gzip body that inflates to 256 MiB",
            infer(gzip.compress(b" " * (256 << 20)), {"Content-Encoding": "gzip"}),
            names=("limit",),
            statuses=(413,),
        ),
        served(
            "http-encoding-unknown",
            "Content-Encoding: br (not supported)",
            infer(good, {"Content-Encoding": "br"}),
            names=("br",),
            statuses=(400, 415),
        ),
        served(
            "http-binary-header-length-words",
            "Inference-Header-Content-Length: many",
            binary_infer(
                {"inputs": [image_input(data=None, parameters={"binary_data_size": 3072})]}, b"\0" * 3072, "many"
            ),
            names=("Inference-Header-Content-Length",),
            statuses=(400,),
        ),
        served(
            "http-binary-header-length-negative",
            "Inference-Header-Content-Length: -1",
            binary_infer({"inputs": []}, b"", "-1"),
            names=("Inference-Header-Content-Length",),
            statuses=(400,),
        ),
        served(
            "http-binary-header-length-beyond",
            "Inference-Header-Content-Length past the body",
            binary_infer({"inputs": []}, b"", "99999"),
            names=("Inference-Header-Content-Length",),
            statuses=(400,),
        ),
        served(
            "http-binary-size-mismatch",
            "binary_data_size 100 for a 3072-byte tensor",
            binary_infer(
                image_header([1, 3, 16, 16], 100),
                b"\0" * 100,
            ),
            names=("3072",),
            statuses=(400,),
        ),
        served(
            "http-binary-size-beyond-body",
            "binary_data_size beyond the body",
            binary_infer(
                image_header([1, 3, 16, 16], 3072),
                b"\0" * 10,
            ),
            names=("binary",),
            statuses=(400,),
        ),
        served(
            "http-binary-size-negative",
            "binary_data_size -3072",
            binary_infer(
                image_header([1, 3, 16, 16], -3072),
                b"\0" * 3072,
            ),
            names=("binary_data_size",),
            statuses=(400,),
        ),
        served(
            "http-binary-trailing-bytes",
            "binary data longer than the tensors",
            binary_infer(
                image_header([1, 3, 16, 16], 3072),
                b"\0" * 4000,
            ),
            names=("bytes",),
            statuses=(400,),
        ),
        served(
            "http-binary-huge-shape",
            "binary shape [0, 2**62]",
            binary_infer(
                image_header([0, 2**62], 0),
                b"",
            ),
            names=("shape",),
            statuses=(400,),
        ),
        served(
            "http-binary-nan",
            "NaN in binary data (passed as sent)",
            binary_infer(
                image_header([1, 3, 16, 16], 3072),
                b"\x00\x00\xc0\x7f" * 768,
            ),
            expect="success",
        ),
        served(
            "http-binary-header-garbage",
            "a binary request whose JSON header is garbage",
            lambda s: _request(
                "POST",
                _infer_path(s),
                b"garbage" + b"\0" * 3072,
                {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": "7"},
            ),
            names=("JSON",),
            statuses=(400,),
        ),
        served(
            "http-text-ids-negative",
            "token id -5",
            infer(_json_body(text_inputs([1, -5, 3]))),
            server="text",
            names=("-5",),
            statuses=(400,),
        ),
        served(
            "http-text-ids-beyond",
            "token id 100 (embedding of 100)",
            infer(_json_body(text_inputs([1, 100, 3]))),
            server="text",
            names=("100",),
            statuses=(400,),
        ),
        served(
            "http-text-ids-huge",
            "token id 10**12",
            infer(_json_body(text_inputs([1, 10**12, 3]))),
            server="text",
            names=("1000000000000",),
            statuses=(400,),
        ),
        served(
            "http-text-ids-float",
            "token ids as floats",
            infer(_json_body(text_inputs([1.5, 2.0, 3.0]))),
            server="text",
            statuses=(400,),
        ),
        served(
            "http-text-ids-int32",
            "token ids sent as INT32",
            infer(_json_body(text_inputs([1, 2, 3], "INT32"))),
            server="text",
            names=("INT32",),
            statuses=(400,),
        ),
        served(
            "http-text-seq-too-long",
            "a 65-token sequence (range 1..64)",
            infer(_json_body(text_inputs([1] * 65))),
            server="text",
            names=("65",),
            statuses=(400,),
        ),
        served(
            "http-text-good",
            "a good text request",
            infer(_json_body(text_inputs([1, 2, 3]))),
            server="text",
            expect="success",
            check=_has_outputs,
        ),
        Case(
            "http-bad-then-good",
            "service",
            "a malformed request, then a good one on the same connection",
            _custom("image", _bad_then_good),
            expect="success",
            server="image",
        ),
        Case(
            "http-disconnect-mid-body",
            "service",
            "a client hangs up mid-body: not counted as a 500",
            _custom("image", _disconnect_mid_body),
            names=("499",),
            server="image",
        ),
        Case(
            "http-slow-client",
            "service",
            "a client sending a byte a second is cut off",
            _custom("image", _slow_client),
            names=("closed",),
            server="image",
        ),
        Case(
            "http-huge-json-health",
            "service",
            "a 60 MB JSON body: refused, and /health keeps answering",
            _custom("image", _health_during_huge_json),
            names=("health",),
            statuses=(413,),
            server="image",
        ),
    ]


# ---------------------------------------------------------------- round three (issue 39): folders, models, clients

GRAPH = "engine_graph(f)"
RUNNER = "from trt_pipeline.pipeline.runners import load_runner\n"
CACHE = (
    RUNNER + "f = copy(IMAGE)\nload_runner(f).close()\n"
    "cache = f / 'served.json'\nrecord = json.loads(cache.read_text())\n"
    "batch, label = next(iter(record['ms'])), record['served']\n"
)
# A cache the runner did not trust must be named in its description: measured again, or ignored.
CACHE_NAMED = (
    "r = load_runner(f)\nr.infer(image_batch(2))\n"
    "if not ('served.json' in r.description and any(w in r.description for w in ('valid', 'replac', 'ignor'))): "
    "wrong('the cache it did not use is not named: ' + r.description[-160:])\nprint('OK')"
)
LOCK = (
    "folder = WORK / 'engines' / 'toy_models-tiny_cnn-fp32'\nfolder.mkdir(parents=True)\n"
    "victim = WORK / 'victim.txt'\nvictim.write_text('precious')\nlock = folder / '.build.lock'\n"
)
LOCK_KEPT = (
    "\nstatus = build()\nif victim.read_text() != 'precious': wrong('the build wrote through the lock into ' + str(victim))"
    "\nsys.exit(status)"
)
UNFINISHED = (
    RUNNER
    + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m.update(complete=False))\nlock = f / '.build.lock'\nlock.unlink(missing_ok=True)\n"
)


def _folder_cases() -> list[Case]:
    return [
        # the build lock: never written through a link, never blocking on what is not a plain file
        py(
            "lock-symlink",
            "folder",
            "the folder's .build.lock is a symlink to another file: the build must not empty it",
            LOCK + "lock.symlink_to(victim)" + LOCK_KEPT,
            names=(".build.lock", "link"),
        ),
        py(
            "lock-dangling-symlink",
            "folder",
            "the .build.lock is a link to a path that does not exist: the build must not create it",
            LOCK + "lock.symlink_to(WORK / 'created')"
            "\nstatus = build()\nif (WORK / 'created').exists(): wrong('the build created the file the lock links to')"
            "\nsys.exit(status)",
            names=(".build.lock", "link"),
        ),
        py(
            "lock-hard-link",
            "folder",
            "the .build.lock is a second name (hard link) of another file",
            LOCK + "os.link(victim, lock)" + LOCK_KEPT,
            names=(".build.lock",),
        ),
        py(
            "lock-directory",
            "folder",
            "the .build.lock is a directory",
            LOCK + "lock.mkdir()" + LOCK_KEPT,
            names=(".build.lock", "directory"),
        ),
        py(
            "lock-fifo",
            "folder",
            "the .build.lock is a FIFO",
            LOCK + "os.mkfifo(lock)" + LOCK_KEPT,
            names=(".build.lock", "FIFO"),
        ),
        py(
            "reader-lock-fifo",
            "folder",
            "an unfinished folder whose .build.lock is a FIFO: the reader must not wait on it",
            UNFINISHED + "os.mkfifo(lock)\nload_runner(f, 'onnxruntime')",
            names=("unfinished",),
        ),
        py(
            "reader-lock-directory",
            "folder",
            "an unfinished folder whose .build.lock is a directory",
            UNFINISHED + "lock.mkdir()\nload_runner(f, 'onnxruntime')",
            names=("unfinished",),
        ),
        py(
            "reader-lock-symlink",
            "folder",
            "an unfinished folder whose .build.lock links to a file holding a live pid: no build of this folder",
            UNFINISHED + "(WORK / 'pid').write_text(str(os.getpid()))\nlock.symlink_to(WORK / 'pid')\n"
            "load_runner(f, 'onnxruntime')",
            names=("unfinished",),
        ),
        # served.json: measured again where it does not validate, and said so
        py(
            "served-time-string",
            "runner",
            "served.json with 'fast' for a time (the right key)",
            CACHE + "record['ms'][batch][label] = 'fast'\ncache.write_text(json.dumps(record))\n" + CACHE_NAMED,
            expect="success",
        ),
        py(
            "served-time-null",
            "runner",
            "served.json with null for a time",
            CACHE + "record['ms'][batch][label] = None\ncache.write_text(json.dumps(record))\n" + CACHE_NAMED,
            expect="success",
        ),
        py(
            "served-time-true",
            "runner",
            "served.json with true for a time",
            CACHE + "record['ms'][batch][label] = True\ncache.write_text(json.dumps(record))\n" + CACHE_NAMED,
            expect="success",
        ),
        py(
            "served-batch-word",
            "runner",
            "served.json with a batch 'many'",
            CACHE
            + "record['ms']['many'] = record['ms'].pop(batch)\ncache.write_text(json.dumps(record))\n"
            + CACHE_NAMED,
            expect="success",
        ),
        py(
            "served-huge",
            "runner",
            "a 1.5 GiB served.json (sparse): not read at every load",
            CACHE + "os.truncate(cache, 1536 << 20)\n" + CACHE_NAMED,
            expect="success",
        ),
        py(
            "served-fifo",
            "runner",
            "served.json is a FIFO: the load must not wait on it",
            CACHE + "cache.unlink()\nos.mkfifo(cache)\n" + CACHE_NAMED,
            expect="success",
        ),
        # one refusal, one fix: the reader's finding passes through load_session
        py(
            "runner-graph-fifo",
            "runner",
            "model.onnx replaced by a FIFO",
            RUNNER + f"f = copy(IMAGE)\ng = f / {GRAPH}\ng.unlink()\nos.mkfifo(g)\nload_runner(f, 'onnxruntime')",
            names=("onnx",),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-symlink",
            "runner",
            "model.onnx replaced by a link to another model's graph",
            RUNNER + f"f = copy(IMAGE)\ng = f / {GRAPH}\ng.unlink()\n"
            "g.symlink_to(TEXT / engine_graph(TEXT))\n"
            "load_runner(f, 'onnxruntime')",
            names=("onnx",),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-truncated-auto",
            "runner",
            "model.onnx truncated, backend auto",
            RUNNER + f"f = copy(IMAGE)\ng = f / {GRAPH}\ng.write_bytes(g.read_bytes()[:100])\nload_runner(f)",
            names=("onnx",),
            forbidden=SECOND_FINDING,
        ),
        py(
            "runner-graph-truncated-cuda-runner",
            "runner",
            "model.onnx truncated, backend onnxruntime-cuda on device='cpu'",
            RUNNER + f"f = copy(IMAGE)\ng = f / {GRAPH}\ng.write_bytes(g.read_bytes()[:100])\n"
            "load_runner(f, 'onnxruntime-cuda', device='cpu')",
            names=("onnx",),
            forbidden=SECOND_FINDING,
        ),
        # a manifest that does not describe its graph: said so, not blamed on the caller's correct input
        py(
            "runner-manifest-input-shape-edited",
            "runner",
            "the manifest's input shape edited to [batch, 32]; a correct input sent",
            RUNNER + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m['inputs'][0].update(shape=['batch', 32]))\n"
            "load_runner(f, 'onnxruntime').infer(image_batch(2))",
            names=("manifest",),
        ),
        py(
            "runner-manifest-input-dtype-edited",
            "runner",
            "the manifest's input dtype edited to float64; a correct input sent",
            RUNNER + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m['inputs'][0].update(dtype='float64'))\n"
            "load_runner(f, 'onnxruntime').infer(image_batch(2))",
            names=("manifest",),
        ),
        py(
            "runner-manifest-output-renamed",
            "runner",
            "the manifest's output renamed",
            RUNNER + "f = copy(IMAGE)\nedit_manifest(f, lambda m: m['outputs'][0].update(name='probs'))\n"
            "load_runner(f, 'onnxruntime').infer(image_batch(2))",
            names=("manifest",),
        ),
        py(
            "runner-manifest-text-seq-fixed",
            "runner",
            "the text manifest's sequence axis edited to a fixed 12; a 5-token input sent",
            RUNNER
            + "f = copy(TEXT)\nedit_manifest(f, lambda m: [t.update(shape=['batch', 12]) for t in m['inputs']])\n"
            "load_runner(f, 'onnxruntime').infer({'input_ids': np.zeros((1, 5), np.int64), "
            "'attention_mask': np.ones((1, 5), np.float32)})",
            names=("manifest",),
        ),
        # load_runner's options: their types and counts
        *[
            py(
                f"runner-option-{name}",
                "runner",
                f"load_runner(..., {call})",
                RUNNER + f"load_runner(IMAGE, {call})",
                names=(word,),
            )
            for name, call, word in (
                ("device-int", "'onnxruntime-cuda', device=0", "device"),
                ("device-none", "'onnxruntime-cuda', device=None", "device"),
                ("sessions-str", "'onnxruntime-cuda', device='cpu', sessions='2'", "sessions"),
                ("sessions-zero", "'onnxruntime-cuda', device='cpu', sessions=0", "sessions"),
                ("threads-str", "'onnxruntime', intra_op_threads='2'", "intra_op_threads"),
                ("threads-bool", "'onnxruntime', intra_op_threads=True", "intra_op_threads"),
                ("split-str", "'onnxruntime', split_large_batches='no'", "split_large_batches"),
                ("graph-int", "'onnxruntime', graph=0", "graph"),
                ("providers-str", "'onnxruntime', providers='CPUExecutionProvider'", "providers"),
                ("providers-unknown", "'onnxruntime', providers=['NoSuchProvider']", "NoSuchProvider"),
                ("providers-empty", "'onnxruntime', providers=[]", "providers"),
                ("contexts-str", "'tensorrt', contexts='2'", "contexts"),
                ("torch-device-int", "'torch', device=3", "device"),
                ("torch-device-unknown", "'torch', device='nonsense'", "nonsense"),
            )
        ],
        py(
            "runner-option-providers-cuda-here",
            "runner",
            "providers=['CUDAExecutionProvider']: refused where it cannot run, never 'as requested' on the CPU",
            RUNNER + "r = load_runner(IMAGE, 'onnxruntime', providers=['CUDAExecutionProvider'])\n"
            "used = r.session.get_providers()\n"
            "if 'CUDAExecutionProvider' not in used and 'less' not in r.description: "
            "wrong(f'runs on {used}, described as: ' + r.description[:160])\nprint('OK', used)",
            expect="either",
            names=("CUDAExecutionProvider",),
        ),
    ]


def _model_cases() -> list[Case]:
    factory = "catalogue_factories:"
    return [
        build("model-deep-nesting", "a model of 1 200 nested modules", ["--model", factory + "deep"], names=("deep",)),
        build(
            "model-deep-sequential",
            "1 200 nn.Sequential nested in each other",
            ["--model", factory + "deep_sequential"],
            names=("deep",),
        ),
        build(
            "model-recursing-forward",
            "forward() recursing 5 000 times",
            ["--model", factory + "recursing"],
            names=("recursion",),
        ),
        build(
            "model-returns-empty-tuple",
            "forward() returns ()",
            ["--model", factory + "returns_empty_tuple"],
            names=("()",),
        ),
        build(
            "model-returns-empty-dict",
            "forward() returns {}",
            ["--model", factory + "returns_empty_dict"],
            names=("{}",),
        ),
        build(
            "factory-float64-default",
            "a factory that calls torch.set_default_dtype(torch.float64), PRECISION=fp16",
            ["--model", factory + "float64_default", "--precision", "fp16"],
            names=("float64",),
        ),
        build(
            "model-float64",
            "a float64 model (.double()), PRECISION=fp16",
            ["--model", factory + "explicit_double", "--precision", "fp16"],
            names=("float64",),
        ),
        py(
            "factory-changes-directory",
            "cli",
            "a factory that calls os.chdir: the artifacts must land in OUT (relative)",
            "status = build('--model', 'catalogue_factories:changes_directory', out='engines')\n"
            "if status: sys.exit(status)\n"
            "if not (WORK / 'engines' / 'catalogue_factories-changes_directory-fp32' / 'engine.plan').is_file(): "
            "wrong('done, but no engine under OUT')\nprint('OK')",
            expect="success",
        ),
        py(
            "factory-leaves-a-thread",
            "cli",
            "a factory that leaves a non-daemon thread running: the command must still exit",
            "import subprocess\n"
            "argv = ['all', '--model', 'catalogue_factories:leaves_a_thread', '--precision', 'fp32', '--batch', '1:2:4']\n"
            "done = subprocess.run([sys.executable, '-m', 'trt_pipeline', *argv, '--out', str(WORK / 'engines')], "
            "capture_output=True, text=True)\n"
            "sys.stderr.write(done.stderr)\nprint(done.stdout)\nsys.exit(done.returncode)",
            expect="success",
        ),
    ]


# ---------------------------------------------------------------- service: what real clients see

_GRPC_STATUS = {
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def _answer(status: int, message: str) -> Outcome:
    return Outcome(status=status, body=json.dumps({"error": message}))


def _grpc_refusal(error: Any) -> Outcome:
    code = error.code().name
    return _answer(_GRPC_STATUS.get(code, 500), f"{code}: {error.details()}")


def _grpc_garbage(method: str) -> Callable[[Any], Outcome]:
    def flow(server: Any) -> Outcome:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            try:
                call(b"\xff\xfe garbage \x00\x01", timeout=HTTP_LIMIT_S)
            except grpc.RpcError as error:
                return _grpc_refusal(error)
        return _answer(200, "answered garbage")

    return flow


def _grpc_infer(shape: list[int], model: str | None = None) -> Callable[[Any], Outcome]:
    def flow(server: Any) -> Outcome:
        import numpy as np
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        given = grpcclient.InferInput("input", shape, "FP32")
        given.set_data_from_numpy(np.zeros(shape, np.float32))
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
            try:
                client.infer(model or server.model, [given], client_timeout=HTTP_LIMIT_S)
            except InferenceServerException as error:
                code = (error.status() or "").removeprefix("StatusCode.")
                return _answer(_GRPC_STATUS.get(code, 500), f"{code}: {error.message()}")
        return _answer(200, "answered")

    return flow


def _grpc_typed_and_raw(server: Any) -> Outcome:
    """One input given both as fp32_contents and as raw_input_contents (Triton refuses it)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    tensor = service_pb2.ModelInferRequest.InferInputTensor(
        name="input", datatype="FP32", shape=[1, 3, 16, 16], contents={"fp32_contents": [1.0] * 768}
    )
    request = service_pb2.ModelInferRequest(
        model_name=server.model, inputs=[tensor], raw_input_contents=[bytes(4 * 768)]
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=HTTP_LIMIT_S)
        except grpc.RpcError as error:
            return _grpc_refusal(error)
    return _answer(200, "answered from one of the two")


def _grpc_burst(server: Any, calls: int = 300) -> Outcome:
    """`calls` calls at once on one tritonclient channel, within --max-connections: every one answered?"""
    import threading
    from collections import Counter

    import numpy as np
    import tritonclient.grpc as grpcclient

    failures: Counter = Counter()
    answered = threading.Semaphore(0)

    def done(result: Any, error: Any) -> None:
        if error is not None:
            failures[f"{error.status()} {error.message()}"] += 1
        answered.release()

    given = grpcclient.InferInput("input", [1, 3, 16, 16], "FP32")
    given.set_data_from_numpy(np.zeros((1, 3, 16, 16), np.float32))
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        for _ in range(calls):
            client.async_infer(server.model, [given], done, client_timeout=HTTP_LIMIT_S)
        for _ in range(calls):
            if not answered.acquire(timeout=HTTP_LIMIT_S * 3):
                return Outcome(timed_out=True)
    if failures:
        return _answer(503, f"{sum(failures.values())} of {calls} failed: {dict(failures)}")
    return _answer(200, f"{calls} answered")


def _whole_body_then_read(chunked: bool) -> Callable[[Any], Outcome]:
    """http.client's way: the whole body sent (22 MB of JSON, the JSON limit is 8 MiB), then the answer read."""

    def flow(server: Any) -> Outcome:
        body = _json_body([image_input(rows=6000)])
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_LIMIT_S * 3)
        try:
            content: Any = iter([body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]) if chunked else body
            headers = {"Content-Type": "application/json"}
            connection.request("POST", _infer_path(server), body=content, headers=headers, encode_chunked=chunked)
            answer = connection.getresponse()
            return Outcome(status=answer.status, body=answer.read().decode("utf-8", "replace"))
        except (OSError, http.client.HTTPException) as error:
            return Outcome(transport_error=f"{type(error).__name__}: {error}")
        finally:
            connection.close()

    return flow


def _tritonclient_big_binary(server: Any) -> Outcome:
    """tritonclient.http sending 70 MiB of binary data (the body limit is 64 MiB): does it read the 413?"""
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    values = np.zeros((1, 70 * 1024 * 1024 // 4), np.float32)
    given = httpclient.InferInput("input", list(values.shape), "FP32")
    given.set_data_from_numpy(values)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=HTTP_LIMIT_S * 3)
    try:
        client.infer(server.model, [given])
    except InferenceServerException as error:
        status = int(error.status()) if (error.status() or "").isdigit() else None
        return Outcome(status=status, body=json.dumps({"error": error.message() or ""}), transport_error=str(error))
    except Exception as error:  # what tritonclient raises when the connection is reset
        return Outcome(transport_error=f"{type(error).__name__}: {error}")
    finally:
        client.close()
    return _answer(200, "answered")


def _expect_continue(server: Any) -> Outcome:
    """A client that waits for `100 Continue` before a 100 MiB body: the 413 must come first, without the body."""
    head = _request("POST", _infer_path(server), b"", {"Content-Type": "application/json"}, length=False)
    head = head.replace(b"\r\n\r\n", f"\r\nContent-Length: {100 << 20}\r\nExpect: 100-continue\r\n\r\n".encode())
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_LIMIT_S) as connection:
        connection.sendall(head)
        answer = connection.makefile("rb").read().decode("utf-8", "replace")
    status_line, _, rest = answer.partition("\r\n")
    if not status_line.startswith("HTTP/1.1 413"):
        return Outcome(status=100 if " 100 " in status_line else 500, body=json.dumps({"error": answer[:200]}))
    return Outcome(status=413, body=rest.partition("\r\n\r\n")[2])


def _service_client_cases() -> list[Case]:
    return [
        # JSON true/false are not numbers
        served(
            "http-data-bool-among-floats",
            "true among FP32 data",
            infer(_json_body([image_input(data=[0.5] * 5 + [True] + [0.5] * 762)])),
            names=("true",),
            statuses=(400,),
        ),
        served(
            "http-data-bool-nested",
            "false nested in FP32 data",
            infer(_json_body([image_input(data=[[[0.5] * 767 + [False]]])])),
            names=("true",),
            statuses=(400,),
        ),
        served(
            "http-text-ids-bool",
            "true among INT64 token ids",
            infer(_json_body([{**text_inputs([1, 2, 3])[0], "data": [1, True, 3]}, text_inputs([1, 2, 3])[1]])),
            server="text",
            names=("true",),
            statuses=(400,),
        ),
        # a body over the limit, as real clients send it
        Case(
            "http-body-too-big-http-client",
            "service",
            "http.client sends a 22 MB JSON body (limit 8 MiB) whole, then reads",
            _custom("image", _whole_body_then_read(chunked=False)),
            names=("limit",),
            statuses=(413,),
            server="image",
        ),
        Case(
            "http-body-too-big-chunked-http-client",
            "service",
            "http.client sends a 22 MB JSON body chunked, then reads",
            _custom("image", _whole_body_then_read(chunked=True)),
            names=("limit",),
            statuses=(413,),
            server="image",
        ),
        Case(
            "http-body-too-big-tritonclient",
            "service",
            "tritonclient.http sends 70 MiB of binary data (limit 64 MiB)",
            _custom("image", _tritonclient_big_binary),
            names=("limit",),
            statuses=(413,),
            server="image",
        ),
        Case(
            "http-expect-continue-too-big",
            "service",
            "Expect: 100-continue with a 100 MiB Content-Length: 413 without asking for the body",
            _custom("image", _expect_continue),
            names=("limit",),
            statuses=(413,),
            server="image",
        ),
        # gRPC
        Case(
            "grpc-garbage-infer",
            "service",
            "gRPC ModelInfer with bytes that are no protobuf message",
            _custom("image", _grpc_garbage("ModelInfer")),
            names=("protobuf",),
            statuses=(400,),
            server="image",
        ),
        Case(
            "grpc-garbage-live",
            "service",
            "gRPC ServerLive with bytes that are no protobuf message",
            _custom("image", _grpc_garbage("ServerLive")),
            names=("protobuf",),
            statuses=(400,),
            server="image",
        ),
        Case(
            "grpc-unknown-model",
            "service",
            "gRPC infer on a model not served",
            _custom("image", _grpc_infer([1, 3, 16, 16], model="nosuch")),
            names=("nosuch",),
            statuses=(404,),
            server="image",
        ),
        Case(
            "grpc-wrong-shape",
            "service",
            "gRPC infer with shape [1, 4, 16, 16]",
            _custom("image", _grpc_infer([1, 4, 16, 16])),
            names=("shape",),
            statuses=(400,),
            server="image",
        ),
        Case(
            "grpc-typed-and-raw",
            "service",
            "gRPC infer with one input in both fp32_contents and raw_input_contents (the typed values were ignored)",
            _custom("image", _grpc_typed_and_raw),
            names=("both typed contents and raw_input_contents",),
            statuses=(400,),
            server="image",
        ),
        Case(
            "grpc-burst-one-channel",
            "service",
            "300 gRPC calls at once on one tritonclient channel (within --max-connections): all answered",
            _custom("image", _grpc_burst),
            expect="success",
            server="image",
        ),
    ]
