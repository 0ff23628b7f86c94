"""Hypothesis-generated ``verl`` command lines through ``verl_core.cli.main``, output captured.

Random orderings of flags (``--resume``, ``--print-config``, ``--output-dir DIR``), overrides (real
keys, misspelt keys, bad values), junk tokens and config files (valid, broken, missing), always
with ``--check`` so no engine is built. The only outcomes allowed: exit 0, or exit 2 with exactly
one line on stderr, ``verl train: error: ...``, naming the offending key, value, token or file
(an unexpected exception would exit 1). Flags change nothing about the config wherever they stand.

Generated inputs (``max_examples``): 700 command lines + 200 flag placements + 100 unknown
commands = 1000 (test_fuzz_config.py adds 3000: about 4000 in all).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from config_strategies import overrides
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_core.cli import main
from verl_core.kernel.errors import ConfigError
from verl_core.trainer.config import config_to_dict, load_config, parse_override, read_config_file
from verl_core.trainer.rl import trainer as trainer_module

CLI = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FLAGS = ["--resume", "--print-config", "--check"]


@pytest.fixture(autouse=True)
def _no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that reaches engine building fails the test (``--check`` must stop before)."""

    def refuse(self: Any) -> None:
        raise AssertionError("a command with --check started building engines")

    monkeypatch.setattr(trainer_module.Trainer, "setup", refuse)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    out = {
        "good.toml": "steps = 3\n[rollout]\nn = 4\n",
        "good.yaml": "steps: 3\nrollout:\n  n: 4\n",
        "typo.toml": "steps = 3\n[rolout]\nn = 4\n",
        "bad.toml": "steps = = 3\n",
        "bad.yaml": "steps: [3\n",
        "range.toml": "[optim]\neps = -1.0\n",
    }
    for name, text in out.items():
        (root / name).write_text(text)
    (root / "latin1.toml").write_bytes(b"# caf\xe9\nsteps = 3\n")
    return {name: root / name for name in [*out, "latin1.toml", "missing.toml"]}


def _not_special(token: str) -> bool:
    """Tokens that would stop the fuzzing itself: ``--`` (the rest as positionals, ``--check`` too),
    abbreviations of ``--debug`` (a traceback, not one line) and ``--output-dir`` (it would take the
    next token)."""
    return token != "--" and not any(len(token) >= 3 and f.startswith(token) for f in ("--debug", "--output-dir"))


junk = st.text(min_size=1, max_size=10).filter(_not_special) | st.sampled_from(
    ["-x", "--bogus", "--resume=1", "-", "steps", "=", "a..b=1", "--check=yes", "-1", "--p"]
)


@st.composite
def command_lines(draw: st.DrawFn, names: list[str]) -> tuple[list[str], str | None]:
    """``train [CONFIG] tokens...`` with ``--check`` somewhere, and the config file's name (or None)."""
    tokens: list[list[str]] = [["--check"]]
    tokens += [[draw(overrides())] for _ in range(draw(st.integers(0, 3)))]
    tokens += [[draw(st.sampled_from(FLAGS))] for _ in range(draw(st.integers(0, 2)))]
    tokens += [[draw(junk)] for _ in range(draw(st.integers(0, 2)))]
    if draw(st.booleans()):
        tokens.append(["--output-dir", "OUT"])
    tokens = draw(st.permutations(tokens))
    config = draw(st.none() | st.sampled_from(names))
    return ["train", *([config] if config else []), *(t for group in tokens for t in group)], config


def _candidates(argv: list[str]) -> Iterator[str]:
    """What an error line may quote to name its cause: a token, an override's key (or a part of
    it) or string value, a key in the config file; flags are named bare."""
    for token in argv[1:]:
        yield repr(token)
        if token.startswith("-"):
            yield token.partition("=")[0]
        try:
            path, value = parse_override(token)
        except ConfigError:
            continue
        yield from (repr(".".join(path[: i + 1])) for i in range(len(path)))
        yield repr(".".join(path))[:-1] + "["  # an item of a list value: 'logging.sinks[0]'
        yield repr(".".join(path))[:-1] + "."  # a key of a table value: 'ray.parallel.0'
        if isinstance(value, str):
            yield repr(value)
    if Path(argv[1]).is_file():  # the keys inside the config file
        with contextlib.suppress(ConfigError):
            yield from (repr(key) for key in _dotted(read_config_file(argv[1])))


