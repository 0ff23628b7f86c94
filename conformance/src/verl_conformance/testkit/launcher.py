"""A torchrun launcher for multi-rank tests that returns per-rank results through files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_core.enginekit.checkpoint import write_atomic

__all__ = ["LaunchError", "launch_torchrun", "write_rank_result"]

_RESULT_DIR_ENV = "VERL_TESTKIT_RESULT_DIR"
# What an in-process vLLM leaves in os.environ must not leak into child processes.
_STRIP_ENV = ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")


class LaunchError(RuntimeError):
    """A multi-rank run failed; the message holds the tail of its output."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_rank_result(obj: Any) -> None:
    """Called inside a launched script: store this rank's result (tensors, numbers, str, dicts)."""
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ[_RESULT_DIR_ENV]) / f"rank{rank}.pt"
    write_atomic(out, lambda fh: torch.save(obj, fh))


def launch_torchrun(
    script: str | os.PathLike[str],
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``script`` under ``torchrun --nproc_per_node nproc`` and return each rank's result.

    Each rank calls :func:`write_rank_result` once. Environment leftovers of an in-process vLLM
    (LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD) are stripped from the children.

    Raises:
        LaunchError: a rank failed, timed out or wrote no result (with the output's tail).
    """
    child_env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="verl-launch-") as tmp:
        child_env[_RESULT_DIR_ENV] = tmp
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), *args,
        ]
        try:
            proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or "")[-3000:] if isinstance(e.stdout, str) else ""
            raise LaunchError(f"{script} with {nproc} ranks timed out after {timeout}s\n{tail}") from e
        if proc.returncode != 0:
            raise LaunchError(
                f"{script} with {nproc} ranks exited {proc.returncode}\n"
                f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
            )
        results = []
        for rank in range(nproc):
            path = Path(tmp) / f"rank{rank}.pt"
            if not path.exists():
                raise LaunchError(f"rank {rank} of {script} wrote no result\n{proc.stderr[-3000:]}")
            results.append(torch.load(path, weights_only=True))
        return results
