"""The Megatron TrainingEngine: megatron-core GPTModel under tensor, pipeline and data parallelism.

Layout of one forward: Megatron's RoPE takes arange positions, so each row of ``[prompt;
response]`` is shifted left until its first real token sits at column 0. Real tokens are
contiguous (prompts are left-padded, responses right-padded), so their positions become
``0..L-1``, which is exactly ``cumsum(attention_mask) - 1`` of the padded layout, and the padding
now trails every real token, so a causal mask alone keeps it out of every real token's attention.

Training runs through Megatron's pipeline schedules (``get_forward_backward_func``: 1F1B under
PP). The loss function's scalar is already normalised by the global counts, so the schedules run
with ``calculate_per_token_loss`` (no division by the number of micro-batches). Gradients are
then made global: summed over the tensor-parallel group for the replicated QK-norm weights,
over the embedding group for a tied embedding split across pipeline stages, and over
data-parallel ranks, once at the end of each call. Micro-batches are cut by the kernel partitioner
under the call's token budget and handed to the schedule as ``num_microbatches``; a call that
raises clears the gradients it left.

Mixed precision: with a bfloat16 (or float16) spec and ``MegatronOptions.master_weights`` on,
AdamW steps float32 master copies of the parameters (:class:`verl_core.enginekit.precision.MasterWeights`)
and rounds them into the model after each step; the Adam moments are keyed by the masters.

With ``MegatronOptions.optimizer="megatron"`` megatron-core's own optimizer steps instead
(:class:`verl_megatron.core_optimizer.CoreOptimizer`): the stage runs wrapped in megatron's
DistributedDataParallel, gradients accumulate in its float32 buffers (``param.main_grad``) and its
``finish_grad_sync`` makes the data-parallel sum; the engine still reduces QK-norm and tied
embedding gradients itself, and checkpoints keep the same layout-free format.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import (
    BatchValidationError,
    CheckpointError,
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    Tokenizer,
    TrainingCapabilities,
    TrainingEngine,
    WeightManifest,
    WeightMessage,
    stream_weights,
)
from verl_core.enginekit.checkpoint import verify_step_count, verify_tensors
from verl_core.enginekit.hf_tokenizer import load_tokenizer
from verl_core.enginekit.precision import MasterWeights
from verl_core.kernel.registry import parse_options
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_megatron.convert import StateDictAdapter
from verl_megatron.core_optimizer import CoreOptimizer
from verl_megatron.logprobs import vocab_parallel_log_probs
from verl_megatron.model import build_stage, load_hf_state_dict, load_stage_weights, model_dims
from verl_megatron.options import MegatronOptions
from verl_megatron.parallel import ParallelConfig, init_distributed
from verl_megatron.plugin import training_capabilities

__all__ = ["MegatronTrainingEngine", "build_training_engine"]

_LOG_PROBS_ONLY: frozenset[ModelOutput] = frozenset({"log_probs"})
_CKPT_META = "verl_megatron_checkpoint.json"
_CKPT_STATE = "state.pt"
_Gatherable = Literal["param", "grad", "master", "exp_avg", "exp_avg_sq"]


def build_training_engine(spec: EngineSpec) -> MegatronTrainingEngine:
    """Factory of the actor, reference and critic roles (the plugin's import string)."""
    return MegatronTrainingEngine(spec)


@dataclass(frozen=True)
class _Prepared:
    """A micro-batch in the model's layout."""

    batch: TensorBatch
    tokens: Tensor  # [b, s] shifted left, padding trailing
    gather_idx: Tensor  # [b, R] column of the logits that predicts response token t
    response_mask: Tensor  # [b, R]
    real: int  # samples that are not padding added for uniform pipeline shapes


class MegatronTrainingEngine(TrainingEngine):
    """A megatron-core GPTModel (local layer spec) loaded from a transformers folder.

    Every rank of the SPMD group builds the engine with the same spec and makes the same calls in
    the same order (collectives). ``forward`` computes the batch it is given on every data-parallel
    replica; ``forward_backward`` takes this data-parallel rank's share of the mini-batch.

    Args:
        spec: The engine spec; ``spec.parallel`` must match the launcher's world size.
    """

    def __init__(self, spec: EngineSpec) -> None:
        if spec.role not in ("actor", "reference", "critic"):
            raise ConfigError(f"the Megatron training engine plays actor, reference or critic, not {spec.role!r}")
        self._spec = spec
        self._options = parse_options(MegatronOptions, spec.options, where="backend 'megatron' options")
        self._device = self._resolve_device(spec.device)
        if spec.gradient_checkpointing and self._device.type != "cuda":
            raise ConfigError(
                "gradient_checkpointing needs a CUDA device here: megatron-core's activation recompute "
                "saves and restores the CUDA RNG state; set EngineSpec.gradient_checkpointing=False on CPU"
            )
        self._state = init_distributed(
            ParallelConfig.from_sizes(spec.parallel), device=self._device.type, seed=spec.seed
        )
        from megatron.core import parallel_state as ps

        self._ps = ps
        self.tp, self.pp, self.dp = self._state.tp, self._state.pp, self._state.dp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dims = model_dims(spec.model_path, "value" if spec.role == "critic" else "lm")
        self.dims.check_parallel(self.tp, self.pp)
        self.adapter = StateDictAdapter(self.dims)
        self._dtype: torch.dtype = spec.torch_dtype
        self.model = build_stage(
            self.dims, tp=self.tp, pp=self.pp, pp_rank=self.pp_rank, dtype=self._dtype,
            device=self._device, recompute=spec.gradient_checkpointing, attention=self._options.attention,
        )
        self._load_hf(spec.model_path)
        self._tokenizer = load_tokenizer(spec.model_path)
        self._trainable = spec.role in ("actor", "critic")
        self._step = 0
        # True from a successful forward_backward until optimizer_step consumes its gradients.
        self._grads_pending = False
        self._state_offloaded = False
        self._offload_s = 0.0  # time of the last switch to rollout, reported with the switch back
        self.optimizer: torch.optim.Optimizer | None = None
        self._master: MasterWeights | None = None
        self._master_of: dict[Tensor, torch.nn.Parameter] = {}
        self._core: CoreOptimizer | None = None
        if self._trainable and self._options.optimizer == "megatron":
            self._core = CoreOptimizer(
                self.model, spec.optim, self._dtype, distributed=self._options.distributed_optimizer
            )
        elif self._trainable:
            o = spec.optim
            params = [p for p in self.model.parameters() if p.requires_grad]
            stepped: list[Tensor] = list(params)
            if self._options.master_weights and any(p.dtype != torch.float32 for p in params):
                self._master = MasterWeights(params)
                self._master_of = dict(zip(params, self._master.masters, strict=True))
                stepped = list(self._master.masters)
            self.optimizer = torch.optim.AdamW(
                stepped, lr=o.lr_at(0), betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                fused=self._device.type == "cuda",
            )
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _resolve_device(device: str) -> torch.device:
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ConfigError(f"EngineSpec.device={device!r} but no CUDA device is available; use 'cpu'")
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if device != "cpu":
            raise ConfigError(f"EngineSpec.device must be 'cpu' or 'cuda[:N]', got {device!r}")
        return torch.device("cpu")

    def _load_hf(self, path: str | os.PathLike[str]) -> None:
        hf = load_hf_state_dict(path)
        full = self.adapter.from_hf(hf)
        load_stage_weights(
            self.model, self.adapter, full, tp_rank=self.tp_rank, tp=self.tp, pp_rank=self.pp_rank, pp=self.pp
        )

    def _stepped(self, param: Tensor) -> Tensor:
        """The tensor the optimizer steps for ``param``: its float32 master, or the parameter itself."""
        return self._master_of.get(param, param)

    def _grad(self, param: Tensor) -> Tensor | None:
        """The gradient of ``param`` wherever it is (on its master between ``load_grads`` and the step)."""
        if self._core is not None:
            return self._core.grad(param)
        master = self._master_of.get(param)
        if master is not None and master.grad is not None:
            return master.grad
        return param.grad

    # ------------------------------------------------------------------ protocol properties
    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """What this engine supports."""
        return training_capabilities(self._spec.role)

    @property
    def tokenizer(self) -> Tokenizer:
        """Tokenizer of the model folder."""
        return self._tokenizer

    @property
    def options(self) -> MegatronOptions:
        """The validated backend options of the spec."""
        return self._options

    @property
    def step(self) -> int:
        """Optimizer steps taken (the weight version of an export)."""
        return self._step

    # ------------------------------------------------------------------ input handling
    def _validate(self, batch: TensorBatch, where: str, outputs: Collection[str]) -> None:
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where=where)
        batch.check(where=where, vocab_size=self.dims.vocab_size)  # structure, values, non-empty prompts
        unknown = set(outputs) - {"log_probs", "entropy", "values"}
        if unknown:
            raise ConfigError(f"{where}: unknown outputs {sorted(unknown)}; valid: log_probs, entropy, values")
        if self.dims.head == "value" and set(outputs) - {"values"}:
            raise ConfigError(f"{where}: a critic computes only 'values', got {sorted(outputs)}")
        if self.dims.head == "lm" and "values" in outputs:
            raise ConfigError(f"{where}: 'values' needs role='critic' (a value head); this engine is {self._spec.role}")

    def _prepare(self, mb: TensorBatch, real: int) -> _Prepared:
        prompt_mask, response_mask = mb["prompt_mask"], mb["response_mask"]
        ids = torch.cat([mb["prompt_ids"], mb["response_ids"]], 1)
        mask = torch.cat([prompt_mask, response_mask], 1)
        b, s = ids.shape
        lengths = mask.sum(1)
        left_pad = (~prompt_mask).sum(1)
        cols = torch.arange(s, device=ids.device).unsqueeze(0)
        src = (cols + left_pad.unsqueeze(1)).clamp(max=s - 1)
        tokens = ids.gather(1, src).masked_fill(cols >= lengths.unsqueeze(1), mb.meta.pad_token_id)
        r = response_mask.shape[1]
        prompt_len = prompt_mask.sum(1)
        gather_idx = (prompt_len.unsqueeze(1) + torch.arange(r, device=ids.device) - 1).clamp(0, s - 1)
        if self.pp == 1 and b:
            # Without pipeline stages shapes may vary per micro-batch: drop trailing padding.
            width = max(int(lengths.max()), 1)
            tokens = tokens[:, :width]
            gather_idx = gather_idx.clamp(max=width - 1)
        dev = self._device
        return _Prepared(mb, tokens.to(dev), gather_idx.to(dev), response_mask.to(dev), real)

    def _micro_batches(self, batch: TensorBatch, max_tokens: int | None = None) -> tuple[list[_Prepared], Any]:
        """Micro-batches by the kernel partitioner: the call's budget, else the spec's budget or size."""
        spec = self._spec
        budget = max_tokens if max_tokens is not None else spec.micro_batch_tokens
        if budget is not None:
            mbs = batch.micro_batches(max_tokens=budget, trim=self.pp == 1)
        else:
            mbs = batch.micro_batches(size=spec.micro_batch_size or max(batch.batch_size, 1), trim=self.pp == 1)
        parts = list(mbs.batches)
        if self.pp > 1 and parts:
            # Pipeline stages exchange activations of one fixed shape.
            size = max(p.batch_size for p in parts)
            parts = [p.pad_to_multiple(size)[0] if p.batch_size < size else p for p in parts]
        real = [b.batch_size for b in mbs.batches]
        return [self._prepare(p, n) for p, n in zip(parts, real, strict=True)], mbs

    # ------------------------------------------------------------------ model execution
    def _causal_mask(self, s: int) -> Tensor:
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self._device), 1).view(1, 1, s, s)

    def _outputs(self, out: Tensor, prep: _Prepared, needed: Collection[str], temperature: float) -> dict[str, Tensor]:
        """Model outputs at the response positions ([b, R] float32, 0 where masked)."""
        result: dict[str, Tensor] = {}
        idx = prep.gather_idx
        rmask = prep.response_mask
        zero = torch.zeros((), dtype=torch.float32, device=out.device)
        if "values" in needed:
            vals = out[..., 0].float().gather(1, idx)
            result["values"] = torch.where(rmask, vals, zero)
        if {"log_probs", "entropy"} & set(needed):
            logits = out.gather(1, idx.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
            n_local = out.shape[-1]
            lp, ent = vocab_parallel_log_probs(
                logits,
                prep.batch["response_ids"].to(out.device),
                vocab_start=self.tp_rank * n_local,
                tp_group=self._ps.get_tensor_model_parallel_group() if self.tp > 1 else None,
                tp_size=self.tp,
                temperature=temperature,
                entropy="entropy" in needed,
            )
            if "log_probs" in needed:
                result["log_probs"] = torch.where(rmask, lp, zero)
            if ent is not None:
                result["entropy"] = torch.where(rmask, ent, zero)
        return result

    def _run(
        self,
        preps: list[_Prepared],
        loss_of: Any,
        *,
        forward_only: bool,
        model: Any = None,
    ) -> list[dict[str, Tensor]]:
        """Run Megatron's schedule over ``preps``; returns the last stage's per-micro-batch dicts."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = iter(preps)

        def forward_step(data_iterator: Iterator[_Prepared], model: Any) -> tuple[Tensor, Any]:
            prep = next(data_iterator)
            b, s = prep.tokens.shape
            positions = torch.arange(s, device=self._device).unsqueeze(0).expand(b, s)
            out = model(prep.tokens, positions, self._causal_mask(s))
            return out, partial(loss_of, prep)

        fb = get_forward_backward_func()
        shape = preps[0].tokens.shape
        out: list[dict[str, Tensor]] = fb(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[self.model if model is None else model],
            num_microbatches=len(preps),
            seq_length=int(shape[1]),
            micro_batch_size=int(shape[0]),
            forward_only=forward_only,
        )
        return out

    def _pp_last_rank(self) -> int:
        ranks = dist.get_process_group_ranks(self._ps.get_pipeline_model_parallel_group())
        return int(ranks[-1])

    # ------------------------------------------------------------------ forward
    def forward(
        self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS_ONLY
    ) -> TensorBatch:
        """Compute ``outputs`` for the response tokens, without gradients (see TrainingEngine)."""
        needed = frozenset(outputs)
        self._validate(batch, "MegatronTrainingEngine.forward", needed)
        if batch.batch_size == 0 or not needed:
            return batch
        preps, mbs = self._micro_batches(batch)
        temperature = batch.meta.temperature

        def loss_of(prep: _Prepared, out: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            res = {k: v[: prep.real].detach().cpu() for k, v in self._outputs(out, prep, needed, temperature).items()}
            zero = torch.zeros((), device=out.device, dtype=torch.float32)
            return zero, torch.ones((), dtype=torch.int, device=out.device), res

        self.model.eval()
        with torch.no_grad():
            stored = self._run(preps, loss_of, forward_only=True)
        fields = sorted(needed)
        per_mb: list[TensorBatch] = []
        for i, prep in enumerate(preps):
            r = prep.batch.response_len
            tensors: dict[str, Tensor] = {}
            for name in fields:
                t = stored[i][name] if self.pp_rank == self.pp - 1 else torch.empty(prep.real, r)
                if self.pp > 1:
                    t = t.to(self._comm_device()).contiguous()
                    dist.broadcast(t, src=self._pp_last_rank(), group=self._ps.get_pipeline_model_parallel_group())
                tensors[name] = t.to(mbs.batches[i].device)
            per_mb.append(mbs.batches[i].select(*mbs.batches[i].keys()).update(tensors))
        restored: TensorBatch = mbs.restore(per_mb)
        width = batch.response_len
        result: dict[str, Tensor] = {}
        for k in fields:
            t = restored[k]
            if t.shape[1] < width:  # micro-batches were trimmed of all-padding columns
                t = torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], 1)
            result[k] = t.to(batch.device)
        return batch.update(result)

    def _comm_device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ training
    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """Compute the gradients of ``loss_fn`` over this rank's share of one optimizer step.

        Megatron's schedule (``num_microbatches``) runs the micro-batches the kernel partitioner
        cuts under ``max_tokens`` (else the spec's budget or size); see
        :meth:`TrainingEngine.forward_backward` for the contract, including what a call that
        raises leaves (no gradients).
        """
        if not self._trainable:
            raise ConfigError(f"forward_backward needs role actor or critic; this engine is {self._spec.role}")
        if self._grads_pending:
            raise ConfigError(
                "MegatronTrainingEngine.forward_backward: the gradients of the previous call have not been "
                "applied; call optimizer_step() first (forward_backward takes the whole mini-batch of one "
                "optimizer step)"
            )
        needed = frozenset(loss_fn.needs)
        self._validate(mini_batch, "MegatronTrainingEngine.forward_backward", needed)
        if mini_batch.batch_size == 0:
            raise BatchValidationError("forward_backward got an empty mini-batch; every data-parallel rank needs >= 1 sample")
        onload_s = self._ensure_onloaded()
        preps, _ = self._micro_batches(mini_batch, max_tokens)
        n_mb = torch.tensor([len(preps)], dtype=torch.int64, device=self._device)
        if self.dp > 1:
            dist.all_reduce(n_mb, op=dist.ReduceOp.MAX, group=self._ps.get_data_parallel_group())
        if int(n_mb) > len(preps):
            # Every data-parallel rank runs the same number of micro-batches: pad with empty ones.
            empty = preps[-1].batch.pad_to_multiple(preps[-1].batch.batch_size + 1)[0]
            empty = empty.index(slice(preps[-1].batch.batch_size, None))
            if self.pp > 1:
                empty = empty.pad_to_multiple(preps[-1].batch.batch_size)[0]
            preps += [self._prepare(empty, 0)] * (int(n_mb) - len(preps))
        temperature = mini_batch.meta.temperature

        def loss_of(prep: _Prepared, out: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            outs = self._outputs(out, prep, needed, temperature)
            mb = prep.batch.update({k: v.to(prep.batch.device) for k, v in outs.items()})
            res = loss_fn(mb, stats)
            metrics = {k: v.detach().float().reshape(()).cpu() for k, v in res.metrics.items()}
            metrics["loss"] = res.loss.detach().float().reshape(()).clone().cpu()
            return res.loss, torch.ones((), dtype=torch.int, device=out.device), metrics

        self.model.train()
        try:
            stored = self._run(preps, loss_of, forward_only=False,
                               model=self._core.ddp if self._core is not None else None)
        except BaseException:
            self._clear_grads()  # the call started without gradients: it leaves none
            raise
        self._sync_grads()
        self._grads_pending = True
        metrics = self._reduce_metrics(stored, len(preps))
        if onload_s is not None:
            metrics["switch_to_rollout_s"] = self._offload_s
            metrics["switch_to_training_s"] = onload_s
        return metrics

    def _reduce_metrics(self, stored: list[dict[str, Tensor]], n_mb: int) -> Metrics:
        keys: list[str] = sorted({k for d in stored for k in d}) if self.pp_rank == self.pp - 1 else []
        if self.pp > 1:
            obj: list[Any] = [keys]
            dist.broadcast_object_list(obj, src=self._pp_last_rank(), group=self._ps.get_pipeline_model_parallel_group())
            keys = obj[0]
        vec = torch.zeros(len(keys), dtype=torch.float64)
        if self.pp_rank == self.pp - 1:
            for d in stored:
                for i, k in enumerate(keys):
                    if k in d:
                        vec[i] += float(d[k])
        vec = vec.to(self._device)
        if self.pp > 1:
            dist.broadcast(vec, src=self._pp_last_rank(), group=self._ps.get_pipeline_model_parallel_group())
        if self.dp > 1:
            dist.all_reduce(vec, group=self._ps.get_data_parallel_group())
        out = {k: float(v) for k, v in zip(keys, vec.cpu().tolist(), strict=True)}
        out["num_micro_batches"] = float(n_mb)
        return out

    def _clear_grads(self) -> None:
        """Drop every gradient (the torch ``.grad`` of each parameter, or megatron's buffers)."""
        if self._core is not None:
            self._core.zero_grad()
        else:
            for p in self.model.parameters():
                p.grad = None
        self._grads_pending = False

    def _sync_grads(self) -> None:
        ps = self._ps
        params = dict(self.model.named_parameters())
        if self.tp > 1 and self.dims.qk_norm:
            # QK-norm weights are replicated but each TP rank only saw its own heads.
            for name, p in params.items():
                grad = self._grad(p)
                if grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        if self.pp > 1 and self.dims.tied and ps.is_rank_in_embedding_group():
            shared = self.model.shared_embedding_or_output_weight()
            if self._core is None and shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            grad = self._grad(shared)
            assert grad is not None
            dist.all_reduce(grad, group=ps.get_embedding_group())
        if self._core is not None:
            self._core.reduce()  # megatron's DDP: the data-parallel sum of its gradient buffers
        elif self.dp > 1:
            for p in params.values():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (each parameter counted once over all ranks)."""
        sq = torch.zeros((), dtype=torch.float64, device=self._device)
        for name, p in self.model.named_parameters():
            grad = self._grad(p)
            if grad is None or getattr(p, "shared", False):
                continue  # the last stage's copy of a tied embedding is counted on the first
            if self.adapter.partition(name) == "replicated" and self.tp_rank != 0:
                continue  # identical on every TP rank: count it once
            sq += grad.detach().double().pow(2).sum()
        if self.tp * self.pp > 1:
            dist.all_reduce(sq, group=self._ps.get_model_parallel_group())
        return float(sq.sqrt())

    def optimizer_step(self) -> StepMetrics:
        """Clip, step and zero gradients; all ranks skip together when the grad norm is not finite."""
        self._grads_pending = False
        if self._core is not None:
            lr = self._spec.optim.lr_at(self._step)
            norm, skipped = self._core.step(lr, self._spec.optim.grad_clip)
            if not skipped:
                self._step += 1
            return StepMetrics(grad_norm=norm, lr=lr, skipped=skipped)
        if self.optimizer is None:
            raise ConfigError(f"optimizer_step needs role actor or critic; this engine is {self._spec.role}")
        self._ensure_onloaded()
        if self._master is not None:
            self._master.load_grads()  # after every reduction of forward_backward
        norm = self.grad_norm()
        bad = torch.tensor([0.0 if torch.isfinite(torch.tensor(norm)) else 1.0], device=self._device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        lr = self._spec.optim.lr_at(self._step)
        skipped = bool(bad.item() > 0)
        if not skipped:
            clip = self._spec.optim.grad_clip
            if clip > 0 and norm > clip:
                coef = clip / (norm + 1e-6)
                for p in self.model.parameters():
                    grad = self._grad(p)
                    if grad is not None:
                        grad.mul_(coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self._master is not None:
                self._master.store()
            self._step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return StepMetrics(grad_norm=norm, lr=lr, skipped=skipped)

    # ------------------------------------------------------------------ weights
    def _full_tensor(self, name: str, *, what: _Gatherable = "param") -> Tensor:
        """Gather the full Megatron tensor ``name`` (TP all-gather, PP broadcast) onto every rank.

        ``what`` picks the parameter, its gradient, its float32 master (the parameter itself without
        masters) or one of its Adam moments (zeros when absent); masters and moments come in the
        optimizer's dtype.
        """
        ps = self._ps
        owner = self.adapter.stage_of(name, self.pp)
        full: Tensor | None = None
        dtype = self._dtype
        if what not in ("param", "grad") and self._master is not None:
            dtype = self._master.masters[0].dtype if self._master.masters else self._dtype
        if what != "param" and self._core is not None:
            dtype = torch.float32  # megatron's gradient buffers, main parameters and moments
        if self.pp_rank == owner:
            param = dict(self.model.named_parameters())[self.adapter.local_name(name, self.pp)]
            local = param.detach()
            if what == "grad":
                grad = self._grad(param) if self._core is not None else param.grad
                local = grad.detach() if grad is not None else torch.zeros_like(local)
            elif self._core is not None and what != "param":
                local = self._core.local_state(param, what)
            elif what == "master":
                local = self._stepped(param).detach()
            elif what != "param":
                stepped = self._stepped(param)
                state = self.optimizer.state.get(stepped, {}) if self.optimizer is not None else {}
                local = state[what].detach() if what in state else torch.zeros_like(stepped.detach())
            if self.tp > 1 and self.adapter.partition(name) != "replicated":
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                full = self.adapter.unshard(name, shards)
            else:
                full = local
        if self.pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            src = int(dist.get_process_group_ranks(group)[owner])
            buf = full.contiguous() if full is not None else torch.empty(
                self.adapter.megatron_shape(name), dtype=dtype, device=self._device
            )
            dist.broadcast(buf, src=src, group=group)
            full = buf
        assert full is not None
        return full

    def _hf_tensors(self, *, grad: bool = False, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """Full tensors in transformers naming, one Megatron tensor gathered at a time.

        Each piece is made contiguous and cast to ``dtype`` in one copy (none when it already is);
        nothing of a Megatron tensor outlives its pieces, so besides what the consumer keeps only
        the tensor being gathered and converted is alive.
        """
        for name in self.adapter.megatron_names():
            parts = self.adapter.to_hf_tensor(name, self._full_tensor(name, what="grad" if grad else "param"))
            for hf_name in list(parts):
                t = parts.pop(hf_name)
                assert t is not None
                want = dtype or t.dtype
                if not t.is_contiguous() or t.dtype != want:
                    t = torch.empty(t.shape, dtype=want, device=t.device).copy_(t)
                yield hf_name, t
                del t

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Stream the full weights in transformers naming (see TrainingEngine.export_weights).

        Every rank of the group must iterate the stream to the end (the gathers are collectives).
        With the ``export_ranks="first"`` option only global rank 0's chunks carry tensors.
        """
        out_dtype = dtype or self._dtype
        manifest = WeightManifest(
            version=self._step,
            tensors={n: TensorInfo(s, out_dtype) for n, s in self.adapter.hf_shapes().items()},
            tied_embeddings=self.dims.tied,
        )
        if self._options.export_ranks == "first" and dist.get_rank() != 0:
            def drain() -> Iterator[WeightMessage]:
                yield manifest
                for _ in self._hf_tensors():
                    pass
                from verl_core import WeightCommit

                yield WeightCommit(manifest.version)

            return drain()
        return stream_weights(self._hf_tensors(dtype=dtype), manifest, bucket_bytes=bucket_bytes, dtype=dtype)

    def hf_state_dict(self, *, grads: bool = False) -> dict[str, Tensor]:
        """The full weights (or their accumulated gradients) in transformers naming, on every rank.

        A collective: every rank of the group must call it.
        """
        return {n: t.clone() for n, t in self._hf_tensors(grad=grads)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save weights, float32 masters (when kept), Adam moments, step and RNG atomically to ``path``.

        Tensors are stored whole (TP shards joined, PP stages gathered) under Megatron's global
        names, so the checkpoint loads at any TP/PP layout. Global rank 0 writes into a temporary
        folder and swaps it into place, so a crash leaves the previous checkpoint intact. A
        collective: every rank must call it.
        """
        self._ensure_onloaded()
        dest = Path(path)
        rank0 = dist.get_rank() == 0
        model: dict[str, Tensor] = {}
        moments: dict[str, dict[str, Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        masters: dict[str, Tensor] = {}
        has_optimizer = self.optimizer is not None or self._core is not None
        keep_masters = self._master is not None or (self._core is not None and self._dtype != torch.float32)
        for name in self.adapter.megatron_names():
            t = self._full_tensor(name)
            if rank0:
                model[name] = t.detach().cpu().clone()
            if keep_masters:
                m = self._full_tensor(name, what="master")
                if rank0:
                    masters[name] = m.detach().cpu().clone()
            if has_optimizer:
                for key, store in moments.items():
                    m = self._full_tensor(name, what=key)  # type: ignore[arg-type]
                    if rank0:
                        store[name] = m.detach().cpu().clone()
        adam_step = 0.0
        if self._core is not None:
            adam_step = self._core.adam_step()
        elif self.optimizer is not None:
            for state in self.optimizer.state.values():
                adam_step = float(state["step"])
                break
        if rank0:
            tmp = dest.with_name(f".{dest.name}.incomplete")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            payload = {
                "model": model,
                "optimizer": moments if has_optimizer else None,
                "master_weights": masters if keep_masters else None,
                "adam_step": adam_step,
                "step": self._step,
                "rng": torch.get_rng_state(),
            }
            torch.save(payload, tmp / _CKPT_STATE)
            meta = {"format": "verl_megatron/1", "tp": self.tp, "pp": self.pp, "step": self._step,
                    "role": self._spec.role, "names": self.adapter.megatron_names()}
            (tmp / _CKPT_META).write_text(json.dumps(meta))
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if dest.exists():
                os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`, at this engine's TP/PP layout.

        Everything is checked before anything is restored (see :meth:`_verify_checkpoint`), on
        every rank alike (each reads the whole file), so a refused load raises on all ranks and
        leaves the engine as it was. A checkpoint without float32 masters (saved with
        ``master_weights=False``) starts this engine's masters from its weights.

        Raises:
            ConfigError: the folder is not a verl-megatron checkpoint.
            CheckpointError: the checkpoint does not fit this engine (a tensor missing,
                unexpected or of another shape or dtype, a broken step counter or RNG state); the
                message names the tensor, what was saved, what this engine expects and the folder.
        """
        folder = Path(path)
        if not (folder / _CKPT_META).exists() or not (folder / _CKPT_STATE).exists():
            raise ConfigError(f"{folder} is not a verl-megatron checkpoint (expected {_CKPT_META} and {_CKPT_STATE})")
        payload = torch.load(folder / _CKPT_STATE, map_location="cpu", weights_only=True)
        self._verify_checkpoint(folder, payload)
        self._ensure_onloaded()
        params = dict(self.model.named_parameters())
        moments = payload["optimizer"]
        saved_masters = payload.get("master_weights")
        with torch.no_grad():
            for global_name, local in self.adapter.stage_names(self.pp_rank, self.pp):
                p = params[local]
                stepped = self._stepped(p)

                def piece(t: Tensor, *, _g: str = global_name, _like: Tensor = p) -> Tensor:
                    return self.adapter.shard(_g, t, self.tp_rank, self.tp).to(device=_like.device, dtype=_like.dtype)

                p.copy_(piece(payload["model"][global_name]))
                if self._core is not None:
                    source = saved_masters if saved_masters is not None else payload["model"]
                    master = self.adapter.shard(global_name, source[global_name], self.tp_rank, self.tp).to(
                        device=p.device, dtype=torch.float32)
                    if p.dtype != torch.float32:
                        p.copy_(master)  # the model computes with the masters' rounding
                    state = None
                    if moments is not None and payload["adam_step"] > 0:
                        state = {k: self.adapter.shard(global_name, moments[k][global_name], self.tp_rank, self.tp)
                                 for k in ("exp_avg", "exp_avg_sq")}
                    self._core.load_local_state(p, master, state, float(payload["adam_step"]))
                    continue
                if stepped is not p:
                    source = saved_masters if saved_masters is not None else payload["model"]
                    stepped.copy_(piece(source[global_name], _like=stepped))
                    p.copy_(stepped)
                if self.optimizer is not None:
                    self.optimizer.state.pop(stepped, None)
                    if moments is not None and payload["adam_step"] > 0:
                        self.optimizer.state[stepped] = {
                            "step": torch.tensor(float(payload["adam_step"])),
                            "exp_avg": piece(moments["exp_avg"][global_name], _like=stepped).clone(),
                            "exp_avg_sq": piece(moments["exp_avg_sq"][global_name], _like=stepped).clone(),
                        }
        torch.set_rng_state(payload["rng"])
        self._step = int(payload["step"])
        self._clear_grads()
        dist.barrier()

    def _verify_checkpoint(self, folder: Path, payload: Any) -> None:
        """Refuse a checkpoint that does not fit this engine; copies nothing.

        The file holds whole tensors under Megatron's global names: weights must have the full
        shape of this model and its dtype, float32 masters the full shape in float32, Adam
        moments the full shape in a floating dtype (cast to the optimizer's on load), the step
        counters must be whole numbers >= 0. Then the shard this rank would take of each tensor
        of its stage must have the local parameter's shape.
        """
        where = f"checkpoint {str(folder)!r}"
        if not isinstance(payload, dict) or not isinstance(payload.get("model"), dict):
            raise CheckpointError(f"{where}: {_CKPT_STATE} is not a verl-megatron state; the file is corrupted or foreign")
        full = {n: self.adapter.megatron_shape(n) for n in self.adapter.megatron_names()}
        verify_tensors(payload["model"], {n: TensorInfo(s, self._dtype) for n, s in full.items()}, checkpoint=folder)
        fp32 = {n: TensorInfo(s, torch.float32) for n, s in full.items()}
        masters = payload.get("master_weights")
        if masters is not None:
            verify_tensors(masters if isinstance(masters, dict) else {}, fp32, checkpoint=folder,
                           what="float32 master")
        moments = payload.get("optimizer")
        if moments is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                saved = moments.get(key) if isinstance(moments, dict) else None
                verify_tensors(saved if isinstance(saved, dict) else {}, fp32, checkpoint=folder,
                               what=f"optimizer state ({key})", exact_dtype=False)
        verify_step_count(payload.get("adam_step"), name="adam_step", checkpoint=folder)
        verify_step_count(payload.get("step"), name="step", checkpoint=folder)
        live_rng = torch.get_rng_state()
        verify_tensors({"rng": payload.get("rng")}, {"rng": TensorInfo(tuple(live_rng.shape), live_rng.dtype)},
                       checkpoint=folder, what="RNG state")
        params = dict(self.model.named_parameters())
        for global_name, local in self.adapter.stage_names(self.pp_rank, self.pp):
            # the shard of a tensor of the (verified) full shape, computed without data
            shard = self.adapter.shard(global_name, torch.empty(full[global_name], device="meta"), self.tp_rank, self.tp)
            if tuple(shard.shape) != tuple(params[local].shape):
                raise CheckpointError(
                    f"{where}: tensor {global_name!r} of shape {full[global_name]} gives tensor-parallel rank "
                    f"{self.tp_rank} of {self.tp} a shard of shape {tuple(shard.shape)}, but its parameter "
                    f"{local!r} has shape {tuple(params[local].shape)}; load it into an engine of the same model"
                )

    # ------------------------------------------------------------------ colocated switching
    def stage_parameters(self) -> dict[str, Tensor]:
        """This rank's parameter shards by Megatron global name (each tensor of its stage once).

        The last stage's copy of a tied embedding is left out: the first stage's is the source.
        """
        params = dict(self.model.named_parameters())
        return {g: params[local] for g, local in self.adapter.stage_names(self.pp_rank, self.pp)
                if local == self.adapter.local_name(g, self.pp)}

    @property
    def training_state_offloaded(self) -> bool:
        """Whether optimizer state and gradients are in CPU memory (see :meth:`offload_training_state`)."""
        return self._state_offloaded

    def _move_training_state(self, device: torch.device) -> int:
        """Move gradients, float32 masters and optimizer state to ``device``; returns the bytes moved."""
        moved = 0
        for p in self.model.parameters():
            if p.grad is not None:
                moved += p.grad.numel() * p.grad.element_size()
                p.grad = p.grad.to(device)
        if self._master is not None:
            for m in self._master.masters:
                moved += m.numel() * m.element_size()
                if m.grad is not None:
                    moved += m.grad.numel() * m.grad.element_size()
            self._master.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, Tensor) and key != "step":
                        moved += value.numel() * value.element_size()
                        state[key] = value.to(device)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return moved

    def offload_training_state(self) -> float:
        """Move optimizer state and pending gradients to CPU memory while a colocated rollout runs.

        The parameters stay (``forward`` keeps working); the next ``forward_backward``,
        ``optimizer_step`` or checkpoint call moves the state back first, and that
        ``forward_backward``'s metrics carry both switch times (``switch_to_rollout_s``,
        ``switch_to_training_s``). On a CPU device the move is a no-op ``.to("cpu")``,
        performed and timed all the same.

        Returns:
            Seconds the switch took.
        """
        if self._core is not None:
            raise ConfigError(
                "offload_training_state is not supported with the megatron option optimizer='megatron'; "
                "sync with during_rollout='keep' or use optimizer='torch'"
            )
        t0 = time.perf_counter()
        if not self._state_offloaded:
            self._move_training_state(torch.device("cpu"))
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            self._state_offloaded = True
        self._offload_s = time.perf_counter() - t0
        return self._offload_s

    def onload_training_state(self) -> float:
        """Undo :meth:`offload_training_state`; returns the seconds the switch took."""
        t0 = time.perf_counter()
        if self._state_offloaded:
            self._move_training_state(self._device)
            self._state_offloaded = False
        return time.perf_counter() - t0

    def _ensure_onloaded(self) -> float | None:
        """Switch back to training if the state is offloaded; the seconds it took, or None."""
        if not self._state_offloaded:
            return None
        return self.onload_training_state()

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """No-op: parameters and optimizer state stay where they are (capability ``offload`` is False)."""

    def onload(self) -> None:
        """No-op counterpart of :meth:`offload`."""

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays for other engines)."""
        self.optimizer = None
        if self._core is not None:
            self._core.close()
        self._core = None
        self._master = None
        self._master_of = {}
        self.model = None