def _dotted(data: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(data, dict):
        for k, v in data.items():
            yield prefix + str(k)
            yield from _dotted(v, f"{prefix}{k}.")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@given(data=st.data())
@settings(CLI, max_examples=700)
def test_command_lines_exit_0_or_print_one_error_line_and_exit_2(
    data: st.DataObject, files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    tally: Counter[str],
) -> None:
    argv, config = data.draw(command_lines(sorted(files)))
    out_dir = tmp_path / "out"
    argv = [str(files[a]) if a == config else str(out_dir) if a == "OUT" else a for a in argv]
    code, out, err = _run(argv, capsys)
    assert code in (0, 2), (argv, code, err)
    assert not out_dir.exists(), "--check wrote into output_dir"
    if code == 0:
        if "--print-config" in argv and not out.startswith("usage:"):
            json.loads(out)
        return
    tally["fuzz/command line"] += 1
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl train: error: "), (argv, err)
    message = lines[0].removeprefix("verl train: error: ")
    assert any(c in message for c in _candidates(argv)), (argv, message)


@given(order=st.permutations(["--resume", "--print-config", "OVERRIDES", "--output-dir"]),
       values=st.lists(st.sampled_from(["steps=3", "seed=7", "rollout.n=4", "optim.lr=1e-3", "task.name=reverse"]),
                       min_size=1, max_size=4),
       split=st.integers(0, 4), with_config=st.booleans())
@settings(CLI, max_examples=200)
def test_flags_are_accepted_anywhere_and_change_nothing(
    order: list[str], values: list[str], split: int, with_config: bool, files: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", *([str(files["good.toml"])] if with_config else [])]
    for item in order:
        if item == "OVERRIDES":
            argv += values[:split]
        elif item == "--output-dir":
            argv += [item, str(tmp_path / "o")]
        else:
            argv += [item, *values[split:]] if item == "--resume" else [item]
    code, out, err = _run(argv, capsys)
    assert code == 0, (argv, err)
    expected = load_config(files["good.toml"] if with_config else None,
                           [*values[:split], *values[split:], f"output_dir={json.dumps(str(tmp_path / 'o'))}"])
    assert json.loads(out) == json.loads(json.dumps(config_to_dict(expected)))


@given(argv=st.lists(st.text(min_size=1, max_size=10).filter(lambda s: s not in ("train", "backends", "conformance")),
                     min_size=1, max_size=3))
@settings(CLI, max_examples=100)
def test_unknown_commands_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str],
                                               tally: Counter[str]) -> None:
    if any(a.startswith("-") and len(a) >= 2 and any(f.startswith(a) for f in ("--help", "--version", "-h", "--debug"))
           for a in argv):
        return  # --help, --version and --debug (abbreviated or not) are real flags
    tally["fuzz/command line"] += 1
    code, _, err = _run(argv, capsys)
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and err.startswith("verl: error: "), (argv, err)


