"""Attention over packed rows: sequences laid end to end, each attending causally to itself only.

One owner for the training engines' packed micro-batches (``capabilities.packed_sequences``): the
hf engine's registered ``packed_sdpa`` and the megatron engine's core attention under the ``thd``
format both call :func:`packed_causal_attention` with ``[tokens, heads, dim]`` queries,
``[tokens, groups, dim]`` keys/values and the sequence boundaries (``cu_seqlens``, ``[sequences +
1]``). It runs ``torch.nn.attention.varlen.varlen_attn`` (a CUDA flash kernel for
float16/bfloat16) where it runs, else one ``scaled_dot_product_attention`` per sequence (exact).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["packed_attention_counts", "packed_causal_attention", "varlen_attn_available"]

# How many packed attention calls ran on each kernel (per layer and micro-batch).
_COUNTS = {"varlen_attn": 0, "sdpa_loop": 0}


def packed_attention_counts() -> dict[str, int]:
    """How many packed attention calls ran the flash ``varlen_attn`` kernel or the per-sequence SDPA
    loop since the process started (per layer and micro-batch), counted in eager calls only: a
    call traced by ``torch.compile`` is not counted (a counter read while tracing would be a guard
    on its value, and every later call would recompile)."""
    return dict(_COUNTS)


def _count(kernel: str) -> None:
    if not torch.compiler.is_compiling():
        _COUNTS[kernel] += 1


def _varlen_fn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


@functools.cache
def _varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_fn()).parameters)


def varlen_attn_available(device: torch.device) -> bool:
    """Whether ``torch.nn.attention.varlen.varlen_attn`` (a CUDA flash kernel, torch >= 2.9) can run on ``device``."""
    return device.type == "cuda" and _varlen_fn() is not None and torch.cuda.is_available()


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor | None:
    fn = _varlen_fn()
    if fn is None or query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    params = _varlen_params()
    kw: dict[str, Any] = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal: every key up to the query, none after
    elif "is_causal" in params:  # torch 2.9
        kw["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kw["scale"] = scale
    elif scale != query.shape[-1] ** -0.5:
        return None
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True  # query head h reads group h // rep, as Megatron lays them out
        else:
            key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    cu = cu.to(device=query.device, dtype=torch.int32)
    out: Tensor = fn(query.contiguous(), key.contiguous(), value.contiguous(), cu, cu, max_len, max_len, **kw)
    return out


def packed_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int | None, scale: float,
) -> Tensor:
    """Causal attention within each packed sequence.

    Args:
        query: ``[tokens, heads, dim]``.
        key: ``[tokens, groups, dim]`` (head h reads group h // (heads / groups), as Megatron's
            DotProductAttention and transformers' ``repeat_kv`` lay them out).
        value: Like ``key``.
        cu_seqlens: Cumulative sequence lengths ``[sequences + 1]`` (0 first, ``tokens`` last).
        max_seqlen: The longest sequence (None: read from ``cu_seqlens``).
        scale: Softmax scale.

    Returns:
        ``[tokens, heads, dim]``.
    """
    longest = max_seqlen or 0
    if not longest and cu_seqlens.numel() > 1:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = _varlen(query, key, value, cu_seqlens, longest, scale) if longest > 0 else None
    if out is not None:
        _count("varlen_attn")
        return out
    _count("sdpa_loop")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    rep = query.shape[1] // key.shape[1]
    parts = []
    for a, b in itertools.pairwise(bounds):
        if b <= a:
            continue
        q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, h, n, d]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        parts.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(parts, 0) if parts else query.new_zeros(query.shape)
