"""The faulty engines: each overrides one hook of the example backend's engines (or of the hf
backend's, where the fault needs what only hf has: a reward role, GPT-2 folders)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from collections.abc import Collection, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from verl_example_backend.model import DecoderConfig, DecoderLM, RMSNorm, load_model
from verl_example_backend.plugin import CRITIC_CAPABILITIES
from verl_example_backend.rollout import ExampleRolloutEngine, _truncate, sample_seed
from verl_example_backend.training import ExampleTrainingEngine, token_outputs

from verl_broken_backends.capabilities import (
    BFLOAT16_ROLLOUT,
    BFLOAT16_TRAINING,
    CHECKPOINTING_TRAINING,
    OFFLOAD_TRAINING,
    TENSOR_PARALLEL_ROLLOUT,
    VALUES_TRAINING,
)
from verl_core import (
    ConfigError,
    EngineSpec,
    FunctionReward,
    ModelOutput,
    OptimConfig,
    ParallelSizes,
    RewardCapabilities,
    RolloutCapabilities,
    SamplingParams,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    Tokenizer,
    TrainingCapabilities,
    WeightChunk,
    WeightMessage,
    apply_weight_stream,
)
from verl_core.enginekit.sampling import TokenSampler, eager_decode
from verl_core.trainer.inputs.tiny_model import load_tokenizer
from verl_hf.capabilities import ROLLOUT_CAPABILITIES as HF_ROLLOUT_CAPABILITIES
from verl_hf.modeling import cache_keyword, sequence_inputs
from verl_hf.reward import HFRewardEngine
from verl_hf.rollout import HFRolloutEngine
from verl_hf.rollout_request import concat_responses
from verl_hf.training import HFTrainingEngine

__all__ = [
    "OnlyRankZeroLoads",
    "CriticGradsNotReduced",
    "OtherLayoutDropsOptimizer",
    "Bfloat16NormRollout",
    "Bfloat16NormTraining",
    "Bfloat16Refused",
    "CheckpointWithoutOptimizerState",
    "CheckpointingDoublesGradients",
    "CriticCheckpointWithoutHead",
    "CriticCheckpointWithoutOptimizerState",
    "CriticGradClipIgnored",
    "CriticHeadBiasNotLoaded",
    "CriticNonFiniteUpdateApplied",
    "CriticOffloadLosesTensor",
    "CriticTokenBudgetIgnored",
    "CriticValuesTempered",
    "ArangePositions",
    "BatchCenteredScores",
    "BosAddingRewardTokenizer",
    "EosOutOfMask",
    "FolderEosListStops",
    "GenerationConfigDefaults",
    "IgnoredWeightSync",
    "LastChunkDropped",
    "LastColumnScores",
    "LeftPaddedResponses",
    "LongRopeStalePrefixCache",
    "LossScaledFromStep3",
    "MicroBatchAveragedLoss",
    "OffloadLosesTensor",
    "LengthSortedScores",
    "NaNScoresZeroed",
    "ScoreOneTokenEarly",
    "NoisyScores",
    "OptimizerStateDropped",
    "RankSeededRollout",
    "ReferenceNormWeightsReset",
    "ReferenceQKNormWeightsReset",
    "ResponseMaskIgnored",
    "RolloutNormWeightsIgnored",
    "RolloutQKNormsSkipped",
    "RolloutQKVBiasesIgnored",
    "ShiftedLogProbs",
    "SpecialIdsUncheckedRollout",
    "SpecialIdsUncheckedTraining",
    "TemperatureIgnored",
    "TokenizerIdsUncheckedRollout",
    "TokenizerIdsUncheckedTraining",
    "TopKIgnored",
    "TrainingQKVBiasesIgnored",
    "TruncatedAtLimit",
    "UnseededSampling",
    "WakeReloadsFolder",
    "PaddingIdxDropped",
    "DropUnmarked",
    "DropRotaryFrequencies",
    "LastTokenScores",
    "LlamaOnlyRolloutNormWeightsIgnored",
    "RotaryOnlyArangePositions",
    "SpecialTokensInText",
    "TokenScoresAtLastColumn",
    "TokenScoresOnly",
    "UnknownDeviceDeclared",
    "FinalNormNotSynced",
    "ExportsMasters",
    "FrozenPositionTable",
    "PositionTableUnchecked",
    "DtypeIgnored",
    "ParallelIgnored",
    "QKNormsDropped",
    "QKVBiasesDropped",
    "RandomHeadAccepted",
    "ConstantScheduleDecays",
    "CosineClimbsPastTotal",
    "EntropyAtTemperatureOne",
    "NormsAndBiasesNotDecayed",
    "PerMicroBatchGradClip",
    "ScheduleIgnoredReported",
    "TruncatedRolloutLogProbs",
    "WarmupFromZero",
]


class ShiftedLogProbs(ExampleTrainingEngine):
    """Reads token t's log-prob from the logits at t's own position instead of the one before."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs of a batch whose logits are sliced one position late."""
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        p, r = batch.prompt_len, batch.response_len
        hidden = self.model.hidden(ids, mask)[:, p : p + r]
        logp = torch.log_softmax(self.model.logits(hidden).float() / batch.meta.temperature, -1)
        rmask = batch["response_mask"]
        out = {"log_probs": logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1).masked_fill(~rmask, 0.0)}
        if "entropy" in outputs:
            out["entropy"] = (-(logp.exp() * logp).sum(-1)).masked_fill(~rmask, 0.0)
        return {k: v for k, v in out.items() if k in outputs}


class ZeroRowsReshape(ExampleTrainingEngine):
    """forward folds the hidden states back with ``reshape(batch, seq, -1)``: a batch of 0 rows raises a bare
    RuntimeError (torch cannot infer the -1 of a tensor of 0 elements) instead of returning ``[0, width]`` outputs."""

    def forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The fold of a flat ``[batch * seq, hidden]`` tensor, then the example's forward."""
        rows, seq = batch.batch_size, batch.prompt_len + batch.response_len
        torch.zeros(rows * seq, self.model.cfg.hidden_size).reshape(rows, seq, -1)
        return super().forward(batch, outputs)


