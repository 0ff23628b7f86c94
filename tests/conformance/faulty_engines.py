"""Faulty engines of the meta-tests in test_meta_blind_spots.py: the tiny backend with one fault each.

Each class is an engine factory as ``check_backend(make_training_engine=..., make_rollout_engine=...)``
takes one (called with an EngineSpec), so the meta-tests run them through the factory route.
"""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Final

import torch
from torch import Tensor
from verl_tiny_backend.model import Model, Rope
from verl_tiny_backend.plugin import ROLLOUT_CAPABILITIES
from verl_tiny_backend.rollout import TinyRolloutEngine
from verl_tiny_backend.training import DTYPES, TinyTrainingEngine

from verl_core import (
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ParallelSizes,
    RolloutCapabilities,
    SamplingParams,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    WeightManifest,
    WeightMessage,
    apply_weight_stream,
)
from verl_core.enginekit.rollout_base import Responses
from verl_core.enginekit.sampling import (
    TokenSampler,
    inverse_cdf,
    kept_probs,
    tempered_log_probs,
    uniform_table,
)
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_hf.modeling import sequence_inputs
from verl_hf.reward import HFRewardEngine
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine

__all__ = [
    "Bfloat16NormReward",
    "BlandRefusalRollout",
    "BlandRefusalTraining",
    "BucketDefaultChangedTraining",
    "BudgetIgnored",
    "ClipIgnored",
    "ConstantLearningRate",
    "CoupledWeightDecay",
    "CriticPadRowTrained",
    "CriticQKNormsUnit",
    "CriticWithoutMasterWeights",
    "DefaultBetas",
    "EmptyStepApplied",
    "EosIgnoredWithStopTokens",
    "ExportDtypeIgnored",
    "Float32UnderBfloat16Rollout",
    "Float32UnderBfloat16Training",
    "FirstLabelReward",
    "GradientsKeptOnLoad",
    "GreedyLogProbsAtTemperatureOne",
    "GreedyWhileReportingSoftmax",
    "HardCodedThetaRollout",
    "HardCodedThetaTraining",
    "LastTokenFromPadReward",
    "LengthLimitsIgnored",
    "MetaNotStamped",
    "MomentsResetOnLoad",
    "NonFiniteStepApplied",
    "NormAfterClipping",
    "OmittedKeysOldDefaultsRollout",
    "OmittedKeysOldDefaultsTraining",
    "ParallelIgnoredRollout",
    "Qwen2TiedSplitTraining",
    "QwenThetaHardCodedRollout",
    "QwenThetaHardCodedTraining",
    "RopeScalingIgnoredRollout",
    "RopeScalingIgnoredTraining",
    "RunnerUpAtThirdToken",
    "SameStreamForEverySample",
    "SampledAtTemperatureOne",
    "SchedulerNotCheckpointed",
    "SeededByBatchPosition",
    "SiluHardCodedRollout",
    "SiluHardCodedTraining",
    "SingleFileOnlyRollout",
    "SingleFileOnlyTraining",
    "SkippedStepCounted",
    "SleepingButTakingWeights",
    "SleepingRollout",
    "SlidingWindowIgnoredRollout",
    "SlidingWindowIgnoredTraining",
    "StepCountNotCheckpointed",
    "TiesToTheHighestId",
    "TinyInBfloat16",
    "TopPBeforeTemperature",
    "TopTokenDropped",
    "UncheckedReward",
    "UndeclaredSettingsIgnored",
    "UnseededIsSeedZero",
    "VersionCountsSkippedSteps",
    "VersionTakenAtManifest",
    "WaitsForASecondRow",
    "WeightDecayIgnored",
    "WeightsWrittenDuringGenerate",
    "WindowlessSlidingBuilt",
    "WorkerEndedByClose",
    "WorkerEndedByCloseOnly",
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


class HardCodedThetaTraining(TinyTrainingEngine):
    """Uses the RoPE base 10000 whatever ``rope_theta`` the folder's config sets (the usual default)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.model.cfg = replace(self.model.cfg, rope=Rope.load({"rope_theta": 10000.0}, self.model.cfg.head_dim,
                                                                spec.model_path))


class HardCodedThetaRollout(TinyRolloutEngine):
    """The rollout engine of the same fault."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.model.cfg = replace(self.model.cfg, rope=Rope.load({"rope_theta": 10000.0}, self.model.cfg.head_dim,
                                                                spec.model_path))


