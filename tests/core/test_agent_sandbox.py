"""The Python sandbox: a separate process with CPU, memory, output and wall-clock limits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from verl_core import ConfigError
from verl_core.agent import SandboxLimits, ToolEnvironment, python_tool, run_python

pytestmark = pytest.mark.slow


def test_normal_code_returns_its_output() -> None:
    result = run_python("import json, os\nprint(json.dumps({'n': sum(range(10))}))\nprint(os.listdir('.'))")
    assert result.ok and result.exit_code == 0 and not result.timed_out
    assert result.stdout == '{"n": 45}\n[]\n'  # the working directory starts empty
    assert result.text() == result.stdout


def test_files_in_the_working_directory_work() -> None:
    code = "open('a.txt', 'w').write('hello')\nprint(open('a.txt').read())\nimport os\nprint(os.getcwd())"
    result = run_python(code)
    assert result.ok, result.text()
    out, cwd = result.stdout.splitlines()
    assert out == "hello" and "verl-sandbox-" in cwd
    assert not Path(cwd).exists()  # removed after the run


def test_an_infinite_loop_is_killed_at_the_wall_limit() -> None:
    start = time.monotonic()
    result = run_python("print('start', flush=True)\nwhile True:\n    pass", SandboxLimits(wall_s=1.5, cpu_s=60))
    elapsed = time.monotonic() - start
    assert elapsed < 6.0
    assert result.timed_out and not result.ok
    assert result.stdout == "start\n"  # output before the kill is kept
    assert result.error is not None and "wall-clock limit of 1.5 s" in result.error


def test_cpu_time_is_limited() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", SandboxLimits(wall_s=30, cpu_s=1))
    assert time.monotonic() - start < 15.0
    assert result.timed_out and result.error is not None and "CPU time limit of 1 s" in result.error


@pytest.mark.parametrize("code", ["x = bytearray(8 * 1024**3)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"])
def test_huge_allocations_fail(code: str) -> None:
    result = run_python(code, SandboxLimits(memory_bytes=256 * 2**20))
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr
    assert result.error == "the program exceeded its memory limit of 256 MiB (MemoryError)"


def test_files_outside_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the run's data")
    result = run_python(f"print(open({str(secret)!r}).read())")
    assert not result.ok
    assert "PermissionError" in result.stderr and "is not allowed" in result.stderr
    assert "the run's data" not in result.stdout + result.stderr
    listing = run_python(f"import os\nprint(os.listdir({str(tmp_path)!r}))")
    assert not listing.ok and "listing" in listing.stderr and "secret" not in listing.stdout
    write = run_python(f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')")
    assert not write.ok and not (tmp_path / "new.txt").exists()
    remove = run_python(f"import os\nos.remove({str(secret)!r})")
    assert not remove.ok and secret.exists()
    spawn = run_python("import subprocess\nsubprocess.run(['ls'])")
    assert not spawn.ok and "starting processes" in spawn.stderr


def test_output_is_cut() -> None:
    result = run_python("print('a' * 100000)", SandboxLimits(max_output_chars=1000))
    assert result.ok
    assert result.stdout.startswith("a" * 1000) and result.stdout.endswith("[output cut at 1000 characters]")
    killed = run_python("while True:\n    print('b' * 1000)", SandboxLimits(max_file_bytes=100_000, wall_s=20))
    assert not killed.ok and killed.error is not None and "file size limit" in killed.error


def test_errors_are_reported() -> None:
    result = run_python("def f():\n    raise ValueError('bad input')\nf()")
    assert result.exit_code == 1 and result.error == "the program exited with code 1"
    assert "ValueError: bad input" in result.stderr and "raise ValueError('bad input')" in result.stderr
    assert run_python("import sys\nsys.exit(3)").exit_code == 3
    with pytest.raises(ConfigError, match="must be a finite number > 0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ConfigError, match="memory_bytes"):
        SandboxLimits(memory_bytes=1000)


def test_python_tool_in_a_tool_environment() -> None:
    tool = python_tool(SandboxLimits(wall_s=1.0))
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    env = ToolEnvironment([tool], timeout_s=20)

    def call(code: str) -> str:
        return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"

    result = env.step(call("print(6 * 7)") + call("while True: pass") + call("1/0"), [])
    contents = [m["content"] for m in result.observation]  # type: ignore[index]
    assert contents[0] == "42\n"
    assert contents[1].startswith("Error: [error] the program did not finish within the wall-clock limit of 1 s")
    assert "ZeroDivisionError" in contents[2]
    assert result.metrics == {"tool_calls": 3.0, "tool_errors": 2.0, "tool_timeouts": 1.0}
