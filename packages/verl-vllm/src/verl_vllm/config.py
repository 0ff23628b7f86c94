"""Options of the ``vllm`` backend, validated from ``EngineSpec.options``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from verl_core import ConfigError

__all__ = ["LogprobsMode", "VllmRolloutConfig"]

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
"""Which distribution vLLM reports log-probs of (an engine-wide vLLM setting).

``processed_logprobs``: log softmax(logits / T) after top-k/top-p, exact without truncation at any
temperature. ``raw_logprobs``: log softmax(logits), exact only at T = 1 without truncation.
"""

_MODES: Final = ("processed_logprobs", "raw_logprobs")
_MIB: Final = 1024 * 1024


@dataclass(frozen=True)
class VllmRolloutConfig:
    """Options of the vLLM rollout engine (``EngineSpec.options``).

    Attributes:
        kv_cache_bytes: Bytes reserved for the KV cache, set explicitly so vLLM never takes its
            default share of the machine's memory (92% of RAM on CPU, 90% of a GPU).
        logprobs_mode: Which distribution vLLM reports (see :data:`LogprobsMode`); the default
            ``processed_logprobs`` is exact for every untruncated configuration.
        max_num_seqs: Most sequences vLLM schedules in one step.
        max_num_batched_tokens: Most tokens per scheduler step (None = vLLM's default).
        enable_prefix_caching: Reuse KV blocks of shared prompt prefixes (reset after each sync).
        enforce_eager: Skip vLLM's graph capture and ``torch.compile`` of the model. None (the
            default) picks per platform: compiled on CPU, where vLLM compiles the model once at
            start-up with inductor (no graph capture exists there) and decode steps run faster
            (fused norms and activations, less Python per layer); eager on GPU, which skips
            CUDA-graph capture (faster start, simpler sleep/wake).
        sleep_level: vLLM sleep level used on GPU (1: offload weights, drop KV; 2: drop both).
    """

    kv_cache_bytes: int = 256 * _MIB
    logprobs_mode: LogprobsMode = "processed_logprobs"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    sleep_level: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < _MIB:
            raise ConfigError(
                f"vllm option kv_cache_bytes must be an int >= 1 MiB ({_MIB}), got "
                f"{self.kv_cache_bytes!r}; size it for max_num_seqs x (prompt + response) tokens"
            )
        if self.logprobs_mode not in _MODES:
            raise ConfigError(
                f"vllm option logprobs_mode must be one of {', '.join(_MODES)}, got "
                f"{self.logprobs_mode!r}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"vllm option max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"vllm option max_num_batched_tokens must be >= 1 or None, got "
                f"{self.max_num_batched_tokens}"
            )
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ConfigError(
                f"vllm option enforce_eager must be True, False or None (per platform), got "
                f"{self.enforce_eager!r}"
            )
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"vllm option sleep_level must be 1 or 2, got {self.sleep_level}")
