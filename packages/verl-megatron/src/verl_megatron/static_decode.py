"""The Megatron rollout's static decode loop: its own KV cache, device-side positions, CUDA graphs.

Megatron's ``StaticInferenceContext`` keeps the cache offset as a Python int, so every decode step
is a different program and none can be replayed. This loop calls the model's pieces itself
(embedding, ``decoder`` with explicit rotary embeddings and mask, output layer) and gives every
SDPA core attention a :class:`LayerCache`: keys and values go into preallocated buffers at a
position held in a device tensor. Every step then has one shape, all its state lives in
preallocated tensors updated in place, and nothing waits for the host, so a step can be captured
in a CUDA graph once and replayed (``MegatronOptions.rollout_cuda_graphs``).

Rows stay left-padded, as in the engine's other decode paths: every row's next token sits in one
column, RoPE scores depend only on distances, and padding keys are masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from verl_core.enginekit.decode_attention import grouped_decode_attention
from verl_core.enginekit.sampling import (
    CompiledOrEager,
    StaticDecodeLoop,
    TokenSampler,
    cache_windows,
    mark_window_dynamic,
)
from verl_core.kernel.batch import TensorBatch

__all__ = ["LayerCache", "StaticDecoder", "compiled_last_logits", "last_logits"]

StepLogits = Callable[[Any, Tensor, Tensor, Tensor], Tensor]


def last_logits(model: Any, tokens: Tensor, masked: Tensor, rotary: Tensor) -> Tensor:
    """Float32 full-vocabulary logits of the last position of ``tokens`` [rows, s].

    Runs the model's pieces itself (embedding, ``decoder`` with the explicit ``masked``
    [rows, 1, s, keys] and ``rotary`` embeddings, output layer): the SDPA core attentions read and
    write their :class:`LayerCache`. A free function, so one ``torch.compile`` of it serves every
    decoder of an engine (``MegatronOptions.rollout_compile``).
    """
    positions = torch.zeros_like(tokens)  # unused by rotary models (no learned positions)
    hidden = model.decoder(hidden_states=model.embedding(input_ids=tokens, position_ids=positions),
                           attention_mask=masked, rotary_pos_emb=rotary)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)
    out: Tensor = logits[0].float()
    return out


def compiled_last_logits() -> CompiledOrEager:
    """``torch.compile`` of :func:`last_logits` (specialised to the first shape, then once more for
    each size that changes, made symbolic: :class:`~verl_core.enginekit.sampling.CompiledOrEager`; the
    cache windows below the whole cache have their width marked dynamic, so one compile serves
    them all: :func:`~verl_core.enginekit.sampling.mark_window_dynamic`); where compiling fails,
    :func:`last_logits` itself runs the steps (:class:`~verl_core.enginekit.sampling.CompiledOrEager`).

    Two megatron-core helpers stop dynamo, so inside compiled code (only there: eager calls keep
    Megatron's functions) they are replaced, once per process, by traceable equivalents:
    ``make_viewless_tensor`` swaps a tensor's ``.data`` (replaced by the identity: whether a
    tensor is a view only matters to the memory bookkeeping of Megatron's pipeline schedules,
    which the rollout does not run), and ``get_tensor_model_parallel_group_if_none`` warns when
    given no group, as ``RowParallelLinear`` does with frozen weights (replaced by the same lookup
    without the warning).
    """
    global _SUBSTITUTED
    if not _SUBSTITUTED:
        from megatron.core import parallel_state
        from megatron.core.utils import (
            get_tensor_model_parallel_group_if_none,
            make_viewless_tensor,
        )

        @torch.compiler.substitute_in_graph(make_viewless_tensor)
        def _viewless(inp: Tensor, requires_grad: bool, keep_graph: bool) -> Tensor:
            return inp

        @torch.compiler.substitute_in_graph(get_tensor_model_parallel_group_if_none)
        def _tp_group(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
            if not torch.distributed.is_initialized():
                return None
            if tp_group is not None or not parallel_state.is_initialized():
                return tp_group
            if is_expert:
                return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

        _SUBSTITUTED = True
    return CompiledOrEager(last_logits, "megatron rollout decode step")


_SUBSTITUTED = False


class LayerCache:
    """One attention layer's keys and values [rows, groups, length, dim], written in place.

    Args:
        length: Cache slots (prompt width plus new tokens).
        where: A one-element list holding the slot indices the current call writes (the
            decoder swaps the tensor between the prefill and the decode steps).
        fused: A one-token step's attention runs the fused decode kernel where it takes the
            tensors (``MegatronOptions.rollout_decode_kernel``).
    """

    def __init__(self, length: int, where: list[Tensor], *, fused: bool = False) -> None:
        self.length = length
        self.where = where
        self.fused = fused
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def attend(self, query: Tensor, key: Tensor, value: Tensor, masked: Tensor, scale: float | None) -> Tensor:
        """Write ``key``/``value`` [sq, b, groups, d] at the current slots, attend ``query`` [sq, b, heads, d].

        ``masked`` is [b, 1, sq, n], True where a query must not see a key: the attention reads
        the first ``n`` slots of the cache only (a cache window, or the prompt's slots in the
        prefill), the rest is never read. Returns [sq, b, heads * d]. Head ``h`` reads group
        ``h // (heads / groups)``, as Megatron's attention does; a one-token step is
        :func:`~verl_core.enginekit.decode_attention.grouped_decode_attention` (a group's heads
        folded instead of its keys repeated; the fused kernel with :attr:`fused`), a longer call
        repeats the keys over the ``n`` slots only.
        """
        sq, b, heads, d = query.shape
        if self.k is None or self.v is None:
            shape = (b, key.shape[2], self.length, d)
            self.k = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.v = torch.zeros(shape, dtype=value.dtype, device=value.device)
        slots = self.where[0]
        self.k.index_copy_(2, slots, key.permute(1, 2, 0, 3))
        self.v.index_copy_(2, slots, value.permute(1, 2, 0, 3))
        keep = ~masked
        if sq == 1:
            out = grouped_decode_attention(query.permute(1, 2, 0, 3), self.k, self.v, keep,
                                           d**-0.5 if scale is None else scale, fused=self.fused)
            return out.reshape(1, b, heads * d)
        seen = masked.shape[-1]
        k, v = self.k[:, :, :seen], self.v[:, :, :seen]  # views: the slots past the mask are not read
        rep = heads // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), k, v, attn_mask=keep, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


class StaticDecoder(StaticDecodeLoop):
    """Prefill and decode steps of one shape over :class:`LayerCache` s (see the module docstring).

    Args:
        model: The rollout's megatron-core ``GPTModel`` (pp=1) with SDPA core attention.
        rows: Sequences decoded together.
        width: Prompt width (left-padded).
        sampler: The step's sampling (its uniform table is filled by :meth:`start`).
        max_new: Most new tokens.
        device: Where the model lives.
        step_logits: What a decode step calls instead of :func:`last_logits` (a compiled version
            of it); the prefill always runs :func:`last_logits`.
        window: Smallest attention window of a decode step (0: every step reads the whole
            cache); see :func:`~verl_core.enginekit.sampling.cache_windows`. The prefill reads the
            prompt's slots only either way.
        fused_attention: Decode steps attend through the fused kernel (:class:`LayerCache`).
    """

    def __init__(self, model: Any, rows: int, width: int, sampler: TokenSampler, max_new: int,
                 device: torch.device, step_logits: StepLogits | None = None, window: int = 0,
                 fused_attention: bool = False) -> None:
        length = width + max_new
        super().__init__(rows, max_new, sampler, device, model, "megatron rollout",
                         windows=cache_windows(width, length, window), filled=width)
        self.step_logits = last_logits if step_logits is None else step_logits
        self.width = width
        self.slot = torch.full((1,), width, dtype=torch.int64, device=device)
        self._where: list[Tensor] = [self.slot]
        self.caches = []
        for name, module in model.named_modules():
            if name.endswith("core_attention"):
                cache = LayerCache(length, self._where, fused=fused_attention)
                module.static_cache = cache
                self.caches.append(cache)
        self.freqs: Tensor = model.rotary_pos_emb(length)  # [length, 1, 1, rotary dim]
        self.valid = torch.ones(rows, length, dtype=torch.bool, device=device)
        self.slots = torch.arange(length, device=device)

    def close(self) -> None:
        """Detach the caches from the model's attention modules."""
        for _, module in self.model.named_modules():
            if hasattr(module, "static_cache"):
                del module.static_cache
        self.caches.clear()
        super().close()

    def _prefill(self, chunk: TensorBatch) -> Tensor:
        ids, prompt_mask = chunk["prompt_ids"], chunk["prompt_mask"]
        width, dev = self.width, ids.device
        for cache in self.caches:
            if cache.k is not None and cache.v is not None:
                cache.k.zero_()
                cache.v.zero_()
        self.valid[:, :width].copy_(prompt_mask)
        self.valid[:, width:] = True
        q = torch.arange(width, device=dev)
        slots = self.slots[:width]  # the prefill reads the prompt's slots only
        # A query sees earlier real tokens and itself (a padding query sees only itself).
        causal = (slots[None, :] <= q[:, None])[None]
        visible = causal & (self.valid[:, None, :width] | (slots[None, :] == q[:, None])[None])
        self._where[0] = q
        logits = last_logits(self.model, ids, (~visible)[:, None], self.freqs[:width])
        self._where[0] = self.slot
        self.slot.fill_(width)
        return logits

    def _advance(self) -> Tensor:
        seen = self.window  # the cache window of this step (the whole cache without windows)
        masked = ~self.step_attends(self.valid, self.slots, self.slot, seen)[:, None, None, :]
        logits = self.step_logits(self.model, self.tok.unsqueeze(-1), mark_window_dynamic(masked, 3, seen, self.windows),
                                  self.freqs.index_select(0, self.slot))
        self.slot.add_(1)
        return logits
