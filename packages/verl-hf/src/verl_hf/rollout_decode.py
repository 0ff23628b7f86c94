"""The hf rollout engine's decode loops: a static KV cache (one shape, CUDA-graph ready) and
transformers' DynamicCache, plus how the engine reports which one it runs.

Both loops sample through :class:`~verl_core.enginekit.sampling.TokenSampler`, so a static and a
dynamic decode of the same prompts and seeds draw the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor

from verl_core.enginekit.sampling import (
    CompiledOrEager,
    GraphCaptures,
    StaticDecodeLoop,
    TokenSampler,
    cache_windows,
    eager_decode,
    mark_window_dynamic,
    slow_path_notes,
)
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_hf.config import HFOptions
from verl_hf.modeling import cache_keyword, position_ids

__all__ = [
    "RECOMPILE_LIMIT",
    "HFStaticDecoder",
    "allow_recompiles",
    "compiled_graphs",
    "decode_dynamic",
    "decode_mode",
    "full_attention",
    "log_compile",
]

log = logging.getLogger("verl_hf.rollout")


class HFStaticDecoder(StaticDecodeLoop):
    """The decode loop over a preallocated StaticCache, every step of a cache window at one shape.

    Besides the loop's state (:class:`~verl_core.enginekit.sampling.StaticDecodeLoop`), the position to
    feed and the cache slot are device tensors updated in place. The attention mask is built here
    as a 4D mask (prompt padding and not-yet-written slots masked, and a finished row's slots but
    the one the step writes: :meth:`~verl_core.enginekit.sampling.StaticDecodeLoop.step_attends`),
    which keeps transformers' own mask code (with its host synchronisations) out of the step.

    With ``window`` > 0 the model's attention must read a mask narrower than the cache as "the
    first mask-width slots only" (:func:`verl_hf.modeling.grouped_decode_sdpa`): the prefill's mask
    then covers the prompt's slots, and each decode step's the smallest cache window holding every
    written slot (multiples of ``window``, then the whole cache:
    :func:`~verl_core.enginekit.sampling.cache_windows`), so attention reads what was written
    rather than the whole cache. With ``window`` 0 every mask covers the whole cache (any attention
    implementation).
    """

    def __init__(self, model: Any, rows: int, width: int, sampler: TokenSampler, max_new: int, *,
                 eager_attention: bool, device: torch.device, step_model: Any = None, window: int = 0) -> None:
        from transformers import StaticCache

        length = width + max_new
        super().__init__(rows, max_new, sampler, device, model, "hf rollout",
                         windows=cache_windows(width, length, window), filled=width)
        # What a decode step calls: the model, or a compiled version of it (compiled once for the
        # windows below the whole cache and once for the whole cache, so no recompilation while the
        # decoder is reused; the prefill always runs the model itself).
        self.step_model = model if step_model is None else step_model
        self.width = width
        self.narrow = window > 0  # masks cover the slots a call reads, not the whole cache
        self.cache_kw = cache_keyword(model)
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        if any(bool(getattr(layer, "is_sliding", False)) for layer in self.cache.layers):
            raise ConfigError(
                "HFOptions.rollout_cache='static' supports full-attention models only; this model has "
                "sliding-window layers: use rollout_cache='dynamic'"
            )
        self.eager_attention = eager_attention
        self.dtype = model.get_input_embeddings().weight.dtype
        self.valid = torch.ones(rows, length, dtype=torch.bool, device=device)
        self.slots = torch.arange(length, device=device)
        self.pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot = torch.full((1,), width, dtype=torch.int64, device=device)

    def _prefill(self, chunk: TensorBatch) -> Tensor:
        ids = chunk["prompt_ids"]
        prompt_mask = chunk["prompt_mask"]
        width = self.width
        dev = ids.device
        self.cache.reset()  # type: ignore[no-untyped-call]
        self.valid[:, :width].copy_(prompt_mask)
        pos = position_ids(prompt_mask)
        # Prefill: causal over the prompt, padding masked; a padding query also sees itself so no
        # row is fully masked (its output is never read). Narrow masks cover the prompt's slots.
        seen = width if self.narrow else self.slots.shape[0]
        slots = self.slots[:seen]
        causal = slots[None, :] <= torch.arange(width, device=dev)[:, None]
        own = slots[None, :] == torch.arange(width, device=dev)[:, None]
        mask = (self.valid[:, None, :seen] & causal[None]) | own[None]
        out: Any = self.model(input_ids=ids, attention_mask=self._attention(mask[:, None]), position_ids=pos,
                              use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        self.pos.copy_(pos[:, -1] + 1)
        self.slot.fill_(width)
        logits: Tensor = out.logits[:, -1].float()
        return logits

    def _attention(self, mask: Tensor) -> Tensor:
        """The 4D boolean mask (True = attend) in the form the attention kernel takes."""
        if not self.eager_attention:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.dtype).min
        )

    def _advance(self) -> Tensor:
        seen = self.window if self.narrow else self.slots.shape[0]
        mask = self._attention(self.step_attends(self.valid, self.slots, self.slot, seen)[:, None, None, :])
        out: Any = self.step_model(
            input_ids=self.tok.unsqueeze(-1), attention_mask=mark_window_dynamic(mask, 3, seen, self.windows),
            position_ids=self.pos.unsqueeze(-1), use_cache=True, **{self.cache_kw: self.cache},
        )
        self.pos.add_(1)
        self.slot.add_(1)
        logits: Tensor = out.logits[:, -1].float()
        return logits


def decode_dynamic(
    model: Any, chunk: TensorBatch, sampler: TokenSampler, max_new: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode loop over transformers' DynamicCache (grows one column per step), asking after
    every step whether all rows finished.

    Returns:
        Response ids, mask, log-probs [rows, steps] and truncated [rows].
    """
    return eager_decode(_dynamic_logits(model, chunk), sampler, chunk.batch_size, max_new, device)


