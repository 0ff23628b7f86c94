"""The field schema of TensorBatch: names, dims, dtypes and meaning of every canonical field.

Layout rules (docs/architecture.md, "Batch layout"):

* prompts are LEFT-padded (``prompt_ids``, ``prompt_mask``), responses RIGHT-padded
  (``response_ids``, ``response_mask``); masks are ``bool``, ids ``int64``;
* per-token float fields are ``float32`` of shape ``[batch, response]`` and hold 0 at masked positions;
* the optional ``loss_mask`` marks the response tokens the policy sampled (a multi-turn response also
  holds observation tokens); losses and counts read ``TensorBatch.loss_mask`` (else ``response_mask``);
* pad positions of id fields hold the tokenizer's pad id (``BatchMeta.pad_token_id``);
* ``log_probs[b, t] = log softmax(logits / T)[response_ids[b, t]]`` where the logits are those at the
  position of the preceding token and ``T`` is ``BatchMeta.temperature``, before any top-k/top-p/min-p
  truncation or penalty, computed in float32;
* ``T`` is at least :data:`MIN_TEMPERATURE` (:func:`check_temperature`), so ``logits / T`` stays
  finite in float32 and no log-prob is NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

import torch

from verl_core.kernel.errors import ConfigError, VerlError, check_number, check_str, describe

__all__ = [
    "FIELDS",
    "MIN_TEMPERATURE",
    "TURNS_EXTRA",
    "Dim",
    "FieldKind",
    "FieldSpec",
    "check_temperature",
    "register_field",
]

MIN_TEMPERATURE: Final = 1e-4
"""Lowest temperature T accepted anywhere (sampling and log-probs).

