"""Bring your own model: what a model built outside the SDK provides to become a RolloutEngine.

A backend turns a model object the user built their own way into a RolloutEngine
(``verl_hf.byo.rollout_from_model``, ``verl_megatron.byo.rollout_from_model``). The model
satisfies one of two protocols:

* **forward only**: the backend's native forward (a transformers causal LM's
  ``model(input_ids=, attention_mask=, position_ids=, past_key_values=, use_cache=)``; a
  megatron-core ``GPTModel``'s ``model(input_ids, position_ids, attention_mask)``). The SDK supplies
  generation: the backend's own seeded sampling loop, the same one its file-built engine runs, so
  samples are per-sample reproducible and ``rollout_log_probs`` exact;
* **forward + generate**: the model also has :meth:`GeneratesTokens.generate_tokens`; the SDK then
  calls it for the response ids, cuts each response at its first EOS/stop token and computes
  ``rollout_log_probs`` with the model's forward (teacher forcing), so the log-probs keep the
  schema's definition whatever the model's own sampler does.

This module holds what both backends share: the generate protocol, the post-processing of
user-generated ids, and a duck-typed adapter from a tokenizer object to :class:`Tokenizer`. It
imports no backend library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import torch
from torch import Tensor

from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import BatchValidationError, ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_core.kernel.tokenizer import Tokenizer

__all__ = [
    "IN_MEMORY_MODEL",
    "GeneratesTokens",
    "ScoreFn",
    "as_tokenizer",
    "finish_responses",
    "generate_with_model",
    "in_memory_spec",
]

IN_MEMORY_MODEL: Final = "<in-memory model>"
"""``EngineSpec.model_path`` of an engine built around a model object rather than a folder."""


@runtime_checkable
class GeneratesTokens(Protocol):
    """A model that brings its own sampling (the optional half of the bring-your-own protocol)."""

    def generate_tokens(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, seeds: Sequence[int]
    ) -> Tensor:
        """Response token ids for a batch of prompts.

        Args:
            prompt_ids: Left-padded prompt ids ``[rows, prompt]`` (int64, on the model's device).
            prompt_mask: True at real prompt tokens ``[rows, prompt]``.
            params: Sampling parameters (temperature, top-p/k, greedy, ``max_new_tokens``).
            seeds: One seed per row, derived from (seed, group id, sample index); a model that
                seeds each row's stream from it keeps samples independent of batch order.

        Returns:
            int64 ids ``[rows, k]`` with ``k <= params.max_new_tokens``. Anything after a row's
            first EOS/stop token is ignored; a row without one is a truncated response.
        """
        ...


ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]
"""``fn(prompt_ids, prompt_mask, response_ids, response_mask, temperature) -> log_probs``: the
float32 ``[rows, response]`` log-probs of the response tokens under softmax(logits / T), 0 where
the mask is False. Supplied by the backend (one teacher-forced forward)."""


def finish_responses(
    raw: Tensor, *, stop_ids: Sequence[int], pad_id: int, max_new_tokens: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Cut raw generated ids at each row's first stop token.

    Args:
        raw: Generated ids ``[rows, k]``.
        stop_ids: EOS and the extra stop tokens; the first one in a row ends the response and is
            part of it.
        pad_id: Fills the positions after the end.
        max_new_tokens: Most tokens a response may have.
        vocab_size: Ids must lie in ``[0, vocab_size)``.

    Returns:
        ``response_ids`` (right-padded), ``response_mask`` and ``truncated`` (no stop token).

    Raises:
        BatchValidationError: ``raw`` is not a 2-D integer tensor, is longer than
            ``max_new_tokens``, or holds ids outside the vocabulary.
    """
    if raw.dim() != 2 or raw.dtype.is_floating_point or raw.dtype == torch.bool:
        raise BatchValidationError(
            f"generate_tokens must return integer ids [rows, new_tokens], got {raw.dtype} of shape "
            f"{tuple(raw.shape)}"
        )
    if raw.shape[1] > max_new_tokens:
        raise BatchValidationError(
            f"generate_tokens returned {raw.shape[1]} tokens per row, more than max_new_tokens="
            f"{max_new_tokens}; stop generating at max_new_tokens"
        )
    ids = raw.to(torch.int64)
    rows, width = ids.shape
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64, device=ids.device)
    is_stop = torch.isin(ids, stops)
    # position of each row's first stop (width when none)
    cols = torch.arange(width, device=ids.device).expand(rows, width)
    first = torch.where(is_stop, cols, width).amin(1) if width else torch.zeros(rows, dtype=torch.int64)
    mask = cols <= first.unsqueeze(1)
    truncated = first >= width
    ids = torch.where(mask, ids, pad_id)
    bad = mask & ((ids < 0) | (ids >= vocab_size))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise BatchValidationError(
            f"generate_tokens returned id {int(ids[bad][0])} in row {row}, outside the vocabulary "
            f"[0, {vocab_size})"
        )
    if width == 0:
        truncated = torch.ones(rows, dtype=torch.bool, device=ids.device)
    return ids, mask, truncated


