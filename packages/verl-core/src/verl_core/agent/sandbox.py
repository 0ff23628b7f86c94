"""A built-in code tool: Python code run in a separate, limited process.

:func:`run_python` runs a program with ``python -I -u`` (isolated mode: no environment variables,
no user site) and, unless asked otherwise, ``-S`` (no site-packages: the standard library only),
in a fresh empty temporary directory, with a minimal environment and these limits:

* CPU time (``RLIMIT_CPU``): the kernel kills the process (SIGXCPU) when it is used up;
* address space (``RLIMIT_AS``): an allocation beyond it fails (``MemoryError``);
* file size (``RLIMIT_FSIZE``): bounds what the program prints and writes (a write past it fails
  with ``OSError: File too large``; stdout and stderr go to files outside the sandbox directory,
  of which the first ``max_output_chars`` are read back);
* wall clock: the whole process group is killed (SIGKILL) when the time is up.

An audit hook (:pep:`578`), installed in the child before the program runs, refuses opening files
outside the sandbox directory (reading the Python library the imports need is allowed), listing
or changing paths outside it, and starting processes. **This is a guard against accidents (a
program that reads the run's files or deletes something by mistake), not a security boundary**:
code that means harm can get around an audit hook (``ctypes``, ``gc`` tricks, native extensions).
Run untrusted code in a container or a VM with no access to the run's files and no network.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from verl_core.agent.tools import Tool, ToolError, ToolTimeoutError
from verl_core.kernel.errors import ConfigError, check_bool, check_int, check_number, describe

__all__ = ["SandboxLimits", "SandboxResult", "python_tool", "run_python"]

_MIB: Final = 1 << 20

# Runs in the child, before the user's program: set the limits, read the program from stdin, then
# install the audit hook (after everything the bootstrap itself needs is imported and opened).
_BOOTSTRAP: Final = r'''
import linecache, os, resource, sys, traceback
cpu, memory, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
if memory:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
source = sys.stdin.read()
sys.stdin.close()
sys.stdin = open(os.devnull)
linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
ROOT = os.path.realpath(os.getcwd())
LIBRARY = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isabs(p))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove", "os.rmdir", "os.rename", "os.truncate", "os.chmod", "os.chown", "os.link",
               "os.symlink", "os.mkdir", "os.utime", "os.chdir", "shutil.rmtree", "shutil.copyfile",
               "shutil.move"}
LIST_EVENTS = {"os.listdir", "os.scandir"}
PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "pty.spawn", "os.startfile"}

def _inside(path, roots):
    real = os.path.realpath(os.path.abspath(os.fsdecode(path)))
    return any(real == r or real.startswith(r + os.sep) for r in roots)

def _paths(args):
    return [a for a in args if isinstance(a, (str, bytes, os.PathLike))]

def _guard(event, args):
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int) or _inside(path, (ROOT,)):
            return
        if isinstance(mode, str):
            reading = not any(c in mode for c in "wax+")
        else:
            reading = not (flags or 0) & WRITE_FLAGS
        if reading and _inside(path, LIBRARY):
            return
        raise PermissionError(f"sandbox: opening {os.fsdecode(path)!r} is not allowed; only files in the "
                              f"working directory {ROOT} can be used")
    if event in LIST_EVENTS:
        for p in _paths(args):
            if not _inside(p, (ROOT, *LIBRARY)):
                raise PermissionError(f"sandbox: listing {os.fsdecode(p)!r} is not allowed; only the "
                                      f"working directory {ROOT} can be listed")
    elif event in PATH_EVENTS:
        for p in _paths(args):
            if not _inside(p, (ROOT,)):
                raise PermissionError(f"sandbox: {event} on {os.fsdecode(p)!r} is not allowed outside the "
                                      f"working directory {ROOT}")
    elif event in PROCESS_EVENTS:
        raise PermissionError(f"sandbox: starting processes ({event}) is not allowed")

sys.addaudithook(_guard)
del resource
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(source, "<code>", "exec"), scope)
except SystemExit:
    raise
except BaseException:
    traceback.print_exc()
    sys.exit(1)
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run; checked when built.

    Attributes:
        wall_s: Wall-clock seconds before the process group is killed (> 0).
        cpu_s: CPU seconds (``RLIMIT_CPU``, >= 1); the kernel kills the process past it.
        memory_bytes: Address-space limit (``RLIMIT_AS``, >= 64 MiB; 0 = none); allocations past it
            raise ``MemoryError``. Native libraries that reserve large address ranges (BLAS thread
            pools) may need more than they use.
        max_output_chars: Characters of stdout and of stderr returned (each; the rest is cut).
        max_file_bytes: Largest file the program may write, stdout and stderr included
            (``RLIMIT_FSIZE``, >= 4096); a write past it fails (``OSError: File too large``).
        site_packages: Let the program import installed packages (drops ``-S``; they are then
            readable too, and so are the folders their ``.pth`` files add to ``sys.path``).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * _MIB
    max_output_chars: int = 8192
    max_file_bytes: int = 16 * _MIB
    site_packages: bool = False

    def __post_init__(self) -> None:
        check_number(self.wall_s, "SandboxLimits.wall_s", low=0, low_open=True)
        check_int(self.cpu_s, "SandboxLimits.cpu_s", low=1)
        if self.memory_bytes != 0:
            check_int(self.memory_bytes, "SandboxLimits.memory_bytes", low=64 * _MIB, hint=" or 0 (no limit)")
        check_int(self.max_output_chars, "SandboxLimits.max_output_chars", low=1)
        check_int(self.max_file_bytes, "SandboxLimits.max_file_bytes", low=4096)
        check_bool(self.site_packages, "SandboxLimits.site_packages")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run gave.

    Attributes:
        stdout: What it printed (cut to ``max_output_chars``, with a note).
        stderr: What it wrote to stderr (cut likewise), e.g. a traceback.
        exit_code: The process's exit code; negative: killed by that signal.
        error: Why the run failed (a limit, an exception, a non-zero exit), or None when it
            exited with 0.
        timed_out: A time limit (wall clock or CPU) ended it.
    """

    stdout: str
    stderr: str
    exit_code: int
    error: str | None
    timed_out: bool

    @property
    def ok(self) -> bool:
        """The program ran to its end and exited with 0."""
        return self.error is None

    def text(self) -> str:
        """Stdout, then stderr and the error when there are any: what a model reads."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.error:
            parts.append(f"[error] {self.error}")
        return "\n".join(parts) if parts else "(no output)"


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as fh:
        data = fh.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    size = path.stat().st_size
    if len(text) > limit or size > len(data):
        return f"{text[:limit]}\n... [output cut at {limit} characters]"
    return text


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)


def run_python(code: str, limits: SandboxLimits | None = None, *, python: str | None = None) -> SandboxResult:
    """Run ``code`` in a separate, limited Python process (see the module docstring).

    Args:
        code: The program's source.
        limits: Its limits (default :class:`SandboxLimits`).
        python: The interpreter (default: the one running this process).

    Returns:
        Its output, exit code and, when it failed, why.

    Raises:
        ConfigError: ``code`` is not a string, or this platform has no POSIX resource limits.
    """
    if not isinstance(code, str):
        raise ConfigError(f"run_python() takes the program as a string, got {describe(code)}")
    if os.name != "posix":
        raise ConfigError("the Python sandbox needs POSIX resource limits (Linux or macOS)")
    limits = limits if limits is not None else SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix="verl-sandbox-"))
    logs = Path(tempfile.mkdtemp(prefix="verl-sandbox-logs-"))
    flags = ["-I", "-u"] + ([] if limits.site_packages else ["-S"])
    argv = [python or sys.executable, *flags, "-c", _BOOTSTRAP, str(limits.cpu_s), str(limits.memory_bytes),
            str(limits.max_file_bytes)]
    env = {"PATH": os.defpath, "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    timed_out = False
    try:
        with (logs / "stdout").open("wb") as out, (logs / "stderr").open("wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=root, env=env,
                                    start_new_session=True, close_fds=True)
            try:
                proc.communicate(code.encode("utf-8", errors="replace"), timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # also whatever the program left running
                proc.wait()
        stdout = _read(logs / "stdout", limits.max_output_chars)
        stderr = _read(logs / "stderr", limits.max_output_chars)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
    code_ = int(proc.returncode)
    error: str | None = None
    if timed_out:
        error = f"the program did not finish within the wall-clock limit of {limits.wall_s:g} s and was killed"
    elif code_ == -signal.SIGXCPU:
        timed_out = True
        error = f"the program used more than its CPU time limit of {limits.cpu_s} s and was killed"
    elif code_ == -signal.SIGKILL:
        error = (f"the program was killed (SIGKILL): past its CPU time limit of {limits.cpu_s} s, or by the "
                 "system's out-of-memory killer")
    elif code_ == -signal.SIGXFSZ:
        error = f"the program wrote more than the file size limit of {limits.max_file_bytes} bytes and was killed"
    elif code_ < 0:
        error = f"the program was killed by signal {signal.Signals(-code_).name}"
    elif code_ != 0 and "MemoryError" in stderr and limits.memory_bytes:
        error = f"the program exceeded its memory limit of {limits.memory_bytes // _MIB} MiB (MemoryError)"
    elif code_ != 0 and "File too large" in stderr:  # Python ignores SIGXFSZ: the write fails with EFBIG
        error = f"the program wrote more than the file size limit of {limits.max_file_bytes} bytes"
    elif code_ != 0:
        error = f"the program exited with code {code_}"
    return SandboxResult(stdout, stderr, code_, error, timed_out)


def python_tool(limits: SandboxLimits | None = None, *, name: str = "python") -> Tool:
    """A tool that runs Python code with :func:`run_python` and returns what it printed.

    A run that fails (an exception, a non-zero exit, a limit) raises :class:`ToolError` with its
    output and the reason, so a :class:`~verl_core.agent.tools.ToolEnvironment` shows it to the
    model and counts an error; a time limit raises :class:`ToolTimeoutError` (counted as a timeout).

    Args:
        limits: Limits of each run (default :class:`SandboxLimits`).
        name: The tool's name.
    """
    chosen = limits if limits is not None else SandboxLimits()

    def python(code: str) -> str:
        """Run a Python program in a fresh process and return what it printed.

        Args:
            code: The complete program; print the values you want to see.
        """
        result = run_python(code, chosen)
        if result.timed_out:
            raise ToolTimeoutError(result.text())
        if not result.ok:
            raise ToolError(result.text())
        return result.text()

    return Tool.from_function(python, name=name)
