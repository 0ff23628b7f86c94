"""Packed training micro-batches of the megatron engine: what it can pack.

Megatron's ``thd`` format (:class:`megatron.core.packed_seq_params.PackedSeqParams`) carries the
sequence boundaries (``cu_seqlens``, int32 ``[sequences + 1]``); megatron-core's unfused rotary
embedding restarts positions at 0 for every sequence from them (no TransformerEngine needed), and
the core attention (:class:`verl_megatron.model.sdpa_attention_class`) receives ``[tokens, heads,
dim]`` queries and ``[tokens, groups, dim]`` keys/values, which
:func:`verl_core.enginekit.packed_attention.packed_causal_attention` attends within each sequence.
"""

from __future__ import annotations

__all__ = ["packing_unsupported"]


def packing_unsupported(*, attention: str, pp: int) -> str | None:
    """Why the training engine cannot pack its micro-batches (None: it can)."""
    if attention != "sdpa":
        return f"attention={attention!r} (megatron-core's DotProductAttention takes no packed sequences; use 'sdpa')"
    if pp > 1:
        return f"pipeline parallel size {pp} (pipeline stages exchange activations of one fixed shape; needs pp=1)"
    return None
