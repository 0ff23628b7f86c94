"""The rollout engine facade: what every rollout engine's ``generate`` does, done once.

:class:`RolloutEngineBase` implements :meth:`~verl_core.kernel.rollout.RolloutEngine.generate` as a
template: it refuses a closed, sleeping or stale engine, validates the request
(:func:`check_generate_request`), repeats each prompt ``n`` times and stamps the output's meta
(:func:`~verl_core.enginekit.sampling.expand_prompts`), answers an empty batch itself, moves the
rows to the engine's device, derives each row's seed, and assembles the output batch. A backend
implements only :meth:`RolloutEngineBase._generate_limits` (its vocabulary, device and memory
facts) and :meth:`RolloutEngineBase._sample` (the responses of the expanded rows). It also keeps
the weight version and the stale flag of weight updates (:meth:`RolloutEngineBase._writing_weights`),
and makes generation and weight writes take turns (:class:`WeightTurns`), so an update on another
thread never reaches a ``generate`` call in flight.

Engines may also implement the kernel's :class:`~verl_core.kernel.rollout.RolloutEngine` protocol
directly; the trainer and the conformance suite only use the protocol.
"""

from __future__ import annotations

import contextlib
import threading
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from verl_core.enginekit.memory import check_generate_memory
from verl_core.enginekit.sampling import expand_prompts, sample_seed
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import (
    BatchValidationError,
    ConfigError,
    StaleWeightsError,
    VerlError,
    check_int,
    describe,
)
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.schema import check_temperature

__all__ = [
    "EngineAsleepError",
    "GenerateLimits",
    "Responses",
    "RolloutEngineBase",
    "WeightTurns",
    "check_generate_request",
]


class EngineAsleepError(ConfigError, RuntimeError):
    """An engine was asked to work while asleep (after ``sleep()``, before ``wake()``)."""


Responses = tuple[Tensor, Tensor, Tensor, Tensor]
"""What :meth:`RolloutEngineBase._sample` returns: ``response_ids`` [rows, width] int64 (right-padded
with the pad id), ``response_mask`` [rows, width] bool, ``rollout_log_probs`` [rows, width] float32
(0 where masked) and ``truncated`` [rows] bool, on any device."""


@dataclass(frozen=True)
class GenerateLimits:
    """What a generate request is checked against, and where it runs.

    Every field is checked when the object is built (a ``ConfigError`` naming it).

    Attributes:
        vocab_size: Rows of the model's input embedding: prompt ids and stop ids must be below it.
        device: Where the expanded rows are moved before :meth:`RolloutEngineBase._sample`, and
            whose available memory the request must fit in.
        logits_vocab: Logit columns per row the engine materialises in float32 (usually
            ``vocab_size``); 0 for an engine that keeps its logits elsewhere (memory estimate only).
        rows_at_once: Rows decoded together (None = all of them; memory estimate only).
        min_temperature: A sampling temperature floor above the schema's own (None = none).
        temperature_reason: Why that floor, for the message.
        group: The process group of ranks that generate together (tensor-parallel ranks): they
            refuse a request that cannot fit together.
    """

    vocab_size: int
    device: torch.device
    logits_vocab: int = 0
    rows_at_once: int | None = None
    min_temperature: float | None = None
    temperature_reason: str = ""
    group: Any = None

    def __post_init__(self) -> None:
        check_int(self.vocab_size, "GenerateLimits.vocab_size", low=1)
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError):
            raise ConfigError(f"GenerateLimits.device must be a torch.device, got {describe(self.device)}") from None
        check_int(self.logits_vocab, "GenerateLimits.logits_vocab", low=0, hint=" (0 = logits kept elsewhere)")
        if self.rows_at_once is not None:
            check_int(self.rows_at_once, "GenerateLimits.rows_at_once", low=1, hint=" or None")
        if self.min_temperature is not None:
            check_temperature(self.min_temperature, "GenerateLimits.min_temperature")