def generate_with_model(
    model: GeneratesTokens,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    seeds: Sequence[int],
    params: SamplingParams,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_size: int,
    score: ScoreFn,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Generate with the model's own sampler, then take log-probs from the backend's forward.

    Returns:
        ``response_ids``, ``response_mask``, ``rollout_log_probs`` and ``truncated``, in the layout
        of a rollout engine's decode loop.
    """
    if len(seeds) != prompt_ids.shape[0]:
        raise ConfigError(f"generate_with_model: {len(seeds)} seeds for {prompt_ids.shape[0]} prompts")
    with torch.no_grad():
        raw = model.generate_tokens(prompt_ids, prompt_mask, params, list(seeds))
    if not isinstance(raw, Tensor):
        raise BatchValidationError(
            f"generate_tokens must return a torch.Tensor of ids, got {type(raw).__name__}"
        )
    if raw.dim() == 2 and raw.shape[0] != prompt_ids.shape[0]:
        raise BatchValidationError(
            f"generate_tokens returned {raw.shape[0]} rows for {prompt_ids.shape[0]} prompts"
        )
    ids, mask, truncated = finish_responses(
        raw.to(prompt_ids.device), stop_ids=stop_ids, pad_id=pad_id,
        max_new_tokens=params.max_new_tokens, vocab_size=vocab_size,
    )
    if ids.shape[1] == 0:
        return ids, mask, torch.zeros(ids.shape, dtype=torch.float32, device=ids.device), truncated
    with torch.no_grad():
        log_probs = score(prompt_ids, prompt_mask, ids, mask, params.temperature)
    log_probs = torch.where(mask, log_probs.float(), 0.0)
    return ids, mask, log_probs, truncated


def as_tokenizer(tokenizer: Any, vocab_size: int | None = None) -> Tokenizer:
    """``tokenizer`` as a :class:`Tokenizer`: returned as is when it already is one, else wrapped.

    A transformers tokenizer is always wrapped (its ``encode`` adds special tokens by default,
    which the protocol forbids).

    Raises:
        ConfigError: the object is neither a Tokenizer nor transformers-like.
    """
    transformers_like = hasattr(tokenizer, "convert_ids_to_tokens")
    if not transformers_like and isinstance(tokenizer, Tokenizer):
        return tokenizer
    if transformers_like or (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        return HFTokenizer(tokenizer, vocab_size)
    raise ConfigError(
        f"expected a tokenizer (a verl_core.Tokenizer or a transformers tokenizer), got "
        f"{type(tokenizer).__name__}"
    )


def in_memory_spec(
    *,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    max_prompt_len: int = 512,
    max_response_len: int = 512,
    tp: int = 1,
) -> EngineSpec:
    """The EngineSpec of a rollout engine around a model object (``model_path`` is a placeholder).

    Raises:
        ConfigError: a dtype other than float32, bfloat16 or float16.
    """
    from verl_core.kernel.engine import ParallelSizes

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ConfigError(f"the model's parameters are {dtype}; expected float32, bfloat16 or float16")
    return EngineSpec(
        model_path=IN_MEMORY_MODEL, role="rollout", dtype=names[dtype],  # type: ignore[arg-type]
        device=device, seed=seed, max_prompt_len=max_prompt_len, max_response_len=max_response_len,
        parallel=ParallelSizes(tp=tp),
    )
