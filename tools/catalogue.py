"""The bad-input catalogue (issue 12): bad input and faults thrown at one checkout of the pipeline, each classified.

    .venv/bin/python tools/catalogue.py --code . --work /tmp/catalogue/after --out /tmp/catalogue/after.json
    .venv/bin/python tools/catalogue.py --compare before.json after.json > table.md
    .venv/bin/python tools/catalogue.py --merge after.json rerun.json --out after.json   (after a run with --only)

Each case runs in its own process under a time limit: the command line and the runner/Triton scripts in a child
forked from a warm interpreter (tools/catalogue_forker.py: torch is imported once, not per case), `make` as a
plain subprocess; the service cases are requests to one started server.  PYTHONPATH points at the checkout
under test (--code), so an older checkout can be measured with this tool; the working directory is the case's
own scratch folder (make's is the checkout).  The cases are in tests/bad_inputs/cases.py, beside the bad-input
tests that share their tables; each outcome is one of:

    clear      exit 2 (or a 4xx) with a message that names the problem and a fix, no traceback
    recovered  a correct success where succeeding is right
    traceback  a Python traceback
    unclear    an error without the problem or the fix, another exit status, a 500, or a refusal of good input
    silent     success where it must fail, or a wrong result
    stall      still running at the time limit
    crash      killed by a signal (or the server died)
    code-ran   an injection's marker file appeared
    n/a        the case does not apply to this checkout (an option or API it does not have)

This is a tool, not a test: it prints and writes what it finds (JSON and a markdown table) and exits 0.  The
CI's catalogue is tests/bad_inputs/test_bad_inputs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
# The tool's own tree, whatever --code names: the fixtures beside it, the case tables the tests use.
sys.path[:0] = [str(TOOLS), str(TOOLS.parent)]

from catalogue_fixtures import Fixtures  # noqa: E402

from tests.bad_inputs.cases import Case, Outcome, cases  # noqa: E402

VERDICTS = ("clear", "recovered", "traceback", "unclear", "silent", "stall", "crash", "code-ran", "n/a", "tool-error")
BAD = ("traceback", "unclear", "silent", "stall", "crash", "code-ran")
TRACEBACK = "Traceback (most recent call last)"
# What a Python case's script does around its body: a PipelineError is printed as the command line prints it.
PRELUDE = """\
import json, os, shutil, sys
from pathlib import Path
import numpy as np
from trt_pipeline.pipeline.core.errors import PipelineError
IMAGE, TEXT, WORK, MARKER = (Path(a) for a in sys.argv[1:5])
def wrong(why):
    print("WRONG: " + why)
    sys.exit(3)
def copy(folder):
    target = WORK / folder.name
    shutil.copytree(folder, target)
    return target
def edit_manifest(folder, change):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
def engine_graph(folder):  # the file of the graph the engine is built from, as the manifest's records say
    manifest = json.loads((folder / "manifest.json").read_text())
    engine = [r for r in manifest["graphs"] if r["target"] == "engine" and r["precision"] == manifest["precision"]]
    return next(r["file"] for r in engine if r.get("postprocess") in (None, "none"))
def image_batch(rows):
    return {"input": np.random.default_rng(0).standard_normal((rows, 3, 16, 16), dtype=np.float32)}
def build(*options, out=None):  # the command line's `all` on tiny_cnn into WORK/engines (or out): its exit status
    from trt_pipeline.pipeline import cli
    from tests.bad_inputs.cases import build_argv
    batch = [] if any(word.partition("=")[0] == "--batch" for word in options) else ["--batch", "1:2:4"]
    return cli.main(build_argv([*batch, *options], str(out or WORK / "engines")))
