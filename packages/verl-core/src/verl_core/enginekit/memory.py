"""The memory check every rollout engine runs before generating: refuse what cannot fit.

A request is refused before anything is allocated, from a lower bound of what it needs
(:func:`generate_memory_bytes`) and the memory available on the device
(:func:`verl_core.kernel.batch.check_fits`), so an oversized ``n`` or ``max_new_tokens`` is a clear
:class:`~verl_core.kernel.errors.RequestTooLargeError` instead of an out-of-memory crash.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from verl_core.kernel.batch import TensorBatch, check_fits
from verl_core.kernel.rollout import SamplingParams

__all__ = ["check_generate_memory", "generate_memory_bytes"]

_PROMPT_TOKEN_BYTES: Final = 9  # int64 id + bool mask
_RESPONSE_TOKEN_BYTES: Final = 13  # int64 id + bool mask + float32 log-prob
_LOGIT_BYTES: Final = 8  # a float32 logit and its float32 log-softmax


def generate_memory_bytes(
    prompts: int, prompt_len: int, params: SamplingParams, *, vocab_size: int = 0, rows_at_once: int | None = None
) -> int:
    """A lower bound of the memory a generate call allocates, in bytes.

    ``rows = prompts x n`` samples each hold a copy of their prompt (``prompt_len`` x 9 bytes: int64
    id and bool mask) and ``max_new_tokens`` response slots (13 bytes: int64 id, bool mask, float32
    log-prob); an engine that materialises full-vocabulary logits adds ``rows_at_once x vocab_size
    x 8`` bytes (float32 logits and their log-softmax, for the rows decoded together). KV caches,
    activations and sampling tables come on top, so a request above this bound can never fit.

    Args:
        prompts: Prompts in the call.
        prompt_len: Their padded width.
        params: The sampling parameters (``n``, ``max_new_tokens``).
        vocab_size: Logit columns per row, 0 for an engine that keeps its logits elsewhere.
        rows_at_once: Rows decoded together (None = all of them).
    """
    rows = prompts * params.n
    at_once = rows if rows_at_once is None else min(rows, rows_at_once)
    per_row = prompt_len * _PROMPT_TOKEN_BYTES + params.max_new_tokens * _RESPONSE_TOKEN_BYTES
    return rows * per_row + at_once * vocab_size * _LOGIT_BYTES


def check_generate_memory(
    prompts: TensorBatch, params: SamplingParams, *, device: torch.device | str, vocab_size: int = 0,
    rows_at_once: int | None = None, where: str = "generate", available: int | None = None, group: Any = None,
) -> int:
    """Refuse a generate request that cannot fit in memory, before anything is allocated.

    Every engine calls this at the start of ``generate``. The estimate is
    :func:`generate_memory_bytes` (a lower bound), compared with the memory available on
    ``device`` (free CUDA memory plus PyTorch's unused cache, or the host's available memory);
    requests under 64 MiB are not probed.

    Args:
        prompts: The prompts of the call.
        params: Its sampling parameters.
        device: Where the engine generates.
        vocab_size: Logit columns per row when the engine materialises full-vocabulary logits.
        rows_at_once: Rows the engine decodes together (None = all).
        where: The caller, for the message.
        available: Available bytes (default: probed on ``device``).
        group: The process group of ranks that generate together (e.g. tensor-parallel ranks):
            they compare against the smallest available memory among them, so all refuse or
            all proceed (see :func:`verl_core.kernel.batch.check_fits`).

    Returns:
        The estimate in bytes.

    Raises:
        RequestTooLargeError: the estimate exceeds the available memory; the message gives the
            estimate, how it was made and the memory available.
    """
    need = generate_memory_bytes(prompts.batch_size, prompts.prompt_len, params, vocab_size=vocab_size,
                                 rows_at_once=rows_at_once)
    rows = prompts.batch_size * params.n
    logits = f" + logits of {min(rows, rows_at_once or rows)} rows x {vocab_size} tokens" if vocab_size else ""
    check_fits(need, device, (
        f"{where}: {prompts.batch_size} prompts x n={params.n} = {rows} samples of {prompts.prompt_len} prompt + "
        f"{params.max_new_tokens} new tokens{logits}"
    ), available=available, group=group)
    return need