# ---------------------------------------------------------------------------- exact cases
@pytest.mark.parametrize(("argv", "message"), [
    (["optim.eps=-1"], "config key 'optim.eps' = -1.0 is out of range; allowed: > 0"),
    (["model.num_heads=3"], "config key 'model.num_heads' = 3 does not divide 'model.hidden_size' = 64"),
    (["rollout.temprature=1"], "did you mean 'rollout.temperature'?"),
    (["algorithm.name=ppo", "algorithm.use_critic=false"], "'algorithm.use_critic' is false"),
    (["algorithm.options.nope=1"], "'algorithm.options.nope' is not an option of algorithm 'grpo'"),
    (["backends.actor=nope"], "config key 'backends.actor': unknown verl backend 'nope'; installed: "),
    (["algorithm.use_reference=true", "backends.reference=nope"], "config key 'backends.reference': unknown"),
    (["backends.actor=toy"], "config key 'backends.actor' = 'toy': that backend has no actor engine"),
    (["backends.options.rollout.bogus=1"], "config key 'backends.options.rollout' (backend 'hf'): unknown key(s) bogus"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate (see 'verl train --help')"),
    (["--output-dir"], "argument --output-dir: expected one argument"),
])
def test_known_bad_command_lines(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["train", "--check", *argv], capsys)
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_file_that_is_not_utf8_and_resume_between_overrides(files: dict[str, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["train", str(files["latin1.toml"]), "--resume", "steps=3", "--check"], capsys)
    assert code == 2
    assert err.strip() == (f"verl train: error: config file {str(files['latin1.toml'])!r} is not UTF-8 text: "
                           "byte 0xe9 at line 1; save it as UTF-8")
    code, _, err = _run(["train", str(files["good.toml"]), "--resume", "steps=5", "--check", "seed=2"], capsys)
    assert code == 0, err


def test_cuda_without_cuda_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    code, _, err = _run(["train", "model.device=cuda:0", "--check"], capsys)
    if torch.cuda.is_available():
        assert code == 0, err
        code, _, err = _run(["train", f"model.device=cuda:{torch.cuda.device_count()}", "--check"], capsys)
        assert code == 2 and "CUDA device(s)" in err
    else:
        assert code == 2 and "'model.device' = 'cuda:0', but CUDA is not available here" in err
    # a Ray worker may see GPUs this process does not: the device is then checked where it runs
    assert _run(["train", "model.device=cuda", "executor=ray", "--check"], capsys)[0] == 0


def test_unexpected_errors_exit_1_with_one_line_and_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("disk on fire\nsecond line")

    from verl_core.trainer import config

    real = config.load_config
    monkeypatch.setattr(config, "load_config", broken)
    code, _, err = _run(["train", "steps=3", "--check"], capsys)
    assert code == 1
    assert err == ("verl train: error: unexpected RuntimeError: disk on fire second line "
                   "(run with --debug for the traceback)\n")
    for argv in (["--debug", "train", "steps=3", "--check"], ["train", "steps=3", "--debug", "--check"]):
        code, _, err = _run(argv, capsys)
        assert code == 1
        assert err.startswith("Traceback (most recent call last):") and err.endswith("second line\n"), err
    monkeypatch.setattr(config, "load_config", real)
    code, _, err = _run(["train", "--debug", "steps=0", "--check"], capsys)
    assert code == 2 and "Traceback" in err and "ConfigError: config key 'steps' = 0 is out of range" in err


def test_check_and_print_config_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["train", "steps=4", "--check", "--print-config", "--output-dir", str(tmp_path / "o")], capsys)
    assert code == 0
    assert json.loads(out)["steps"] == 4
    assert err.startswith("verl train: config is valid (4 steps")
    assert not (tmp_path / "o").exists()


def test_a_bad_config_in_a_fresh_process_prints_one_line_and_no_traceback(tmp_path: Path, tally: Counter[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("steps = 3\n[optim]\nlr = 'fast'\n")
    tally["fuzz/command line"] += 1
    out = subprocess.run([sys.executable, "-m", "verl_core.cli", "train", str(cfg)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "verl train: error: config key 'optim.lr': expected a finite number, got 'fast'"


def test_a_misspelt_backend_fails_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["train", "backends.rollout=hff", "--output-dir", str(tmp_path / "o")], capsys)
    assert code == 2, err
    assert err.startswith("verl train: error: config key 'backends.rollout': unknown verl backend 'hff'")
    assert not (tmp_path / "o").exists(), "the tiny model was written before the backend was checked"


@pytest.mark.parametrize("first", ["x" * 300, "agent.concurrency=" + "x" * 300, "a\0b", "steps=\0"])
def test_a_first_argument_the_system_refuses_as_a_file_name_is_one_error_line(
    first: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A name too long for the file system (or holding a NUL byte) is no file: an override or a missing config."""
    code, _, err = _run(["train", "--check", first], capsys)
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl train: error: ") and "unexpected" not in err, err
