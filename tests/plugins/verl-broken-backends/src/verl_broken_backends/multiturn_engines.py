"""The faulty engines of multi-turn episodes: each overrides one hook of the example backend's
engines to get observation tokens, long prompts, stop ids or a prefix cache wrong."""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable
from dataclasses import replace

import torch
from torch import Tensor
from verl_example_backend.model import DecoderLM, position_ids
from verl_example_backend.rollout import ExampleRolloutEngine
from verl_example_backend.training import ExampleTrainingEngine, token_outputs

from verl_broken_backends.multiturn import PREFIX_CONTINUATION_ROLLOUT
from verl_core import (
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    RolloutCapabilities,
    SamplingParams,
    TensorBatch,
    WeightMessage,
)

__all__ = [
    "LossMaskDropped",
    "ObservationOutputs",
    "PrefixKeyedCache",
    "PromptWindow",
    "SpecialTokensDropped",
    "StalePrefixCache",
    "StopIdsIgnored",
    "SurvivingPrefixCache",
    "TurnRestartPositions",
]

class LossMaskDropped(ExampleTrainingEngine):
    """forward_backward hands the loss function micro-batches without ``loss_mask``, so every
    response token counts: the loss is aggregated over ``response_mask``, observation tokens included."""

    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """The example's forward_backward on the batch without its loss_mask."""
        batch = mini_batch.drop("loss_mask") if "loss_mask" in mini_batch else mini_batch
        return super().forward_backward(batch, loss_fn, stats, max_tokens=max_tokens)


class ObservationOutputs(ExampleTrainingEngine):
    """Masks its outputs with ``response_mask`` only: observation tokens get log-probs and entropy."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs as if every response token were sampled."""
        return token_outputs(self.model, batch.drop("loss_mask") if "loss_mask" in batch else batch, outputs)


def _hidden_at(model: DecoderLM, ids: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
    """:meth:`DecoderLM.hidden` at the position ids ``pos`` instead of ``cumsum(mask) - 1``."""
    freqs = pos.unsqueeze(-1).float() * model.inv_freq  # type: ignore[operator]
    emb = torch.cat([freqs, freqs], -1)
    x = model.model.embed_tokens(ids)
    cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)
    s = ids.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril().unsqueeze(0) & mask.unsqueeze(1)
    bias = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min).unsqueeze(1)
    for layer in model.model.layers:
        x = layer(x, cos, sin, bias)
    return model.model.norm(x)  # type: ignore[no-any-return]


class TurnRestartPositions(ExampleTrainingEngine):
    """Restarts the position ids at each turn of a multi-turn response (each turn numbered as if it
    came right after the prompt), as a packer that takes turns for sequences would."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Log-probs and entropy under per-turn position ids."""
        if "turn_ids" not in batch:
            return super().compute(batch, outputs)
        p, r = batch.prompt_len, batch.response_len
        turns = batch["turn_ids"]
        col = torch.arange(r).expand_as(turns)
        starts = torch.ones_like(batch["response_mask"])
        starts[:, 1:] = turns[:, 1:] != turns[:, :-1]
        turn_start = torch.where(starts, col, 0).cummax(1).values
        prompt_pos = position_ids(batch["prompt_mask"])
        pos = torch.cat([prompt_pos, prompt_pos[:, -1:] + 1 + col - turn_start], 1)
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        hidden = _hidden_at(self.model, ids, mask, pos)[:, p - 1 : p + r - 1]
        logp = torch.log_softmax(self.model.logits(hidden).float() / batch.meta.temperature, -1)
        keep = batch.loss_mask
        out = {"log_probs": logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1).masked_fill(~keep, 0.0),
               "entropy": (-(logp.exp() * logp).sum(-1)).masked_fill(~keep, 0.0)}
        return {k: v for k, v in out.items() if k in outputs}


