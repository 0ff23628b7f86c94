"""The RolloutEngine protocol and SamplingParams."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

import torch

from verl_core.kernel.capabilities import RolloutCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError, check_bool, check_int, check_number, describe
from verl_core.kernel.schema import check_temperature

if TYPE_CHECKING:
    from verl_core.kernel.batch import TensorBatch
    from verl_core.kernel.tokenizer import Tokenizer
    from verl_core.kernel.weights import WeightMessage

__all__ = [
    "MAX_NEW_TOKENS",
    "MAX_SAMPLES_PER_PROMPT",
    "RolloutEngine",
    "SamplingParams",
]

MAX_SAMPLES_PER_PROMPT: Final = 65536
"""Largest ``SamplingParams.n``."""
MAX_NEW_TOKENS: Final = 1 << 20
"""Largest ``SamplingParams.max_new_tokens`` (1,048,576; engines also cap it at ``max_response_len``)."""
_MAX_TOKEN_ID: Final = 2**63 - 1  # token ids are int64
_MAX_TOP_K: Final = 2**31 - 1  # engines hold k in 32 bits
_MAX_SEED: Final = 2**64 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    Every field is checked when the object is built: a value of the wrong type (a bool is not an
    integer here) or out of range raises :class:`~verl_core.kernel.errors.ConfigError` naming the field,
    the value and what is allowed.

    Attributes:
        temperature: Softmax temperature, a finite T >= ``verl_core.kernel.schema.MIN_TEMPERATURE`` (1e-4);
            ``rollout_log_probs`` are of softmax(logits / T). Lower temperatures are refused, not
            clamped: below the floor ``logits / T`` overflows float32 and the log-probs would be NaN.
            For argmax decoding use ``greedy=True``.
        top_p: Nucleus threshold in (0, 1] (1 = off).
        top_k: Keep the k most likely tokens, 0 <= k < 2**31 (0 = off).
        max_new_tokens: Longest response, 1 to :data:`MAX_NEW_TOKENS`; a response cut here has
            ``truncated`` True.
        n: Samples per prompt, 1 to :data:`MAX_SAMPLES_PER_PROMPT` (65536); they share the prompt's
            group id.
        stop_token_ids: Extra tokens that end a response besides EOS (kept in the response): a
            tuple (a list is turned into one) of token ids >= 0.
        seed: Seed of sampling, an integer in [0, 2**64 - 1]; with the group id and sample index
            it fixes each sample's stream (engines with ``seeding="per_batch"`` seed the whole
            call). None = unseeded.
        greedy: Take the most likely token (ties to the lowest id); log-probs still use ``temperature``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_number(self.top_p, "SamplingParams.top_p", low=0, high=1, low_open=True, hint=" (1 = off)")
        check_int(self.top_k, "SamplingParams.top_k", low=0, high=_MAX_TOP_K, hint=" (0 = off)")
        check_int(self.max_new_tokens, "SamplingParams.max_new_tokens", low=1, high=MAX_NEW_TOKENS)
        check_int(self.n, "SamplingParams.n", low=1, high=MAX_SAMPLES_PER_PROMPT)
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)):
            raise ConfigError(f"SamplingParams.stop_token_ids must be a tuple of token ids, got {describe(stops)}")
        for i, t in enumerate(stops):
            check_int(t, f"SamplingParams.stop_token_ids[{i}]", low=0, high=_MAX_TOKEN_ID)
        object.__setattr__(self, "stop_token_ids", tuple(stops))  # hashable, like the declared type
        if self.seed is not None:
            check_int(self.seed, "SamplingParams.seed", low=0, high=_MAX_SEED, hint=" or None")
        check_bool(self.greedy, "SamplingParams.greedy")

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p cut the distribution that is sampled from."""
        return self.top_p < 1.0 or self.top_k > 0


