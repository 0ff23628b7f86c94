"""The model-aware micro-batch budget: what one token costs a training call, from the model's shape.

The trainer picks its micro-batch token budget as ``(free memory - state not yet allocated) x
memory_fraction / bytes_per_token`` (:class:`~verl_core.trainer.batching.scheduler.DynamicBatchScheduler`).
:func:`estimate_token_bytes` gives ``bytes_per_token`` from the model folder's ``config.json``
(every backend of this project loads transformers-format folders), the training dtype and
gradient checkpointing, as named terms:

* ``layers``: what each decoder layer keeps for backward, per token. Counted from the tensors a
  transformers Llama-style layer saves (SDPA attention), in the model dtype: the two norm outputs
  and the attention output's two views (4 x hidden), the rotated queries and the attention output
  (2 x query width), the rotated keys and the values (2 x key/value width), the MLP's gate, up,
  activation and product (4 x intermediate); in float32: the two norm inputs (2 x hidden), the
  attention's log-sum-exp (one per head) and the two norms' reciprocal RMS (2). With gradient
  checkpointing only each layer's input (hidden, model dtype) is kept.
* ``backward``: the working set of the layer being differentiated (one more layer's activations;
  two with gradient checkpointing, which recomputes that layer first).
* ``head``: the final norm's float32 input and the LM head's input (model dtype), per token.
* ``logits``: ``vocab x (4 x LOGITS_FLOAT32_COPIES + 2 x dtype bytes)``: the model-dtype logits and
  their gradient; the loss's float32 log-softmax is computed a chunk of tokens at a time
  (:mod:`verl_core.enginekit.token_stats`), so no float32 copy per token is counted. At small
  models this term dominates; it is counted for every token although only response positions get
  logits, so it errs on the safe side.

The terms are per token of the budget, and the budget counts what the engine runs
(:func:`~verl_core.kernel.batch.micro_batch_cost`): padded tokens, or real tokens for an engine
that packs sequences (``TrainingCapabilities.packed_sequences``). The model holds for both: a
packed row keeps the same tensors per token as a padded one, and only the positions before
response tokens go through the LM head in both layouts, so ``logits`` is an upper bound for
packed tokens too.

:func:`pending_state_bytes` is the memory a trainable engine allocates only at its first update
and keeps while later updates run their activations (gradients, AdamW's two moments, in the
dtypes :class:`TrainedState` gives with or without float32 masters), which the free memory read
at set-up does not show yet; it counts the parameters the engine trains
(:func:`trained_parameters`: with ``model.lora`` the adapter's, :func:`lora_parameters`, not the
frozen base's). The estimate is corrected once from the allocator's measured peak after the
first training call (``DynamicBatchScheduler(peak_probe=...)``). A model folder without a
``config.json`` (a third-party backend's own format) falls back to the constant
``SchedulerConfig.bytes_per_token``. :func:`make_schedulers` builds a run's schedulers with the
budget fixed and logs the budget and its terms once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from verl_core.trainer.batching.probes import MemoryProbe, PeakProbe, default_peak_probe
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler, SchedulerConfig
from verl_core.trainer.config import LoraSection, RunConfig

__all__ = [
    "DTYPE_BYTES",
    "LOGITS_FLOAT32_COPIES",
    "ModelShape",
    "TokenMemoryEstimate",
    "TrainedState",
    "estimate_token_bytes",
    "layer_bytes",
    "lora_parameters",
    "make_schedulers",
    "model_estimate",
    "pending_state_bytes",
    "trained_parameters",
]

_log = logging.getLogger(__name__)

DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each training dtype."""

LOGITS_FLOAT32_COPIES: Final = 0
"""float32 ``[tokens, vocab]`` tensors a training call holds at its peak (the ``logits`` term): none
since :func:`verl_core.enginekit.token_stats.token_log_probs` works a chunk at a time."""

