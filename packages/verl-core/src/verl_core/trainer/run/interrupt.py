"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM: at a step boundary, with a checkpoint to resume from.

While :class:`StopSignals` is active in deferring mode (the step loop of
:meth:`~verl_core.trainer.run.context.RunContext.run_steps`), the first SIGINT or SIGTERM only
asks the run to stop: the step under way finishes, a checkpoint of it is written, the metric sinks
are closed and :class:`RunInterrupted` is raised. A second signal stops at once, abandoning the
step under way (nothing of it is saved; the newest checkpoint stays what it was). Outside the
step loop (setting up engines, loading a checkpoint) a signal stops at once.

:class:`RunInterrupted` is a ``KeyboardInterrupt``, not an ``Exception``: ``except Exception``
does not swallow it, as it does not swallow Ctrl-C. ``verl train`` and ``verl sft`` print it as one
line with the step and the command that continues the run, and exit ``128 + signal`` (130 for
SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Final

__all__ = ["STOP_SIGNALS", "RunInterrupted", "StopSignals"]

STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run (``SIGINT``: Ctrl-C; ``SIGTERM``: ``kill``, schedulers, containers)."""


class RunInterrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM stopped the run.

    Attributes:
        signum: The signal.
        exit_code: The exit status a command reports: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM).
        step: Steps completed when the run stopped (None: it stopped while being set up, before
            its step loop began).
        steps: The steps the run was configured for (None when unknown).
        abandoned: A step was under way and was abandoned (a second signal); nothing of it is saved.
        checkpoint: The newest complete checkpoint of the run (None when none was written).
    """

    def __init__(
        self, signum: int, *, step: int | None = None, steps: int | None = None, abandoned: bool = False,
        checkpoint: Path | None = None,
    ) -> None:
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.step = step
        self.steps = steps
        self.abandoned = abandoned
        self.checkpoint = checkpoint

    @property
    def signal_name(self) -> str:
        """``SIGINT`` or ``SIGTERM``."""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def __str__(self) -> str:
        of = f" of {self.steps}" if self.steps is not None else ""
        if self.step is None:
            what = f"interrupted by {self.signal_name} while the run was being set up"
        elif self.abandoned:
            what = (
                f"interrupted by {self.signal_name} during a step (steps completed: {self.step}{of}), "
                "which was abandoned"
            )
        else:
            what = f"interrupted by {self.signal_name}: stopped after step {self.step}{of}"
        saved = (
            f"newest checkpoint {str(self.checkpoint)!r}" if self.checkpoint is not None
            else "no checkpoint was written"
        )
        return f"{what}; {saved}"


class StopSignals:
    """While active, SIGINT and SIGTERM raise :class:`RunInterrupted`, or (deferring) ask for a stop.

    Handlers are installed only in the main thread (Python runs signal handlers there); elsewhere
    the context does nothing. A signal the process ignores (``SIG_IGN``, e.g. SIGINT of a job
    started in the background by a script) stays ignored. The handlers that were there before are
    put back on exit, so contexts nest: the innermost one handles the signal.

    Args:
        defer: The first signal only sets :attr:`requested` (the caller stops at its next safe
            point); a second one raises at once. Without ``defer`` every signal raises at once.
        notify: Called with a line when a stop is requested (``defer`` only).

    Attributes:
        requested: The signal that asked for a stop (None: none yet).
    """

    def __init__(self, *, defer: bool, notify: Callable[[str], None] | None = None) -> None:
        self.defer = defer
        self.notify = notify
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.defer and self.requested is None:
            self.requested = signum
            if self.notify is not None:
                name = signal.Signals(signum).name
                self.notify(
                    f"{name}: stopping after the step under way and saving a checkpoint "
                    f"(send {name} again to stop at once, abandoning the step)"
                )
            return
        raise RunInterrupted(signum)