class RolloutEngine(Protocol):
    """Generates responses with log-probs, and takes new weights from a training engine.

    Input batches need ``prompt_ids`` (left-padded), ``prompt_mask`` and ``group_ids``; they are
    validated at the boundary (shape, dtype, padding side, ids in the vocabulary, prompt length
    within ``spec.max_prompt_len``) and rejected with a BatchValidationError before any engine
    code runs.

    Weight updates during generation: an engine that declares
    ``RolloutCapabilities.concurrent_weight_update`` accepts :meth:`update_weights` on one thread
    while :meth:`generate` calls are in flight on others, and never serves a half-applied weight
    version (the rule is at :meth:`update_weights`). Callers of an engine that does not declare it
    never overlap the two: ``update_weights`` runs only while no ``generate`` call is in flight.
    """

    @property
    @abstractmethod
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""

    @property
    @abstractmethod
    def capabilities(self) -> RolloutCapabilities:
        """What this engine supports."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """Tokenizer of the model."""

    @property
    @abstractmethod
    def weight_dtype(self) -> torch.dtype:
        """Dtype the engine wants weight streams in (the sender casts)."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights serving now (0 = as loaded)."""

    @abstractmethod
    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Sample ``params.n`` responses per prompt.

        Each prompt is sampled as the exact id sequence it is, whatever earlier calls computed: a
        cache of an earlier call's prompt and response (a prefix cache, see
        ``RolloutCapabilities.prefix_continuation``) serves only what a run without it computes.
        Under LongRoPE the rotation of every position depends on the whole sequence's length
        (short factors up to ``original_max_position_embeddings``, long past it), so keys cached
        while a sequence was short never serve its continuation past the threshold
        (``invariance::long_rope_continuation_across_threshold``).

        Returns:
            ``prompts.repeat_interleave(n)`` (samples of one prompt adjacent, same ``group_ids``,
            ``sample_index`` 0..n-1) updated with ``response_ids`` (right-padded with the pad id),
            ``response_mask`` (True at generated tokens including a terminating EOS/stop token),
            ``rollout_log_probs``, ``truncated``; meta carries temperature, top_p, top_k, pad id and
            the weight version: the one complete version that produced every response of the call
            (see :meth:`update_weights` for calls that overlap a weight update).

        Raises:
            StaleWeightsError: the last weight sync failed and no complete one followed.
        """

    @abstractmethod
    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Whether ``rollout_log_probs`` follow the schema's definition exactly under ``params``."""

    @abstractmethod
    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream (see :func:`verl_core.enginekit.weight_stream.apply_weight_stream`).

        On success the new version serves and the prefix cache is invalidated; on any failure
        the engine is stale and ``generate`` raises until a complete sync succeeds. An engine
        asleep (after :meth:`sleep`, whose ``generate`` refuses with ``EngineAsleepError``) refuses
        the call with ``EngineAsleepError`` before reading the stream, keeping its version and its
        stale flag: the caller wakes it first (``stateful::update_while_asleep_refused``).

        An engine that declares ``RolloutCapabilities.concurrent_weight_update`` may be given this
        call on one thread while ``generate`` calls run on others. It never serves a half-applied
        weight version:

        * every response of one ``generate`` call is produced by exactly one complete weight
          version, and the returned batch's ``meta.weight_version`` is that version;
        * a ``generate`` call that starts after ``update_weights`` returned uses the version it
          applied (or a later one, when another update followed);
        * a ``generate`` call that overlaps an update uses the version before it or the version
          it applies, whole; it may wait for the update, but never raises ``StaleWeightsError``
          because an update is in progress (only after one that failed).

        Whether an update waits for the ``generate`` calls in flight, swaps in a second copy of
        the weights or pauses between requests is the engine's choice.
        :class:`~verl_core.enginekit.rollout_base.RolloutEngineBase` takes turns: an update waits
        for the ``generate`` call in flight to end and then writes, and ``generate`` calls that
        arrive meanwhile wait for it.
        """

    def sleep(self) -> None:
        """Release device memory while training runs (a no-op where unsupported)."""
        return None

    def wake(self) -> None:
        """Restore what :meth:`sleep` (or :meth:`sleep_until_sync`) released."""
        return None

    def sleep_until_sync(self) -> None:
        """Release device memory while training runs, where the weights need not survive it.

        The caller promises to :meth:`wake` the engine and send it a complete weight sync
        (:meth:`update_weights` or a :class:`WeightSync`) before the next ``generate``, which is
        what a colocated trainer does after every update. The engine may therefore drop its
        weights instead of saving them (vLLM's sleep level 2): nothing is copied to the host and
        back. An engine that dropped them is stale after :meth:`wake` (``generate`` raises
        ``StaleWeightsError``) until that sync; one that kept them serves them as after
        :meth:`sleep` (``stateful::sleep_until_sync_then_sync``). The default is :meth:`sleep`.
        """
        self.sleep()

    def close(self) -> None:
        """Release resources; the engine is unusable afterwards.

        Ends every child process and non-daemon thread the engine started, and may be called
        more than once (``robustness::close_ends_what_the_engine_started``).
        """
        return None