try:
"""
EPILOGUE = """
except PipelineError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
"""


class Forker:
    """tools/catalogue_forker.py for one checkout: cases fork from an interpreter that has imported torch."""

    def __init__(self, code: Path, env: dict[str, str]):
        script = TOOLS / "catalogue_forker.py"
        self.process = subprocess.Popen(
            [sys.executable, str(script)], cwd=code, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def run(
        self, request: dict, argv: list[str], context: Context, limit: float, fsize: int | None
    ) -> tuple[int, str, str, bool]:
        out, err = context.work / "stdout.txt", context.work / "stderr.txt"
        # The case's own folder as the working directory: a relative path a case writes to lands there.
        request = {**request, "argv": argv, "cwd": str(context.work), "env": context.env, "limit": limit}
        request.update(stdout=str(out), stderr=str(err), fsize=fsize)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return reply["rc"], read(out), read(err), reply["timed_out"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


@dataclass
class Context:
    """What a case runs against: the checkout, the fixtures built with it, its own scratch folder."""

    code: Path
    fixtures: Fixtures
    work: Path
    marker: Path
    env: dict[str, str] = field(default_factory=dict)

    def fill(self, text: str) -> str:
        return text.format(
            marker=self.marker,
            work=self.work,
            image=self.fixtures.image,
            text=self.fixtures.text,
            files=self.fixtures.files,
            full=self.fixtures.full_disk,
            readonly=self.fixtures.read_only,
        )

    forker: Forker | None = None

    def run(self, argv: list[str], limit: float, fsize: int | None = None) -> Outcome:
        """Run argv: `python -m trt_pipeline ...` and case scripts in a child of the warm forker, anything else
        (make) as a plain subprocess."""
        started = time.monotonic()
        if self.forker is not None and argv[0] == sys.executable:
            request = {"module": argv[2]} if argv[1] == "-m" else {"path": argv[1]}
            arguments = argv[3:] if argv[1] == "-m" else argv[2:]
            rc, out, err, timed_out = self.forker.run(request, arguments, self, limit, fsize)
        else:
            rc, out, err, timed_out = self._popen(argv, limit, fsize)
        return Outcome(rc=rc, out=out, err=err, timed_out=timed_out, seconds=time.monotonic() - started)

    def _popen(self, argv: list[str], limit: float, fsize: int | None) -> tuple[int, str, str, bool]:
        def limit_file_size() -> None:  # the child's own limit, for a disk that fills up
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        process = subprocess.Popen(
            argv,
            cwd=self.code,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=limit_file_size,
            start_new_session=True,
        )
        try:
            out, err = process.communicate(timeout=limit)
            return process.returncode, out, err, False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the case's own process group: what it started, nothing else
            out, err = process.communicate()
            return process.returncode, out, err, True

    def python(self, body: str, limit: float) -> Outcome:
        script = PRELUDE + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ") + EPILOGUE
        path = self.work / "case.py"
        path.write_text(script)
        argv = [sys.executable, str(path), str(self.fixtures.image), str(self.fixtures.text), str(self.work)]
        return self.run([*argv, str(self.marker)], limit)


def classify(case: Case, outcome: Outcome, marker: Path) -> tuple[str, str]:
    """(verdict, the line that shows why) for one case's outcome."""
    if marker.exists():
        return "code-ran", f"{marker.name} appeared"
    if outcome.timed_out:
        return "stall", f"still running after {outcome.seconds:.0f} s"
    if outcome.status is not None or outcome.transport_error:
        return _classify_http(case, outcome)
    text = f"{outcome.err}\n{outcome.out}"
    if outcome.rc is not None and outcome.rc < 0:
        return "crash", f"killed by signal {-outcome.rc}"
    if TRACEBACK in text:
        return "traceback", _last_line(outcome.err)
    if "WRONG:" in outcome.out:
        return "silent", outcome.out.split("WRONG:", 1)[1].strip().splitlines()[0]
    message = _error_lines(outcome.err)
    if outcome.rc == 0:
        if case.expect == "error":
            return "silent", "exit 0: " + _last_line(outcome.out or outcome.err)
        return "recovered", _last_line(outcome.out) or "exit 0"
    if case.expect == "success":
        return "unclear", f"refused good input (exit {outcome.rc}): {message}"
    lowered = outcome.err.lower()
    has_fix = "fix:" in outcome.err or "usage:" in outcome.err
    missing = [word for word in case.names if word.lower() not in lowered]
    contradiction = [word for word in case.forbidden if word.lower() in lowered]
    if contradiction:  # a second finding that says the opposite of the first: one refusal, one fix
        return "unclear", f"contradicts itself ({contradiction}): {message}"
    if outcome.rc == 2 and "error:" in outcome.err and has_fix and not missing:
        return "clear", message
    why = f"exit {outcome.rc}" + ("" if has_fix else ", no fix") + (f", does not name {missing}" if missing else "")
    return "unclear", f"{why}: {message}"


