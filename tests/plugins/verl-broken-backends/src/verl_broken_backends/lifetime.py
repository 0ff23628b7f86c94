"""Faulty engines of close(): what an engine starts (a worker process, a thread) and how close() ends it."""

from __future__ import annotations

import subprocess
import sys
import threading

from verl_example_backend.rollout import ExampleRolloutEngine
from verl_example_backend.training import ExampleTrainingEngine

from verl_core import EngineSpec

__all__ = ["RELEASE", "CloseNotIdempotent", "WorkerLeftRunning", "ThreadLeftRunning"]

RELEASE = threading.Event()
"""Set by the meta-tests after the check: the threads :class:`ThreadLeftRunning` left then end (so pytest can exit)."""


class WorkerLeftRunning(ExampleRolloutEngine):
    """Starts a worker process at build (an inference server's stand-in) and never stops it: no close() of its own."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


class ThreadLeftRunning(ExampleRolloutEngine):
    """Starts a non-daemon prefetch thread at build; close() drops the model but never stops the thread."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.prefetch = threading.Thread(target=RELEASE.wait, args=(120,), name="prefetch", daemon=False)
        self.prefetch.start()

    def close(self) -> None:
        """Drop the model (the thread keeps running)."""
        self.model = None


class CloseNotIdempotent(ExampleTrainingEngine):
    """close() deletes the model attribute: a second close() raises AttributeError."""

    def close(self) -> None:
        """``del self.model``."""
        del self.model
