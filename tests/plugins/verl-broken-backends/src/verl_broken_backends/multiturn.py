"""Broken backends of multi-turn episodes: the example backend with one engine that gets observation
tokens, long prompts, stop ids or a prefix cache wrong (engines in :mod:`verl_broken_backends.multiturn_engines`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from verl_example_backend.plugin import ROLLOUT_CAPABILITIES

from verl_broken_backends.plugin import BrokenBackend
from verl_core import RolloutCapabilities

__all__ = [
    "PREFIX_CONTINUATION_ROLLOUT",
    "loss_mask_dropped",
    "observation_outputs",
    "prefix_keyed_cache",
    "prompt_window",
    "special_tokens_dropped",
    "stale_prefix_cache",
    "stop_ids_ignored",
    "surviving_prefix_cache",
    "turn_positions",
]

_ENGINES = "verl_broken_backends.multiturn_engines"
PREFIX_CONTINUATION_ROLLOUT: Final = replace(ROLLOUT_CAPABILITIES, prefix_continuation=True)


def _rollout(name: str, fault: str, engine: str, caps: RolloutCapabilities = ROLLOUT_CAPABILITIES) -> BrokenBackend:
    return BrokenBackend(name, fault, rollout=f"{_ENGINES}:{engine}", rollout_caps=caps)


def _training(name: str, fault: str, engine: str) -> BrokenBackend:
    return BrokenBackend(name, fault, training=f"{_ENGINES}:{engine}")


loss_mask_dropped = _training("broken-loss-mask", "the loss is aggregated over response_mask (loss_mask dropped)",
                              "LossMaskDropped")
observation_outputs = _training("broken-observation-outputs", "observation tokens get log-probs and entropy",
                                "ObservationOutputs")
turn_positions = _training("broken-turn-positions", "position ids restart at each turn", "TurnRestartPositions")
special_tokens_dropped = _rollout("broken-prompt-special-tokens", "prompts lose their special tokens (a text "
                                  "round trip)", "SpecialTokensDropped")
prompt_window = _rollout("broken-prompt-window", "only the last 16 prompt tokens are read", "PromptWindow")
stop_ids_ignored = _rollout("broken-stop-ids", "stop_token_ids are ignored", "StopIdsIgnored")
stale_prefix_cache = _rollout("broken-stale-prefix-cache", "prefix_continuation serves a stale cache entry",
                              "StalePrefixCache", PREFIX_CONTINUATION_ROLLOUT)
prefix_keyed_cache = _rollout("broken-prefix-keyed-cache", "prefix_continuation looks its cache up by a prompt's "
                              "first half and length, within a call as across calls", "PrefixKeyedCache",
                              PREFIX_CONTINUATION_ROLLOUT)
surviving_prefix_cache = _rollout("broken-surviving-prefix-cache", "prefix_continuation keeps its cache across "
                                  "update_weights", "SurvivingPrefixCache", PREFIX_CONTINUATION_ROLLOUT)
