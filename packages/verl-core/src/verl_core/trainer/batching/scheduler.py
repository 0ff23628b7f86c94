"""DynamicBatchScheduler: the memory policy of micro-batching, with OOM back-off and replay.

The scheduler does not cut batches itself: engines micro-batch internally with the kernel's one
partitioner (:func:`~verl_core.kernel.batch.partition_by_token_budget`), and the scheduler picks the
token budget they run under: tokens per micro-batch as the engine counts them
(:func:`~verl_core.kernel.batch.micro_batch_cost`), padded (size x longest sequence, prompt plus
response), or the sum of the sequences' lengths for an engine that packs them
(``TrainingCapabilities.packed_sequences``; callers pass ``packed=`` so the recorded plan is the
engine's). The budget is ``(free memory - reserved_bytes) x memory_fraction / bytes_per_token``
from the free memory a probe reports, clamped to ``[min_tokens, max_tokens]`` (no upper bound by
default), to a ceiling learned from out-of-memory errors, from above to the call's whole batch (a
larger budget would run it the same way) and from below to the call's longest sample. On
``torch.OutOfMemoryError`` the ceiling halves and the WHOLE call runs again on the smaller budget
(an engine call that raises leaves nothing behind, see ``TrainingEngine.forward_backward``), so no
sample is lost or counted twice; after ``grow_after`` micro-batches of successful calls the
ceiling doubles again. Every call's final budget is recorded as a :class:`Decision`; a scheduler given those
decisions (``replay=``) reuses the recorded budget for the same call keys instead of probing, so a
resumed run executes the same micro-batches.

By default the probe is read at every call. :meth:`DynamicBatchScheduler.fix_budget` reads it once
and keeps that budget (the trainer does so at run start and stores it in its checkpoints): the
partition of a step, and so the float sums of its gradients, then does not depend on the memory
free when the step runs, and a resumed run splits its steps like an uninterrupted one.

With a ``peak_probe``, a budget fixed from the probe is refined once: the first training call
(``run(..., training=True)``) runs under the probe, and ``bytes_per_token`` becomes the measured
peak per budget token of its largest micro-batch; the budget is recomputed from the memory read by
``fix_budget``. The refined budget is recorded in that call's :class:`Decision` and in
:meth:`~DynamicBatchScheduler.state_dict`, so a resumed run (from a checkpoint or a replayed plan)
uses the same budget and never measures again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import torch

from verl_core.kernel.batch import TensorBatch, micro_batch_cost, partition_by_token_budget
from verl_core.kernel.errors import ConfigError, VerlError
from verl_core.kernel.training import GlobalBatchStats, LossFn, TrainingEngine
from verl_core.trainer.batching.probes import (
    MemoryInfo,
    MemoryProbe,
    PeakProbe,
    PeakReading,
    cuda_memory_probe,
    cuda_peak_probe,
    default_memory_probe,
    default_peak_probe,
    host_memory_probe,
)

__all__ = [
    "Decision",
    "DynamicBatchScheduler",
    "MemoryInfo",
    "MemoryProbe",
    "MicroBatchOOMError",
    "PeakProbe",
    "PeakReading",
    "SchedulerConfig",
    "cuda_memory_probe",
    "cuda_peak_probe",
    "default_memory_probe",
    "default_peak_probe",
    "train_mini_batch",
    "host_memory_probe",
]

T = TypeVar("T")
_log = logging.getLogger(__name__)

_UNCAPPED: Final = 1 << 40
"""The ceiling of a scheduler without ``max_tokens`` (the batch bounds every call's budget anyway)."""


class MicroBatchOOMError(VerlError, RuntimeError):
    """A call ran out of memory and its budget cannot shrink further (a single sample does not fit)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds and policy of the dynamic micro-batch scheduler.

    Attributes:
        min_tokens: Smallest budget (tokens per micro-batch, see :func:`micro_batch_cost`).
        max_tokens: Largest budget (None: no fixed cap; each call's budget is at most its whole
            batch, which then runs as one micro-batch).
        bytes_per_token: Estimated bytes one budget token costs a training call (forward plus
            backward; a padded token, or a real one when the engine packs); the default is a
            model-agnostic constant, the trainer passes an estimate from the model's shape
            (:mod:`verl_core.trainer.batching.budget`).
        memory_fraction: Share of the free memory (less ``reserved_bytes``) the budget may use.
        reserved_bytes: Free memory set aside before the fraction is taken: state the engines
            allocate only at their first update (gradients, optimizer moments).
        grow_after: Successful micro-batches after which an OOM-lowered ceiling doubles again (counted
            at the end of each successful call).
    """

    min_tokens: int = 64
    max_tokens: int | None = None
    bytes_per_token: int = 256 * 1024
    memory_fraction: float = 0.5
    reserved_bytes: int = 0
    grow_after: int = 8

    def __post_init__(self) -> None:
        if self.min_tokens < 1 or (self.max_tokens is not None and self.max_tokens < self.min_tokens):
            raise ConfigError(
                f"SchedulerConfig needs 1 <= min_tokens <= max_tokens (or max_tokens None), got {self.min_tokens} "
                f"and {self.max_tokens}"
            )
        if self.bytes_per_token < 1:
            raise ConfigError(f"SchedulerConfig.bytes_per_token must be >= 1, got {self.bytes_per_token}")
        if self.reserved_bytes < 0:
            raise ConfigError(f"SchedulerConfig.reserved_bytes must be >= 0, got {self.reserved_bytes}")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"SchedulerConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.grow_after < 1:
            raise ConfigError(f"SchedulerConfig.grow_after must be >= 1, got {self.grow_after}")


@dataclass(frozen=True)
class Decision:
    """The recorded plan of one scheduler call.

    Attributes:
        key: Caller-chosen identifier of the call (e.g. ``"step3/actor_update/0"``).
        groups: The micro-batches of the call at its final budget, as sample indices of the call's
            batch (``partition_by_token_budget`` of its sample lengths, packed or padded as the
            engine ran the call).
        budget: Budget of the call's successful run (what a replay passes again).
        ooms: Out-of-memory errors handled during the call.
        ceiling: The scheduler's OOM ceiling after the call (restored when the call is replayed).
        successes: The scheduler's success counter after the call.
        refined: The fixed budget after this call refined it from the allocator's peak (0: the call
            did not refine; restored when the call is replayed).
    """

    key: str
    groups: tuple[tuple[int, ...], ...]
    budget: int
    ooms: int = 0
    ceiling: int = 0
    successes: int = 0
    refined: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        return {"key": self.key, "groups": [list(g) for g in self.groups], "budget": self.budget,
                "ooms": self.ooms, "ceiling": self.ceiling, "successes": self.successes, "refined": self.refined}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Decision:
        """Inverse of :meth:`to_json`."""
        return cls(str(data["key"]), tuple(tuple(int(i) for i in g) for g in data["groups"]),
                   int(data["budget"]), int(data.get("ooms", 0)), int(data.get("ceiling", 0)),
                   int(data.get("successes", 0)), int(data.get("refined", 0)))


@dataclass
class _Stats:
    ooms: int = 0
    oom_seconds: float = 0.0
    micro_batches: int = 0
    replayed: int = 0
    last_budget: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class DynamicBatchScheduler:
    """Picks micro-batch token budgets from free memory and survives out-of-memory errors.

    Args:
        config: Bounds and policy.
        probe: Memory probe (default: :func:`default_memory_probe` of ``device``); inject one to
            simulate memory pressure.
        device: Device whose memory the default probe reads.
        replay: Decisions of an earlier run; calls with a recorded key run at the recorded budget.
        peak_probe: Reads the allocator's peak around the first training call after
            :meth:`fix_budget` read the memory probe, to refine ``bytes_per_token`` once (None:
            the estimate stays).
    """

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        probe: MemoryProbe | None = None,
        device: str | torch.device = "cpu",
        replay: Iterable[Decision] = (),
        peak_probe: PeakProbe | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self._probe = probe or default_memory_probe(device)
        self._peak_probe = peak_probe
        self._cap = self.config.max_tokens if self.config.max_tokens is not None else _UNCAPPED
        self._ceiling = self._cap
        self._successes = 0
        self._fixed: int | None = None
        self._bytes_per_token = self.config.bytes_per_token
        self._available: int | None = None  # memory the fixed budget was computed from
        self._refine_from: int | None = None  # that memory, while the one-time refinement is pending
        self._rereadable = False  # the budget was read from the probe and no training call ran since
        self._replay = {d.key: d for d in replay}
        self._plan: list[Decision] = []
        self._stats = _Stats()
        self._oom_seconds: dict[str, float] = {}  # call key -> seconds of its attempts that ran out of memory

    # ------------------------------------------------------------------ budget
    def probe_budget(self) -> int:
        """The budget of the next call, within the bounds and the OOM ceiling.

        It is the fixed budget after :meth:`fix_budget`, else what the free memory allows now.
        """
        allowed = self._fixed if self._fixed is not None else self._budget_for(self._read_available())
        return max(self.config.min_tokens, min(allowed, self._ceiling, self._cap))

    def _read_available(self) -> int:
        return max(0, self._probe().free_bytes - self.config.reserved_bytes)

    def _budget_for(self, available: int) -> int:
        allowed = int(available * self.config.memory_fraction) // self._bytes_per_token
        return max(self.config.min_tokens, min(allowed, self._cap))

    def fix_budget(self, budget: int | None = None) -> int:
        """Read the probe once (or take ``budget``) and use that budget for every later call.

        Out-of-memory errors still lower the budget through the ceiling. :meth:`state_dict`
        carries the fixed budget, so a resumed run reuses it instead of reading its own memory.
        A budget read from the probe is refined once by the first training call when the
        scheduler has a ``peak_probe``; a given ``budget`` is kept as it is.

        Returns:
            The budget fixed, within ``[min_tokens, max_tokens]``.

        Raises:
            ConfigError: ``budget`` is below 1.
        """
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"fix_budget(budget={budget!r}) needs an integer >= 1 (or None to read the probe)")
        if budget is None:
            self._available = self._read_available()
            self._fixed = self._budget_for(self._available)
            self._refine_from = self._available if self._peak_probe is not None else None
            self._rereadable = True
        else:
            self._available = self._refine_from = None
            self._rereadable = False
            self._fixed = max(self.config.min_tokens, min(budget, self._cap))
        return self._fixed

    def reread_budget(self) -> int:
        """Read the probe again and fix the budget from that reading, where :meth:`fix_budget` read
        it and no training call ran since (a budget given or restored stays); otherwise change nothing.

        For a run whose memory at the first update differs from the memory at :meth:`fix_budget`:
        a rollout engine that sleeps through the update frees its weights then, which the reading
        at setup counted as used. Returns the fixed budget.
        """
        if not self._rereadable or self._fixed is None:
            return self._fixed or 0
        self._available = self._read_available()
        if self._refine_from is not None:
            self._refine_from = self._available
        self._fixed = self._budget_for(self._available)
        return self._fixed

    @property
    def fixed_budget(self) -> int | None:
        """The budget set by :meth:`fix_budget` (None: the probe is read at every call)."""
        return self._fixed

    @property
    def available_bytes(self) -> int | None:
        """Free memory less ``reserved_bytes`` that :meth:`fix_budget` read (None: not read)."""
        return self._available

    @property
    def bytes_per_token(self) -> int:
        """The bytes per token the budget is computed with (the config's, or the refined one)."""
        return self._bytes_per_token

    @property
    def refinement_pending(self) -> bool:
        """True until the first training call refines the fixed budget (see :meth:`run`)."""
        return self._refine_from is not None

    @property
    def ceiling(self) -> int:
        """Largest budget allowed after the out-of-memory errors seen so far."""
        return self._ceiling

    @property
    def plan(self) -> tuple[Decision, ...]:
        """Every decision recorded by this scheduler, in call order."""
        return tuple(self._plan)

    def add_replay(self, decisions: Iterable[Decision]) -> None:
        """Add decisions to replay (e.g. read back from an interrupted run's plan file)."""
        for d in decisions:
            self._replay[d.key] = d

    # ------------------------------------------------------------------ run
    def run(
        self, batch: TensorBatch, fn: Callable[[int], T], *, key: str, training: bool = False, packed: bool = False
    ) -> T:
        """Call ``fn(budget)`` for the whole ``batch``; on out-of-memory, call it again on a halved budget.

        ``fn`` runs the whole batch under the token budget it is given (e.g.
        ``lambda budget: engine.forward_backward(batch, loss, stats, max_tokens=budget)``) and must
        leave nothing behind when it raises, as engine calls do. The budget is never below the
        batch's longest sample, which the partitioner needs to fit into one micro-batch, and never
        above the whole batch's cost.

        ``training`` marks a forward-backward call: the first one after :meth:`fix_budget` read
        the probe runs under the ``peak_probe``, and its measured peak per budget token replaces
        ``bytes_per_token`` for the fixed budget of later calls (once; recorded in the decision).

        ``packed`` says the engine packs this call's micro-batches (its
        ``capabilities.packed_sequences``): a micro-batch then costs the sum of its lengths
        instead of size x longest, so the recorded groups, the out-of-memory back-off and the
        refinement count what the engine runs.

        Returns:
            What the successful call of ``fn`` returned.

        Raises:
            MicroBatchOOMError: the call ran out of memory with every micro-batch a single sample,
                or at the smallest budget allowed (``min_tokens``, or the longest sample).
            ConfigError: a replayed decision does not cover ``batch``.
        """
        lengths = [int(n) for n in batch.seq_lengths().tolist()]
        longest = max(lengths, default=1)
        recorded = self._replay.pop(key, None)
        if recorded is not None:
            covered = sorted(i for g in recorded.groups for i in g)
            if covered != list(range(batch.batch_size)):
                raise ConfigError(
                    f"replayed plan for {key!r} covers {len(covered)} samples, the batch has "
                    f"{batch.batch_size}; the resumed run differs from the recorded one"
                )
            budget = max(recorded.budget, longest)
            self._stats.replayed += 1
        else:
            budget = max(self.probe_budget(), longest)
        whole = max(micro_batch_cost(lengths, packed=packed), longest)
        budget = min(budget, whole)  # more than the whole batch changes nothing
        measure = self._peak_probe if training and recorded is None and self._refine_from is not None else None
        if training:
            self._rereadable = False
        reading: PeakReading | None = None
        ooms = 0
        while True:
            groups = partition_by_token_budget(lengths, budget, packed=packed)
            started = time.perf_counter()
            try:
                if measure is not None:
                    result, reading = measure(functools.partial(fn, budget))
                else:
                    result = fn(budget)
                break
            except torch.OutOfMemoryError as e:
                lost = time.perf_counter() - started  # the failed attempt's work, run again below
                self._oom_seconds[key] = self._oom_seconds.get(key, 0.0) + lost
                self._stats.oom_seconds += lost
                ooms += 1
                self._stats.ooms += 1
                self._successes = 0
                worst = max((micro_batch_cost([lengths[i] for i in g], packed=packed) for g in groups), default=1)
                if all(len(g) == 1 for g in groups):
                    raise MicroBatchOOMError(
                        f"{key}: one sample of {longest} tokens ran out of memory on its own; "
                        "lower max_prompt_len/max_response_len, use a smaller model or free memory"
                    ) from e
                new_budget = max(self.config.min_tokens, longest, min(budget, worst) // 2)
                if new_budget >= worst:
                    raise MicroBatchOOMError(
                        f"{key}: micro-batches of {worst} {'packed' if packed else 'padded'} tokens ran out "
                        f"of memory and the budget cannot go below {new_budget} (batch.min_tokens={self.config.min_tokens}, longest "
                        f"sample {longest} tokens); lower batch.min_tokens or the sequence lengths, or free memory"
                    ) from e
                budget = new_budget
                self._ceiling = new_budget
        self._stats.micro_batches += len(groups)
        self._successes += len(groups)
        if self._successes >= self.config.grow_after and self._ceiling < self._cap:
            self._ceiling = min(self._cap, self._ceiling * 2)
            self._successes = 0
        if recorded is not None and recorded.ceiling:
            self._ceiling, self._successes = recorded.ceiling, recorded.successes
        refined = 0
        if measure is not None:
            refined = self._refine(reading, groups, lengths, key, packed)
        elif recorded is not None and recorded.refined:
            self._fixed, self._refine_from, refined = recorded.refined, None, recorded.refined
        self._stats.last_budget = budget
        self._plan.append(
            Decision(key, tuple(tuple(g) for g in groups), budget, ooms, self._ceiling, self._successes, refined)
        )
        return result

    def _refine(
        self, reading: PeakReading | None, groups: list[list[int]], lengths: list[int], key: str, packed: bool
    ) -> int:
        """Correct ``bytes_per_token`` from the peak of the first training call; returns the fixed budget."""
        available, self._refine_from = self._refine_from, None
        assert available is not None and self._fixed is not None
        tokens = max((micro_batch_cost([lengths[i] for i in g], packed=packed) for g in groups if g), default=0)
        if reading is None or reading.transient <= 0 or tokens <= 0:
            _log.info("micro-batch budget: %s read no allocator peak; the budget stays %d tokens (%d bytes/token)",
                      key, self._fixed, self._bytes_per_token)
            return self._fixed
        estimate, before = self._bytes_per_token, self._fixed
        self._bytes_per_token = max(1, -(-reading.transient // tokens))
        self._fixed = self._budget_for(available)
        _log.info(
            "micro-batch budget refined after %s: the allocator's peak was %d bytes above the call's resident "
            "memory for a micro-batch of %d %s tokens, %d bytes/token (estimate %d); budget %d -> %d tokens",
            key, reading.transient, tokens, "packed" if packed else "padded", self._bytes_per_token, estimate,
            before, self._fixed,
        )
        return self._fixed

    def run_forward(
        self, batch: TensorBatch, fn: Callable[[TensorBatch], TensorBatch], *, key: str, packed: bool = False
    ) -> TensorBatch:
        """Run a batch-to-batch function (a forward pass) per micro-batch and reassemble the samples in input order.

        The micro-batches are ``batch.micro_batches(max_tokens=budget, packed=packed)`` (the kernel
        partitioner) at the budget :meth:`run` picks; pass ``packed`` when ``fn`` runs an engine
        that packs (its ``capabilities.packed_sequences``). A forward computes no gradients, so its
        pieces are independent calls and an out-of-memory error runs the whole batch again on a
        smaller budget.
        """

        def whole(budget: int) -> TensorBatch:
            mbs = batch.micro_batches(max_tokens=budget, trim=False, packed=packed)
            return mbs.restore([fn(mb) for mb in mbs])

        return self.run(batch, whole, key=key, packed=packed)

    def oom_seconds(self, prefix: str = "") -> float:
        """Wall seconds of the attempts that ran out of memory (and ran again on a smaller budget), over
        the calls whose key starts with ``prefix`` (``"step3/"``: one step's)."""
        return sum(t for k, t in self._oom_seconds.items() if k.startswith(prefix))

    # ------------------------------------------------------------------ state
    def metrics(self) -> dict[str, float]:
        """Counters since construction: OOMs handled and the seconds they cost, micro-batches of successful
        calls, replayed calls, budgets."""
        return {
            "scheduler/ooms": float(self._stats.ooms),
            "scheduler/oom_seconds": self._stats.oom_seconds,
            "scheduler/micro_batches": float(self._stats.micro_batches),
            "scheduler/replayed_calls": float(self._stats.replayed),
            "scheduler/budget": float(self._stats.last_budget),
            "scheduler/ceiling": float(self._ceiling),
            "scheduler/bytes_per_token": float(self._bytes_per_token),
        }

    def state_dict(self) -> dict[str, Any]:
        """The learned ceiling, success counter, fixed budget and a pending refinement's memory
        (``refine_from``; what a resume needs besides the plan)."""
        return {"ceiling": self._ceiling, "successes": self._successes, "budget": self._fixed,
                "refine_from": self._refine_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        A state without ``budget`` keeps the current one; a state without ``refine_from`` (written
        before budgets were refined) refines nothing, so its budget stays as the run had it.
        """
        self._ceiling = int(state["ceiling"])
        self._successes = int(state["successes"])
        if "budget" in state:
            self._fixed = None if state["budget"] is None else int(state["budget"])
        refine_from = state.get("refine_from")
        self._refine_from = None if refine_from is None or self._peak_probe is None else int(refine_from)
        self._rereadable = False


def train_mini_batch(engine: TrainingEngine, scheduler: DynamicBatchScheduler, mini_batch: TensorBatch,
                     loss: LossFn, *, key: str) -> dict[str, float]:
    """One optimizer step of ``engine`` on ``mini_batch``, the training call the RL update and SFT share.

    ``forward_backward`` takes the whole mini-batch under the scheduler's budget (the engine cuts
    it into micro-batches, packed when its ``capabilities.packed_sequences`` says so, which the
    scheduler's plan follows; on out-of-memory the scheduler halves the budget and calls again),
    then ``optimizer_step``.

    Returns:
        The loss's metrics for the mini-batch, plus ``grad_norm``, ``lr`` and ``skipped`` (1.0 when
        the engine skipped a non-finite update, on every rank).
    """
    stats = GlobalBatchStats.of(mini_batch)

    def call(budget: int) -> Mapping[str, float]:
        return engine.forward_backward(mini_batch, loss, stats, max_tokens=budget)

    packed = engine.capabilities.packed_sequences
    result = scheduler.run(mini_batch, call, key=key, training=True, packed=packed)
    metrics = {k: float(v) for k, v in result.items()}
    step = engine.optimizer_step()
    metrics.update(grad_norm=step.grad_norm, lr=step.lr, skipped=float(step.skipped))
    return metrics