def _theta_10000_unless_llama(engine: TinyTrainingEngine | TinyRolloutEngine, path: str) -> None:
    if engine.model.cfg.model_type != "llama":
        engine.model.cfg = replace(engine.model.cfg, rope=Rope.load({"rope_theta": 10000.0},
                                                                    engine.model.cfg.head_dim, path))


class Qwen2TiedSplitTraining(TinyTrainingEngine):
    """Reads ``tie_word_embeddings`` for Llama and Qwen3 only: on a tied Qwen2 folder the lm_head is a
    parameter of its own, copied from the embedding (the forward is right; the first update is not)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        m = self.model
        if m.cfg.model_type == "qwen2" and m.cfg.tied and not m.cfg.value_head:
            m.cfg = replace(m.cfg, tied=False)
            embed = m.model.embed_tokens.weight
            m.lm_head = torch.nn.Linear(m.cfg.hidden, m.cfg.vocab_size, bias=False, dtype=embed.dtype)
            with torch.no_grad():
                m.lm_head.weight.copy_(embed)
            o = spec.optim
            self.optimizer = torch.optim.AdamW(m.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                               weight_decay=o.weight_decay)


class WaitsForASecondRow(TinyRolloutEngine):
    """Serves prompts in pairs: a call with one prompt waits, without a timeout, for a partner that never
    comes (a batching worker's mistake); every other call is the tiny engine's."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._partners: queue.Queue[TensorBatch] = queue.Queue()

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """The tiny engine's generate, after a partner for a lone prompt (which never arrives)."""
        if prompts.batch_size == 1:
            self._partners.get()
        return super().generate(prompts, params)


_BLAND_REFUSALS: Final = ("crafted-rope-", "crafted-sliding-window-", "crafted-oov-")


def _refuse_blandly(spec: EngineSpec) -> None:
    """A ConfigError naming only the folder, for the folders that hold a setting the engine could refuse
    (RoPE scaling, a sliding window, special ids past the vocabulary): their names hold those words."""
    if Path(spec.model_path).name.startswith(_BLAND_REFUSALS):
        raise ConfigError(f"could not load {spec.model_path}: internal error")


class BlandRefusalTraining(TinyTrainingEngine):
    """Refuses the rope-scaled, sliding-window and out-of-vocabulary folders naming nothing but the folder."""

    def __init__(self, spec: EngineSpec) -> None:
        _refuse_blandly(spec)
        super().__init__(spec)


class BlandRefusalRollout(TinyRolloutEngine):
    """The rollout engine of the same fault."""

    def __init__(self, spec: EngineSpec) -> None:
        _refuse_blandly(spec)
        super().__init__(spec)


class CriticPadRowTrained(TinyTrainingEngine):
    """The critic's embedding has no padding_idx (the actor's keeps it): where the pad id is a real response
    token, the pad row of the critic's embedding gets a gradient that transformers' does not."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if spec.role == "critic":
            self.model.model.embed_tokens.padding_idx = None


class CriticQKNormsUnit(TinyTrainingEngine):
    """The critic's Qwen3 q/k norm weights stay at one (never loaded from the folder); the actor's are loaded."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if spec.role == "critic" and self.model.cfg.qk_norm:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name.endswith(("q_norm.weight", "k_norm.weight")):
                        p.fill_(1.0)


class EmptyStepApplied(TinyTrainingEngine):
    """Steps AdamW after a mini-batch with no loss token: the backward through the model left zero gradients,
    so weight decay and Adam's momentum move every weight (the step must change none)."""

    @property
    def _nothing_to_learn(self) -> bool:
        return False


class ParallelIgnoredRollout(TinyRolloutEngine):
    """Builds whatever EngineSpec.parallel says, running alone as if every size were 1 (no refusal)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, parallel=ParallelSizes()))


class UncheckedReward(HFRewardEngine):
    """The hf reward model's score without validating its input (no check_model_inputs)."""

    def score(self, batch: TensorBatch) -> TensorBatch:
        """hf's score with the input check taken out for the call."""
        import verl_hf.reward as module

        checked = module.__dict__["check_model_inputs"]
        setattr(module, "check_model_inputs", lambda *args, **kwargs: None)  # noqa: B010
        try:
            return super().score(batch)
        finally:
            setattr(module, "check_model_inputs", checked)  # noqa: B010


class LastTokenFromPadReward(HFRewardEngine):
    """Reads the head at the last token whose id is not the pad id (instead of the masks)."""

    def _score(self, chunk: TensorBatch) -> Tensor:
        ids, mask, pos = sequence_inputs(chunk)
        hidden = self._model.base_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos,
                                        use_cache=False).last_hidden_state
        real = (ids != chunk.meta.pad_token_id).long()
        last = (real * torch.arange(ids.shape[1])).argmax(-1)
        scores: Tensor = self._head(hidden[torch.arange(ids.shape[0]), last])[:, 0].float()
        return scores


