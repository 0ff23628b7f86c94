"""Running user callables on daemon threads under one wall-clock deadline (tools and environments)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "run_with_deadline"]


@dataclass
class Outcome:
    """What one job gave: its value or exception, and whether it finished before the deadline."""

    value: Any = None
    error: BaseException | None = None
    finished: bool = False


def run_with_deadline(jobs: Sequence[Callable[[], Any]], timeout_s: float | None) -> list[Outcome]:
    """Run every job on its own daemon thread, all together, waiting at most ``timeout_s`` for all.

    A job still running at the deadline is abandoned (its outcome is unfinished): Python threads
    cannot be killed, so it runs on in the background, and being a daemon it does not hold up the
    interpreter's exit. Code that can hang for good belongs in a separate process (the sandbox).

    Args:
        jobs: Callables without arguments.
        timeout_s: Seconds to wait for all of them (None = until they finish).

    Returns:
        One outcome per job, in order.
    """
    outcomes = [Outcome() for _ in jobs]

    def run(job: Callable[[], Any], out: Outcome) -> None:
        try:
            out.value = job()
        except BaseException as e:  # reported to the caller; nothing may escape a user thread
            out.error = e
        out.finished = True

    threads = [threading.Thread(target=run, args=(j, o), daemon=True, name="verl-agent")
               for j, o in zip(jobs, outcomes, strict=True)]
    for t in threads:
        t.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return outcomes