def check_generate_request(
    prompts: object, params: object, *, spec: EngineSpec, limits: GenerateLimits, where: str
) -> None:
    """Refuse a generate request the engine cannot serve, before anything is allocated.

    Args:
        prompts: The prompts given to ``generate``.
        params: The sampling parameters given to ``generate``.
        spec: The engine's spec (``max_prompt_len``, ``max_response_len``).
        limits: The engine's vocabulary, device and memory facts.
        where: The caller, for the messages (``"MyRolloutEngine.generate"``).

    Raises:
        BatchValidationError: not a TensorBatch, a missing or malformed field (dtype, shape,
            padding side, an empty prompt, ids outside the vocabulary), or a prompt longer than
            ``spec.max_prompt_len``.
        ConfigError: not a SamplingParams, ``max_new_tokens`` above ``spec.max_response_len``, a
            stop id outside the vocabulary, or a temperature below the engine's floor.
        RequestTooLargeError: the request cannot fit in memory.
    """
    if not isinstance(prompts, TensorBatch):
        raise BatchValidationError(f"{where}: prompts must be a TensorBatch, got {describe(prompts)}")
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"{where}: params must be a SamplingParams, got {describe(params)}")
    prompts.require("prompt_ids", "prompt_mask", "group_ids", where=where)
    prompts.check(where=where, vocab_size=limits.vocab_size)
    if prompts.batch_size:
        lengths = prompts["prompt_mask"].sum(1)
        row = int(lengths.argmax())
        if int(lengths[row]) > spec.max_prompt_len:
            raise BatchValidationError(
                f"{where}: prompt of sample {row} has {int(lengths[row])} tokens, more than max_prompt_len="
                f"{spec.max_prompt_len}; raise it in the EngineSpec or shorten the prompts"
            )
    if params.max_new_tokens > spec.max_response_len:
        raise ConfigError(
            f"{where}: max_new_tokens={params.max_new_tokens} exceeds the engine's max_response_len="
            f"{spec.max_response_len}; lower it or raise max_response_len"
        )
    for t in params.stop_token_ids:
        if not 0 <= t < limits.vocab_size:
            raise ConfigError(f"{where}: stop token id {t} is outside the vocabulary [0, {limits.vocab_size})")
    if limits.min_temperature is not None and not params.greedy:
        check_temperature(params.temperature, floor=limits.min_temperature, reason=limits.temperature_reason)
    check_generate_memory(prompts, params, device=limits.device, vocab_size=limits.logits_vocab,
                          rows_at_once=limits.rows_at_once, where=where, group=limits.group)


