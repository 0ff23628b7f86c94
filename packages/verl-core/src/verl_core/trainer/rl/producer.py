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
:class:`~verl_core.trainer.config.AsyncTrainingConfig`. Under those two the producer also samples
every released step at once, each on a slot of its own (:func:`producer_slots`): a step's rollout
starts as soon as it is released, not when the step before it has all its samples, and in a
multi-turn run the episodes of the steps share the rollout's generate calls, so the longest
episodes of one step decode beside the first turns of the next.) Under ``"finish"`` a run's numbers do not depend on thread timing, and ``max_staleness = 0`` is the synchronous
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

from verl_core.trainer.config import RunConfig
from verl_core.trainer.rl.step_state import StepState

__all__ = ["RolloutProducer", "producer_slots", "release_limit"]


def release_limit(step: int, *, max_staleness: int, checkpoint_every: int, steps: int) -> int:
    """The last step whose samples may be generated while step ``step`` trains (see the module doc)."""
    limit = step + max_staleness
    if checkpoint_every:
        next_checkpoint = (step // checkpoint_every + 1) * checkpoint_every
        limit = min(limit, next_checkpoint - 1)
    return min(limit, steps - 1)


def producer_slots(config: RunConfig) -> int:
    """How many steps the producer samples at once: ``max_staleness + 1`` (every step a training step
    may wait for, and those released with it) when ``async_training.partial_rollouts`` lets rollouts
    run across a weight update, else 1 (under ``"finish"`` the sync waits for every released step, so
    a second step would never start before the first ends)."""
    a = config.async_training
    return a.max_staleness + 1 if a.mode == "async" and a.partial_rollouts != "finish" else 1


class RolloutProducer:
    """Produces each released step, in order, on threads of its own.

    Each step's prompts are drawn in step order on the producer's thread (``draw``); its samples
    (``sample``) are made there too, or, with ``parallel`` > 1, on one of ``parallel`` worker
    threads, so up to ``parallel`` released steps are sampled at once (their episodes then share the
    rollout's generate calls: :class:`~verl_core.agent.loop.AgentLoop`).

    Args:
        draw: Draws a step's prompts: its state, without samples.
        sample: Makes the samples of a drawn step (the ``samples`` half), on worker ``slot``
            (0 <= slot < ``parallel``; a slot runs one step at a time).
        first: The first step to produce (the steps completed: 0, or a resumed run's step).
        snapshot: The data order's state before a step's prompts are drawn (kept per step, so a
            checkpoint records the position of the steps consumed, not of those drawn ahead).
        parallel: Most steps sampled at once (>= 1).
    """

    def __init__(self, draw: Callable[[int], StepState], sample: Callable[[StepState, int], None], *, first: int,
                 snapshot: Callable[[], Mapping[str, Any] | None], parallel: int = 1) -> None:
        self._draw = draw
        self._sample = sample
        self._snapshot = snapshot
        self._parallel = max(1, parallel)
        self._cond = threading.Condition()
        self._next = first  # the next step to draw
        self._allowed = first - 1
        self._busy: dict[int, int] = {}  # step -> slot, for the steps drawn and being sampled
        self._ready: dict[int, StepState] = {}
        self._data: dict[int, Mapping[str, Any] | None] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []

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
            BaseException: what the producer raised for this step, or for another before this one
                was produced (re-raised here).
            RuntimeError: ``step`` was not released, or was taken already.
        """
        t = time.perf_counter()
        with self._cond:
            gone = step < self._next and step not in self._ready and step not in self._busy
            if step > self._allowed or (gone and self._error is None):
                raise RuntimeError(f"step {step + 1} was not released to the rollout producer, or was taken")
            while step not in self._ready and (self._error is None or step in self._busy):
                self._cond.wait()  # a step under way when another failed still finishes
            if step not in self._ready:
                assert self._error is not None
                raise self._error
            self._data = {k: v for k, v in self._data.items() if k >= step}
            return self._ready.pop(step), time.perf_counter() - t

    def wait_idle(self) -> None:
        """Wait until every released step is produced (or the producer failed): no rollout is in flight."""
        with self._cond:
            while ((self._next <= self._allowed or self._busy) and self._error is None
                   and self._thread is not None):
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

    @property
    def in_flight(self) -> int:
        """Steps drawn whose samples are being made."""
        with self._cond:
            return len(self._busy)

    def close(self) -> None:
        """Stop producing; waits for the steps under way to finish."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for worker in self._workers:
            worker.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while (self._next > self._allowed or len(self._busy) >= self._parallel) and not self._closing \
                        and self._error is None:
                    self._cond.wait()
                if self._closing or self._error is not None:
                    return
                step = self._next
                slot = min(set(range(self._parallel)) - set(self._busy.values()))
                self._data[step] = self._snapshot()
            try:
                state = self._draw(step)
            except BaseException as e:  # handed to the trainer, which names the failed stage
                self._fail(e)
                return
            with self._cond:
                self._busy[step] = slot
                self._next = step + 1
            if self._parallel == 1:
                self._sample_step(state, slot)
            else:
                worker = threading.Thread(target=self._sample_step, args=(state, slot), daemon=True,
                                          name=f"verl-rollout-producer-{slot}")
                self._workers = [w for w in self._workers if w.is_alive()] + [worker]
                worker.start()

    def _sample_step(self, state: StepState, slot: int) -> None:
        try:
            self._sample(state, slot)
        except BaseException as e:  # handed to the trainer, which names the failed stage
            self._fail(e, state.step)
            return
        with self._cond:
            self._busy.pop(state.step, None)
            self._ready[state.step] = state
            self._cond.notify_all()

    def _fail(self, error: BaseException, step: int | None = None) -> None:
        """Record the first failure (of ``step``'s sampling, when given): nothing more is drawn."""
        with self._cond:
            if step is not None:
                self._busy.pop(step, None)
            if self._error is None:
                self._error = error
            self._cond.notify_all()