class FirstLabelReward(HFRewardEngine):
    """Scores with row 0 of a score head of several labels, where it must refuse the folder (built on a copy
    whose ``score.weight`` keeps its first row only)."""

    def __init__(self, spec: EngineSpec) -> None:
        from safetensors.torch import load_file, save_file

        self._folder = tempfile.TemporaryDirectory(prefix="verl-faulty-")
        for f in Path(spec.model_path).iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                (Path(self._folder.name) / f.name).symlink_to(f)
        weights = load_file(str(Path(spec.model_path) / "model.safetensors"))
        if "score.weight" in weights:
            weights["score.weight"] = weights["score.weight"][:1].contiguous()
        save_file(weights, str(Path(self._folder.name) / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((Path(spec.model_path) / "config.json").read_text())
        for key in ("id2label", "label2id"):
            config.pop(key, None)
        (Path(self._folder.name) / "config.json").write_text(json.dumps(config))
        super().__init__(replace(spec, model_path=self._folder.name))


class Bfloat16NormReward(HFRewardEngine):
    """The hf reward model whose RMSNorms compute in the model's dtype: in bfloat16 the mean of squares, its
    rsqrt and the product round to bfloat16 (no float32 upcast; in float32 it is hf's reward model)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        for module in self._model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = _norm_in_input_dtype(module)


def _norm_in_input_dtype(norm: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """``norm``'s forward computed in its input's dtype."""

    def forward(x: Tensor) -> Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        out: Tensor = norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))
        return out

    return forward


class CriticWithoutMasterWeights(HFTrainingEngine):
    """The hf training engine whose critic steps its bfloat16 parameters directly (hf option
    ``master_weights=False`` for the critic alone: no float32 master weights); the actor keeps its masters."""

    def __init__(self, spec: EngineSpec) -> None:
        if spec.role == "critic":
            spec = replace(spec, options={**spec.options, "master_weights": False})
        super().__init__(spec)


class Float32UnderBfloat16Rollout(HFRolloutEngine):
    """The hf rollout (it declares float32 and bfloat16) that loads its model in float32 whatever the spec's dtype
    says, as a worker that upcasts the weight stream does; it reports the spec it was given. Its bfloat16 outputs
    are float32's, within the bfloat16 tier of every check."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, dtype="float32"))
        self._spec = spec

    @property
    def weight_dtype(self) -> torch.dtype:
        """float32, whatever the spec says (weight messages are upcast to it)."""
        return torch.float32


class Float32UnderBfloat16Training(HFTrainingEngine):
    """The hf training engine that builds its model in float32 whatever the spec's dtype says, reporting the spec
    it was given (an actor that declares bfloat16 and computes in float32)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, dtype="float32"))
        self._spec = spec


class WindowlessSlidingBuilt(HFTrainingEngine):
    """The hf actor without its layer_types rule: it builds on a folder whose layer_types marks sliding layers
    while use_sliding_window is false (transformers' forward then fails at the first call)."""

    def __init__(self, spec: EngineSpec) -> None:
        import verl_hf.modeling as modeling

        rule = modeling.check_layer_types
        modeling.check_layer_types = lambda *args, **kwargs: None
        try:
            super().__init__(spec)
        finally:
            modeling.check_layer_types = rule


def _old_defaults_where_omitted(engine: TinyTrainingEngine | TinyRolloutEngine, path: str) -> None:
    """Where config.json leaves ``rms_norm_eps`` or ``tie_word_embeddings`` out, use Llama 2's 1e-5 and a
    tied lm_head (the defaults of older configs) instead of what transformers 5 fills in (1e-6, untied)."""
    from verl_tiny_backend.model import RMSNorm

    raw = json.loads((Path(path) / "config.json").read_text())
    if "rms_norm_eps" not in raw:
        for module in engine.model.modules():
            if isinstance(module, RMSNorm):
                module.eps = 1e-5
    if "tie_word_embeddings" not in raw and not engine.model.cfg.value_head:
        engine.model.cfg = replace(engine.model.cfg, tied=True)


class OmittedKeysOldDefaultsTraining(TinyTrainingEngine):
    """Fills the ``rms_norm_eps`` and ``tie_word_embeddings`` a config leaves out with older defaults (1e-5, tied)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _old_defaults_where_omitted(self, spec.model_path)


class OmittedKeysOldDefaultsRollout(TinyRolloutEngine):
    """The rollout engine of the same fault."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _old_defaults_where_omitted(self, spec.model_path)


def _single_file_only(path: str) -> None:
    """Refuse a folder without one ``model.safetensors``, as the tiny example once did."""
    if not (Path(path) / "model.safetensors").is_file():
        raise ConfigError(f"{path} has no model.safetensors; this backend reads single-file safetensors folders")


class SingleFileOnlyTraining(TinyTrainingEngine):
    """Reads one ``model.safetensors`` and refuses a sharded folder (model-0000k-of-0000n files and an index)."""

    def __init__(self, spec: EngineSpec) -> None:
        _single_file_only(spec.model_path)
        super().__init__(spec)


class SingleFileOnlyRollout(TinyRolloutEngine):
    """The rollout engine of the same fault."""

    def __init__(self, spec: EngineSpec) -> None:
        _single_file_only(spec.model_path)
        super().__init__(spec)


class BucketDefaultChangedTraining(TinyTrainingEngine):
    """``export_weights`` with a bucket_bytes default of its own (256 MiB, the protocol's is 512 MiB): every
    stream it sends is valid, and a caller that leaves the argument out gets other chunks than it asked for."""

    def export_weights(self, *, dtype: torch.dtype | None = None,
                       bucket_bytes: int = 256 * 1024 * 1024) -> Iterator[WeightMessage]:
        """The tiny engine's stream."""
        return super().export_weights(dtype=dtype, bucket_bytes=bucket_bytes)


class QwenThetaHardCodedTraining(TinyTrainingEngine):
    """Reads ``rope_theta`` from a Llama folder, and uses 10000 on Qwen2 and Qwen3 folders whatever they set."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _theta_10000_unless_llama(self, spec.model_path)


class QwenThetaHardCodedRollout(TinyRolloutEngine):
    """The rollout engine of the same fault."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _theta_10000_unless_llama(self, spec.model_path)


def _config_read_without(spec: EngineSpec, *keys: str) -> tuple[EngineSpec, tempfile.TemporaryDirectory[str]]:
    """``spec`` on a copy of its folder whose config.json leaves ``keys`` out (what an engine that never
    reads them sees; ``layer_types`` all full attention where given); the folder lives as long as the handle."""
    tmp = tempfile.TemporaryDirectory(prefix="verl-faulty-")
    for f in Path(spec.model_path).iterdir():
        if f.is_file() and f.name != "config.json":
            (Path(tmp.name) / f.name).symlink_to(f)
    config = json.loads((Path(spec.model_path) / "config.json").read_text())
    for key in keys:
        config.pop(key, None)
    if "layer_types" in config:
        config["layer_types"] = ["full_attention"] * len(config["layer_types"])
    (Path(tmp.name) / "config.json").write_text(json.dumps(config))
    return replace(spec, model_path=tmp.name), tmp


class _ConfigKeysIgnored:
    """An engine built on its folder with :attr:`ignored` left out of config.json (see :func:`_config_read_without`)."""

    ignored: tuple[str, ...] = ()

    def __init__(self, spec: EngineSpec) -> None:
        plain, self._folder = _config_read_without(spec, *self.ignored)
        super().__init__(plain)  # type: ignore[call-arg]


class SiluHardCodedTraining(_ConfigKeysIgnored, TinyTrainingEngine):
    """Never reads ``hidden_act``: its MLP runs SiLU whatever the config names (no refusal)."""

    ignored = ("hidden_act",)


class SiluHardCodedRollout(_ConfigKeysIgnored, TinyRolloutEngine):
    """The rollout engine of the same fault."""

    ignored = ("hidden_act",)


class SlidingWindowIgnoredTraining(_ConfigKeysIgnored, TinyTrainingEngine):
    """Never reads the sliding-window keys: full attention on a folder that declares a window (no refusal)."""

    ignored = ("use_sliding_window", "sliding_window")


class SlidingWindowIgnoredRollout(_ConfigKeysIgnored, TinyRolloutEngine):
    """The rollout engine of the same fault."""

    ignored = ("use_sliding_window", "sliding_window")


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


class _KeptSetSampler(TokenSampler):
    """A sampler whose top-k / nucleus set a fault chooses (:meth:`_kept`); greedy and untruncated steps as usual."""

    def _kept(self, logits: Tensor, logp: Tensor) -> Tensor:
        raise NotImplementedError

    def step(self, logits: Tensor, t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        p = self.params
        if p.greedy or self.uniforms is None or not p.truncates:
            return super().step(logits, t, alive)
        logp = tempered_log_probs(logits, p.temperature)
        u = self.uniforms[:, t] if isinstance(t, int) else self.uniforms.index_select(1, t).squeeze(1)
        tok = inverse_cdf(self._kept(logits, logp), u)
        tok = torch.where(alive, tok, self.pad)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        stopped = alive & (tok.unsqueeze(-1) == self.stops).any(-1)
        return tok, torch.where(alive, lp, 0.0), stopped


class _TopPFirstSampler(_KeptSetSampler):
    def _kept(self, logits: Tensor, logp: Tensor) -> Tensor:
        keep = kept_probs(logits.float(), self.params.top_k, self.params.top_p) > 0  # the untempered logits' set
        return torch.where(keep, logp.exp(), 0.0)


class TopPBeforeTemperature(_SamplerRollout):
    """Picks the top-k / nucleus set from the untempered logits, then samples it at the temperature."""

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return _TopPFirstSampler(params, self.tokenizer.pad_token_id, stops, uniforms)


class _TopTokenDroppedSampler(_KeptSetSampler):
    def _kept(self, logits: Tensor, logp: Tensor) -> Tensor:
        rest = logp.scatter(-1, torch.argmax(logits, -1, keepdim=True), -math.inf)
        return kept_probs(rest, self.params.top_k, self.params.top_p)


class TopTokenDropped(_SamplerRollout):
    """Leaves the most likely token out of the top-k / nucleus set (top_k=1 samples the runner-up)."""

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return _TopTokenDroppedSampler(params, self.tokenizer.pad_token_id, stops, uniforms)


class _HighestIdFirstSampler(_KeptSetSampler):
    def _kept(self, logits: Tensor, logp: Tensor) -> Tensor:
        # the engine kit's rule over the reversed vocabulary: equal logits rank the highest id first
        p = self.params
        return kept_probs(logp.flip(-1), p.top_k, p.top_p, ranking=logits.flip(-1)).flip(-1)


class TinyInBfloat16(TinyRolloutEngine):
    """Not a fault: the tiny rollout with bfloat16 declared (the tiny backend does not), its model in the spec's dtype."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, dtype="float32"))  # the tiny backend refuses an undeclared dtype
        self._spec = spec
        self.model = Model.from_folder(spec.model_path, DTYPES[spec.dtype])

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The tiny rollout's capabilities, with bfloat16 declared."""
        return replace(ROLLOUT_CAPABILITIES, dtypes=frozenset({"float32", "bfloat16"}))


class TiesToTheHighestId(TinyInBfloat16, _SamplerRollout):
    """Not a fault: in bfloat16, top-k and the nucleus break a tie at the top to the highest id (greedy: the lowest)."""

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return _HighestIdFirstSampler(params, self.tokenizer.pad_token_id, stops, uniforms)


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

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """The tiny engine's step at the scheduler's learning rate, then the scheduler's step."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.sqrt(sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=norm, lr=lr, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepMetrics(grad_norm=norm, lr=lr, skipped=False)


class MomentsResetOnLoad(TinyTrainingEngine):
    """load_checkpoint restores everything but AdamW's second moments (zeros)."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, then zero every exp_avg_sq."""
        super().load_checkpoint(path)
        for state in self.optimizer.state.values():
            state["exp_avg_sq"].zero_()


class GradientsKeptOnLoad(TinyTrainingEngine):
    """load_checkpoint keeps the gradients of a forward_backward before it (they add to the next update)."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, then put back the gradients the parameters held before."""
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        super().load_checkpoint(path)
        for n, p in self.model.named_parameters():
            p.grad = grads[n]


class StepCountNotCheckpointed(TinyTrainingEngine):
    """load_checkpoint restores AdamW's moments but not its per-parameter step count (bias correction restarts)."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, then reset AdamW's step count."""
        super().load_checkpoint(path)
        for state in self.optimizer.state.values():
            state["step"] = torch.zeros_like(state["step"])


# ---------------------------------------------------------------------------------------- the optimizer
def _optimizer_step(engine: TinyTrainingEngine, *, clip: bool = True, decay: bool = True, betas: bool = True,
                    schedule: bool = True, norm_after_clip: bool = False, skip: bool = True,
                    count_skipped: bool = False) -> StepMetrics:
    """The tiny engine's optimizer step (the base class counts applied steps) with the settings a fault leaves out."""
    grads = [p.grad for p in engine.model.parameters() if p.grad is not None]

    def norm_of() -> float:
        return float(torch.sqrt(sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))))

    norm = norm_of()
    o = engine.spec.optim
    lr = o.lr_at(engine.step) if schedule else o.lr
    if engine._nothing_to_learn:  # as the tiny engine: a mini-batch with no loss token changes nothing
        engine.optimizer.zero_grad(set_to_none=True)
        return StepMetrics(grad_norm=0.0, lr=lr, skipped=False)
    if skip and not math.isfinite(norm):
        engine.optimizer.zero_grad(set_to_none=True)
        if count_skipped:
            engine._step += 1
        return StepMetrics(grad_norm=norm, lr=lr, skipped=True)
    if clip and o.grad_clip > 0 and norm > o.grad_clip:
        for g in grads:
            g.mul_(o.grad_clip / (norm + 1e-6))
    reported = norm_of() if norm_after_clip else norm
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = o.weight_decay if decay else 0.0
        group["betas"] = o.betas if betas else (0.9, 0.999)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    return StepMetrics(grad_norm=reported, lr=lr, skipped=False)


class WeightDecayIgnored(TinyTrainingEngine):
    """Steps AdamW without the spec's weight decay."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A step with weight_decay 0."""
        return _optimizer_step(self, decay=False)


class DefaultBetas(TinyTrainingEngine):
    """Steps AdamW with torch's default betas (0.9, 0.999) whatever the spec says."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A step with the default betas."""
        return _optimizer_step(self, betas=False)


class ClipIgnored(TinyTrainingEngine):
    """Never clips the gradients."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A step without clipping."""
        return _optimizer_step(self, clip=False)


class NormAfterClipping(TinyTrainingEngine):
    """Reports the grad norm after clipping instead of before."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A step reporting the clipped norm."""
        return _optimizer_step(self, norm_after_clip=True)


class ConstantLearningRate(TinyTrainingEngine):
    """Steps at ``spec.optim.lr`` always (no warmup, no decay)."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A step at the peak learning rate."""
        return _optimizer_step(self, schedule=False)


class CoupledWeightDecay(TinyTrainingEngine):
    """Adam with L2 regularisation (weight decay added to the gradient) instead of AdamW's decoupled decay."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        o = spec.optim
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=o.lr, betas=o.betas,  # type: ignore[assignment]
                                          eps=o.eps, weight_decay=o.weight_decay)


class NonFiniteStepApplied(TinyTrainingEngine):
    """Steps even when the grad norm is not finite (the weights become NaN)."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A step that never skips."""
        return _optimizer_step(self, skip=False)


class SkippedStepCounted(TinyTrainingEngine):
    """Skips a non-finite update but advances its step counter (the schedule moves on)."""

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """A skip that counts as a step."""
        return _optimizer_step(self, count_skipped=True)


# ---------------------------------------------------------------------------------------- more training faults
class BudgetIgnored(TinyTrainingEngine):
    """forward_backward ignores the call's ``max_tokens`` (the spec's micro-batching applies)."""

    def forward_backward(self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *,
                         max_tokens: int | None = None) -> Metrics:
        """The call without its budget."""
        return super().forward_backward(mini_batch, loss_fn, stats, max_tokens=None)


class ExportDtypeIgnored(TinyTrainingEngine):
    """export_weights sends the parameters' own dtype whatever dtype the receiver asks for."""

    def export_weights(self, *, dtype: torch.dtype | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        """The stream in float32."""
        return super().export_weights(dtype=None, bucket_bytes=bucket_bytes)


class VersionCountsSkippedSteps(TinyTrainingEngine):
    """The weight stream's version counts optimizer_step calls, skipped ones included."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.calls = 0

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """Count the call, then step (or skip)."""
        self.calls += 1
        return super()._optimizer_step(where=where)

    def export_weights(self, *, dtype: torch.dtype | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        """The stream, versioned by the count of calls (the manifest is built when called)."""
        applied, self._step = self._step, self.calls
        try:
            return super().export_weights(dtype=dtype, bucket_bytes=bucket_bytes)
        finally:
            self._step = applied


class UndeclaredSettingsIgnored(TinyTrainingEngine):
    """Builds in float32 without gradient checkpointing whatever dtype and checkpointing the spec asks for."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, dtype="float32", gradient_checkpointing=False))
        self._asked = spec

    @property
    def spec(self) -> EngineSpec:
        """The spec it was asked to build."""
        return self._asked


class LengthLimitsIgnored(TinyTrainingEngine):
    """Accepts prompts and responses longer than the spec's max_prompt_len and max_response_len."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, max_prompt_len=1 << 20, max_response_len=1 << 20))
        self._asked = spec

    @property
    def spec(self) -> EngineSpec:
        """The spec it was asked to build."""
        return self._asked


# ---------------------------------------------------------------------------------------- more rollout faults
class GreedyLogProbsAtTemperatureOne(TinyRolloutEngine):
    """Greedy decoding reports log-probs of softmax(logits), not softmax(logits / T)."""

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        return super()._sample(rows, replace(params, temperature=1.0) if params.greedy else params, seeds)


class SeededByBatchPosition(TinyInBfloat16):
    """Row r draws from the first row's stream plus r (its position in the batch), not from its own
    (seed, group id, sample index): a prompt sampled alone draws what another batch's first row draws."""

    def _sample_seeds(self, rows: TensorBatch, params: SamplingParams) -> list[int]:
        seeds = super()._sample_seeds(rows, params)
        return [seeds[0] + r for r in range(len(seeds))]


class UnseededIsSeedZero(TinyRolloutEngine):
    """seed=None samples under seed 0 (every unseeded call gives the same samples)."""

    def _sample_seeds(self, rows: TensorBatch, params: SamplingParams) -> list[int]:
        return super()._sample_seeds(rows, replace(params, seed=0) if params.seed is None else params)


class SameStreamForEverySample(TinyRolloutEngine):
    """The n samples of a prompt share the first one's random stream (identical samples)."""

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        first: dict[int, int] = {}
        groups = rows["group_ids"].tolist()
        for g, seed in zip(groups, seeds, strict=True):
            first.setdefault(g, seed)
        return super()._sample(rows, params, [first[g] for g in groups])



class MetaNotStamped(TinyRolloutEngine):
    """A generate written without the facade that keeps the prompts' meta instead of ``expand_prompts``'s
    (temperature 1, weight version 0): its log-probs are right, the batch says the wrong temperature."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        return super().generate(prompts, params).update(meta=prompts.meta)

# ---------------------------------------------------------------------------------------- weight updates during generate
class WeightsWrittenDuringGenerate(TinyRolloutEngine):
    """Copies each chunk of a sync into the live parameters as it arrives, outside the facade's turn
    (no ``_writing_weights``): a generate call in flight samples from a mix of two versions."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply chunk by chunk into the model, then take the version."""
        params = dict(self.model.named_parameters())
        expected = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in params.items()}

        def apply(chunk: list[tuple[str, Tensor]]) -> None:
            with torch.no_grad():
                for name, tensor in chunk:
                    params[name].copy_(tensor)

        self._commit_weights(apply_weight_stream(stream, expected, apply).version)


class VersionTakenAtManifest(TinyRolloutEngine):
    """Takes a sync's version as soon as its manifest arrives; the previous weights serve until the
    commit, so a generate call in between reports the new version with the old weights."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Stage the stream (announcing its version first), then copy it in under the facade's turn."""

        def announced() -> Iterator[WeightMessage]:
            for msg in stream:
                if isinstance(msg, WeightManifest):
                    self._version = msg.version
                yield msg

        params = dict(self.model.named_parameters())
        expected = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in params.items()}
        staged: dict[str, Tensor] = {}
        manifest = apply_weight_stream(announced(), expected, staged.update)
        with self._writing_weights(), torch.no_grad():
            for name, tensor in staged.items():
                params[name].copy_(tensor)
            self._commit_weights(manifest.version)


# ---------------------------------------------------------------------------------------- a sync to a sleeping engine
class SleepingRollout(TinyRolloutEngine):
    """The tiny rollout with a sleep that frees its weights (``_asleep`` set, ``generate`` refuses):
    correct, as the facade refuses a weight write while asleep."""

    def sleep(self) -> None:
        """Mark the engine asleep (as one that frees its weights does)."""
        self._asleep = True

    def wake(self) -> None:
        """Serve again."""
        self._asleep = False


class SleepingButTakingWeights(SleepingRollout):
    """Forwards a sync to its weights whether asleep or not (an out-of-process client that sends the
    stream to its worker without asking the facade): the sync lands in an engine that holds nothing."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Stage, copy and commit, without the facade's write turn (and so without its asleep check)."""
        params = dict(self.model.named_parameters())
        expected = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in params.items()}
        staged: dict[str, Tensor] = {}
        manifest = apply_weight_stream(stream, expected, staged.update)
        with torch.no_grad():
            for name, tensor in staged.items():
                params[name].copy_(tensor)
        self._commit_weights(manifest.version)