class _PromptRewriter(ExampleRolloutEngine):
    """Samples from rewritten prompt ids (:meth:`rewrite`) and returns the prompts it was given."""

    def rewrite(self, ids: list[int]) -> list[int]:
        """The ids the engine actually runs for a prompt of ``ids``."""
        return ids

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate from the rewritten prompts; hand back the original ones."""
        rows = [self.rewrite(prompts["prompt_ids"][b][prompts["prompt_mask"][b]].tolist())
                for b in range(prompts.batch_size)]
        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for b, row in enumerate(rows):
            ids[b, width - len(row):] = torch.tensor(row, dtype=torch.int64)
            mask[b, width - len(row):] = True
        out = super().generate(prompts.update(prompt_ids=ids, prompt_mask=mask), params)
        given = prompts.repeat_interleave(params.n)
        return out.update(prompt_ids=given["prompt_ids"], prompt_mask=given["prompt_mask"])


class SpecialTokensDropped(_PromptRewriter):
    """Passes prompts through text (decode, then encode): the special tokens inside a prompt, such as
    the EOS that ended an earlier turn, are lost."""

    def rewrite(self, ids: list[int]) -> list[int]:
        """The prompt without the ids that decode to no text."""
        return [i for i in ids if self.tokenizer.decode([i])]


class PromptWindow(_PromptRewriter):
    """Keeps only the last 16 tokens of a prompt (a context window sized for single-turn prompts)."""

    def rewrite(self, ids: list[int]) -> list[int]:
        """The prompt's last 16 ids."""
        return ids[-16:]


class StopIdsIgnored(ExampleRolloutEngine):
    """Stops at EOS only, whatever ``stop_token_ids`` says."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate without the stop ids."""
        return super().generate(prompts, replace(params, stop_token_ids=()))


class StalePrefixCache(_PromptRewriter):
    """Declares prefix_continuation; its cache entry of a prompt that extends an earlier call's prompt
    is keyed by that earlier prompt and the new prompt's length, so another continuation of the same
    length (another observation after the same turn) is served the cached one's samples."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._roots: list[tuple[int, ...]] = []
        self._continuations: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The example's capabilities with prefix_continuation=True."""
        return PREFIX_CONTINUATION_ROLLOUT

    def rewrite(self, ids: list[int]) -> list[int]:
        """The cached continuation of the same earlier prompt and length, else ``ids`` (then cached)."""
        root = next((r for r in self._roots if len(r) < len(ids) and tuple(ids[: len(r)]) == r), None)
        if root is None:
            self._roots.append(tuple(ids))
            return ids
        return self._continuations.setdefault((root, len(ids)), ids)


class PrefixKeyedCache(_PromptRewriter):
    """Declares prefix_continuation; keys its cache by the first half of a prompt and its length, and
    fills it row by row, so a prompt of the same length after the same turn (another observation) is
    served the first one's samples in the call that samples both as in any later one: an engine
    that never saw the earlier calls, sampling every prompt in one call, repeats the fault."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._entries: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The example's capabilities with prefix_continuation=True."""
        return PREFIX_CONTINUATION_ROLLOUT

    def rewrite(self, ids: list[int]) -> list[int]:
        """The cached prompt of the same first half and length, else ``ids`` (then cached)."""
        return self._entries.setdefault((tuple(ids[: len(ids) // 2]), len(ids)), ids)


class SurvivingPrefixCache(ExampleRolloutEngine):
    """Declares prefix_continuation and caches, for each prompt it sampled, the model that computed it
    (its keys and values), looked up by the whole id sequence; its weight write no longer drops that
    cache, so a prompt that continues one sampled before update_weights runs on the old weights."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._cached: dict[tuple[int, ...], DecoderLM] = {}

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The example's capabilities with prefix_continuation=True."""
        return PREFIX_CONTINUATION_ROLLOUT

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate on the model of a cached prefix of the first prompt, if any; cache every prompt."""
        rows = [tuple(prompts["prompt_ids"][b][prompts["prompt_mask"][b]].tolist()) for b in range(prompts.batch_size)]
        current = self.model
        first = rows[0] if rows else ()
        hit = next((m for key, m in self._cached.items() if len(key) < len(first) and first[: len(key)] == key), None)
        self.model = hit if hit is not None else current
        try:
            return super().generate(prompts, params)
        finally:
            self.model = current
            self._cached.update(dict.fromkeys(rows, current))

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """The example's update on a copy of the model: the cache keeps (and serves) the old one."""
        self.model = copy.deepcopy(self.model)
        super().update_weights(stream)
