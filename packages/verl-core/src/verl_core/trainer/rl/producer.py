"""Asynchronous rollout: the samples of the next steps are generated while the policy updates.

With ``async_training.mode = "async"`` the trainer is a consumer: a :class:`RolloutProducer`
draws each step's prompts and runs its ``samples`` half (rollout, ReMax's baseline, reward,
dynamic sampling) on a thread of its own, while the trainer runs the forwards, the advantages and
the optimizer steps of an earlier step. ``max_staleness`` bounds how far ahead it runs: the samples
of step ``j`` come from weight version ``max(c, j - max_staleness)``, where ``c`` is the last
checkpoint step at or before ``j``. The schedule is fixed, not a race:

* at the start of step ``t`` the trainer releases steps up to ``min(t + max_staleness, b - 1)``,
  where ``b`` is the next checkpoint step after ``t`` (no step is drawn across a checkpoint, so the
  checkpoint holds no unconsumed samples and ``--resume`` continues exactly);
* every released step is generated with the weights serving at the moment of release, because the
  weight sync at the end of step ``t`` first waits until the producer has finished what it was
  released (:meth:`RolloutProducer.wait_idle`): no ``generate`` is in flight while weights arrive,
  and no response mixes two versions.

(That is ``async_training.partial_rollouts = "finish"``; with ``"continue"`` the sync waits only for
the ``generate`` call in flight, and the rest samples from the new weights; ``"restart"`` waits the
same way but samples an episode that spans the update again from its first turn: see
:class:`~verl_core.trainer.config.AsyncTrainingConfig`.) So a run's numbers do not depend on thread timing, and ``max_staleness = 0`` is the synchronous
trainer, computed by this machinery (tested bit-equal). Nothing is ever older than the bound, so
nothing is dropped; ``async/staleness`` reports the age of each step's samples in weight versions.
The off-policy gap (the rollout's log-probs against the current policy's) is what the importance
sampling corrections of the algorithm settings act on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from verl_core.trainer.rl.step_state import StepState

__all__ = ["RolloutProducer", "release_limit"]


def release_limit(step: int, *, max_staleness: int, checkpoint_every: int, steps: int) -> int:
    """The last step whose samples may be generated while step ``step`` trains (see the module doc)."""
    limit = step + max_staleness
    if checkpoint_every:
        next_checkpoint = (step // checkpoint_every + 1) * checkpoint_every
        limit = min(limit, next_checkpoint - 1)
    return min(limit, steps - 1)


class RolloutProducer:
    """Runs ``make(step)`` for each released step, in order, on a thread of its own.

    Args:
        make: Builds a step's state with its samples (prompts drawn, the ``samples`` half run).
        first: The first step to produce (the steps completed: 0, or a resumed run's step).
        snapshot: The data order's state before a step's prompts are drawn (kept per step, so a
            checkpoint records the position of the steps consumed, not of those drawn ahead).
    """

    def __init__(self, make: Callable[[int], StepState], *, first: int,
                 snapshot: Callable[[], Mapping[str, Any] | None]) -> None:
        self._make = make
        self._snapshot = snapshot
        self._cond = threading.Condition()
        self._next = first  # the next step to produce
        self._allowed = first - 1
        self._ready: dict[int, StepState] = {}
        self._data: dict[int, Mapping[str, Any] | None] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    def release(self, upto: int) -> None:
        """Allow the steps up to ``upto`` to be produced (starts the thread on first use)."""
        with self._cond:
            self._allowed = max(self._allowed, upto)
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verl-rollout-producer", daemon=True)
            self._thread.start()

    def take(self, step: int) -> tuple[StepState, float]:
        """The state of ``step`` once produced, and the seconds waited for it.

        Raises:
            BaseException: what the producer raised for this or an earlier step (re-raised here).
            RuntimeError: ``step`` was not released, or was taken already.
        """
        t = time.perf_counter()
        with self._cond:
            if step > self._allowed or (step < self._next and step not in self._ready):
                raise RuntimeError(f"step {step + 1} was not released to the rollout producer, or was taken")
            while step not in self._ready and self._error is None:
                self._cond.wait()
            if step not in self._ready:
                assert self._error is not None
                raise self._error
            self._data = {k: v for k, v in self._data.items() if k >= step}
            return self._ready.pop(step), time.perf_counter() - t

    def wait_idle(self) -> None:
        """Wait until every released step is produced (or the producer failed): no rollout is in flight."""
        with self._cond:
            while self._next <= self._allowed and self._error is None and self._thread is not None:
                self._cond.wait()

    def data_state(self, step: int) -> Mapping[str, Any] | None:
        """The data order's state before ``step``'s prompts were drawn; None if they were not drawn ahead."""
        with self._cond:
            return self._data.get(step)

    @property
    def ahead(self) -> int:
        """Steps produced and not yet taken."""
        with self._cond:
            return len(self._ready)

    def close(self) -> None:
        """Stop producing; waits for a step under way to finish."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next > self._allowed and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                step = self._next
                self._data[step] = self._snapshot()
            try:
                state = self._make(step)
            except BaseException as e:  # handed to the trainer, which names the failed stage
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[step] = state
                self._next = step + 1
                self._cond.notify_all()