# ---------------------------------------------------------------------------------------- greedy against another backend
class _RunnerUpAtThirdToken(TokenSampler):
    def step(self, logits: Tensor, t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.params.greedy and t == 2:  # the third token: the second most likely instead of the most likely
            logits = logits.scatter(-1, torch.argmax(logits, -1, keepdim=True), -math.inf)
        return super().step(logits, t, alive)


class RunnerUpAtThirdToken(_SamplerRollout):
    """Greedy decoding that takes the runner-up at the third token (a decided one, no near-tie)."""

    def _sampler(self, params: SamplingParams, stops: Tensor, uniforms: Tensor | None) -> TokenSampler:
        return _RunnerUpAtThirdToken(params, self.tokenizer.pad_token_id, stops, uniforms)


# ---------------------------------------------------------------------------------------- lifetime
_WORKER = "import time; time.sleep(600)  # a dropped engine's worker"


class WorkerEndedByCloseOnly(TinyRolloutEngine):
    """Starts a worker process at build (an inference server's stand-in) that close() ends (a kill and a wait), and
    registers no weakref.finalize: an engine dropped without close() leaves it running."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.worker = subprocess.Popen([sys.executable, "-c", _WORKER])

    def close(self) -> None:
        """Kill the worker and wait for it (twice is harmless)."""
        _end(self.worker)
        super().close()


class WorkerEndedByClose(WorkerEndedByCloseOnly):
    """:class:`WorkerEndedByCloseOnly` with the finalizer docs/backend-rollout-engine.md asks for: a dropped engine
    ends its worker too (the callback holds the worker, not the engine)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        weakref.finalize(self, _end, self.worker)


def _end(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.kill()
        worker.wait(10)
