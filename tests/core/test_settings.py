"""Each setting declared once (pipeline/core/settings.py) and followed everywhere: the command line's options, the
Makefile's arguments and defaults, the reuse key, the rebuild command, docs/options.md; a setting given for a
precision it does not change is refused; a message names settings in the words of the front end that shows it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trt_pipeline.pipeline import cli
from trt_pipeline.pipeline.core.errors import PipelineError
from trt_pipeline.pipeline.core.mentions import COMMAND_LINE, MAKE, PYTHON, option_of, render, spoken_in
from trt_pipeline.pipeline.core.precision import Precision
from trt_pipeline.pipeline.core.settings import (
    DECLARED,
    DEFAULTS,
    SWITCH_OFF,
    SWITCH_ON,
    Postprocess,
    Settings,
    deciding,
    engine_command,
    mention,
)
from trt_pipeline.pipeline.folder.rebuild import make_engine_command
from trt_pipeline.pipeline.stages.sequence import reuse_key

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
SWITCHES = {name for name, default in DEFAULTS.items() if isinstance(default, bool)}
TINY = "tests.helpers.toy_models:tiny_cnn"


def _make_list(name: str) -> list[str]:
    """A `NAME := A B \\ C` list of the Makefile, continuation lines joined."""
    match = re.search(rf"^{name} := ((?:.*\\\n)*.*)$", MAKEFILE, re.M)
    assert match, f"the Makefile has no {name}"
    return match.group(1).replace("\\\n", " ").split()


def _make(*arguments: str, dry_run: bool = False) -> subprocess.CompletedProcess:
    flags = ["-n"] if dry_run else ["-s"]
    command = ["make", *flags, "-o", ".venv/.installed", "engine", *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------- one declaration, followed


def test_every_setting_is_declared_with_a_variable_and_an_option_of_its_own():
    assert set(DECLARED) == set(DEFAULTS) and "float_search" in DECLARED
    variables = [declared.make for declared in DECLARED.values()]
    assert len(set(variables)) == len(variables)
    for name in SWITCHES:  # a switch sets the value opposite its default: NO_<...> for those on by default
        assert DECLARED[name].make.startswith("NO_") == DEFAULTS[name], name


def test_the_makefile_lists_every_setting_and_its_defaults_are_the_declared_ones():
    values, switches = _make_list("SETTING_VALUES"), _make_list("SETTING_SWITCHES")
    assert sorted(values) == sorted(DECLARED[name].make for name in DECLARED if name not in SWITCHES)
    assert sorted(switches) == sorted(DECLARED[name].make for name in SWITCHES)
    defaults = dict(re.findall(r"^([A-Z_0-9]+) \?=[ \t]*(.*)$", MAKEFILE, re.M))
    by_variable = {declared.make: name for name, declared in DECLARED.items()}
    for variable in set(defaults) & set(by_variable):
        assert defaults[variable] == str(DEFAULTS[by_variable[variable]]), variable


def test_make_engine_passes_each_setting_to_its_declared_option():
    given = {name: f"v{index}" for index, name in enumerate(DECLARED) if name not in SWITCHES}
    assignments = [f"{DECLARED[name].make}={value}" for name, value in given.items()]
    assignments += [f"{DECLARED[name].make}=1" for name in SWITCHES]
    command = _make(*assignments, dry_run=True)
    assert command.returncode == 0, command.stderr
    for name, value in given.items():
        assert f"'{option_of(DECLARED[name].make)}={value}'" in command.stdout, name
    for name in SWITCHES:  # a switch's word as given: Python reads it (settings.read_switch)
        assert f"'{option_of(DECLARED[name].make)}=1'" in command.stdout, name
    # Unset, only the variables with a default here are passed; one set to nothing is passed as nothing.
    bare = _make("CALIB=", dry_run=True).stdout
    assert "'--calib='" in bare and "--smooth" not in bare and "'--model=resnet'" in bare


def test_no_setting_variable_runs_what_it_holds(tmp_path):
    marker = tmp_path / "INJECTED"
    payload = f"$(shell touch {marker})"  # make would run it were the value expanded; the shell, were it unquoted
    command = _make(*(f"{declared.make}={payload}" for declared in DECLARED.values()), dry_run=True)
    assert command.returncode == 0, command.stderr
    assert not marker.exists() and f"'--smooth={payload}'" in command.stdout


def test_the_command_line_has_each_declared_option_and_no_switch_shows_a_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["engine", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert {option_of(declared.make) for declared in DECLARED.values()} <= set(re.findall(r"--[a-z0-9-]+", text))
    assert "(default: True)" not in text and "int8: do not try leaving the op" in text and "[NO_FLOAT_SEARCH]" in text


def test_the_options_table_has_a_row_per_setting_that_agrees_with_its_declaration():
    lines = (ROOT / "docs" / "options.md").read_text().splitlines()
    rows = [
        [cell.strip() for cell in line.split("|")[1:5]] for line in lines if re.match(r"\| `[A-Z_0-9]+` \| `--", line)
    ]
    by_variable = {
        variable.strip("`"): (option.strip("`"), default, precisions) for variable, option, default, precisions in rows
    }
    assert sorted(by_variable) == sorted(declared.make for declared in DECLARED.values())
    for name, declared in DECLARED.items():
        shown = "" if DEFAULTS[name] is None or name in SWITCHES else f"`{DEFAULTS[name]}`"
        changes = "all" if declared.precisions == tuple(Precision) else ", ".join(declared.precisions)
        assert by_variable[declared.make] == (option_of(declared.make), shown, changes), declared.make


def test_the_options_doc_states_the_words_a_switch_reads():
    def words(listed: tuple[str, ...]) -> str:
        return ", ".join(f"`{word}`" for word in listed[:-1]) + f" or `{listed[-1]}`"

    text = (ROOT / "docs" / "options.md").read_text()
    assert (
        f"is on when given {words(SWITCH_ON)}, and off when given {', '.join(f'`{w}`' for w in SWITCH_OFF)} or "
        "nothing, in any case" in text
    )
    for name in SWITCHES:
        assert f"`{DECLARED[name].make}`" in text.split("A switch (", 1)[1].split(")", 1)[0], name


# --------------------------------------------------------------------------- the reuse key and the rebuild


def test_the_reuse_key_holds_only_the_settings_that_change_that_precisions_artifacts():
    assert not {"calib_method", "smooth", "strict_calib", "float_search"} & set(deciding(Precision.FP16))
    assert not {"keep_fp32", "auto_fp32"} & set(deciding(Precision.INT8))
    assert not {"calib", "calib_samples", "keep_fp32"} & set(deciding(Precision.FP32))
    assert {"calib", "calib_samples", "calib_batch"} <= set(deciding(Precision.FP16)) & set(deciding(Precision.INT8))
    # Unchecked settings, as a folder of the previous version recorded them: NO_FLOAT_SEARCH=1 must not rebuild
    # an FP16 folder (it cannot change it), and must rebuild an INT8 one.
    fp16, int8 = Settings(precision="fp16"), Settings(precision="int8", calib=Path("absent"))
    assert reuse_key(fp16, "m") == reuse_key(Settings(precision="fp16", float_search=False, smooth="off"), "m")
    assert reuse_key(int8, "m") != reuse_key(Settings(precision="int8", calib=Path("absent"), float_search=False), "m")
    assert reuse_key(fp16, "m") != reuse_key(Settings(precision="fp16", keep_fp32="TopK"), "m")


def test_the_rebuild_command_repeats_what_decides_the_folder_in_each_front_ends_words():
    record = {"model": "x", "precision": "fp32", "out_root": "d"}
    expected = {
        MAKE: "make engine MODEL=x PRECISION=fp32 OUT=d FORCE=1",
        COMMAND_LINE: "trt-pipeline engine --model x --precision fp32 --out d --force",
        PYTHON: 'make_engine(Settings(model="x", precision="fp32", out_root="d", force=True))',
    }
    for front_end, words in expected.items():
        with spoken_in(front_end):
            assert render(make_engine_command(record, force=True)) == words
    # An FP16 folder recorded with INT8's settings (written before they were refused): the command leaves them out.
    old = {**record, "precision": "fp16", "float_search": False, "smooth": "off", "batch": "1:2:4", "weights": "w.pt"}
    with spoken_in(MAKE):
        assert render(make_engine_command(old)) == "make engine MODEL=x PRECISION=fp16 BATCH=1:2:4 WEIGHTS=w.pt OUT=d"
        int8 = render(make_engine_command({**old, "precision": "int8", "calib": "my data"}))
    assert int8 == (
        "make engine MODEL=x PRECISION=int8 BATCH=1:2:4 WEIGHTS=w.pt CALIB='my data' SMOOTH=off NO_FLOAT_SEARCH=1 OUT=d"
    )


def test_pythons_rebuild_command_is_python_that_gives_the_folders_settings_back():
    record = {"model": "x", "precision": "int8", "batch": "1:2:4", "calib": "my data", "smooth": "off"}
    record |= {"float_search": False, "workspace_mib": 64, "out_root": "d"}
    with spoken_in(PYTHON):
        words = render(make_engine_command(record))
    call = words.removeprefix("make_engine(").removesuffix(")")
    settings = eval(call, {"Settings": Settings}).check()  # our own words: they must be Python that runs
    assert {name: settings.as_record()[name] for name in record} == record


# --------------------------------------------------------------------------- a setting a precision ignores


@pytest.mark.parametrize(
    "precision, given, option, changes",
    [
        ("fp16", ["--calib-method", "auto"], "--calib-method", "int8"),  # given at its default: still refused
        ("fp16", ["--smooth", "off"], "--smooth", "int8"),
        ("fp16", ["--no-float-search"], "--no-float-search", "int8"),
        ("fp32", ["--strict-calib"], "--strict-calib", "int8"),
        ("fp32", ["--calib", "data.npy"], "--calib", "fp16 and int8"),
        ("int8", ["--calib", "data.npy", "--keep-fp32", "TopK"], "--keep-fp32", "fp16"),
        ("int8", ["--calib", "data.npy", "--no-auto-fp32"], "--no-auto-fp32", "fp16"),
    ],
)
def test_an_option_given_for_a_precision_it_does_not_change_is_refused(
    precision, given, option, changes, tmp_path, capsys
):
    out = tmp_path / "engines"
    argv = ["engine", "--model", TINY, "--precision", precision, *given, "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {option} changes only {changes} builds; at {precision} it would do nothing" in err
    assert f"fix: leave {option} out, or build with --precision" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


def test_settings_check_refuses_a_value_a_precision_ignores_and_takes_the_default():
    Settings(precision="fp16", calib_method="auto", smooth="auto").check()  # their defaults: nothing given
    with pytest.raises(PipelineError) as refused:
        Settings(precision="fp16", float_search=False).check()
    assert refused.value.problem == "Settings.float_search changes only int8 builds; at fp16 it would do nothing"
    assert refused.value.fix == 'leave Settings.float_search out, or build with Settings(precision="int8")'
    with pytest.raises(PipelineError, match=r"Settings.keep_fp32 changes only fp16 builds; at int8"):
        Settings(precision="int8", calib=Path("data.npy"), keep_fp32="TopK").check()


@pytest.mark.parametrize("given", [["--calib-samples", "8"], ["--calib-batch", "16"], ["--recalibrate"]])
def test_an_option_that_says_how_calib_is_read_is_refused_without_calib(given, tmp_path, capsys):
    # FP16 reads CALIB only where it is given: without it CALIB_SAMPLES was recorded in the manifest and ignored.
    out = tmp_path / "engines"
    assert cli.main(["engine", "--model", TINY, "--precision", "fp16", *given, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {given[0]} says how --calib is read, and no --calib was given: it would do nothing" in err
    assert f"fix: leave {given[0]} out, or add --calib <folder of images, or a .npy/.npz file>" in err
    assert not out.exists()


def test_settings_check_refuses_calibration_settings_without_calib_unless_data_stands_in():
    with pytest.raises(PipelineError, match=r"^Settings.calib_samples says how Settings.calib is read"):
        Settings(precision="fp16", calib_samples=8).check()
    Settings(precision="fp16", calib_samples=8, calib=Path("data.npy")).check()
    Settings(model="digits", recalibrate=True).check(data_besides_calib=True)  # accuracy's labelled set


def test_make_refuses_a_setting_its_precision_ignores_in_makes_words(tmp_path):
    result = _make(f"MODEL={TINY}", "PRECISION=fp16", "NO_FLOAT_SEARCH=1", f"OUT={tmp_path}/engines")
    assert result.returncode == 2, result.stderr
    assert "error: NO_FLOAT_SEARCH changes only int8 builds; at fp16 it would do nothing" in result.stderr
    assert "fix: leave NO_FLOAT_SEARCH out, or build with PRECISION=int8" in result.stderr
    assert not (tmp_path / "engines").exists()


# --------------------------------------------------------------------------- one message, three front ends


def test_one_error_in_the_words_of_each_front_end(tmp_path):
    with pytest.raises(PipelineError) as caught:
        Settings(model=TINY, precision="int8").check()
    assert caught.value.problem == 'Settings(precision="int8") needs calibration data and none was given'
    assert (
        'add Settings(calib=<folder of images, or a .npy/.npz file>) (e.g. Settings(calib="calibration/samples"))'
        in (caught.value.fix or "")
    )
    command = [sys.executable, "-m", "trt_pipeline", "engine", "--model", TINY, "--precision", "int8"]
    line = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert line.returncode == 2 and "Traceback" not in line.stderr
    assert "error: --precision int8 needs calibration data and none was given" in line.stderr
    assert "add --calib <folder of images, or a .npy/.npz file> (e.g. --calib calibration/samples)" in line.stderr
    make = _make(f"MODEL={TINY}", "PRECISION=int8", f"OUT={tmp_path}")
    assert make.returncode == 2
    assert "error: PRECISION=int8 needs calibration data and none was given" in make.stderr
    assert "add CALIB=<folder of images, or a .npy/.npz file> (e.g. CALIB=calibration/samples)" in make.stderr


def test_a_mention_is_data_until_the_message_is_read():
    # Composed, and re-wrapped as the code does, before anyone chose the words.
    inner = PipelineError(f"{mention(smooth='0.5x')} is no alpha", f"give {mention(smooth='off')}")
    outer = f"the int8 stage failed: {inner._problem}"  # the text as an f-string holds it
    rebuild = engine_command(model="m", precision="int8", calib="<data>", more=True)
    error = PipelineError(outer, f"{inner._fix}, then {rebuild}")
    words = {
        PYTHON: 'Settings(smooth="0.5x") is no alpha\n  fix: give Settings(smooth="off"), then '
        'make_engine(Settings(model="m", precision="int8", calib=<data>, ...))',
        COMMAND_LINE: "--smooth 0.5x is no alpha\n  fix: give --smooth off, then "
        "trt-pipeline engine --model m --precision int8 --calib <data> ...",
        MAKE: "SMOOTH=0.5x is no alpha\n  fix: give SMOOTH=off, then "
        "make engine MODEL=m PRECISION=int8 CALIB=<data> ...",
    }
    for front_end, text in words.items():
        with spoken_in(front_end):
            assert str(error) == f"the int8 stage failed: {text}"
            wrapped = PipelineError(f"outer: {error.problem}", error.fix)  # .problem and .fix are read: worded
            assert str(wrapped) == f"outer: the int8 stage failed: {text}"
    assert "\x02" not in repr(error)


# --------------------------------------------------------------------------- POSTPROCESS=nms and its settings


def test_an_nms_setting_without_postprocess_nms_is_refused_in_each_front_ends_words(tmp_path, capsys):
    with pytest.raises(PipelineError) as refused:
        Settings(nms_iou_threshold=0.5).check()
    assert refused.value.problem == (
        'Settings.nms_iou_threshold configures Settings(postprocess="nms") only; with Settings(postprocess="none") it '
        "would do nothing"
    )
    out = tmp_path / "engines"
    assert cli.main(["engine", "--model", TINY, "--precision", "fp32", "--nms-class-agnostic", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: --nms-class-agnostic configures --postprocess nms only" in err and "Traceback" not in err
    assert "fix: leave --nms-class-agnostic out, or add --postprocess nms" in err and not out.exists()


@pytest.mark.parametrize(
    "given, problem",
    [
        ({"nms_iou_threshold": 1.5}, "NMS IoU threshold 1.5 is not in [0, 1] (NMS_IOU_THRESHOLD=1.5)"),
        ({"nms_max_detections": 300, "nms_candidates": 200}, "max detections 300 is more than the candidates it"),
        ({"nms_candidates": 5000}, "more than TensorRT's TopK takes (3840) (NMS_CANDIDATES=5000)"),
    ],
)
def test_a_bad_nms_value_is_refused_before_anything_runs_naming_the_setting(given, problem):
    with spoken_in(MAKE):
        with pytest.raises(PipelineError) as refused:
            Settings(postprocess="nms", **given).check()
        assert problem in refused.value.problem


def test_the_nms_settings_reach_nmsconfig_and_decide_only_an_nms_folder():
    settings = Settings(postprocess="nms", nms_iou_threshold=0.6, nms_max_detections=20, nms_class_agnostic=True)
    config = settings.check().nms_config()
    assert config is not None and (config.iou_threshold, config.max_detections, config.class_aware) == (0.6, 20, False)
    assert Settings().nms_config() is None
    nms_names = {name for name, declared in DECLARED.items() if declared.postprocess}
    assert nms_names <= set(deciding(Precision.INT8, Postprocess.NMS)) and not nms_names & set(deciding(Precision.INT8))
    plain = Settings(precision="fp16", postprocess="nms")
    checked = Settings(precision="fp16", postprocess="nms").check()  # text once, where Settings takes it
    assert checked.precision is Precision.FP16 and checked.postprocess is Postprocess.NMS
    assert reuse_key(plain, "m") != reuse_key(Settings(precision="fp16"), "m")
    assert reuse_key(plain, "m") != reuse_key(Settings(precision="fp16", postprocess="nms", nms_iou_threshold=0.6), "m")
    with spoken_in(MAKE):
        words = render(make_engine_command(Settings(postprocess="nms", nms_candidates=300).as_record()))
    assert "POSTPROCESS=nms NMS_CANDIDATES=300" in words


def test_int8_without_calibration_data_is_refused():
    with pytest.raises(PipelineError, match="needs calibration data") as error:
        Settings(model="digits", precision="int8").check()
    assert "Settings(calib=" in str(error.value)
