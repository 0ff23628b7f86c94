"""Faulty engines of the meta-tests in test_meta_blind_spots.py: the tiny backend with one fault each.

Each class is an engine factory as ``check_backend(make_training_engine=..., make_rollout_engine=...)``
takes one (called with an EngineSpec), so the meta-tests run them through the factory route.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from verl_tiny_backend.model import Rope
from verl_tiny_backend.rollout import TinyRolloutEngine
from verl_tiny_backend.training import TinyTrainingEngine

from verl_core import EngineSpec, SamplingParams, StepMetrics, TensorBatch
from verl_core.enginekit.rollout_base import Responses
from verl_core.enginekit.sampling import (
    TokenSampler,
    inverse_cdf,
    kept_probs,
    tempered_log_probs,
    uniform_table,
)

__all__ = [
    "EosIgnoredWithStopTokens",
    "GreedyWhileReportingSoftmax",
    "MomentsResetOnLoad",
    "RopeScalingIgnoredRollout",
    "RopeScalingIgnoredTraining",
    "SampledAtTemperatureOne",
    "SchedulerNotCheckpointed",
    "StepCountNotCheckpointed",
    "TopPBeforeTemperature",
]


# ---------------------------------------------------------------------------------------- RoPE scaling
def _plain_rope(path: str, head_dim: int) -> Rope:
    """The folder's rotary embedding with its scaling left out (only ``rope_theta`` read)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    params = raw.get("rope_parameters") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    return Rope.load({"rope_theta": theta}, head_dim, path)


class RopeScalingIgnoredTraining(TinyTrainingEngine):
    """Reads ``rope_theta`` and ignores the folder's RoPE scaling (linear, LongRoPE, ...)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.model.cfg = replace(self.model.cfg, rope=_plain_rope(spec.model_path, self.model.cfg.head_dim))


class RopeScalingIgnoredRollout(TinyRolloutEngine):
    """The rollout engine of the same fault."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.model.cfg = replace(self.model.cfg, rope=_plain_rope(spec.model_path, self.model.cfg.head_dim))


# ---------------------------------------------------------------------------------------- sampling
class _SamplerRollout(TinyRolloutEngine):
    """The tiny rollout's decode loop with the stop ids and the sampler as hooks a fault overrides."""

    def _stops(self, params: SamplingParams) -> list[int]:
        return [self.tokenizer.eos_token_id, *params.stop_token_ids]

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return TokenSampler(params, self.tokenizer.pad_token_id, stops, uniforms)

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        uniforms = None if params.greedy else uniform_table(seeds, params.max_new_tokens)
        sampler = self._sampler(params, torch.tensor(self._stops(params)), uniforms)
        ids, mask = rows["prompt_ids"], rows["prompt_mask"]
        toks: list[Tensor] = []
        masks: list[Tensor] = []
        lps: list[Tensor] = []
        alive = torch.ones(rows.batch_size, dtype=torch.bool)
        with torch.no_grad():
            for t in range(params.max_new_tokens):
                logits = self.model.logits(self.model.hidden(ids, mask)[:, -1])
                tok, lp, stopped = sampler.step(logits, t, alive)
                toks.append(tok)
                masks.append(alive.clone())
                lps.append(lp)
                ids = torch.cat([ids, tok[:, None]], 1)
                mask = torch.cat([mask, alive[:, None]], 1)
                alive = alive & ~stopped
                if not bool(alive.any()):
                    break
        return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(lps, 1).float(), alive.clone()


class _TemperatureOneSampler(TokenSampler):
    def step(self, logits: Tensor, t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tok, _, stopped = TokenSampler(replace(self.params, temperature=1.0), self.pad, self.stops,
                                       self.uniforms).step(logits, t, alive)
        lp = tempered_log_probs(logits, self.params.temperature).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        return tok, torch.where(alive, lp, 0.0), stopped


class SampledAtTemperatureOne(_SamplerRollout):
    """Samples from softmax(logits) whatever the temperature, and reports log-probs at the temperature asked."""

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return _TemperatureOneSampler(params, self.tokenizer.pad_token_id, stops, uniforms)


class GreedyWhileReportingSoftmax(TinyRolloutEngine):
    """Takes the most likely token at every step, and reports its log-prob under softmax(logits / T)."""

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        return super()._sample(rows, replace(params, greedy=True), seeds)


class _TopPFirstSampler(TokenSampler):
    def step(self, logits: Tensor, t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        p = self.params
        if p.greedy or self.uniforms is None:
            return super().step(logits, t, alive)
        logp = tempered_log_probs(logits, p.temperature)
        keep = kept_probs(logits.float(), p.top_k, p.top_p) > 0  # the nucleus of the untempered logits
        u = self.uniforms[:, t] if isinstance(t, int) else self.uniforms.index_select(1, t).squeeze(1)
        tok = inverse_cdf(torch.where(keep, logp.exp(), 0.0), u)
        tok = torch.where(alive, tok, self.pad)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        stopped = alive & (tok.unsqueeze(-1) == self.stops).any(-1)
        return tok, torch.where(alive, lp, 0.0), stopped


class TopPBeforeTemperature(_SamplerRollout):
    """Picks the top-k / nucleus set from the untempered logits, then samples it at the temperature."""

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return _TopPFirstSampler(params, self.tokenizer.pad_token_id, stops, uniforms)


# ---------------------------------------------------------------------------------------- stop conditions
class EosIgnoredWithStopTokens(_SamplerRollout):
    """Stops on ``stop_token_ids`` instead of EOS when any are given (EOS no longer ends a response)."""

    def _stops(self, params: SamplingParams) -> list[int]:
        return list(params.stop_token_ids) or [self.tokenizer.eos_token_id]


# ---------------------------------------------------------------------------------------- checkpoints
class SchedulerNotCheckpointed(TinyTrainingEngine):
    """Schedules the learning rate with a torch LambdaLR that save_checkpoint leaves out.

    The optimizer's state holds the learning rate of the next step, so the first update after
    load_checkpoint runs at the right rate; the fresh scheduler then steps from position 0.
    """

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        optim = spec.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: optim.lr_at(k) / optim.lr)

    def optimizer_step(self) -> StepMetrics:
        """The tiny engine's step at the scheduler's learning rate, then the scheduler's step."""
        self._pending = False
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.sqrt(sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=norm, lr=lr, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.scheduler.step()
        return StepMetrics(grad_norm=norm, lr=lr, skipped=False)


class MomentsResetOnLoad(TinyTrainingEngine):
    """load_checkpoint restores everything but AdamW's second moments (zeros)."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, then zero every exp_avg_sq."""
        super().load_checkpoint(path)
        for state in self.optimizer.state.values():
            state["exp_avg_sq"].zero_()


class StepCountNotCheckpointed(TinyTrainingEngine):
    """load_checkpoint restores AdamW's moments but not its per-parameter step count (bias correction restarts)."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, then reset AdamW's step count."""
        super().load_checkpoint(path)
        for state in self.optimizer.state.values():
            state["step"] = torch.zeros_like(state["step"])
