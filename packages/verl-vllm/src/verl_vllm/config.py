"""Options of the ``vllm`` backend, validated from ``EngineSpec.options``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Final, Literal

from verl_core.kernel.convert import Check, Ge, check_fields

__all__ = ["LogprobsMode", "VllmRolloutConfig"]

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
"""Which distribution vLLM reports log-probs of (an engine-wide vLLM setting).

``processed_logprobs``: log softmax(logits / T) after top-k/top-p, exact without truncation at any
temperature. ``raw_logprobs``: log softmax(logits), exact only at T = 1 without truncation.
"""

_MODES: Final = ("processed_logprobs", "raw_logprobs")
_MIB: Final = 1024 * 1024


def _at_least_a_mib(n: int) -> bool:
    return n >= _MIB


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

    kv_cache_bytes: Annotated[int, Check(
        _at_least_a_mib, f">= 1 MiB ({_MIB}); size it for max_num_seqs x (prompt + response) tokens"
    )] = 256 * _MIB
    logprobs_mode: LogprobsMode = "processed_logprobs"
    max_num_seqs: Annotated[int, Ge(1)] = 256
    max_num_batched_tokens: Annotated[int, Ge(1)] | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    sleep_level: Literal[1, 2] = 1

    def __post_init__(self) -> None:
        check_fields(self, prefix="vllm.", label="option")  # types, choices and bounds, from the fields
