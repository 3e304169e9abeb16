"""The README's and docs' commands name what exists: every `make` target and variable is the Makefile's, every
`trt-pipeline` subcommand and option is the command line's, and every link to a docs page resolves to a file.
(The README's Python blocks run in tests/end_to_end/test_readme.py.)"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from trt_pipeline.pipeline.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAKEFILE = (ROOT / "Makefile").read_text()
# Pages about one subcommand: every --option they name is that subcommand's.
PAGE_COMMAND = {"serving.md": "serve", "latency.md": "bench"}


def commands(prefix: str) -> list[tuple[str, str]]:
    """(page, command) for every `prefix ...` in a code span or a shell block line of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        spans = re.findall(r"`([^`\n]+)`", text) + re.findall(
            r"^(\S.*)$", "\n".join(re.findall(r"```sh\n(.*?)```", text, re.S)), re.M
        )
        found += [(page.name, span[span.index(prefix) :].split("#")[0]) for span in spans if prefix + " " in span]
    return found


def subcommand_options(subcommand: str) -> set[str] | None:
    """The options `trt-pipeline <subcommand> --help` lists, or None when there is no such subcommand."""
    help_text, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.redirect_stderr(errors), pytest.raises(SystemExit) as exit:
        build_parser(subcommand).parse_args([subcommand, "--help"])
    return set(re.findall(r"--[a-z][a-z0-9-]*", help_text.getvalue())) if exit.value.code == 0 else None


def test_every_make_target_and_variable_named_exists_in_the_makefile():
    named = commands("make")
    assert len(named) > 10
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", MAKEFILE, re.M))
    for page, command in named:
        words = re.sub(r"-o \S+|-[a-z]\b", "", command).split()[1:]  # make's own flags (-o FILE, -s) are not targets
        variables = [word.split("=")[0] for word in words if re.match(r"[A-Z_0-9]+=", word)]
        target = next(word for word in words if "=" not in word)
        assert target in targets, f"{page}: `{command}` names no Makefile target"
        for variable in variables:
            assert re.search(rf"\b{variable}\b", MAKEFILE), f"{page}: `{command}`: the Makefile has no {variable}"


def test_every_trt_pipeline_subcommand_and_option_named_exists():
    named = commands("trt-pipeline")
    assert len(named) > 5
    for page, command in named:
        words = command.split()
        if len(words) < 2 or words[1].startswith("-") or words[1].startswith("<"):
            continue  # `trt-pipeline --help`, `trt-pipeline <command> --help`
        options = subcommand_options(words[1])
        assert options is not None, f"{page}: `{command}`: no subcommand {words[1]!r}"
        assert {w.split("=")[0] for w in words if w.startswith("--")} <= options, f"{page}: `{command}`"


@pytest.mark.parametrize("page, subcommand", sorted(PAGE_COMMAND.items()))
def test_every_option_a_commands_page_names_is_that_commands(page: str, subcommand: str):
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", (ROOT / "docs" / page).read_text()))
    assert named and named <= subcommand_options(subcommand), sorted(named - subcommand_options(subcommand))


def test_every_link_to_a_docs_page_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"
    assert "](docs/" in (ROOT / "README.md").read_text()
