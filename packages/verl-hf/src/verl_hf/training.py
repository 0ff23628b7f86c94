"""HFTrainingEngine: actor, frozen reference and critic over transformers models.

Layout of one ``forward_backward``: the rank's share of the mini-batch is split into micro-batches
by the kernel partitioner (under the call's token budget, else the spec's budget or size), every
rank runs the same number of them (padding with empty ones that contribute zero gradient), the
outputs the loss needs are computed with autograd, and each micro-batch's loss (already normalised
by the global counts) is backpropagated. Gradients are summed over micro-batches and, once at the
end of the call, over ranks, so results do not depend on micro-batch size or data-parallel degree.
A call that raises clears the gradients it left.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from verl_core.enginekit.checkpoint import verify_step_count, verify_tensors
from verl_core.enginekit.precision import MasterWeights
from verl_core.enginekit.weight_stream import stream_weights
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.capabilities import TrainingCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import CheckpointError, ConfigError
from verl_core.kernel.registry import parse_options
from verl_core.kernel.training import (
    DEFAULT_BUCKET_BYTES,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TrainingEngine,
)
from verl_core.kernel.weights import TensorInfo, WeightManifest, WeightMessage
from verl_hf import checkpoint as ckpt
from verl_hf.capabilities import training_capabilities
from verl_hf.config import HFOptions
from verl_hf.distributed import DataParallel, init_data_parallel
from verl_hf.modeling import (
    FlatParameters,
    ModelKind,
    export_order,
    load_model,
    token_outputs,
    validate_inputs,
)
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFTrainingEngine", "build_training_engine"]

_INPUT_FIELDS: Final = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_LOG_PROBS_ONLY: Final[frozenset[ModelOutput]] = frozenset({"log_probs"})


class HFTrainingEngine(TrainingEngine):
    """A transformers model as a verl TrainingEngine (roles actor, reference and critic).

    The actor and reference load ``AutoModelForCausalLM``; the critic loads
    ``AutoModelForTokenClassification`` with one label (a value head on the final hidden state),
    initialising the head from ``spec.seed`` when the folder holds a causal LM. Dropout is off.
    Parameters are kept in ``spec.dtype``; with bfloat16 the optimizer updates float32 master
    copies and rounds them into the model after each step (``HFOptions.master_weights``), and
    log-probs, entropy and values are always computed in float32 from upcast logits. The optimizer is AdamW with
    linear warmup and constant or cosine decay (``spec.optim``), applying weight decay to every
    parameter.

    Args:
        spec: The engine spec (role actor, reference or critic; ``parallel.tp == parallel.pp == 1``).
        options: Backend options (default: parsed from ``spec.options``).

    Raises:
        ConfigError: wrong role, tensor/pipeline parallel requested, dp > 1 outside torchrun, or
            a model folder that cannot be loaded as needed.
    """

    def __init__(self, spec: EngineSpec, options: HFOptions | None = None) -> None:
        if spec.role not in ("actor", "reference", "critic"):
            raise ConfigError(
                f"HFTrainingEngine serves roles actor, reference and critic, got {spec.role!r}; "
                "use verl_hf.rollout / verl_hf.reward for the other roles"
            )
        if spec.parallel.tp != 1 or spec.parallel.pp != 1:
            raise ConfigError(
                f"the hf backend is data parallel only, got tp={spec.parallel.tp}, pp={spec.parallel.pp}; "
                "use the megatron backend for tensor or pipeline parallelism"
            )
        if spec.dtype == "float16":
            raise ConfigError(
                "the hf training engine runs float32 or bfloat16 (float16 would need loss scaling); "
                "set EngineSpec.dtype to 'bfloat16'"
            )
        self._spec = spec
        self._options = options if options is not None else parse_options(
            HFOptions, spec.options, where="hf backend options"
        )
        self._kind: ModelKind = "value" if spec.role == "critic" else "causal_lm"
        self._dp: DataParallel = init_data_parallel(spec.parallel.dp, spec.device)
        self._device = self._dp.device
        self._caps = training_capabilities(spec.role)
        self._trainable = spec.role != "reference"
        mode = self._options.data_parallel
        if mode == "auto":
            mode = "fsdp2" if self._device.type == "cuda" else "allreduce"
        self._dp_mode = mode
        model = load_model(
            spec.model_path, self._kind, dtype=spec.torch_dtype, device=self._device,
            attn_implementation=self._options.attn_implementation, seed=spec.seed,
        )
        self._tied = bool(getattr(model.config, "tie_word_embeddings", False)) and self._kind == "causal_lm"
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self._trainable:
            model.requires_grad_(False)
        self._names = self._export_names(model)
        # (name, owning module, attribute) of every exported tensor, found on first use.
        self._owners: list[tuple[str, Any, str]] | None = None
        self._fsdp = self._dp.active and self._dp_mode == "fsdp2"
        # Factor that turns the gradients a backward leaves into the SUM over ranks.
        self._grad_scale = 1.0
        if self._fsdp:
            _apply_fsdp2(model)
            # FSDP averages over ranks; scaling by the world size gives the sum (exact for
            # power-of-two worlds). A divide factor of 1 would need PREMUL_SUM, which gloo lacks.
            self._grad_scale = float(self._dp.world)
        self._model: Any = model
        # An actor on one device keeps its weights in one buffer, in export order: a rollout
        # engine with the same layout syncs with one device copy (HFDirectSync). Dropped while
        # offloaded, rebuilt on onload.
        self._flat: FlatParameters | None = None
        if spec.role == "actor" and not self._fsdp:
            self._flat = FlatParameters.build(self._live_state())
        self._tokenizer: HFTokenizer | None = None
        self._step = 0
        self._offloaded = False
        # True from a successful forward_backward until optimizer_step consumes its gradients.
        self._grads_pending = False
        self._master: MasterWeights | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if self._trainable:
            self._build_optimizer()

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """What this engine supports."""
        return self._caps

    @property
    def tokenizer(self) -> HFTokenizer:
        """Tokenizer of the model."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._spec.model_path, self._vocab_size)
        return self._tokenizer

    @property
    def model(self) -> Any:
        """The underlying transformers model (FSDP2-wrapped under data parallel ``fsdp2``)."""
        return self._model

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped steps do not count)."""
        return self._step

    @property
    def data_parallel_mode(self) -> str:
        """``fsdp2`` or ``allreduce`` (what ``HFOptions.data_parallel='auto'`` resolved to)."""
        return self._dp_mode

    # ------------------------------------------------------------------ setup helpers
    def _build_optimizer(self) -> None:
        optim = self._spec.optim
        params = [p for p in self._model.parameters() if p.requires_grad]
        if self._options.master_weights and not self._fsdp and any(p.dtype != torch.float32 for p in params):
            self._master = MasterWeights(params)
            params = list(self._master.masters)
        self._optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
            fused=self._device.type == "cuda" and not self._fsdp,
        )
        lr = optim.lr
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lambda step: optim.lr_at(step) / lr
        )

    def _export_names(self, model: Any) -> list[str]:
        return export_order([n for n in model.state_dict() if not (self._tied and n == "lm_head.weight")])

    # ------------------------------------------------------------------ validation
    def _validate(self, batch: TensorBatch, where: str) -> None:
        validate_inputs(batch, where, self._vocab_size, self._spec)

    def _check_outputs(self, outputs: Collection[str], where: str) -> None:
        allowed = {"values"} if self._kind == "value" else {"log_probs", "entropy"}
        unknown = set(outputs) - {"log_probs", "entropy", "values"}
        if unknown:
            raise ConfigError(f"{where}: unknown model outputs {sorted(unknown)}; known: log_probs, entropy, values")
        bad = set(outputs) - allowed
        if bad:
            raise ConfigError(
                f"{where}: the {self._spec.role} engine computes {sorted(allowed)}, not {sorted(bad)}"
                + ("; values need a critic engine" if "values" in bad else "; log-probs need a causal-LM engine")
            )

    def _require_onloaded(self, where: str) -> None:
        if self._offloaded:
            raise ConfigError(f"{where}: the engine is offloaded; call onload() first")

    # ------------------------------------------------------------------ micro-batches
    def _plan(self, batch: TensorBatch, max_tokens: int | None, size: int | None) -> list[tuple[Tensor, TensorBatch]]:
        """Micro-batches of ``batch`` with the original sample indices of each."""
        if batch.batch_size == 0:
            return []
        if max_tokens is not None:
            mbs = batch.micro_batches(max_tokens=max_tokens)
        else:
            mbs = batch.micro_batches(size=size or batch.batch_size)
        out: list[tuple[Tensor, TensorBatch]] = []
        start = 0
        for mb in mbs.batches:
            out.append((mbs.order[start : start + mb.batch_size], mb))
            start += mb.batch_size
        return out

    def _padding_micro_batch(self, meta: BatchMeta) -> TensorBatch:
        """A one-sample micro-batch with an empty response: it contributes exactly zero."""
        pad = meta.pad_token_id
        dev = self._device
        return TensorBatch(
            {
                "prompt_ids": torch.full((1, 1), pad, dtype=torch.int64, device=dev),
                "prompt_mask": torch.ones(1, 1, dtype=torch.bool, device=dev),
                "response_ids": torch.full((1, 1), pad, dtype=torch.int64, device=dev),
                "response_mask": torch.zeros(1, 1, dtype=torch.bool, device=dev),
            },
            meta=meta,
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS_ONLY
    ) -> TensorBatch:
        """Compute ``outputs`` (float32, 0 where the response mask is False) without gradients."""
        where = f"HFTrainingEngine.forward ({self._spec.role})"
        wanted = set(outputs)
        self._check_outputs(wanted, where)
        self._require_onloaded(where)
        self._validate(batch, where)
        src_device = batch.device
        work = batch.to(self._device)
        max_tokens = self._options.forward_micro_batch_tokens or self._spec.micro_batch_tokens
        size = None if max_tokens is not None else self._spec.micro_batch_size
        plan = self._plan(work, max_tokens, size)
        n = self._dp.max_int(len(plan)) if self._fsdp else len(plan)
        results: dict[str, Tensor] = {
            name: torch.zeros(batch.batch_size, batch.response_len, dtype=torch.float32, device=self._device)
            for name in wanted
        }
        self._model.eval()
        temperature = batch.meta.temperature
        with torch.no_grad():
            for i in range(n):
                if i < len(plan):
                    idx, mb = plan[i]
                    out = token_outputs(
                        self._model, mb, wanted, kind=self._kind, temperature=temperature,
                        always_run=self._fsdp,
                    )
                    width = mb.response_len
                    for name, value in out.items():
                        results[name][idx, :width] = value
                else:
                    token_outputs(
                        self._model, self._padding_micro_batch(batch.meta), wanted,
                        kind=self._kind, temperature=temperature, always_run=True,
                    )
        return batch.update({k: v.to(src_device) for k, v in results.items()})

    # ------------------------------------------------------------------ training
    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """Compute the gradients of ``loss_fn`` over this rank's share of one optimizer step.

        Micro-batches hold at most ``max_tokens`` padded tokens (else ``spec.micro_batch_tokens``,
        else ``spec.micro_batch_size`` samples); see :meth:`TrainingEngine.forward_backward` for
        the contract, including what a call that raises leaves (no gradients).
        """
        where = f"HFTrainingEngine.forward_backward ({self._spec.role})"
        if not self._trainable:
            raise ConfigError(f"{where}: the reference engine is frozen; train the actor or critic")
        needs = set(loss_fn.needs)
        self._check_outputs(needs, where)
        self._require_onloaded(where)
        if self._grads_pending:
            raise ConfigError(
                f"{where}: the gradients of the previous call have not been applied; call optimizer_step() "
                "first (forward_backward takes the whole mini-batch of one optimizer step)"
            )
        self._validate(mini_batch, where)
        work = mini_batch.to(self._device)
        if max_tokens is not None:
            plan = self._plan(work, max_tokens, None)
        else:
            plan = self._plan(work, self._spec.micro_batch_tokens, self._spec.micro_batch_size)
        n = self._dp.max_int(len(plan))
        temperature = mini_batch.meta.temperature
        loss_sum = torch.zeros((), dtype=torch.float32, device=self._device)
        metric_sums: dict[str, Tensor] = {}
        params = [p for p in self._model.parameters() if p.requires_grad]
        self._model.train()
        try:
            for i in range(n):
                if self._fsdp:
                    self._set_grad_sync(i == n - 1)
                if i < len(plan):
                    mb = plan[i][1]
                    out = token_outputs(
                        self._model, mb, needs, kind=self._kind, temperature=temperature,
                        always_run=self._fsdp,
                    )
                    result = loss_fn(mb.update(out), stats)
                    loss = result.loss
                    if loss.dim() != 0:
                        raise ConfigError(f"{where}: the loss function returned shape {tuple(loss.shape)}, expected a scalar")
                    for k, v in result.metrics.items():
                        v = v.detach().float().to(self._device).reshape(())
                        metric_sums[k] = metric_sums[k] + v if k in metric_sums else v
                    loss_sum += loss.detach().float()
                    if self._fsdp or not loss.requires_grad:
                        # A loss that ignores the model (e.g. only empty responses) still runs
                        # backward through the whole forward, so FSDP's collectives match across ranks.
                        loss = loss + _zero_link(out, self._device)
                else:
                    pad = self._padding_micro_batch(mini_batch.meta)
                    out = token_outputs(
                        self._model, pad, needs, kind=self._kind, temperature=temperature,
                        always_run=True,
                    )
                    loss = _zero_link(out, self._device)
                if loss.requires_grad:
                    loss.backward()  # type: ignore[no-untyped-call]
        except BaseException:
            for p in params:  # the call started without gradients: it leaves none
                p.grad = None
            raise
        finally:
            self._model.eval()
            if self._fsdp:
                self._set_grad_sync(True)
        self._reduce_new_grads(params)
        self._grads_pending = True
        keys = self._dp.union_keys(list(metric_sums))
        packed = torch.stack(
            [loss_sum] + [metric_sums.get(k, torch.zeros((), device=self._device)) for k in keys]
        )
        packed = self._dp.sum_tensor(packed).cpu()
        metrics: Metrics = {"loss": float(packed[0])}
        metrics.update({k: float(packed[j + 1]) for j, k in enumerate(keys)})
        metrics["num_micro_batches"] = float(n)
        return metrics

    def _reduce_new_grads(self, params: list[nn.Parameter]) -> None:
        """Turn this rank's gradients of the call into the sum over ranks (once per call)."""
        if not self._dp.active:
            return
        if not self._fsdp:
            self._dp.sum_grads(params, self._options.allreduce_bucket_bytes)
        elif self._grad_scale != 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(self._grad_scale)

    def _set_grad_sync(self, sync: bool) -> None:
        fn = getattr(self._model, "set_requires_gradient_sync", None)
        if fn is not None:
            fn(sync)

    def optimizer_step(self) -> StepMetrics:
        """Clip, step AdamW and the schedule, zero the gradients; skip on a non-finite grad norm."""
        where = f"HFTrainingEngine.optimizer_step ({self._spec.role})"
        if self._optimizer is None or self._scheduler is None:
            raise ConfigError(f"{where}: the reference engine has no optimizer")
        self._require_onloaded(where)
        if self._master is not None:
            self._master.load_grads()
            params: list[Tensor] = list(self._master.masters)
        else:
            params = [p for p in self._model.parameters() if p.requires_grad]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self._device)
        full = getattr(norm, "full_tensor", None)
        if full is not None:
            norm = full()
        norm = norm.float()
        lr = float(self._optimizer.param_groups[0]["lr"])
        self._grads_pending = False
        if not self._dp.all_finite(norm):
            self._optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=float(norm), lr=lr, skipped=True)
        clip = self._spec.optim.grad_clip
        if clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        self._optimizer.step()
        if self._master is not None:
            self._master.store()
        self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._step += 1
        return StepMetrics(grad_norm=float(norm), lr=lr, skipped=False)

    # ------------------------------------------------------------------ weights
    def _live_state(self) -> dict[str, Tensor]:
        """Name -> the tensor the model holds now under each exported name (its state dict).

        Read through each name's owning module (found once), not by walking the whole module
        tree as ``state_dict()`` does: a sync asks for it every step. A parameter replaced or
        moved since the last call is seen as it is now.
        """
        if self._owners is None:
            owners = []
            for name in self._names:
                prefix, _, attr = name.rpartition(".")
                owners.append((name, self._model.get_submodule(prefix), attr))
            self._owners = owners
        return {name: getattr(module, attr) for name, module, attr in self._owners}

    def _full_tensors(self, state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        for name in self._names:
            t = state[name]
            full = getattr(t, "full_tensor", None)
            yield name, (full() if full is not None else t)

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Stream the weights in transformers naming (manifest, chunks, commit).

        Under FSDP2 every rank must consume the stream (each tensor is gathered collectively).
        """
        self._require_onloaded("HFTrainingEngine.export_weights")
        state = self._live_state()
        infos = {
            n: TensorInfo(tuple(state[n].shape), dtype if dtype is not None else state[n].dtype)
            for n in self._names
        }
        manifest = WeightManifest(version=self._step, tensors=infos, tied_embeddings=self._tied)
        return stream_weights(self._full_tensors(state), manifest, bucket_bytes=bucket_bytes, dtype=dtype)

    # ------------------------------------------------------------------ checkpoints
    def _full_model_state(self) -> dict[str, Tensor]:
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            sd = get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = self._model.state_dict()
        keep = set(self._names)
        return {k: v.detach().cpu().contiguous() for k, v in sd.items() if k in keep and isinstance(v, Tensor)}

    def _optimizer_state(self) -> dict[str, Any]:
        assert self._optimizer is not None
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            return dict[str, Any](get_optimizer_state_dict(
                self._model, self._optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ))
        state: dict[str, Any] = _to_cpu(self._optimizer.state_dict())
        return state

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model (safetensors), optimizer, scheduler, RNG and step atomically under ``path``.

        ``path`` is a folder holding committed states and a ``latest`` pointer; a crash at any
        point leaves the previous state loadable. Every data-parallel rank must call this.
        """
        self._require_onloaded("HFTrainingEngine.save_checkpoint")
        root = Path(path)
        name = self._dp.broadcast_str(ckpt.new_state_name(self._step))
        part = ckpt.partial_dir(root, name)
        if self._dp.rank == 0:
            part.mkdir(parents=True, exist_ok=False)
        self._dp.barrier()
        model_state = self._full_model_state()
        optim_state = self._optimizer_state() if self._optimizer is not None else None
        if self._dp.rank == 0:
            save_file(model_state, str(part / "model.safetensors"), metadata={"format": "pt"})
            torch.save(
                {
                    "format": ckpt.CHECKPOINT_FORMAT,
                    "step": self._step,
                    "role": self._spec.role,
                    "optimizer": optim_state,
                    "master_weights": self._master.state() if self._master is not None else None,
                    "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
                },
                part / "trainer_state.pt",
            )
        torch.save(ckpt.get_rng_state(), part / f"rng_rank{self._dp.rank}.pt")
        self._dp.barrier()
        if self._dp.rank == 0:
            ckpt.commit_state_dir(root, name)
        self._dp.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore the state :meth:`save_checkpoint` committed under ``path`` exactly.

        Every file is read and every tensor checked against the live engine before anything is
        restored: model tensors by name, shape and dtype; float32 masters and Adam moments by
        name and shape (moments may come in another floating dtype: a checkpoint of a run
        without masters restores into one with them); step counters and the RNG state by form.
        A refused load leaves the engine as it was.

        Raises:
            ConfigError: ``path`` holds no committed checkpoint.
            CheckpointError: the checkpoint does not fit this engine (a tensor missing,
                unexpected or of another shape or dtype, optimizer state for other parameters,
                a broken step counter or RNG state); the message names the tensor, what was
                saved, what this engine expects and the checkpoint folder.
        """
        self._require_onloaded("HFTrainingEngine.load_checkpoint")
        state_dir = ckpt.current_state_dir(path)
        weights = load_file(str(state_dir / "model.safetensors"))
        trainer = torch.load(state_dir / "trainer_state.pt", map_location="cpu", weights_only=True)
        rng_file = state_dir / f"rng_rank{self._dp.rank}.pt"
        if not rng_file.exists():
            rng_file = state_dir / "rng_rank0.pt"
        rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        self._verify_checkpoint(state_dir, weights, trainer, rng)
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self._model, dict[str, Any](weights), options=opts)
            if self._optimizer is not None and trainer["optimizer"] is not None:
                set_optimizer_state_dict(self._model, self._optimizer, trainer["optimizer"], options=opts)
        else:
            with torch.no_grad():
                params = dict(self._model.state_dict())
                for name, value in weights.items():
                    params[name].copy_(value.to(params[name].device))
            if self._master is not None:
                masters = trainer.get("master_weights")
                if masters is not None:
                    self._master.load_state(masters)
                else:  # a checkpoint of a pure-precision engine: start the masters from its weights
                    self._master.reload()
            if self._optimizer is not None and trainer["optimizer"] is not None:
                self._optimizer.load_state_dict(trainer["optimizer"])
        if self._scheduler is not None and trainer["scheduler"] is not None:
            self._scheduler.load_state_dict(trainer["scheduler"])
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self._grads_pending = False
        self._step = int(trainer["step"])
        ckpt.set_rng_state(rng)

    def _verify_checkpoint(self, folder: Path, weights: dict[str, Tensor], trainer: Any, rng: Any) -> None:
        """Refuse a checkpoint that does not fit this engine (see :meth:`load_checkpoint`); copies nothing."""
        if not isinstance(trainer, dict) or trainer.get("format") != ckpt.CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: trainer_state.pt is not a {ckpt.CHECKPOINT_FORMAT} state; "
                "load a checkpoint written by HFTrainingEngine.save_checkpoint"
            )
        live = self._live_state()
        verify_tensors(weights, {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in live.items()}, checkpoint=folder)
        verify_step_count(trainer.get("step"), name="step", checkpoint=folder)
        trainable = [(n, p) for n, p in self._model.named_parameters() if p.requires_grad]
        masters = trainer.get("master_weights")
        if masters is not None:
            if not isinstance(masters, list | tuple):
                raise CheckpointError(
                    f"checkpoint {str(folder)!r}: the float32 masters are a {type(masters).__name__}, not a "
                    "list of tensors; the file is corrupted or foreign"
                )
            labels = [n for n, _ in trainable] + [f"#{i}" for i in range(len(trainable), len(masters))]
            verify_tensors(
                dict(zip(labels, masters, strict=False)),
                {n: TensorInfo(tuple(p.shape), torch.float32) for n, p in trainable},
                checkpoint=folder, what="float32 master",
            )
        if self._optimizer is not None and trainer.get("optimizer") is not None:
            self._verify_optimizer_state(folder, trainer["optimizer"], [n for n, _ in trainable])
        if self._scheduler is not None and trainer.get("scheduler") is not None:
            sched = trainer["scheduler"]
            verify_step_count(
                sched.get("last_epoch") if isinstance(sched, dict) else sched, name="scheduler last_epoch",
                checkpoint=folder,
            )
        ckpt.verify_rng_state(rng, folder)

    def _verify_optimizer_state(self, folder: Path, saved: Any, names: list[str]) -> None:
        """Adam's state against the live optimizer: the same groups, moments shaped like their parameter."""
        assert self._optimizer is not None
        live_groups = self._optimizer.param_groups
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        state = saved.get("state") if isinstance(saved, dict) else None
        if (
            not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(live_groups)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        ):
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: the optimizer state is not a torch optimizer state with "
                f"{len(live_groups)} parameter group(s); load a checkpoint of an engine with the same model"
            )
        expected: dict[str, TensorInfo] = {}
        got: dict[str, Any] = {}
        listed: set[Any] = set()
        order = iter(names)
        for g, (sg, lg) in enumerate(zip(groups, live_groups, strict=True)):
            if len(sg["params"]) != len(lg["params"]):
                raise CheckpointError(
                    f"checkpoint {str(folder)!r}: optimizer parameter group {g} holds {len(sg['params'])} "
                    f"parameters, this engine's {len(lg['params'])}; load a checkpoint of the same model"
                )
            for key, param in zip(sg["params"], lg["params"], strict=True):
                name = next(order)
                listed.add(key)
                entry = state.get(key)
                if entry is None:
                    continue  # a parameter the optimizer has not stepped yet
                if not isinstance(entry, dict):
                    entry = {}  # reported below as missing moments
                verify_step_count(entry.get("step"), name=f"{name} Adam step", checkpoint=folder)
                info = TensorInfo(tuple(param.shape), param.dtype)
                expected |= {f"{name}.exp_avg": info, f"{name}.exp_avg_sq": info}
                got |= {f"{name}.{k}": v for k, v in entry.items() if k != "step"}
        stray = set(state) - listed
        if stray:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: the optimizer state holds entries for {len(stray)} parameters "
                "this engine's optimizer does not have; load a checkpoint of the same model"
            )
        verify_tensors(got, expected, checkpoint=folder, what="optimizer state", exact_dtype=False)

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU (a no-op on CPU)."""
        if self._device.type == "cpu" or self._offloaded:
            self._offloaded = self._device.type != "cpu"
            return
        self._move(torch.device("cpu"))
        self._offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move everything back to the engine's device."""
        if not self._offloaded:
            return
        self._move(self._device)
        self._offloaded = False

    def _move(self, device: torch.device) -> None:
        # The weight buffer would keep the old device's memory alive once the parameters move; it
        # is rebuilt when they come back.
        self._flat = None
        self._model.to(device)
        if self._master is not None:
            self._master.to(device)
        if self._optimizer is not None:
            for state in self._optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, Tensor) and k != "step":
                        state[k] = v.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if device == self._device and self._spec.role == "actor" and not self._fsdp:
            self._flat = FlatParameters.build(self._live_state())

    def close(self) -> None:
        """Drop the model and optimizer."""
        self._optimizer = None
        self._scheduler = None
        self._master = None
        self._model = None


def _zero_link(outputs: dict[str, Tensor], device: torch.device) -> Tensor:
    """Zero that depends on every output: backward through it touches every parameter, adding 0."""
    total = torch.zeros((), device=device)
    for v in outputs.values():
        total = total + v.sum()
    return total * 0.0


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _apply_fsdp2(model: Any) -> None:
    """Shard each decoder layer, then the root (``torch.distributed.fsdp.fully_shard``)."""
    from torch.distributed.fsdp import fully_shard

    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(
            f"FSDP2 data parallel needs a decoder with .model.layers; {type(model).__name__} has none. "
            "Set options={'data_parallel': 'allreduce'}"
        )
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def build_training_engine(spec: EngineSpec) -> HFTrainingEngine:
    """Factory of the ``hf`` backend's actor, reference and critic engines."""
    return HFTrainingEngine(spec)
