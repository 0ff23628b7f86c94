"""A time limit per check: an engine call that never returns fails its check instead of hanging the run.

The limit is a ``SIGALRM`` timer of the main thread. When it fires, :class:`CheckTimedOut` is raised
where the main thread is: inside the backend's call that hangs, or inside a wait for a worker that
does. It derives from ``BaseException``, as ``KeyboardInterrupt`` does, so a backend's
``except Exception`` does not swallow it. The message names the frames the main thread was in
outside the suite (file, line, function): the backend's call and what it waits in.

Limits of the method: the timer needs the main thread and a POSIX system (elsewhere the checks run
without a limit); a call that holds the GIL inside native code (a C++ loop that never returns) is
interrupted only when it gives control back to Python; and a timer installed by someone else
(pytest-timeout's ``--timeout``) is left to run: the suite adds none of its own then.
"""

from __future__ import annotations

import signal
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Final

__all__ = ["DEFAULT_CHECK_TIMEOUT_S", "CheckTimedOut", "check_time_limit", "limit_from_option"]

DEFAULT_CHECK_TIMEOUT_S: Final = 900.0
"""The default limit of one check, in seconds: the slowest check of the suite takes about 60 s on 2
CPU cores (a two-rank checkpoint round trip under torchrun); 900 leaves a busy machine room."""

_SUITE: Final = str(Path(__file__).resolve().parent)


def limit_from_option(seconds: float | None) -> float | None:
    """The limit a ``--check-timeout`` / ``--verl-check-timeout`` value asks for: the default where not
    given, None (no limit) for 0."""
    return DEFAULT_CHECK_TIMEOUT_S if seconds is None else float(seconds) or None


class CheckTimedOut(BaseException):
    """A check ran past its time limit; the message says how long and where the main thread was."""


def _where(frame: FrameType | None) -> str:
    """The innermost frames (up to three, outermost first) of the stack at ``frame`` outside the suite's
    own code: the backend's call and what it waits in (``FILE:LINE in FUNCTION``, joined by " -> ")."""
    stack = traceback.extract_stack(frame) if frame is not None else []
    outside = [f for f in stack if not str(Path(f.filename).resolve()).startswith(_SUITE)] or stack
    return " -> ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in outside[-3:]) or "an unknown frame"


@contextmanager
def check_time_limit(seconds: float | None, check_id: str) -> Iterator[None]:
    """Raise :class:`CheckTimedOut` in the main thread when the block runs longer than ``seconds``.

    No limit where ``seconds`` is None or not positive, off the main thread, without ``SIGALRM``, or
    where another ``SIGALRM`` handler is installed (pytest-timeout's)."""
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None))
    if not usable:
        yield
        return
    assert seconds is not None

    def expired(signum: int, frame: FrameType | None) -> None:
        raise CheckTimedOut(
            f"{check_id} did not finish within {seconds:g} s (the check time limit: verl conformance "
            f"--check-timeout, pytest --verl-check-timeout); the main thread was at {_where(frame)}: an engine "
            "call that never returns, or a wait for a worker that does not answer")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
