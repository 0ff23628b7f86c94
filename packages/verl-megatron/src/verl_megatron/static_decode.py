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

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from verl_core.batch import TensorBatch
from verl_core.sampling import TokenSampler

__all__ = ["LayerCache", "StaticDecoder"]


class LayerCache:
    """One attention layer's keys and values [rows, groups, length, dim], written in place.

    Args:
        length: Cache slots (prompt width plus new tokens).
        where: A one-element list holding the slot indices the current call writes (the
            decoder swaps the tensor between the prefill and the decode steps).
    """

    def __init__(self, length: int, where: list[Tensor]) -> None:
        self.length = length
        self.where = where
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def attend(self, query: Tensor, key: Tensor, value: Tensor, masked: Tensor, scale: float | None) -> Tensor:
        """Write ``key``/``value`` [sq, b, groups, d] at the current slots, attend ``query`` [sq, b, heads, d].

        ``masked`` is [b, 1, sq, length], True where a query must not see a key. Returns
        [sq, b, heads * d]. Head ``h`` reads group ``h // (heads / groups)``, as Megatron's
        attention does; a one-token step folds a group's heads instead of repeating its keys.
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
        groups = self.k.shape[1]
        rep = heads // groups
        if sq == 1 and rep > 1:
            folded = query.reshape(b, groups, rep, d)
            out = F.scaled_dot_product_attention(folded, self.k, self.v, attn_mask=keep, scale=scale)
            return out.reshape(1, b, heads * d)
        k, v = self.k, self.v
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), k, v, attn_mask=keep, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


class StaticDecoder:
    """Prefill and decode steps of one shape over :class:`LayerCache` s (see the module docstring).

    Args:
        model: The rollout's megatron-core ``GPTModel`` (pp=1) with SDPA core attention.
        rows: Sequences decoded together.
        width: Prompt width (left-padded).
        sampler: The step's sampling (its uniform table is filled by :meth:`start`).
        max_new: Most new tokens.
        device: Where the model lives.
    """

    def __init__(self, model: Any, rows: int, width: int, sampler: TokenSampler, max_new: int,
                 device: torch.device) -> None:
        self.model = model
        self.sampler = sampler
        self.max_new = max_new
        self.width = width
        length = width + max_new
        dev = device
        self.slot = torch.full((1,), width, dtype=torch.int64, device=dev)
        self._where: list[Tensor] = [self.slot]
        self.caches = []
        for name, module in model.named_modules():
            if name.endswith("core_attention"):
                cache = LayerCache(length, self._where)
                module.static_cache = cache
                self.caches.append(cache)
        self.freqs: Tensor = model.rotary_pos_emb(length)  # [length, 1, 1, rotary dim]
        self.valid = torch.ones(rows, length, dtype=torch.bool, device=dev)
        self.slots = torch.arange(length, device=dev)
        self.out_tok = torch.full((rows, max_new), sampler.pad, dtype=torch.int64, device=dev)
        self.out_mask = torch.zeros(rows, max_new, dtype=torch.bool, device=dev)
        self.out_lp = torch.zeros(rows, max_new, dtype=torch.float32, device=dev)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.tok = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.t = torch.ones(1, dtype=torch.int64, device=dev)
        self.done = 1  # steps whose tokens are in the output columns
        self.graph: Any = None
        self._params = [p.data_ptr() for p in model.parameters()]

    def reusable(self, model: Any) -> bool:
        """Whether the buffers (and a captured graph) still address ``model``'s live parameters."""
        return model is self.model and [p.data_ptr() for p in model.parameters()] == self._params

    def close(self) -> None:
        """Detach the caches from the model's attention modules."""
        for _, module in self.model.named_modules():
            if hasattr(module, "static_cache"):
                del module.static_cache
        self.caches.clear()
        self.graph = None

    def _logits(self, tokens: Tensor, masked: Tensor, rotary: Tensor) -> Tensor:
        """Float32 full-vocabulary logits of the last position of ``tokens`` [rows, s]."""
        m = self.model
        positions = torch.zeros_like(tokens)  # unused by rotary models (no learned positions)
        hidden = m.decoder(hidden_states=m.embedding(input_ids=tokens, position_ids=positions),
                           attention_mask=masked, rotary_pos_emb=rotary)
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)
        out: Tensor = logits[0].float()
        return out

    def start(self, chunk: TensorBatch, uniforms: Tensor | None) -> None:
        """Prefill ``chunk``'s prompts and sample the first token; resets every buffer in place."""
        ids, prompt_mask = chunk["prompt_ids"], chunk["prompt_mask"]
        width, dev = self.width, ids.device
        if uniforms is not None:
            assert self.sampler.uniforms is not None
            self.sampler.uniforms.copy_(uniforms)
        for cache in self.caches:
            if cache.k is not None and cache.v is not None:
                cache.k.zero_()
                cache.v.zero_()
        self.valid[:, :width].copy_(prompt_mask)
        self.valid[:, width:] = True
        q = torch.arange(width, device=dev)
        # A query sees earlier real tokens and itself (a padding query sees only itself).
        visible = (self.slots[None, :] <= q[:, None])[None] & (self.valid[:, None, :] | (self.slots[None, :] == q[:, None])[None])
        prefill_slots = torch.arange(width, device=dev)
        self._where[0] = prefill_slots
        logits = self._logits(ids, (~visible)[:, None], self.freqs[:width])
        self._where[0] = self.slot
        self.out_tok.fill_(self.sampler.pad)
        self.out_mask.zero_()
        self.out_lp.zero_()
        self.finished.zero_()
        self.slot.fill_(width)
        self.t.fill_(1)
        self.done = 1
        self.tok.copy_(self._sample(logits, 0))

    def _sample(self, logits: Tensor, t: int | Tensor) -> Tensor:
        alive = ~self.finished
        tok, lp, stopped = self.sampler.step(logits, t, alive)
        if isinstance(t, int):
            self.out_tok[:, t] = tok
            self.out_mask[:, t] = alive
            self.out_lp[:, t] = lp
        else:
            self.out_tok.index_copy_(1, t, tok.unsqueeze(1))
            self.out_mask.index_copy_(1, t, alive.unsqueeze(1))
            self.out_lp.index_copy_(1, t, lp.unsqueeze(1))
        self.finished |= stopped
        return tok

    def step(self) -> None:
        """Feed the last token, sample the next one, advance every counter (all in place)."""
        masked = ~(self.valid & (self.slots <= self.slot))
        logits = self._logits(self.tok.unsqueeze(-1), masked[:, None, None, :], self.freqs.index_select(0, self.slot))
        self.tok.copy_(self._sample(logits, self.t))
        self.slot.add_(1)
        self.t.add_(1)

    def _all_finished(self) -> bool:
        return bool(self.finished.all())

    def run(self, check_every: int = 1) -> None:
        """Eager steps until every row finished or max_new tokens were drawn."""
        self._loop(self.step, check_every)

    def _loop(self, advance: Callable[[], None], check_every: int) -> None:
        while self.done < self.max_new:
            if self.done % check_every == 0 and self._all_finished():
                return
            advance()
            self.done += 1

    def run_with_graph(self, warmup: int = 2, check_every: int = 8) -> str | None:
        """A few eager steps, one step captured in a CUDA graph, replays for the rest.

        Returns:
            None, or why capture failed (the remaining steps then ran eagerly).
        """
        if self.graph is not None:
            self._loop(self.graph.replay, check_every)
            return None
        if self._all_finished():
            return None
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(min(warmup, self.max_new - self.done)):
                self.step()
                self.done += 1
        torch.cuda.current_stream().wait_stream(side)
        if self.done >= self.max_new or self._all_finished():
            return None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step()
        except Exception as e:  # a kernel or library call that cannot be captured: decode eagerly
            warnings.warn(f"megatron rollout: CUDA graph capture failed ({type(e).__name__}: {e}); decoding "
                          "eagerly from now on", RuntimeWarning, stacklevel=2)
            self.run(check_every)
            return f"{type(e).__name__}: {e}"
        self.graph = graph
        self._loop(graph.replay, check_every)
        return None

    def result(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Output columns trimmed to the steps where any row was alive, and truncated flags."""
        width = max(1, int(self.out_mask.any(0).sum()))
        return (self.out_tok[:, :width].clone(), self.out_mask[:, :width].clone(),
                self.out_lp[:, :width].clone(), ~self.finished)
