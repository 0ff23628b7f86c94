"""Capabilities: what a backend declares it supports, per role.

The conformance suite skips checks of what is declared unsupported and fails what is declared
supported but behaves wrong. One line of docstring per capability. ``dtypes`` and ``devices`` are
sets of names, stored as frozensets (a list or tuple is taken and converted, a bare string refused):
``TrainingCapabilities(dtypes=frozenset({"float32", "bfloat16"}), devices=frozenset({"cpu", "cuda"}))``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from verl_core.kernel.errors import ConfigError

__all__ = [
    "Capabilities",
    "RewardCapabilities",
    "RolloutCapabilities",
    "SeedingMode",
    "TrainingCapabilities",
]

SeedingMode = Literal["per_sample", "per_batch", "none"]
"""How sampling is seeded: per (seed, group id, sample index), per call, or not reproducibly."""


def _name_sets(caps: Capabilities) -> None:
    """Store the ``dtypes`` and ``devices`` fields of ``caps`` as frozensets: a set, list or tuple of
    names is taken; a bare string or a name that is not a string is refused."""
    for name, example in (("dtypes", "{'float32', 'bfloat16'}"), ("devices", "{'cpu', 'cuda'}")):
        if not hasattr(caps, name):  # RewardCapabilities declares no dtypes
            continue
        value = getattr(caps, name)
        names = tuple(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{type(caps).__name__}.{name} is {value!r}; expected a set of names, "
                              f"for example {name}=frozenset({example})")
        object.__setattr__(caps, name, frozenset(names))


@dataclass(frozen=True)
class TrainingCapabilities:
    """Capabilities of a training engine (actor, reference or critic role).

    An engine refuses, with ``ConfigError``, an ``EngineSpec`` asking for a dtype, a device type, a
    parallel size above 1 or gradient checkpointing its capabilities do not declare
    (:func:`verl_core.enginekit.gates.refuse_undeclared`; ``robustness::undeclared_settings_refused``).
    """

    log_probs: bool = True
    """forward computes log_probs of the response tokens."""
    entropy: bool = True
    """forward computes the entropy of the token distribution."""
    values: bool = False
    """forward computes critic values (a value head)."""
    tensor_parallel: bool = False
    """Runs with parallel.tp > 1."""
    pipeline_parallel: bool = False
    """Runs with parallel.pp > 1."""
    data_parallel: bool = False
    """Runs with parallel.dp > 1 (gradients reduced over data-parallel ranks)."""
    micro_batch_tokens: bool = True
    """Honours EngineSpec.micro_batch_tokens and forward_backward's max_tokens (token-budget micro-batching)."""
    packed_sequences: bool = False
    """Packs sequences without padding; the token budget then counts real tokens."""
    gradient_checkpointing: bool = False
    """Honours EngineSpec.gradient_checkpointing."""
    offload: bool = False
    """offload()/onload() move parameters and optimizer state off the device and back."""
    checkpoint: bool = True
    """save_checkpoint/load_checkpoint round-trip model, optimizer, scheduler, RNG and step exactly."""
    lora: bool = False
    """Trains EngineSpec.lora adapters (base frozen), with base_forward and export_adapter."""
    dtypes: frozenset[str] = field(default_factory=lambda: frozenset({"float32"}))
    """Parameter dtypes the engine runs in."""
    devices: frozenset[str] = field(default_factory=lambda: frozenset({"cpu"}))
    """Device types the engine runs on (cpu, cuda)."""

    def __post_init__(self) -> None:
        _name_sets(self)


@dataclass(frozen=True)
class RolloutCapabilities:
    """Capabilities of a rollout engine.

    An engine refuses, with ``ConfigError``, an ``EngineSpec`` asking for a dtype, a device type, or a
    tensor or pipeline parallel size above 1 its capabilities do not declare
    (:func:`verl_core.enginekit.gates.refuse_undeclared`; ``robustness::undeclared_settings_refused``).
    Its dp is its own to take or refuse: a rollout that shares its actor's ranks takes the actor's sizes.
    """

    temperature: bool = True
    """Samples at any temperature > 0 and reports log-probs at that temperature."""
    top_p: bool = True
    """Supports nucleus sampling."""
    top_k: bool = True
    """Supports top-k sampling."""
    stop_token_ids: bool = True
    """Stops at any of SamplingParams.stop_token_ids (the stop token is part of the response)."""
    seeding: SeedingMode = "per_sample"
    """How sampling is seeded (see SeedingMode)."""
    exact_log_probs: bool = True
    """rollout_log_probs follow the schema's definition for untruncated sampling (no top-k/top-p)."""
    exact_log_probs_truncated: bool = False
    """rollout_log_probs are exact even with top-k/top-p (log softmax(logits/T) before truncation)."""
    weight_update: bool = True
    """update_weights applies a WeightChunk stream."""
    sleep_frees_memory: bool = False
    """sleep() releases device memory (otherwise it only pauses)."""
    lora_adapters: bool = False
    """Built with EngineSpec.lora, update_weights applies adapter streams (export_adapter) and samples from base + adapter."""
    prefix_continuation: bool = False
    """generate reuses its cache of a prompt that extends an earlier call's prompt and response (multi-turn)."""
    concurrent_weight_update: bool = False
    """update_weights may run on another thread while generate calls are in flight (see RolloutEngine.update_weights)."""
    tensor_parallel: bool = False
    """Runs with parallel.tp > 1."""
    pipeline_parallel: bool = False
    """Runs with parallel.pp > 1."""
    dtypes: frozenset[str] = field(default_factory=lambda: frozenset({"float32"}))
    """Model dtypes the engine runs in."""
    devices: frozenset[str] = field(default_factory=lambda: frozenset({"cpu"}))
    """Device types the engine runs on."""

    def __post_init__(self) -> None:
        _name_sets(self)


@dataclass(frozen=True)
class RewardCapabilities:
    """Capabilities of a reward engine."""

    scores: bool = True
    """Produces sequence-level scores."""
    token_scores: bool = False
    """Produces per-token scores."""
    needs_text: bool = False
    """Scores decoded text (and so needs a tokenizer), not token ids."""
    sequence_classifier: bool = False
    """Its ``scores`` are the sequence-classification head of the model folder it was built on
    (``EngineSpec.model_path``) read at the last real token of prompt + response, as transformers'
    ``...ForSequenceClassification`` reads it: a reward model. The suite then compares them with a
    float64 reference on Llama, Qwen2 and Qwen3 folders (``reward::scores_match_reference``) and expects
    a ``ConfigError`` for a folder without a trained head, parallel sizes above 1 and a dtype the engine
    would not compute in (``reward::unsupported_settings_refused``); reward functions and other scorers
    leave it False."""
    devices: frozenset[str] = field(default_factory=lambda: frozenset({"cpu"}))
    """Device types the engine runs on."""

    def __post_init__(self) -> None:
        _name_sets(self)


Capabilities = TrainingCapabilities | RolloutCapabilities | RewardCapabilities
"""The capabilities object of one role."""