_FLOAT32: Final = 4


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that set its memory per token.

    Attributes:
        hidden_size: Width of the residual stream.
        num_layers: Decoder layers.
        intermediate_size: Width of the MLP.
        vocab_size: Vocabulary (the LM head's outputs).
        num_heads: Attention (query) heads.
        num_kv_heads: Key/value heads.
        head_dim: Width of one head.
        tied: The LM head shares the embedding's weights.
    """

    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape | None:
        """The shape a transformers ``config.json`` describes (its ``text_config`` for multimodal models).

        Returns None when a size the estimate needs (``hidden_size``, ``num_hidden_layers``,
        ``intermediate_size``, ``vocab_size``) is missing or not a positive integer.
        ``num_attention_heads``, ``num_key_value_heads`` and ``head_dim`` default as transformers
        does (one head, as many key/value heads as heads, hidden / heads).
        """
        text = config.get("text_config")
        if "hidden_size" not in config and isinstance(text, Mapping):
            config = text

        def size(key: str, default: int | None = None) -> int | None:
            v = config.get(key, default)
            if v is None:  # transformers writes null for "same as the default"
                v = default
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

        hidden, layers = size("hidden_size"), size("num_hidden_layers")
        inter, vocab = size("intermediate_size"), size("vocab_size")
        heads = size("num_attention_heads", 1)
        if hidden is None or layers is None or inter is None or vocab is None or heads is None:
            return None
        kv = size("num_key_value_heads", heads)
        head_dim = size("head_dim", max(1, hidden // heads))
        if kv is None or head_dim is None:
            return None
        return cls(hidden, layers, inter, vocab, heads, kv, head_dim, bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def from_model_folder(cls, path: str | os.PathLike[str]) -> ModelShape | None:
        """The shape of the model folder's ``config.json`` (None: no readable transformers config there)."""
        file = Path(path) / "config.json"
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            return None
        return cls.from_config(data) if isinstance(data, dict) else None

    @property
    def parameters(self) -> int:
        """Parameters: embedding (and untied LM head), each layer's projections and norms, the final norm."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.vocab_size * h * (1 if self.tied else 2) + self.num_layers * per_layer + h


@dataclass(frozen=True)
class TokenMemoryEstimate:
    """Bytes one token of the budget costs a training call, as named terms.

    Attributes:
        terms: ``(name, bytes per token, how it was counted)`` of each term.
        source: Where the shape came from (the config.json read, or why the constant is used).
    """

    terms: tuple[tuple[str, int, str], ...]
    source: str

    @property
    def bytes_per_token(self) -> int:
        """The sum of the terms (at least 1)."""
        return max(1, sum(b for _, b, _ in self.terms))

    def term(self, name: str) -> int:
        """Bytes per token of the term ``name`` (0 when the estimate has no such term)."""
        return next((b for n, b, _ in self.terms if n == name), 0)

    def describe(self) -> str:
        """One line: the total, each term with how it was counted, and the source."""
        parts = ", ".join(f"{n} {b:,} ({how})" for n, b, how in self.terms)
        return f"{self.bytes_per_token:,} bytes/token = {parts}; from {self.source}"


def layer_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes per token one decoder layer keeps for backward (see the module docstring's ``layers``)."""
    d = DTYPE_BYTES[dtype]
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return d * (4 * h + 2 * q + 2 * kv + 4 * shape.intermediate_size) + _FLOAT32 * (2 * h + shape.num_heads + 2)


def estimate_token_bytes(
    shape: ModelShape, dtype: str, *, gradient_checkpointing: bool = False, source: str = "the model's shape"
) -> TokenMemoryEstimate:
    """The terms of a training call's memory per token (see the module docstring).

    Args:
        shape: The model's sizes.
        dtype: Training dtype (``float32``, ``bfloat16``, ``float16``).
        gradient_checkpointing: Layers keep only their inputs and recompute the rest in backward.
        source: Where ``shape`` came from (for the log line).
    """
    d = DTYPE_BYTES[dtype]
    layer = layer_bytes(shape, dtype)
    n = shape.num_layers
    if gradient_checkpointing:
        layers = (n * shape.hidden_size * d, f"{n} layers x their input {shape.hidden_size} x {d} B (checkpointed)")
        backward = (2 * layer, f"2 x {layer:,}: one layer recomputed and differentiated")
    else:
        layers = (n * layer, f"{n} layers x {layer:,}")
        backward = (layer, "one layer's working set")
    head = ((_FLOAT32 + d) * shape.hidden_size, f"final norm and LM head input {shape.hidden_size} x {_FLOAT32 + d} B")
    per_vocab = _FLOAT32 * LOGITS_FLOAT32_COPIES + 2 * d
    logits = (shape.vocab_size * per_vocab,
              f"vocab {shape.vocab_size} x ({LOGITS_FLOAT32_COPIES} float32 copies + the {dtype} logits and their gradient)")
    return TokenMemoryEstimate(
        (("layers", *layers), ("backward", *backward), ("head", *head), ("logits", *logits)),
        f"{source}, {dtype}{', gradient checkpointing' if gradient_checkpointing else ''}",
    )


@dataclass(frozen=True)
class TrainedState:
    """Bytes per parameter a trained engine keeps, by part (AdamW, float32 masters below float32).

    Attributes:
        weights: The parameter (model dtype).
        masters: Its float32 master copy (0 without masters).
        grads: Its gradient while backward runs (model dtype).
        step_grads: Its gradient at the optimizer step: float32 on the master with masters (the
            model-dtype one is freed as it is copied), else the backward's.
        moments: AdamW's two moments, in the dtype of what the optimizer steps (torch's AdamW
            keeps them like its parameters: float32 on masters, else the model dtype).
    """

    weights: int
    masters: int
    grads: int
    step_grads: int
    moments: int

    @classmethod
    def of(cls, dtype: str, *, master_weights: bool = True) -> TrainedState:
        """The parts for a model in ``dtype`` (masters only below float32, when ``master_weights``)."""
        d = DTYPE_BYTES[dtype]
        masters = master_weights and d < _FLOAT32
        stepped = _FLOAT32 if masters else d
        return cls(d, _FLOAT32 if masters else 0, d, stepped, 2 * stepped)


def lora_parameters(shape: ModelShape, lora: LoraSection) -> int:
    """Parameters a LoRA adapter of ``shape`` trains: ``rank x (in + out)`` per adapted projection
    of every layer (the attention and MLP projections named in ``lora.targets``; other patterns are
    not counted), plus the embedding or LM head when ``lora.full`` names them."""
    h, q, kv, inter = (shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                       shape.intermediate_size)
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
             "up_proj": (h, inter), "down_proj": (inter, h)}
    per_layer = sum(lora.rank * (i + o) for name, (i, o) in sizes.items() if name in lora.targets)
    full = sum(shape.vocab_size * h for name in ("embed_tokens", "lm_head") if name in lora.full)
    return shape.num_layers * per_layer + full


