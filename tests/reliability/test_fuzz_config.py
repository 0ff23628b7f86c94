"""Hypothesis-generated bad configs, config files, overrides and command lines.

Every bad input ends in a ConfigError naming the key (the ``verl`` command prints it and exits 2;
argparse's own usage errors exit 2 too): never a KeyError, TypeError or traceback, and never a run
that starts from a config it did not understand.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_core import ConfigError
from verl_core.cli import main
from verl_core.trainer.config import RunConfig, config_from_dict, config_to_dict, load_config

DEFAULTS = config_to_dict(RunConfig())
SECTIONS = {k: v for k, v in DEFAULTS.items() if isinstance(v, dict) and k != "options"}
SCALAR_KEYS = [k for k, v in DEFAULTS.items() if not isinstance(v, dict)]

values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _error(fn: Any, *args: Any) -> ConfigError | None:
    """The ConfigError ``fn(*args)`` raised, or None when it succeeded (any other error fails the test)."""
    error: ConfigError | None = None
    try:
        fn(*args)
    except ConfigError as e:
        error = e
    assert error is None or (isinstance(error, ValueError) and str(error))
    return error


def _mutations() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """A config that is the defaults with one key set to a random value, or an unknown key added."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
        data = json.loads(json.dumps(DEFAULTS))
        kind = draw(st.sampled_from(["value", "unknown_key", "section_type"]))
        if kind == "unknown_key":
            section = draw(st.sampled_from([None, *SECTIONS]))
            name = draw(st.text(min_size=1, max_size=10).filter(lambda s: s not in DEFAULTS and s not in SECTIONS.get(section or "", {})))
            (data if section is None else data[section])[name] = draw(values)
            return f"unknown {section}.{name}", data
        if kind == "section_type":
            section = draw(st.sampled_from(list(SECTIONS)))
            data[section] = draw(values.filter(lambda v: not isinstance(v, dict)))
            return f"section {section}", data
        section = draw(st.sampled_from([None, *SECTIONS]))
        keys = SCALAR_KEYS if section is None else [k for k in SECTIONS[section] if k != "options"]
        key = draw(st.sampled_from(keys))
        (data if section is None else data[section])[key] = draw(values)
        return f"{section}.{key}" if section else key, data

    return build()


@given(case=_mutations())
@settings(max_examples=400, deadline=None)
def test_config_from_dict_accepts_or_raises_config_error(case: tuple[str, dict[str, Any]], tally: Counter[str]) -> None:
    label, data = case
    err = _error(config_from_dict, data)
    if err is not None:
        key = label.split()[-1].split(".")[-1]
        msg = str(err)
        assert key in msg or repr(key)[1:-1] in msg or "table" in msg or "config keys" in msg, (label, msg)
        tally["fuzz/config values and keys"] += 1
        return
    # accepted: then it is a valid config that round-trips
    cfg = config_from_dict(data)
    assert config_from_dict(config_to_dict(cfg)) == cfg


@given(text=st.text(max_size=200))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_toml_file_gives_a_config_or_a_config_error(text: str, tmp_path: Path, tally: Counter[str]) -> None:
    path = tmp_path / "run.toml"
    try:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    except UnicodeEncodeError:
        return
    err = _error(load_config, path)
    if err is not None:
        assert str(path) in str(err) or "config key" in str(err), str(err)
        tally["fuzz/config files"] += 1


@given(overrides=st.lists(st.text(max_size=30), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_any_override_gives_a_config_or_a_config_error(overrides: list[str], tally: Counter[str]) -> None:
    if _error(load_config, None, overrides) is not None:
        tally["fuzz/config overrides"] += 1


BAD_OVERRIDES = st.one_of(
    st.sampled_from(["steps=0", "optim.lr=-1", "rollout.top_p=2", "task.name=sing", "nope=1", "batch=3",
                     "model.dtype=float8", "rollout.n=1.5", "checkpoint.keep=0", "max_consecutive_skips=-1",
                     "algorithm.name=unknown", "backends.actor.x=1", "task.digits=99", "=", "a..b=1"]),
    st.text(min_size=1, max_size=12).filter(lambda s: "=" not in s and not s.startswith("-")).map(lambda s: s + ".toml"),
)


@given(bad=BAD_OVERRIDES, good=st.lists(st.sampled_from(["steps=2", "seed=3", "optim.lr=1e-3"]), max_size=2),
       flags=st.lists(st.sampled_from(["--resume"]), max_size=1))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_train_command_reports_bad_input_and_exits_2(
    bad: str, good: list[str], flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    tally: Counter[str]
) -> None:
    argv = ["train", *good, bad, "--output-dir", str(tmp_path / "out"), *flags]
    if bad.endswith(".toml"):
        argv = ["train", bad, *good, "--output-dir", str(tmp_path / "out"), *flags]
    tally["fuzz/command line"] += 1
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert "error" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "checkpoints").exists(), "a rejected command started a run"


@given(argv=st.lists(st.text(min_size=1, max_size=10).filter(lambda s: s not in ("train", "backends", "conformance")),
                     min_size=1, max_size=3))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_unknown_commands_exit_2_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str], tally: Counter[str]) -> None:
    if (argv[0].startswith("-") and argv[0] in ("-h", "--help", "--version")) or argv[0] in ("-h", "--help"):
        return
    tally["fuzz/command line"] += 1
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    if argv[0].startswith("--h") or argv[0].startswith("--v") or argv[0].startswith("-h"):
        return  # an abbreviation of --help/--version
    assert code == 2 and "Traceback" not in err


def test_a_bad_config_in_a_fresh_process_prints_one_line_and_no_traceback(tmp_path: Path, tally: Counter[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("steps = 3\n[optim]\nlr = 'fast'\n")
    tally["fuzz/command line"] += 1
    out = subprocess.run([sys.executable, "-m", "verl_core.cli", "train", str(cfg)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "verl train: error: config key 'optim.lr': expected a finite number, got 'fast'"


def test_every_config_section_is_fuzzed() -> None:
    assert set(SECTIONS) == {f.name for f in dataclasses.fields(RunConfig)} - set(SCALAR_KEYS)