class TemperatureIgnored(ExampleTrainingEngine):
    """Computes log-probs at temperature 1 whatever the batch's temperature."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs at T = 1."""
        return token_outputs(self.model, batch.with_meta(temperature=1.0), outputs)


class PaddingIdxDropped(ExampleTrainingEngine):
    """An embedding without padding_idx: the pad row gets gradients where the pad id is a real token."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.model.model.embed_tokens.padding_idx = None


class ResponseMaskIgnored(ExampleTrainingEngine):
    """Leaves log-probs and entropy of padding positions in the output."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs as if every response position were real."""
        full = batch.update(response_mask=torch.ones_like(batch["response_mask"]))
        return token_outputs(self.model, full, outputs)


class MicroBatchAveragedLoss(ExampleTrainingEngine):
    """Divides each micro-batch's loss by the number of micro-batches (framework averaging not undone)."""

    def loss_scale(self, num_micro_batches: int) -> float:
        """1 / number of micro-batches."""
        return 1.0 / num_micro_batches


class OptimizerStateDropped(ExampleTrainingEngine):
    """Forgets AdamW's moments before every step (each step acts like the first one)."""

    def optimizer_step(self) -> StepMetrics:
        """Drop the optimizer state, then step."""
        self.optimizer.state.clear()
        return super().optimizer_step()


class LeftPaddedResponses(ExampleRolloutEngine):
    """Returns responses padded on the left instead of the right."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate, then move each response's padding to its left."""
        out = super().generate(prompts, params)
        mask = out["response_mask"]
        width = mask.shape[1]
        shift = width - mask.sum(1)
        idx = (torch.arange(width).unsqueeze(0) - shift.unsqueeze(1)) % width
        fields = {name: out[name].gather(1, idx) for name in ("response_ids", "response_mask", "rollout_log_probs")}
        return TensorBatch._trusted({**dict(out.items()), **fields}, dict(out.extras), out.meta, out.batch_size)