def trained_parameters(shape: ModelShape, config: RunConfig, role: str) -> int:
    """Parameters ``role``'s engine trains: the actor's LoRA adapter under ``model.lora`` (its base is
    frozen), else every parameter of ``shape``."""
    lora = config.model.lora
    return lora_parameters(shape, lora) if lora.enabled and role == "actor" else shape.parameters


def pending_state_bytes(
    shape: ModelShape, dtype: str, *, master_weights: bool = True, parameters: int | None = None
) -> int:
    """Bytes a trainable engine allocates at its first update that set-up does not hold yet and that
    are on the device while later updates' activations are.

    Per trained parameter (``parameters``, default every parameter of ``shape``): its gradient
    during backward (model dtype) and AdamW's two moments (float32 with masters or in float32, else
    the model dtype; :class:`TrainedState`). The float32 master gradients of the optimizer step are
    not counted: they exist only in the step, after the activations are freed. An upper bound for
    engines that allocate their optimizer state up front (they have it in use already).
    """
    part = TrainedState.of(dtype, master_weights=master_weights)
    n = shape.parameters if parameters is None else parameters
    return n * (part.grads + part.moments)


def model_estimate(
    model_path: str, dtype: str, *, gradient_checkpointing: bool = False, master_weights: bool = True
) -> tuple[TokenMemoryEstimate, int] | None:
    """The estimate and the pending state bytes of the model folder (None: no usable config.json there)."""
    shape = ModelShape.from_model_folder(model_path)
    if shape is None:
        _log.info("micro-batch budget: %s has no transformers config.json with the sizes the estimate needs",
                  model_path)
        return None
    est = estimate_token_bytes(shape, dtype, gradient_checkpointing=gradient_checkpointing,
                               source=str(Path(model_path) / "config.json"))
    return est, pending_state_bytes(shape, dtype, master_weights=master_weights)