``logits / T`` then stays finite in float32 for every logit below 3.4e34 in magnitude (float32's
largest value times ``1e-4``), so ``log softmax(logits / T)`` is never NaN. At T = 1e-40 the
division overflows to inf and every log-prob becomes NaN. Lower temperatures are refused, not
clamped; for argmax decoding use ``SamplingParams(greedy=True)``.
"""


def check_temperature(
    value: object, name: str = "SamplingParams.temperature", *, floor: float = MIN_TEMPERATURE,
    error: type[VerlError] = ConfigError, reason: str = "",
) -> float:
    """The one check of a temperature T: a finite number >= ``floor`` (:data:`MIN_TEMPERATURE` by default).

    Every place that takes a temperature (``SamplingParams``, ``BatchMeta``, engines with a higher
    floor of their own) calls this, so the rule and its message live here.

    Args:
        value: The temperature given.
        name: How the message names it.
        floor: The lowest allowed temperature (an engine may ask for more, never for less).
        error: The error class to raise.
        reason: Why this floor, for the message (default: float32 finiteness of ``logits / T``).

    Returns:
        The temperature as a float.

    Raises:
        ConfigError: (or ``error``) naming ``name``, the value and the allowed range.
    """
    why = reason or "lower ones overflow logits / T in float32 and give NaN log-probs"
    return check_number(value, name, low=max(floor, MIN_TEMPERATURE), error=error,
                        hint=f" ({why}; for argmax decoding use greedy=True)")

TURNS_EXTRA: Final = "turns"
"""Extras key of per-turn metadata: per sample, a sequence whose item k describes turn k (``turn_ids``)."""

Dim = Literal["batch", "prompt", "response"]
"""A named dimension. All fields share ``batch``; prompt fields share ``prompt``; per-token fields
share ``response``."""

FieldKind = Literal["ids", "mask", "float", "index", "flag"]
"""What a field holds, which decides its padding value and whether it is checked for NaN/inf."""


def _integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


_KIND_DTYPES: Final[dict[str, Callable[[torch.dtype], bool]]] = {
    "ids": _integer,
    "mask": lambda d: d == torch.bool,
    "float": lambda d: d.is_floating_point,
    "index": _integer,
    "flag": lambda d: d == torch.bool,
}
_KIND_VALUES: Final = {"ids": "integers", "mask": "booleans", "float": "floating-point numbers",
                       "index": "integers", "flag": "booleans"}
_LAYOUTS: Final[tuple[tuple[Dim, ...], ...]] = (("batch",), ("batch", "prompt"), ("batch", "response"))
"""The shapes a field may have: per sample, per prompt token, per response token."""


@dataclass(frozen=True)
class FieldSpec:
    """The declared shape, dtype and meaning of one batch field.

    Attributes:
        name: Field name, a valid Python identifier.
        dims: Named dims: ``("batch",)``, ``("batch", "prompt")`` or ``("batch", "response")``.
        dtype: The exact torch dtype the field must have.
        kind: ``ids`` (padded with the pad id), ``mask`` (padded with False), ``float`` (padded with 0,
            must be finite), ``index`` (int64 per-sample ids), ``flag`` (bool per sample).
        doc: One-paragraph meaning of the field.
    """

    name: str
    dims: tuple[Dim, ...]
    dtype: torch.dtype
    kind: FieldKind
    doc: str

    def __post_init__(self) -> None:
        check_str(self.name, "FieldSpec.name")
        if not self.name.isidentifier():
            raise ConfigError(f"FieldSpec.name must be a valid Python identifier, got {describe(self.name)}")
        if self.dims not in _LAYOUTS:
            raise ConfigError(
                f"FieldSpec.dims of field {self.name!r} must be one of {', '.join(map(str, _LAYOUTS))}, "
                f"got {describe(self.dims)}"
            )
        if not isinstance(self.kind, str) or self.kind not in _KIND_DTYPES:
            raise ConfigError(
                f"FieldSpec.kind of field {self.name!r} must be one of {', '.join(_KIND_DTYPES)}, got {describe(self.kind)}"
            )
        if not isinstance(self.dtype, torch.dtype) or not _KIND_DTYPES[self.kind](self.dtype):
            raise ConfigError(
                f"FieldSpec.dtype of field {self.name!r} (kind {self.kind!r}) must be a torch dtype that holds "
                f"{_KIND_VALUES[self.kind]}, got {describe(self.dtype)}"
            )
        if not isinstance(self.doc, str):
            raise ConfigError(f"FieldSpec.doc of field {self.name!r} must be a string, got {describe(self.doc)}")

    @property
    def pad_value(self) -> float | bool | None:
        """Value that fills padding positions, or None for ids (the batch's pad id is used)."""
        if self.kind == "ids":
            return None
        if self.kind in ("mask", "flag"):
            return False
        return 0


_F32: Final = torch.float32
_TOKEN: Final[tuple[Dim, ...]] = ("batch", "response")
_SEQ: Final[tuple[Dim, ...]] = ("batch",)

FIELDS: dict[str, FieldSpec] = {}
"""Every field a TensorBatch accepts, by name. Extend it with :func:`register_field`."""


def register_field(spec: FieldSpec) -> FieldSpec:
    """Add a field to the schema so batches accept it.

    Registering the same spec twice is a no-op. :class:`FieldSpec` checks itself when built.

    Raises:
        ConfigError: ``spec`` is not a FieldSpec, or a different spec is registered under its name
            (the message names both).
    """
    if not isinstance(spec, FieldSpec):
        raise ConfigError(f"register_field() takes a FieldSpec, got {describe(spec)}")
    old = FIELDS.get(spec.name)
    if old is not None and old != spec:
        raise ConfigError(f"field {spec.name!r} is already registered as {old}; refusing {spec}")
    FIELDS[spec.name] = spec
    return spec


for _spec in (
    FieldSpec("prompt_ids", ("batch", "prompt"), torch.int64, "ids",
              "Prompt token ids, LEFT-padded with the pad id."),
    FieldSpec("prompt_mask", ("batch", "prompt"), torch.bool, "mask",
              "True at real prompt tokens; padding (on the left) is False."),
    FieldSpec("response_ids", _TOKEN, torch.int64, "ids",
              "Generated token ids, RIGHT-padded with the pad id. A generated EOS/stop token is part of "
              "the response (mask True); a response cut at the length limit has no EOS."),
    FieldSpec("response_mask", _TOKEN, torch.bool, "mask",
              "True at every real response token, including a terminating EOS and, in a multi-turn "
              "episode, the observation and tool tokens after a model turn; may be all False (an empty "
              "response is legal). Attention and position ids come from it."),
    FieldSpec("loss_mask", _TOKEN, torch.bool, "mask",
              "Optional: True at the response tokens the policy sampled, False at observation and tool "
              "tokens and padding; a subset of response_mask. Log-probs and entropy are defined only where "
              "it is True (0 elsewhere); every loss, KL, entropy bonus, aggregation and token count is over "
              "it. Absent, a batch behaves as loss_mask == response_mask; read it as TensorBatch.loss_mask."),
    FieldSpec("turn_ids", _TOKEN, torch.int64, "index",
              "Optional: k on the tokens of model turn k (0 first) and on the observation tokens after it, "
              "0 at padding: >= 0, non-decreasing along the response. Per-turn metadata: extras['turns']."),
    FieldSpec("rollout_log_probs", _TOKEN, _F32, "float",
              "Log-probs reported by the rollout engine for response_ids, with the semantics of "
              "log_probs; exact only where the engine declares it (RolloutEngine.log_probs_exact)."),
    FieldSpec("log_probs", _TOKEN, _F32, "float",
              "log softmax(logits / T)[response_ids] of the current model at the batch temperature T, "
              "before top-k/top-p truncation and penalties, in float32; 0 where loss_mask is False."),
    FieldSpec("old_log_probs", _TOKEN, _F32, "float",
              "log_probs of the policy that generated the batch (the behaviour policy), as recomputed "
              "by the training engine before the update."),
    FieldSpec("ref_log_probs", _TOKEN, _F32, "float",
              "log_probs of the frozen reference policy, used by KL penalties and losses."),
    FieldSpec("entropy", _TOKEN, _F32, "float",
              "Entropy of the same distribution as log_probs (softmax(logits / T)), in float32; 0 where "
              "loss_mask is False."),
    FieldSpec("values", _TOKEN, _F32, "float",
              "Critic value of the state before response token t (read at the same position as the "
              "log-prob of token t); 0 where loss_mask is False."),
    FieldSpec("old_values", _TOKEN, _F32, "float",
              "Critic values computed before the update, used by value clipping."),
    FieldSpec("token_scores", _TOKEN, _F32, "float",
              "Per-token scores from a reward engine (dense rewards)."),
    FieldSpec("token_rewards", _TOKEN, _F32, "float",
              "Per-token rewards after shaping (scores placed on the last loss token, minus any KL "
              "penalty); 0 where loss_mask is False."),
    FieldSpec("advantages", _TOKEN, _F32, "float",
              "Advantage of response token t, 0 where loss_mask is False."),
    FieldSpec("returns", _TOKEN, _F32, "float",
              "Return (value target) of response token t, 0 where loss_mask is False."),
    FieldSpec("scores", _SEQ, _F32, "float",
              "Sequence-level score of each response from the reward engine."),
    FieldSpec("baseline_scores", _SEQ, _F32, "float",
              "Score of a baseline response per sample (ReMax: the greedy response's score)."),
    FieldSpec("group_ids", _SEQ, torch.int64, "index",
              "Id of the prompt group a sample belongs to; unique for the whole run, so concatenating "
              "batches never merges groups."),
    FieldSpec("sample_index", _SEQ, torch.int64, "index",
              "Index of the sample within its group (0..n-1); with group_ids and the seed it fixes the "
              "sampling random stream of the sample."),
    FieldSpec("truncated", _SEQ, torch.bool, "flag",
              "True when the response was cut at the maximum length without an EOS/stop token."),
):
    register_field(_spec)
del _spec