def _classify_http(case: Case, outcome: Outcome) -> tuple[str, str]:
    if outcome.server_died:
        return "crash", "the server process died"
    if outcome.status is None:
        return ("unclear" if case.expect != "success" else "unclear"), f"no response: {outcome.transport_error}"
    status, body = outcome.status, outcome.body[:300].replace("\n", " ")
    shown = f"{status} {body}"
    if 200 <= status < 300:
        if case.expect == "error":
            return "silent", shown
        if outcome.wrong:
            return "silent", f"{outcome.wrong}: {shown}"
        return "recovered", shown
    if case.expect == "success":
        return "unclear", f"refused good input: {shown}"
    if status >= 500 and status not in case.statuses:
        return "unclear", shown
    if case.plain_ok and 400 <= status < 500 and (not case.statuses or status in case.statuses):
        return "clear", shown  # refused by the HTTP layer before the app: its plain-text 400 is the answer
    missing = [word for word in case.names if word.lower() not in body.lower()]
    if '"error"' not in body or missing:
        return "unclear", shown + (f" (does not name {missing})" if missing else " (no error message)")
    if case.statuses and status not in case.statuses:
        return "unclear", f"status {status}, expected {case.statuses}: {body}"
    return "clear", shown


def _error_lines(err: str) -> str:
    lines = [line.strip() for line in err.strip().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), max(len(lines) - 2, 0))
    return " / ".join(lines[start : start + 2])[:300]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_case(case: Case, code: Path, fixtures: Fixtures, work: Path, env: dict[str, str], forkers: queue.Queue) -> dict:
    case_work = work / "cases" / case.id
    case_work.mkdir(parents=True, exist_ok=True)
    marker = case_work / "INJECTED"
    context = Context(code, fixtures, case_work, marker, {**env, "CATALOGUE_MARKER": str(marker)})
    reason = case.not_applicable(code, fixtures)
    if reason:
        verdict, detail, seconds = "n/a", reason, 0.0
    else:
        context.forker = forkers.get()
        try:
            outcome = case.run(context)
            verdict, detail = classify(case, outcome, context.marker)
            seconds = outcome.seconds
        except Exception as error:  # the tool's own failure on one case must not lose the others' rows
            verdict, detail, seconds = "tool-error", f"{type(error).__name__}: {error}", 0.0
        finally:
            forkers.put(context.forker)
    print(f"{verdict:10} {case.id:45} {detail[:110]}", flush=True)
    return {
        "id": case.id,
        "area": case.area,
        "what": case.what,
        "expect": case.expect,
        "verdict": verdict,
        "detail": detail,
        "seconds": round(seconds, 1),
    }


def run_catalogue(code: Path, work: Path, jobs: int, only: str | None) -> list[dict]:
    shutil.rmtree(work / "cases", ignore_errors=True)  # a case's scratch folder starts empty
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{work / 'files'}", "CATALOGUE_CODE": str(code)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("TRUST_MODEL_FILE", None)
    wanted = only.split(",") if only else None
    selected = [case for case in cases() if wanted is None or any(part in case.id for part in wanted)]
    fixtures = Fixtures.build(code, work, env)
    forkers: queue.Queue[Forker] = queue.Queue()
    try:
        for _ in range(jobs):
            forkers.put(Forker(code, env))
        local = [case for case in selected if case.server is None]
        served = [case for case in selected if case.server is not None]
        with ThreadPoolExecutor(jobs) as pool:
            rows = list(pool.map(lambda case: run_case(case, code, fixtures, work, env, forkers), local))
        if served:
            with fixtures.servers(env) as servers:
                for case in served:
                    case.servers = servers
                    rows.append(run_case(case, code, fixtures, work, env, forkers))
    finally:
        fixtures.release()
        while not forkers.empty():
            forkers.get().close()
    return rows