def make_schedulers(
    config: RunConfig, roles: Collection[str], *, model_path: str, training: Collection[str] = ("actor",),
    gradient_checkpointing: bool = False, probe: MemoryProbe | None = None, peak_probe: PeakProbe | None = None,
) -> dict[str, DynamicBatchScheduler]:
    """One micro-batch scheduler per role, the budget fixed at run start and logged once.

    ``batch.micro_batch_tokens`` > 0 is the budget as it is. Otherwise each budget is ``(free
    memory - pending state of the ``training`` roles) x memory_fraction / bytes_per_token`` with
    the model-aware estimate of ``model_path`` (the constant when the folder has no usable
    config.json), within ``batch.min_tokens`` and ``batch.max_tokens`` (0 = no cap); the schedulers
    of ``training`` roles refine it once from the allocator's peak of their first update
    (``peak_probe``, default: the CUDA allocator of ``model.device``; nothing on the CPU).

    Args:
        config: The run (``batch``, ``model.dtype``, ``model.device``).
        roles: The roles to build a scheduler for.
        model_path: The policy's model folder.
        training: The roles among ``roles`` that train (their state is reserved, their first
            update refines the budget).
        gradient_checkpointing: The training engines recompute activations in backward.
        probe: Free-memory probe (default: the device's real memory).
        peak_probe: Allocator peak probe (default: :func:`~verl_core.trainer.batching.probes.default_peak_probe`).
    """
    bc, device = config.batch, config.model.device
    if bc.micro_batch_tokens:
        fixed = SchedulerConfig(min_tokens=bc.micro_batch_tokens, max_tokens=bc.micro_batch_tokens)
        schedulers = {r: DynamicBatchScheduler(fixed, probe=probe, device=device) for r in roles}
        for s in schedulers.values():
            s.fix_budget()
        _log.info("micro-batch budget: %d tokens (batch.micro_batch_tokens)", bc.micro_batch_tokens)
        return schedulers
    found = model_estimate(model_path, config.model.dtype, gradient_checkpointing=gradient_checkpointing)
    base = SchedulerConfig(min_tokens=bc.min_tokens, max_tokens=bc.max_tokens or None)
    if found is None:
        sched_cfg, how = base, f"the constant {base.bytes_per_token:,} bytes/token (no estimate for {model_path})"
    else:
        est, _ = found
        shape = ModelShape.from_model_folder(model_path)
        assert shape is not None
        reserved = sum(pending_state_bytes(shape, config.model.dtype, master_weights=bool(
            config.backends.options.get(r, {}).get("master_weights", True)),
            parameters=trained_parameters(shape, config, r)) for r in roles if r in training)
        sched_cfg = SchedulerConfig(min_tokens=bc.min_tokens, max_tokens=bc.max_tokens or None,
                                    bytes_per_token=est.bytes_per_token, reserved_bytes=reserved)
        how = est.describe()
    peak = peak_probe if peak_probe is not None else default_peak_probe(device)
    schedulers = {
        r: DynamicBatchScheduler(sched_cfg, probe=probe, device=device, peak_probe=peak if r in training else None)
        for r in roles
    }
    budget = 0
    for s in schedulers.values():
        budget = s.fix_budget()
    first = next(iter(schedulers.values()), None)
    available = first.available_bytes if first is not None else None
    _log.info(
        "micro-batch budget: %d tokens = %s bytes (free memory less %s reserved for gradients and optimizer "
        "state) x %s / %s; tokens within [%d, %s]%s",
        budget, f"{available:,}" if available is not None else "?", f"{sched_cfg.reserved_bytes:,}",
        sched_cfg.memory_fraction, how, bc.min_tokens, bc.max_tokens or "the batch",
        "; refined once after the first update from the allocator's peak" if any(
            s.refinement_pending for s in schedulers.values()) else "",
    )
    if available == 0 and sched_cfg.reserved_bytes > 0:  # the slow path is said, never taken silently
        _log.warning(
            "micro-batch budget: the free memory is below the %.1f GB reserved for the trained roles' gradients "
            "and optimizer state, so every micro-batch runs at the smallest budget (%d tokens, at least one "
            "sequence): the update will be slow. Free device memory (rollout.sleep, a smaller rollout batch), "
            "set backends.options.actor.master_weights=false or model.lora.enabled=true, or set "
            "batch.micro_batch_tokens", sched_cfg.reserved_bytes / 1e9, budget)
    return schedulers