class WeightTurns:
    """Generation and weight writes of one engine take turns: one holder at a time, writes first.

    ``generating()`` holds the turn for a ``generate`` call, ``writing()`` for a weight update.
    A write waits for the holder to let go; while a write waits, no new ``generate`` call takes
    the turn, so a steady flow of ``generate`` calls cannot starve an update. ``generate`` calls
    of one engine thus run one at a time. The thread that holds the turn may take it again (a
    weight path that nests another, a ``generate`` that writes), so nesting never deadlocks.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None  # the thread holding the turn
        self._depth = 0  # how many times it took it
        self._writes_waiting = 0

    def generating(self) -> contextlib.AbstractContextManager[None]:
        """Hold the turn for generation (waits for a write in progress or waiting)."""
        return self._hold(write=False)

    def writing(self) -> contextlib.AbstractContextManager[None]:
        """Hold the turn for a weight write (waits for the ``generate`` call in flight)."""
        return self._hold(write=True)

    @contextlib.contextmanager
    def _hold(self, *, write: bool) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                if write:
                    self._writes_waiting += 1
                try:
                    self._cond.wait_for(lambda: self._owner is None and (write or not self._writes_waiting))
                except BaseException:  # interrupted while waiting
                    if write:
                        self._writes_waiting -= 1
                        self._cond.notify_all()  # generate calls waiting behind this write may go
                    raise
                if write:
                    self._writes_waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._cond.notify_all()


_TURNS_MADE = threading.Lock()  # guards the lazy creation of each engine's WeightTurns


class RolloutEngineBase(RolloutEngine):
    """A :class:`~verl_core.kernel.rollout.RolloutEngine` whose ``generate`` is written once.

    Subclasses implement the protocol's properties (``spec``, ``capabilities``, ``tokenizer``,
    ``weight_dtype``), ``log_probs_exact``, ``update_weights`` and two hooks:

    * :meth:`_generate_limits`: the vocabulary size, device and memory facts requests are checked
      against;
    * :meth:`_sample`: the responses of the rows ``generate`` prepared.

    ``generate`` then refuses a closed engine (``VerlError``), a sleeping one
    (:class:`EngineAsleepError`) and one whose last weight sync failed
    (:class:`~verl_core.kernel.errors.StaleWeightsError`), validates the request
    (:func:`check_generate_request`), and fills the output's response fields and meta. Every
    message names the engine class.

    Weight updates during generation (``RolloutCapabilities.concurrent_weight_update``): ``generate``
    holds the engine's :class:`WeightTurns` from its first check to its output, and
    :meth:`_writing_weights` holds it while weights are written. An ``update_weights`` that writes
    through :meth:`_writing_weights` waits for the ``generate`` call in flight to end and then
    applies the whole stream; ``generate`` calls that arrive meanwhile wait for it and then use
    the new version (or raise ``StaleWeightsError`` if it failed). Each call therefore samples from
    one complete version and stamps that version in its meta. A weight path that writes outside
    :meth:`_writing_weights` (``_mark_stale`` ... ``_commit_weights`` on its own) gets no such
    guarantee, and its engine must not declare the capability.

    The state it keeps (version, stale reason, asleep, closed, turns) has class-level defaults or
    is made on first use, so a subclass constructor need not call ``super().__init__()``.
    ``update_weights`` writes through :meth:`_writing_weights`. ``sleep`` and ``wake`` are the
    protocol's no-ops unless a subclass overrides them (a ``sleep`` that frees memory sets
    ``_asleep``, ``wake`` clears it). ``close`` sets ``_closed``, which ``generate`` then refuses;
    a subclass's ``close`` that releases more sets it too.
    """

    _version: int = 0
    _stale_reason: str | None = None
    _asleep: bool = False
    _closed: bool = False
    _weight_turns: WeightTurns | None = None

    # ------------------------------------------------------------------ the hooks
    @abstractmethod
    def _generate_limits(self) -> GenerateLimits:
        """The vocabulary size, device and memory facts a request is checked against."""

    @abstractmethod
    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        """Generate one response per row.

        Args:
            rows: The validated prompts repeated ``params.n`` times (``prompt_ids``, ``prompt_mask``,
                ``group_ids``, ``sample_index`` 0..n-1 and the input's other fields), at least one
                row, on :attr:`GenerateLimits.device`.
            params: The sampling parameters.
            seeds: Row r's seed (:meth:`_sample_seeds`): its random stream is fixed by it.

        Returns:
            The response fields (:data:`Responses`), on any device.
        """

    # ------------------------------------------------------------------ generation
    @property
    def weight_version(self) -> int:
        """Version of the weights serving now (0 = as loaded)."""
        return self._version

    @property
    def stale(self) -> bool:
        """True after a failed weight sync, until a complete one succeeds (``generate`` refuses)."""
        return self._stale_reason is not None

    def _name(self, what: str) -> str:
        return f"{type(self).__name__}.{what}"

    @property
    def _turns(self) -> WeightTurns:
        """This engine's :class:`WeightTurns` (made on first use)."""
        turns = self._weight_turns
        if turns is None:
            with _TURNS_MADE:
                if self._weight_turns is None:
                    self._weight_turns = WeightTurns()
                turns = self._weight_turns
        return turns

    def _check_ready(self, what: str) -> None:
        """Refuse to run ``what`` on a closed or sleeping engine.

        Raises:
            VerlError: the engine was closed.
            EngineAsleepError: :meth:`sleep` was called without :meth:`wake`.
        """
        if self._closed:
            raise VerlError(f"{self._name(what)}: the engine was closed; build a new one")
        if self._asleep:
            raise EngineAsleepError(f"{self._name(what)}: the engine is asleep; call wake() first")

    def close(self) -> None:
        """Mark the engine closed: :meth:`generate` refuses it from now on (a subclass releases more)."""
        self._closed = True

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Sample ``params.n`` responses per prompt (see :meth:`RolloutEngine.generate`).

        The call holds the engine's turn (:class:`WeightTurns`) throughout: it waits for a weight
        write in progress or waiting, and no write starts until it returns.

        Raises:
            VerlError: the engine was closed.
            EngineAsleepError: :meth:`sleep` was called without :meth:`wake`.
            StaleWeightsError: the last weight sync failed and no complete one followed.
            BatchValidationError: malformed prompts, or one longer than ``spec.max_prompt_len``.
            ConfigError: ``max_new_tokens`` above ``spec.max_response_len``, a stop id outside the
                vocabulary, or a temperature below the engine's floor.
            RequestTooLargeError: the request cannot fit in memory.
        """
        with self._turns.generating():
            return self._generate(prompts, params)

    def _generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """:meth:`generate` with the turn held."""
        where = self._name("generate")
        self._check_ready("generate")
        if self._stale_reason is not None:
            raise StaleWeightsError(
                f"{where}: the engine holds inconsistent weights ({self._stale_reason}); run a complete "
                "update_weights() before generating"
            )
        limits = self._generate_limits()
        check_generate_request(prompts, params, spec=self.spec, limits=limits, where=where)
        expanded, meta = expand_prompts(prompts, params, pad_token_id=self.tokenizer.pad_token_id,
                                        weight_version=self._version)
        device = prompts.device
        if expanded.batch_size == 0:
            ids = torch.zeros(0, 0, dtype=torch.int64, device=device)
            return expanded.update(response_ids=ids, response_mask=ids.bool(), rollout_log_probs=ids.float(),
                                   truncated=torch.zeros(0, dtype=torch.bool, device=device), meta=meta)
        rows = expanded.to(limits.device)
        ids, mask, log_probs, truncated = self._sample(rows, params, self._sample_seeds(rows, params))
        return expanded.update(response_ids=ids.to(device), response_mask=mask.to(device),
                               rollout_log_probs=log_probs.to(device), truncated=truncated.to(device), meta=meta)

    def _sample_seeds(self, rows: TensorBatch, params: SamplingParams) -> list[int]:
        """Each row's seed: :func:`~verl_core.enginekit.sampling.sample_seed` of (call seed, group
        id, sample index), the call seed being ``params.seed`` or :meth:`_call_seed` when unset."""
        seed = params.seed if params.seed is not None else self._call_seed()
        groups = rows["group_ids"].tolist()
        indices = rows["sample_index"].tolist()
        return [sample_seed(seed, g, i) for g, i in zip(groups, indices, strict=True)]

    def _call_seed(self) -> int:
        """A random seed for an unseeded call, from torch's global generator (override to share
        one among the ranks that generate together)."""
        return int(torch.randint(0, 2**62, (1,)).item())

    # ------------------------------------------------------------------ weights
    def _mark_stale(self, reason: str) -> None:
        """Refuse ``generate`` (StaleWeightsError naming ``reason``) until :meth:`_commit_weights`."""
        self._stale_reason = reason

    def _commit_weights(self, version: int) -> None:
        """Serve the weights written since the engine went stale as ``version``."""
        self._version = version
        self._stale_reason = None

    @contextlib.contextmanager
    def _writing_weights(self) -> Iterator[None]:
        """Hold the engine's turn and mark it stale while its weights are written; the body ends
        with :meth:`_commit_weights`. An exception leaves it stale, recording why, and propagates.

        Entering waits for the ``generate`` call in flight to end; ``generate`` calls that arrive
        while the body runs wait for it (:class:`WeightTurns`). The thread inside may enter again
        (a weight path that falls back to another).

        Raises:
            VerlError: the engine was closed (nothing is marked stale).
            EngineAsleepError: :meth:`sleep` was called without :meth:`wake`: weights are sent to
                an engine that is awake (the version and the stale flag stay as they were).
        """
        with self._turns.writing():
            self._check_ready("update_weights")
            self._mark_stale("a weight sync is in progress")
            try:
                yield
            except Exception as e:
                detail = str(e) if isinstance(e, VerlError) else f"{type(e).__name__}: {e}"
                self._mark_stale(f"the last weight sync failed: {detail}")
                raise
            except BaseException:
                self._mark_stale("a weight sync was interrupted")
                raise
