"""The RolloutEngine protocol and SamplingParams."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from verl_core.kernel.capabilities import RolloutCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError

if TYPE_CHECKING:
    from verl_core.kernel.batch import TensorBatch
    from verl_core.kernel.tokenizer import Tokenizer
    from verl_core.kernel.weights import WeightMessage

__all__ = ["RolloutEngine", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    Attributes:
        temperature: Softmax temperature T > 0; ``rollout_log_probs`` are of softmax(logits / T).
        top_p: Nucleus threshold in (0, 1] (1 = off).
        top_k: Keep the k most likely tokens (0 = off).
        max_new_tokens: Longest response; a response cut here has ``truncated`` True.
        n: Samples per prompt; they share the prompt's group id.
        stop_token_ids: Extra tokens that end a response besides EOS (kept in the response).
        seed: Seed of sampling; with the group id and sample index it fixes each sample's stream
            (engines with ``seeding="per_batch"`` seed the whole call). None = unseeded.
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
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"SamplingParams.{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_new_tokens", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"SamplingParams.{name} must be an integer, got {value!r}")
        if not self.temperature > 0:
            raise ConfigError(
                f"SamplingParams.temperature must be > 0 (use greedy=True for argmax), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ConfigError(f"SamplingParams.n must be >= 1, got {self.n}")

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

        Returns:
            ``prompts.repeat_interleave(n)`` (samples of one prompt adjacent, same ``group_ids``,
            ``sample_index`` 0..n-1) updated with ``response_ids`` (right-padded with the pad id),
            ``response_mask`` (True at generated tokens including a terminating EOS/stop token),
            ``rollout_log_probs``, ``truncated``; meta carries temperature, top_p, top_k, pad id and
            the weight version.

        Raises:
            StaleWeightsError: the last weight sync failed and no complete one followed.
        """

    @abstractmethod
    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Whether ``rollout_log_probs`` follow the schema's definition exactly under ``params``."""

    @abstractmethod
    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream (see :func:`verl_core.kernel.weights.apply_weight_stream`).

        On success the new version serves and the prefix cache is invalidated; on any failure
        the engine is stale and ``generate`` raises until a complete sync succeeds.
        """

    def sleep(self) -> None:
        """Release device memory while training runs (a no-op where unsupported)."""
        return None

    def wake(self) -> None:
        """Restore what :meth:`sleep` released."""
        return None

    def close(self) -> None:
        """Release resources; the engine is unusable afterwards."""
        return None