def counts(rows: list[dict]) -> dict[str, int]:
    return {verdict: sum(row["verdict"] == verdict for row in rows) for verdict in VERDICTS}


def markdown(rows: list[dict]) -> str:
    lines = ["| case | area | expected | verdict | what happened |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['id']} | {row['area']} | {row['expect']} | {row['verdict']} | {_cell(row['detail'])} |")
    totals = ", ".join(f"{verdict} {n}" for verdict, n in counts(rows).items() if n)
    return "\n".join([*lines, "", f"{len(rows)} cases: {totals}"]) + "\n"


def compare(runs: dict[str, list[dict]]) -> str:
    """The counts, then one row per case of the last run: its verdict in every run and what the last one said."""
    names, last = list(runs), list(runs.values())[-1]
    by_id = {name: {row["id"]: row for row in rows} for name, rows in runs.items()}
    totals = {name: counts(rows) for name, rows in runs.items()}
    lines = ["| verdict | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {v} | " + " | ".join(str(totals[name][v]) for name in names) + " |" for v in VERDICTS]
    bad = " | ".join(f"**{sum(totals[name][v] for v in BAD)}**" for name in names)
    lines += [f"| **bad: {', '.join(BAD)}** | {bad} |", ""]
    lines += ["| case | what | " + " | ".join(names) + f" | {names[-1]}: what happened |"]
    lines += ["|---" * (len(names) + 3) + "|"]
    for row in last:
        verdicts = " | ".join(by_id[name].get(row["id"], {"verdict": "-"})["verdict"] for name in names)
        lines.append(f"| {row['id']} | {_cell(row['what'])} | {verdicts} | {_cell(row['detail'])} |")
    return "\n".join(lines) + "\n"


def merge(base: list[dict], patch: list[dict]) -> list[dict]:
    """`base` with the rows of a partial rerun (--only) put in place of the rows of the same id."""
    newer = {row["id"]: row for row in patch}
    return [newer.get(row["id"], row) for row in base] + [
        row for row in patch if row["id"] not in {r["id"] for r in base}
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:220]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, default=Path.cwd(), help="the checkout to run the cases against")
    parser.add_argument("--work", type=Path, default=Path("/tmp/catalogue/run"), help="scratch folder (emptied)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here, and a .md table beside it")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (the server's cases run one by one)")
    parser.add_argument("--only", help="only the cases whose id contains this (or one of these, comma-separated)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--compare", nargs="+", type=Path, metavar="RUN", help="print the table of these runs' JSON")
    parser.add_argument("--merge", nargs=2, type=Path, metavar=("BASE", "PATCH"), help="put PATCH's rows into BASE")
    args = parser.parse_args()
    if args.list:
        for case in cases():
            print(f"{case.id:45} {case.area:8} {case.expect:8} {case.what}")
        return 0
    if args.compare:
        print(compare({path.stem: json.loads(path.read_text()) for path in args.compare}), end="")
        return 0
    if args.merge:
        base, patch = (json.loads(path.read_text()) for path in args.merge)
        rows = merge(base, patch)
        (args.out or args.merge[0]).write_text(json.dumps(rows, indent=1) + "\n")
        print(markdown(rows).splitlines()[-1])
        return 0
    rows = run_catalogue(args.code.resolve(), args.work.resolve(), args.jobs, args.only)
    table = markdown(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table)
    print(table.splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