class IgnoredWeightSync(ExampleRolloutEngine):
    """Checks the stream and bumps the version, but never copies the weights."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Consume the stream; apply nothing."""
        expected = {n: TensorInfo(tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}
        manifest = apply_weight_stream(stream, expected, lambda chunk: None)
        self._version = manifest.version


class UnseededSampling(ExampleRolloutEngine):
    """Draws from fresh random generators whatever the seed."""

    def generators(self, batch: TensorBatch, params: SamplingParams) -> list[torch.Generator]:
        """Unseeded generators."""
        gens = []
        for _ in range(batch.batch_size):
            g = torch.Generator()
            g.seed()
            gens.append(g)
        return gens


class CheckpointWithoutOptimizerState(ExampleTrainingEngine):
    """save_checkpoint writes the weights, step and RNG but not AdamW's moments."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save with the optimizer's per-parameter state left out."""
        moments = dict(self.optimizer.state)
        self.optimizer.state.clear()
        try:
            super().save_checkpoint(path)
        finally:
            self.optimizer.state.update(moments)


class OffloadLosesTensor(ExampleTrainingEngine):
    """Declares offload; offload() keeps AdamW's state in a host copy, onload() zeroes one parameter's second moments."""

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities with offload=True."""
        return OFFLOAD_TRAINING

    def offload(self) -> None:
        """Move the optimizer state into a host copy."""
        self._host = {p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
                      for p, st in self.optimizer.state.items()}
        self.optimizer.state.clear()

    def onload(self) -> None:
        """Put the state back, with the first parameter's exp_avg_sq lost (zeros)."""
        for i, (p, st) in enumerate(self._host.items()):
            if i == 0:
                st["exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
            self.optimizer.state[p] = st
        self._host = {}


class ActorDeclaresValues(ExampleTrainingEngine):
    """Every role declares values (as an earlier example did), though only a critic on a value-head folder serves them."""

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's actor capabilities with values=True, for every role."""
        return VALUES_TRAINING


class LossScaledFromStep3(ExampleTrainingEngine):
    """From the third optimizer step on, the loss (and with it every gradient) is scaled by 1.01."""

    def loss_scale(self, num_micro_batches: int) -> float:
        """1.01 once two optimizer steps ran."""
        return 1.01 if self.step >= 2 else 1.0


class Bfloat16Refused(ExampleTrainingEngine):
    """Declares bfloat16 but refuses to build in it."""

    def __init__(self, spec: EngineSpec) -> None:
        if spec.dtype == "bfloat16":
            raise ConfigError("bfloat16 is not implemented")
        super().__init__(spec)

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities with dtypes float32 and bfloat16."""
        return BFLOAT16_TRAINING


class _RMSNormInDtype(RMSNorm):
    """RMSNorm computed in the activations' dtype: in bfloat16 the variance and its reciprocal
    square root are rounded to bfloat16 (no float32 island)."""

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dim without upcasting."""
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _norms_in_dtype(model: DecoderLM) -> None:
    """Make every RMSNorm of ``model`` compute in the activations' dtype (the one fault: the rotary
    frequencies, which ``load_model`` casts to the model's dtype with the rest, are float32 again)."""
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = _RMSNormInDtype
    cfg = model.cfg
    model.inv_freq = (1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
                      ).float()


class Bfloat16NormTraining(ExampleTrainingEngine):
    """Declares bfloat16; its RMSNorms compute in bfloat16, without transformers' float32 upcast."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _norms_in_dtype(self.model)

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities for the role, with dtypes float32 and bfloat16."""
        return replace(super().capabilities, dtypes=BFLOAT16_TRAINING.dtypes)


class Bfloat16NormRollout(ExampleRolloutEngine):
    """Declares bfloat16; its RMSNorms compute in bfloat16, without transformers' float32 upcast."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _norms_in_dtype(self.model)

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The example's capabilities with dtypes float32 and bfloat16."""
        return BFLOAT16_ROLLOUT


class CheckpointingDoublesGradients(ExampleTrainingEngine):
    """Declares gradient checkpointing; with it on, gradients are accumulated twice (a recompute that also backpropagates)."""

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities with gradient_checkpointing=True."""
        return CHECKPOINTING_TRAINING

    def loss_scale(self, num_micro_batches: int) -> float:
        """2 with gradient checkpointing on."""
        return 2.0 if self.spec.gradient_checkpointing else 1.0


class WakeReloadsFolder(ExampleRolloutEngine):
    """wake() reloads the model folder's weights, losing those synced since the engine was built."""

    def wake(self) -> None:
        """Reload from the folder."""
        self.model = load_model(self.spec.model_path, self.spec.torch_dtype).eval()


class DropUnmarked(ExampleRolloutEngine):
    """sleep_until_sync() drops the weights (zeros them) but keeps serving, where it must refuse until the next sync."""

    def sleep_until_sync(self) -> None:
        """Zero every parameter."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()


class DropRotaryFrequencies(ExampleRolloutEngine):
    """sleep_until_sync() drops every tensor of the model, its rotary frequencies too, which no weight stream carries."""

    def sleep_until_sync(self) -> None:
        """Zero every parameter and buffer, and refuse generate until the next sync."""
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                t.zero_()
        self._stale = True


class TopKIgnored(ExampleRolloutEngine):
    """Samples from the whole distribution whatever top_k says."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate with top_k turned off."""
        return super().generate(prompts, replace(params, top_k=0))


class RankSeededRollout(ExampleRolloutEngine):
    """Declares tensor parallel rollout; runs the whole model on each rank but mixes the rank into the sample seeds."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, parallel=ParallelSizes()))
        self._spec = spec
        self._rank = int(os.environ.get("RANK", "0"))

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The example's capabilities with tensor_parallel=True."""
        return TENSOR_PARALLEL_ROLLOUT

    def generators(self, batch: TensorBatch, params: SamplingParams) -> list[torch.Generator]:
        """Per-sample generators seeded from (seed + rank, group id, sample index)."""
        if params.seed is None:
            return super().generators(batch, params)
        seed = params.seed + self._rank
        return [torch.Generator().manual_seed(sample_seed(seed, int(g), int(i)))
                for g, i in zip(batch["group_ids"].tolist(), batch["sample_index"].tolist(), strict=True)]
class EosOutOfMask(ExampleRolloutEngine):
    """Drops the terminating EOS from the response (mask False, pad id), as if EOS were not generated."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate, then unmask every EOS."""
        out = super().generate(prompts, params)
        eos = (out["response_ids"] == self.tokenizer.eos_token_id) & out["response_mask"]
        fields = {
            "response_mask": out["response_mask"] & ~eos,
            "response_ids": out["response_ids"].masked_fill(eos, self.tokenizer.pad_token_id),
            "rollout_log_probs": out["rollout_log_probs"].masked_fill(eos, 0.0),
        }
        return out.update(fields)


def _folder_json(path: str | os.PathLike[str], file: str) -> dict[str, Any]:
    """The folder's ``file`` as a dict (absent: empty)."""
    target = Path(path) / file
    return dict(json.loads(target.read_text())) if target.exists() else {}


class FolderEosListStops(ExampleRolloutEngine):
    """Stops on every EOS id ``config.json`` lists (``eos_token_id: [1, 31]``), not only on the tokenizer's."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate with config.json's EOS list added to the stop ids."""
        eos = _folder_json(self.spec.model_path, "config.json").get("eos_token_id")
        listed = eos if isinstance(eos, list) else [] if eos is None else [eos]
        stops = tuple(sorted({*params.stop_token_ids, *(int(i) for i in listed)}))
        return super().generate(prompts, replace(params, stop_token_ids=stops))


class GenerationConfigDefaults(ExampleRolloutEngine):
    """Samples at ``generation_config.json``'s temperature and top_k where the folder sets them, not at
    the request's (greedy decoding untouched)."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate with the folder's sampling defaults over the request's."""
        gen = _folder_json(self.spec.model_path, "generation_config.json")
        if params.greedy:
            return super().generate(prompts, params)
        return super().generate(prompts, replace(params, temperature=float(gen.get("temperature", params.temperature)),
                                                 top_k=int(gen.get("top_k", params.top_k))))


class TruncatedAtLimit(ExampleRolloutEngine):
    """Sets ``truncated`` for a max_new_tokens-long response unless it ends with one of
    ``params.stop_token_ids``: an EOS as the last allowed token counts as cut."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Generate, then flag full-length responses that do not end with a stop token (EOS forgotten)."""
        out = super().generate(prompts, params)
        full = out["response_mask"].sum(1) == params.max_new_tokens
        last = out["response_ids"][:, -1]
        stopped = torch.isin(last, torch.tensor(params.stop_token_ids, dtype=last.dtype))
        return out.update(truncated=full & ~stopped)


class LastChunkDropped(ExampleRolloutEngine):
    """Copies each chunk when the next one arrives (overlapping receive and copy); at the commit only a
    lone chunk is flushed, so the last chunk of a stream of several is never applied."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply all chunks but the last of a multi-chunk stream."""
        params = dict(self.model.named_parameters())
        held: list[list[tuple[str, Tensor]]] = []
        applied = 0
        self._stale = True

        def copy(chunk: list[tuple[str, Tensor]]) -> None:
            with torch.no_grad():
                for name, t in chunk:
                    if name in params:
                        params[name].copy_(t)

        def receive(chunk: list[tuple[str, Tensor]]) -> None:
            nonlocal applied
            if held:
                copy(held.pop())
                applied += 1
            held.append(chunk)

        optional = frozenset({"lm_head.weight"}) if self.model.cfg.tied else frozenset()
        manifest = apply_weight_stream(stream, self.expected_weights(), receive, optional=optional)
        if held and applied == 0:
            copy(held.pop())
        self._version = manifest.version
        self._stale = False


@contextlib.contextmanager
def _special_ids_unchecked() -> Iterator[None]:
    """The example backend's config reader without its special-token-id check, while the engine is built."""
    import verl_example_backend.model as model

    original = model.check_special_token_ids
    model.check_special_token_ids = lambda *args, **kwargs: None
    try:
        yield
    finally:
        model.check_special_token_ids = original


class SpecialIdsUncheckedTraining(ExampleTrainingEngine):
    """Builds on a folder whose pad, EOS or BOS id lies outside the vocabulary: nn.Embedding's
    padding_idx assertion escapes as a bare AssertionError, other ids build."""

    def __init__(self, spec: EngineSpec) -> None:
        with _special_ids_unchecked():
            super().__init__(spec)


class SpecialIdsUncheckedRollout(ExampleRolloutEngine):
    """The rollout engine of :class:`SpecialIdsUncheckedTraining`'s fault."""

    def __init__(self, spec: EngineSpec) -> None:
        with _special_ids_unchecked():
            super().__init__(spec)


@contextlib.contextmanager
def _config_json_ids_only() -> Iterator[None]:
    """The example backend's config reader checking ``config.json``'s special ids only, while the engine
    is built: the tokenizer's and ``generation_config.json``'s ids are never compared with the vocabulary."""
    import verl_example_backend.model as model

    from verl_core.enginekit import model_folder

    def config_json_only(folder: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
        model_folder._check_config_json(folder, config or {})  # the example's reader passes its config.json

    original = model.check_special_token_ids
    model.check_special_token_ids = config_json_only
    try:
        yield
    finally:
        model.check_special_token_ids = original


class TokenizerIdsUncheckedTraining(ExampleTrainingEngine):
    """Refuses config.json's out-of-vocabulary ids but builds on a folder whose tokenizer EOS (an added token
    past the embedding) or generation_config.json EOS lies outside the vocabulary."""

    def __init__(self, spec: EngineSpec) -> None:
        with _config_json_ids_only():
            super().__init__(spec)


class TokenizerIdsUncheckedRollout(ExampleRolloutEngine):
    """The rollout engine of :class:`TokenizerIdsUncheckedTraining`'s fault."""

    def __init__(self, spec: EngineSpec) -> None:
        with _config_json_ids_only():
            super().__init__(spec)


class _LinearBiasIgnored(torch.nn.Linear):
    """A linear layer that keeps (loads, syncs, exports) its bias but never adds it."""

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight.T``, the bias left out."""
        return torch.nn.functional.linear(x, self.weight)


class _RMSNormWeightIgnored(RMSNorm):
    """An RMSNorm that keeps (loads, syncs) its weight but computes as if every entry were one."""

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dim in float32, unscaled."""
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _RMSNormSkipped(RMSNorm):
    """An RMSNorm that keeps (loads, syncs) its weight but passes its input through."""

    def forward(self, x: Tensor) -> Tensor:
        """The input, unchanged."""
        return x


def _qkv_biases_ignored(model: DecoderLM) -> None:
    """Make the q, k and v projections of ``model`` leave their biases out."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj") and type(module) is torch.nn.Linear:
            module.__class__ = _LinearBiasIgnored


class RolloutQKVBiasesIgnored(ExampleRolloutEngine):
    """Loads and syncs the q, k and v biases but leaves them out of the forward: right on Llama, wrong on Qwen2."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _qkv_biases_ignored(self.model)


class TrainingQKVBiasesIgnored(ExampleTrainingEngine):
    """Loads, trains (a zero gradient) and exports the q, k and v biases but leaves them out of the forward."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _qkv_biases_ignored(self.model)


def _norm_weights_reset(model: DecoderLM, names: Collection[str] = ()) -> None:
    """Set the weight of every RMSNorm of ``model`` to ones (only those whose attribute name is in ``names``,
    where given): the folder's values are loaded, then lost."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is RMSNorm and (not names or name.rsplit(".", 1)[-1] in names):
                module.weight.fill_(1.0)


class ReferenceNormWeightsReset(ExampleTrainingEngine):
    """Loads the folder, then sets every RMSNorm weight (input_layernorm, post_attention_layernorm, the final
    norm, Qwen3's q/k norms) to ones: right on a folder whose norm weights are all one."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _norm_weights_reset(self.model)


class ReferenceQKNormWeightsReset(ExampleTrainingEngine):
    """Loads the folder, then sets Qwen3's q_norm and k_norm weights to ones: right on Llama and Qwen2 (which
    have none) and on a Qwen3 folder whose q/k norm weights are all one."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        _norm_weights_reset(self.model, ("q_norm", "k_norm"))


class RolloutNormWeightsIgnored(ExampleRolloutEngine):
    """Computes every RMSNorm as if its weight were ones (the weights loaded and synced, never read): right on
    a random folder, whose norm weights are all one."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        for module in self.model.modules():
            if type(module) is RMSNorm:
                module.__class__ = _RMSNormWeightIgnored


class LlamaOnlyRolloutNormWeightsIgnored(RolloutNormWeightsIgnored):
    """:class:`RolloutNormWeightsIgnored` in a rollout that runs Llama folders only (Qwen2 and Qwen3 refused with a
    ConfigError naming the model_type, as a backend may): a Qwen folder cannot show its norms."""

    def __init__(self, spec: EngineSpec) -> None:
        model_type = DecoderConfig.from_folder(spec.model_path).model_type
        if model_type != "llama":
            raise ConfigError(f"this rollout runs llama folders; {spec.model_path} has model_type {model_type!r}")
        super().__init__(spec)


class RolloutQKNormsSkipped(ExampleRolloutEngine):
    """Skips Qwen3's per-head RMSNorm of q and k (loaded and synced, never applied): right on Llama and Qwen2."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        for name, module in self.model.named_modules():
            if name.rsplit(".", 1)[-1] in ("q_norm", "k_norm") and type(module) is RMSNorm:
                module.__class__ = _RMSNormSkipped


class CriticCheckpointWithoutHead(ExampleTrainingEngine):
    """The critic's save_checkpoint writes the backbone without the value head (``score.*``), and its
    load_checkpoint loads what is there (non-strict): a loaded critic keeps the head of its folder."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save; for the critic, with ``score.*`` left out of the model's state."""
        if self.spec.role != "critic":
            super().save_checkpoint(path)
            return
        head = self.model.score
        del self.model.score  # state_dict() walks the modules: the backbone alone
        try:
            super().save_checkpoint(path)
        finally:
            self.model.score = head

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, tolerating tensors the checkpoint lacks."""
        strict = self.model.load_state_dict

        def lenient(state: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
            return strict(state, strict=False)

        self.model.load_state_dict = lenient  # type: ignore[method-assign,assignment]
        try:
            super().load_checkpoint(path)
        finally:
            del self.model.load_state_dict


class CriticCheckpointWithoutOptimizerState(CheckpointWithoutOptimizerState):
    """The critic's save_checkpoint leaves AdamW's moments out (the actor's keeps them)."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save; for the critic, without the optimizer's per-parameter state."""
        if self.spec.role == "critic":
            super().save_checkpoint(path)
        else:
            ExampleTrainingEngine.save_checkpoint(self, path)


class CriticOffloadLosesTensor(OffloadLosesTensor):
    """Both roles declare offload; the critic's onload() brings one parameter's second moments back as zeros
    (the actor's offload keeps everything)."""

    @property
    def capabilities(self) -> TrainingCapabilities:
        """The example's capabilities of the role with offload=True."""
        if self._caps.values:  # the critic's (read while the engine is built, before its spec is set)
            return replace(CRITIC_CAPABILITIES, offload=True)
        return OFFLOAD_TRAINING

    def offload(self) -> None:
        """The critic's faulty offload; nothing to move for the actor (CPU)."""
        if self.spec.role == "critic":
            super().offload()

    def onload(self) -> None:
        """The critic's faulty onload; nothing to move for the actor (CPU)."""
        if self.spec.role == "critic":
            super().onload()


class CriticValuesTempered(ExampleTrainingEngine):
    """The critic divides its values by the batch's temperature (``batch.meta.temperature``), as log-probs divide the logits."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Outputs, values over T."""
        out = super().compute(batch, outputs)
        if "values" in out:
            out["values"] = out["values"] / batch.meta.temperature
        return out


class CriticTokenBudgetIgnored(ExampleTrainingEngine):
    """The critic ignores the token budget (``max_tokens``, ``spec.micro_batch_tokens``): it splits by
    ``micro_batch_size`` alone, one micro-batch when that is unset (the actor applies it)."""

    def _split(self, batch: TensorBatch, max_tokens: int | None = None) -> tuple[list[TensorBatch], object]:
        if self.spec.role != "critic":
            return super()._split(batch, max_tokens)
        mbs = batch.micro_batches(size=self.spec.micro_batch_size or max(batch.batch_size, 1))
        return list(mbs), mbs


class CriticGradClipIgnored(ExampleTrainingEngine):
    """The critic never clips its gradients, whatever ``OptimConfig.grad_clip`` says (the actor clips)."""

    def optimizer_step(self) -> StepMetrics:
        """Step; for the critic, with grad_clip taken as 0."""
        if self.spec.role != "critic":
            return super().optimizer_step()
        spec = self._spec
        self._spec = replace(spec, optim=replace(spec.optim, grad_clip=0.0))
        try:
            return super().optimizer_step()
        finally:
            self._spec = spec


class CriticHeadBiasNotLoaded(ExampleTrainingEngine):
    """The critic never loads the folder's ``score.bias`` (it stays 0, as transformers initialises it)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if spec.role == "critic":
            with torch.no_grad():
                self.model.score.bias.zero_()


class CriticNonFiniteUpdateApplied(ExampleTrainingEngine):
    """The critic's optimizer_step never looks at the grad norm: a NaN loss's gradients are applied (its weights
    turn NaN, its step and version advance, ``skipped=False``); the actor skips the update."""

    def optimizer_step(self) -> StepMetrics:
        """Step; for the critic, AdamW on whatever gradients there are, finite or not."""
        if self.spec.role != "critic":
            return super().optimizer_step()
        self._pending = False
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.sqrt(sum((p.grad.double().pow(2).sum() for p in params),  # type: ignore[union-attr]
                                         torch.zeros((), dtype=torch.float64))))
        lr = self._spec.optim.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepMetrics(grad_norm=grad_norm, lr=lr, skipped=False)


class ArangePositions(HFTrainingEngine):
    """Feeds the model position ids ``arange(width)`` over the padded row (wrong under left padding)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        model = self.model
        forward = model.forward

        def arange_forward(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids")
            if kwargs.get("position_ids") is not None and ids is not None:
                kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            return forward(*args, **kwargs)

        model.forward = arange_forward


class ExportsMasters(HFTrainingEngine):
    """export_weights streams a bfloat16 engine's float32 masters instead of the bfloat16 weights the model runs."""

    def export_weights(self, *, dtype: torch.dtype | None = None,
                       bucket_bytes: int = 64 * 1024 * 1024) -> Iterator[WeightMessage]:
        master = self._optim.master if self._optim is not None else None
        if master is None:
            yield from super().export_weights(dtype=dtype, bucket_bytes=bucket_bytes)
            return
        trained = [p for p in self.model.parameters() if p.requires_grad]
        by_param = {id(p): m for p, m in zip(trained, master.masters, strict=True)}
        wide = {name: by_param[id(p)].detach() for name, p in self.model.named_parameters() if id(p) in by_param}
        for msg in super().export_weights(dtype=torch.float32, bucket_bytes=bucket_bytes):
            if isinstance(msg, WeightChunk):
                msg = WeightChunk(tuple((n, wide.get(n, t)) for n, t in msg.tensors))
            yield msg


class FrozenPositionTable(HFTrainingEngine):
    """On a GPT-2 folder the learned position table gets no gradient (it never trains)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        wpe = getattr(getattr(self.model, "transformer", None), "wpe", None)
        if wpe is not None:
            wpe.weight.requires_grad_(False)


class PositionTableUnchecked(HFTrainingEngine):
    """Builds on a learned-position folder whatever the spec's lengths (the position table is never compared)."""

    def __init__(self, spec: EngineSpec) -> None:
        import verl_hf.training as training

        original = training.load_model

        def unchecked(*args: Any, sequence_len: int | None = None, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        training.load_model = unchecked  # type: ignore[assignment]
        try:
            super().__init__(spec)
        finally:
            training.load_model = original


class FinalNormNotSynced(HFRolloutEngine):
    """On a GPT-2 folder a weight sync skips the final layer norm (``transformer.ln_f``): the old one keeps serving."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply the stream, then put ``transformer.ln_f``'s tensors back to what they were."""
        kept = {n: p.detach().clone() for n, p in self.model.named_parameters() if n.startswith("transformer.ln_f.")}
        super().update_weights(stream)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in kept:
                    p.copy_(kept[n])


class NaNScoresZeroed(HFRewardEngine):
    """Replaces NaN and inf scores by 0 (``nan_to_num``) instead of raising."""

    def _score(self, chunk: TensorBatch) -> Tensor:
        return torch.nan_to_num(super()._score(chunk), nan=0.0, posinf=0.0, neginf=0.0)


class LengthSortedScores(HFRewardEngine):
    """Scores the samples sorted by length (less padding) and returns the scores in that sorted order."""

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Sort, score, forget to unsort."""
        lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
        order = torch.argsort(lengths, stable=True)
        scored = super().score(batch.index(order))
        return batch.update(scores=scored["scores"])


class BatchCenteredScores(HFRewardEngine):
    """Subtracts the batch's mean score (normalising rewards inside the engine)."""

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Scores minus their batch mean."""
        s = super().score(batch)["scores"]
        return batch.update(scores=s - s.mean())


class LastColumnScores(HFRewardEngine):
    """Reads the score at the last column of prompt + response instead of the last real token."""

    def _score(self, chunk: TensorBatch) -> Tensor:
        ids, mask, pos = sequence_inputs(chunk)
        out = self._model.base_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False)
        scores: Tensor = self._head(out.last_hidden_state[:, -1])[:, 0].float()
        return scores


class ScoreOneTokenEarly(HFRewardEngine):
    """Reads the score one real token early (the token before the last of prompt + response)."""

    def _score(self, chunk: TensorBatch) -> Tensor:
        ids, mask, pos = sequence_inputs(chunk)
        out = self._model.base_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False)
        last = (mask.long() * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)
        early = torch.clamp(last - 1, min=0)
        hidden = out.last_hidden_state
        scores: Tensor = self._head(hidden[torch.arange(hidden.shape[0], device=hidden.device), early])[:, 0].float()
        return scores


class NoisyScores(HFRewardEngine):
    """Adds unseeded noise to every score (like dropout left on)."""

    def _score(self, chunk: TensorBatch) -> Tensor:
        s = super()._score(chunk)
        return s + 0.01 * torch.randn(s.shape, device=s.device)


class _BosFirst:
    """A tokenizer whose encode prepends BOS (transformers' add_special_tokens=True default)."""

    def __init__(self, inner: Tokenizer, bos: int) -> None:
        self._inner = inner
        self._bos = bos
        self.eos_token_id = inner.eos_token_id
        self.pad_token_id = inner.pad_token_id
        self.vocab_size = inner.vocab_size

    def encode(self, text: str) -> list[int]:
        return [self._bos, *self._inner.encode(text)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


class BosAddingRewardTokenizer(HFRewardEngine):
    """Exposes a ``tokenizer`` whose encode prepends BOS, which the reward model never saw."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer with BOS prepended on encode."""
        return _BosFirst(super().tokenizer, bos=2)


class RotaryOnlyArangePositions(ArangePositions):
    """Position ids ``arange`` over the padded row in a backend that refuses GPT-2 folders (rotary models only)."""

    def __init__(self, spec: EngineSpec) -> None:
        import json
        from pathlib import Path

        config = json.loads((Path(spec.model_path) / "config.json").read_text())
        if config.get("model_type") == "gpt2":
            raise ConfigError("this backend runs rotary models only; got a gpt2 folder")
        super().__init__(spec)


class LastTokenScores(HFRewardEngine):
    """The hf reward engine with ``token_scores`` too: each sample's score at its last real response
    token, 0 elsewhere (a correct token-scoring engine, which the faulty ones below change)."""

    @property
    def capabilities(self) -> RewardCapabilities:
        """Scores and token scores."""
        return replace(super().capabilities, token_scores=True)

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Scores, and the same scores placed at the last real response token."""
        out = super().score(batch)
        return out.update(token_scores=self.place(out["scores"], batch["response_mask"]))

    @staticmethod
    def place(scores: Tensor, mask: Tensor) -> Tensor:
        """``scores`` at the last True column of each row of ``mask`` (rows without one stay 0)."""
        if mask.shape[1] == 0:
            return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        last = (mask.long() * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)
        dense = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense[torch.arange(mask.shape[0], device=mask.device), last] = scores.float()
        return dense * mask


class TokenScoresAtLastColumn(LastTokenScores):
    """Places each token score at the last column of the response, padding or not."""

    @staticmethod
    def place(scores: Tensor, mask: Tensor) -> Tensor:
        """``scores`` at the last column."""
        dense = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense[:, -1] = scores.float()
        return dense


class TokenScoresOnly(LastTokenScores):
    """Declares scores (and token scores) but returns only ``token_scores``."""

    def score(self, batch: TensorBatch) -> TensorBatch:
        """The token scores without the sequence scores."""
        out = super().score(batch)
        return batch.update(token_scores=out["token_scores"])


class UnknownDeviceDeclared(HFRewardEngine):
    """Declares the devices ``cpu`` and ``gpu`` (no such torch device type)."""

    @property
    def capabilities(self) -> RewardCapabilities:
        """The hf reward capabilities with ``gpu`` for ``cuda``."""
        return replace(super().capabilities, devices=frozenset({"cpu", "gpu"}))


def _text_score(prompt: str, response: str, extras: Mapping[str, Any]) -> float:
    """A score of both texts (their lengths and characters)."""
    return len(response) / 4 + sum(map(ord, prompt + response)) % 7


class SpecialTokensInText(FunctionReward):
    """A reward function over decoded text whose decoding keeps special tokens (``<bos>``, ``<eos>``) in the text."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(_text_score, _SpecialsKept(load_tokenizer(spec.model_path)))


class _SpecialsKept:
    """A tokenizer whose decode ignores ``skip_special_tokens`` and keeps them."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.eos_token_id = inner.eos_token_id
        self.pad_token_id = inner.pad_token_id
        self.vocab_size = inner.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._inner.decode(ids, skip_special_tokens=False)


class LongRopeStalePrefixCache(HFRolloutEngine):
    """Declares prefix_continuation and keeps the keys and values (transformers' DynamicCache) of each
    sequence it sampled, looked up by the whole id sequence (the longest cached prefix of a prompt, each
    row alone): right under plain RoPE, but it serves them whatever the continuation's length, so on a
    LongRoPE folder keys rotated with the short factors serve a continuation past the threshold."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._entries: dict[tuple[int, ...], Any] = {}

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The hf rollout's capabilities with prefix_continuation=True."""
        return replace(HF_ROLLOUT_CAPABILITIES, prefix_continuation=True)

    @torch.no_grad()
    def _decode(self, chunk: TensorBatch, seeds: list[int], params: SamplingParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decode each row alone over its cached prefix."""
        device = torch.device(self.spec.device)
        stops = torch.tensor(sorted({self.tokenizer.eos_token_id, *params.stop_token_ids}), dtype=torch.int64,
                             device=device)
        parts = []
        for b in range(chunk.batch_size):
            ids = chunk["prompt_ids"][b][chunk["prompt_mask"][b]].tolist()
            sampler = TokenSampler(params, self.tokenizer.pad_token_id, stops, self._uniforms(seeds[b : b + 1], params))
            parts.append(eager_decode(self._steps(ids, device), sampler, 1, params.max_new_tokens, device))
        return concat_responses(parts, self.tokenizer.pad_token_id, device)

    def _steps(self, ids: list[int], device: torch.device) -> Generator[Tensor, Tensor, None]:
        """Next-token logits of one row: the prompt's (after the longest cached prefix), then one per token sent."""
        hit = max((k for k in self._entries if len(k) < len(ids) and tuple(ids[: len(k)]) == k), key=len, default=())
        cache = copy.deepcopy(self._entries[hit]) if hit else None
        kw = cache_keyword(self.model)
        seen = list(ids)
        new = torch.tensor([ids[len(hit):]], device=device)
        at = torch.arange(len(hit), len(ids), device=device).unsqueeze(0)
        out = self.model(input_ids=new, position_ids=at, use_cache=True, logits_to_keep=1, **{kw: cache})
        try:
            while True:
                tok = yield out.logits[:, -1].float()
                at = torch.tensor([[len(seen)]], device=device)
                out = self.model(input_ids=tok.view(1, 1), position_ids=at, use_cache=True, **{kw: getattr(out, kw)})
                seen.append(int(tok))
        finally:
            self._entries[tuple(seen)] = getattr(out, kw)

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Drop the cache, then apply the stream."""
        self._entries.clear()
        super().update_weights(stream)


class QKVBiasesDropped(HFRewardEngine):
    """Leaves the q, k and v projections' biases out (zeroes them after loading): right on Llama, wrong on Qwen2."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        with torch.no_grad():
            for name, module in self._model.named_modules():
                bias = getattr(module, "bias", None)
                if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj") and isinstance(bias, Tensor):
                    bias.zero_()


class QKNormsDropped(HFRewardEngine):
    """Leaves Qwen3's per-head RMSNorm of q and k out (each replaced by the identity): right on Llama and Qwen2."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        for module in list(self._model.modules()):
            for norm in ("q_norm", "k_norm"):
                if isinstance(getattr(module, norm, None), torch.nn.Module):
                    setattr(module, norm, torch.nn.Identity())


class DtypeIgnored(HFRewardEngine):
    """Builds in float32 whatever dtype the spec asks for (no error, no warning)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, dtype="float32"))


class ParallelIgnored(HFRewardEngine):
    """Builds one single-device engine whatever parallel sizes the spec asks for."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(replace(spec, parallel=ParallelSizes()))


class RandomHeadAccepted(HFRewardEngine):
    """Loads any folder as a sequence classifier: a causal LM's, or one without ``score.weight``, gets a head
    initialised at random (the checks of ``verl_hf.modeling.load_model`` left out)."""

    def __init__(self, spec: EngineSpec) -> None:
        import verl_hf.reward as reward

        namespace = vars(reward)  # the name the engine's module looks load_model up under
        original = namespace["load_model"]

        def unchecked(path: str, kind: str, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                      seed: int = 0, **kwargs: Any) -> Any:
            import transformers

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, num_labels=1)
            return model.to(device).eval()

        namespace["load_model"] = unchecked
        try:
            super().__init__(spec)
        finally:
            namespace["load_model"] = original


class _PeriodicCosine(OptimConfig):
    """``lr_at`` as torch's CosineAnnealingLR computes it: the cosine is not held at its floor after
    ``total_steps`` but climbs back (its period is twice the decay)."""

    def lr_at(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "cosine" and self.total_steps > self.warmup_steps:
            progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
            return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        return self.lr


class _CosineAlways(OptimConfig):
    """``lr_at`` that decays along the cosine whenever ``total_steps`` is set, ``schedule='constant'`` or not."""

    def lr_at(self, step: int) -> float:
        if not self.total_steps:
            return super().lr_at(step)
        return OptimConfig(**{f.name: getattr(self, f.name) for f in fields(OptimConfig)} | {"schedule": "cosine"}).lr_at(step)


class _WarmupFromZero(OptimConfig):
    """``lr_at`` whose warmup counts the first step as 0 (``lr * step / warmup_steps``: the first update at lr 0)."""

    def lr_at(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * step / self.warmup_steps
        return super().lr_at(step)


class _OwnSchedule(ExampleTrainingEngine):
    """Steps (and reports) at the learning rate of its own schedule, ``SCHEDULE``'s ``lr_at``."""

    SCHEDULE: type[OptimConfig] = OptimConfig

    def optimizer_step(self) -> StepMetrics:
        """Step at ``SCHEDULE(**spec.optim).lr_at(step)``."""
        spec = self._spec
        o = spec.optim
        own = self.SCHEDULE(**{f.name: getattr(o, f.name) for f in fields(OptimConfig)})
        self._spec = replace(spec, optim=own)
        try:
            return super().optimizer_step()
        finally:
            self._spec = spec


class CosineClimbsPastTotal(_OwnSchedule):
    """After ``total_steps`` the cosine climbs back up (torch's CosineAnnealingLR) instead of staying at
    ``min_lr_ratio * lr``."""

    SCHEDULE = _PeriodicCosine


class ConstantScheduleDecays(_OwnSchedule):
    """``schedule='constant'`` with ``total_steps`` set decays along the cosine all the same."""

    SCHEDULE = _CosineAlways


class WarmupFromZero(_OwnSchedule):
    """The warmup counts the first step as 0: the first update runs at lr 0."""

    SCHEDULE = _WarmupFromZero


class ScheduleIgnoredReported(ExampleTrainingEngine):
    """Steps at the peak ``lr`` every time (no warmup, no decay) but reports ``lr_at(step)``."""

    def optimizer_step(self) -> StepMetrics:
        """Step at ``spec.optim.lr``; report the scheduled lr."""
        spec = self._spec
        k = self.step
        self._spec = replace(spec, optim=replace(spec.optim, warmup_steps=0, schedule="constant"))
        try:
            out = super().optimizer_step()
        finally:
            self._spec = spec
        return replace(out, lr=spec.optim.lr_at(k))


class NormsAndBiasesNotDecayed(ExampleTrainingEngine):
    """Weight decay on the matrices only: 1-D parameters (norm weights, biases) in a group without it."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        o = spec.optim
        params = list(self.model.parameters())
        groups: list[dict[str, Any]] = [{"params": [p for p in params if p.dim() > 1]},
                                        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


class PerMicroBatchGradClip(ExampleTrainingEngine):
    """Clips each micro-batch's gradient to ``grad_clip`` as it accumulates (then the sum once more in
    optimizer_step), instead of the accumulated gradient once."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._clipped: dict[torch.nn.Parameter, Tensor] = {}

    def _clip_contribution(self) -> None:
        clip = self._spec.optim.grad_clip
        raw: dict[torch.nn.Parameter, Tensor] = {}
        for p in self.model.parameters():
            if p.grad is not None:
                raw[p] = p.grad - self._clipped[p] if p in self._clipped else p.grad.clone()
        norm = float(torch.sqrt(sum((g.double().pow(2).sum() for g in raw.values()),
                                    torch.zeros((), dtype=torch.float64))))
        scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
        for p, g in raw.items():
            total = g * scale + self._clipped[p] if p in self._clipped else g * scale
            p.grad.copy_(total)  # type: ignore[union-attr]
            self._clipped[p] = total.clone()

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        if self.model.training:  # a micro-batch of forward_backward: the previous one's gradient is complete
            self._clip_contribution()
        return super().compute(batch, outputs)

    def forward_backward(self, mini_batch: TensorBatch, loss_fn: Any, stats: Any, *,
                         max_tokens: int | None = None) -> Any:
        """The example's loop, each micro-batch's gradient clipped (the last one's after it)."""
        self._clipped = {}
        out = super().forward_backward(mini_batch, loss_fn, stats, max_tokens=max_tokens)
        self._clip_contribution()
        return out


class EntropyAtTemperatureOne(ExampleTrainingEngine):
    """log_probs at the batch's temperature, entropy of the untempered distribution (temperature 1)."""

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        out = super().compute(batch, outputs)
        if "entropy" in outputs:
            plain = batch.update(meta=replace(batch.meta, temperature=1.0))
            out["entropy"] = super().compute(plain, ["entropy"])["entropy"]
        return out


class TruncatedRolloutLogProbs(ExampleRolloutEngine):
    """rollout_log_probs of the truncated distribution (renormalised over the top-k/top-p tokens) while
    declaring exact_log_probs_truncated (log softmax(logits / T) before truncation)."""

    def tempered_log_probs(self, logits: Tensor, params: SamplingParams) -> Tensor:
        return torch.log_softmax(_truncate(logits / params.temperature, params.top_k, params.top_p), -1)


class OtherLayoutDropsOptimizer(HFTrainingEngine):
    """A checkpoint loaded under another number of ranks than saved it restores the weights, the step and
    the schedule but starts the optimizer's moments afresh (an author's "cannot reshard the optimizer")."""

    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """The hf engine's load; then, where the saved world size differs, the Adam moments dropped."""
        from verl_hf.checkpoint import current_state_dir

        step = super()._load_checkpoint(path)
        saved_world = len(list(current_state_dir(path).glob("rng_rank*.pt")))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if saved_world != world and self._optim is not None:
            self._optim.optimizer.state.clear()
        return step


class CriticGradsNotReduced(HFTrainingEngine):
    """Under data parallelism the critic's gradients are not summed over the ranks (the actor's are): each
    rank steps on the gradient of its own share, and the ranks' critics drift apart. The loss and the
    metrics are still summed, so they look global."""

    def __init__(self, spec: EngineSpec) -> None:
        critic = spec.role == "critic" and spec.parallel.dp > 1
        if critic:  # the all-reduce mode, whose gradient sum is one call to leave out
            spec = replace(spec, options={**spec.options, "data_parallel": "allreduce"})
        super().__init__(spec)
        if critic:
            self._loop._reduce_grads = lambda params: None  # type: ignore[method-assign]


class OnlyRankZeroLoads(HFTrainingEngine):
    """load_checkpoint restores the state on data-parallel rank 0 only (the others keep the fresh engine's)."""

    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Rank 0: the hf engine's load; another rank: nothing read."""
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return self._step
        return super()._load_checkpoint(path)