def _dynamic_logits(model: Any, chunk: TensorBatch) -> Generator[Tensor, Tensor, None]:
    """Next-token float32 logits of every row: the prompt's, then one per token sent."""
    rows = chunk.batch_size
    attn = chunk["prompt_mask"].long()
    pos = position_ids(attn)
    out: Any = model(input_ids=chunk["prompt_ids"], attention_mask=attn, position_ids=pos, use_cache=True,
                     logits_to_keep=1)
    cache_kw = cache_keyword(model)
    cur = pos[:, -1]
    while True:
        tok = yield out.logits[:, -1].float()
        attn = torch.cat([attn, torch.ones(rows, 1, dtype=attn.dtype, device=attn.device)], 1)
        cur = cur + 1
        out = model(input_ids=tok.unsqueeze(-1), attention_mask=attn, position_ids=cur.unsqueeze(-1),
                    use_cache=True, **{cache_kw: getattr(out, cache_kw)})


def decode_mode(options: HFOptions, graphs: GraphCaptures | None = None, compiled: CompiledOrEager | None = None) -> str:
    """How the engine decodes under ``options``: ``dynamic``, ``static``, ``static+cuda-graphs``,
    ``static+compile`` or ``static+compile+cuda-graphs``, with ``+windows`` where steps attend
    over cache windows, ``+fused-attention`` where they run the fused decode-attention kernel, the
    shapes that decode eagerly after their CUDA-graph captures failed, and the error after which
    the decode step runs uncompiled (:func:`~verl_core.enginekit.sampling.slow_path_notes`)."""
    if options.rollout_cache == "dynamic":
        return "dynamic+fused-attention" if options.rollout_decode_kernel else "dynamic"
    mode = "static+compile" if options.rollout_compile else "static"
    if options.rollout_cuda_graphs:
        mode += "+cuda-graphs"
    if options.rollout_decode_window:
        mode += "+windows"
    if options.rollout_decode_kernel:
        mode += "+fused-attention"
    return mode + slow_path_notes(graphs if options.rollout_cuda_graphs else None, compiled)


RECOMPILE_LIMIT = 64
"""Compiled versions of one function dynamo keeps (``torch._dynamo.config.recompile_limit``) while a
rollout compiles its decode step: a few in all (the first shape, then once per size that changes, made
symbolic; twice each with cache windows: the windows below the whole cache, and the whole
cache), more where the traced code fixes a size; above dynamo's default of 8, past which it would
run the step uncompiled."""


def allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit to :data:`RECOMPILE_LIMIT` (never lower it).

    A process-wide setting: the compiled decode step is specialised to each shape it sees (rows
    and prompt width, a cache window below the whole cache or the whole cache), and a run meets a
    few of each.
    """
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < RECOMPILE_LIMIT:
        log.info("hf rollout: torch._dynamo.config.recompile_limit %d -> %d (a compiled decode step per rows, "
                 "prompt width and cache window kind)", dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        dynamo_config.recompile_limit = RECOMPILE_LIMIT


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process, every function's (a call that raises it compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def log_compile(rows: int, width: int, seconds: float) -> None:
    """Log a first decode of a shape under ``rollout_compile`` that compiled (the decode step, its
    sampling) and where inductor caches what it compiled, which shortens the next run's compile."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        where = f"inductor's cache: {cache_dir()}"
    except (ImportError, AttributeError):  # another torch layout: the message names no folder
        where = "inductor's on-disk cache"
    log.info("hf rollout: first decode of %d rows x %d prompt tokens took %.1f s, compiling the decode step "
             "(later calls of this shape reuse it, and so do other shapes once the sizes that change are symbolic; %s)",
             rows, width, seconds, where)


def full_attention(config: Any) -> bool:
    """Whether every layer of the model attends to the whole context (a static KV cache fits it)."""
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return False
    return not bool(getattr(config, "use_sliding_window", False))
