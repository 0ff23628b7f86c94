"""The Megatron TrainingEngine: megatron-core GPTModel under tensor, pipeline and data parallelism.

The engine validates inputs and composes its parts, each in its own module: the model stage and its
layout (:mod:`verl_megatron.stage`), the micro-batch loop run by megatron-core's pipeline schedules
(:mod:`verl_megatron.micro_batches`, which documents the model's input layout and how gradients
are made global), the optimizer (:mod:`verl_megatron.stage_optimizer`), whole-tensor gathering for
the weight stream (:mod:`verl_megatron.weight_export`), checkpoints
(:mod:`verl_megatron.engine_checkpoint`) and the colocated switch of optimizer state
(:mod:`verl_megatron.state_switch`).

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

import os
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import Tensor

from verl_core import (
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TensorBatch,
    Tokenizer,
    TrainingCapabilities,
    WeightMessage,
)
from verl_core.enginekit.gates import check_model_inputs, refuse_undeclared
from verl_core.enginekit.hf_tokenizer import load_tokenizer
from verl_core.enginekit.precision import MasterWeights
from verl_core.enginekit.training_base import TrainingEngineBase
from verl_core.kernel.registry import parse_options
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_megatron.capabilities import training_capabilities
from verl_megatron.convert import StateDictAdapter
from verl_megatron.core_optimizer import CoreOptimizer
from verl_megatron.engine_checkpoint import StageCheckpoint
from verl_megatron.micro_batches import MicroBatchLoop
from verl_megatron.model import (
    build_stage,
    load_hf_state_dict,
    load_stage_weights,
    model_dims,
    seeded_value_head,
)
from verl_megatron.options import MegatronOptions
from verl_megatron.packed import packing_unsupported
from verl_megatron.parallel import ParallelConfig, init_distributed
from verl_megatron.stage import Stage
from verl_megatron.stage_optimizer import StageOptimizer
from verl_megatron.state_switch import TrainingStateSwitch
from verl_megatron.weight_export import Gatherable, StageWeights

__all__ = ["MegatronTrainingEngine", "build_training_engine"]

_LOG_PROBS_ONLY: frozenset[ModelOutput] = frozenset({"log_probs"})


def build_training_engine(spec: EngineSpec) -> MegatronTrainingEngine:
    """Factory of the actor, reference and critic roles (the plugin's import string)."""
    return MegatronTrainingEngine(spec)


class MegatronTrainingEngine(TrainingEngineBase):
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
        self._device = _resolve_device(spec.device)
        # float16 (it would need loss scaling) and gradient checkpointing (megatron-core's recompute is
        # not wired to the trainer's memory budget, and on CPU it cannot restore the CUDA RNG) are refused
        refuse_undeclared(spec, training_capabilities(spec.role), engine="the megatron training engine")
        self._packed = _resolve_packing(self._options, pp=spec.parallel.pp)
        # the folder is refused (unreadable config, family, RoPE, special ids) before any process group exists
        self.dims = model_dims(spec.model_path, "value" if spec.role == "critic" else "lm")
        self._state = init_distributed(
            ParallelConfig.from_sizes(spec.parallel), device=self._device.type, seed=spec.seed
        )
        from megatron.core import parallel_state as ps

        self._ps = ps
        self.tp, self.pp, self.dp = self._state.tp, self._state.pp, self._state.dp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dims.check_parallel(self.tp, self.pp)
        self.adapter = StateDictAdapter(self.dims)
        self._dtype: torch.dtype = spec.torch_dtype
        self.model: Any = build_stage(
            self.dims, tp=self.tp, pp=self.pp, pp_rank=self.pp_rank, dtype=self._dtype,
            device=self._device, attention=self._options.attention,
        )
        hf_state = load_hf_state_dict(spec.model_path)
        if self.dims.head == "value" and "score.weight" not in hf_state:
            # a critic on a causal-LM folder (the policy's): its backbone, and a value head from the seed
            hf_state.pop("lm_head.weight", None)  # the causal LM's output layer is not the critic's
            hf_state.update(seeded_value_head(spec.model_path, self.dims.hidden_size, spec.seed))
        full = self.adapter.from_hf(hf_state)
        load_stage_weights(
            self.model, self.adapter, full, tp_rank=self.tp_rank, tp=self.tp, pp_rank=self.pp_rank, pp=self.pp
        )
        self._tokenizer = load_tokenizer(spec.model_path)
        self._trainable = spec.role in ("actor", "critic")
        self._init_training()
        stage = Stage(self.model, self.adapter, self.dims, ps, self.tp, self.pp, self.dp, self.tp_rank,
                      self.pp_rank, self.dp_rank, self._device, self._dtype)
        self._opt: StageOptimizer | None = None
        if self._trainable:
            self._opt = StageOptimizer(stage, spec, self._options)
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)
        self._loop = MicroBatchLoop(stage, spec, self._opt, packed=self._packed)
        self._weights = StageWeights(stage, self._opt, self._options.export_ranks)
        self._checkpoint = StageCheckpoint(stage, self._weights, self._opt, spec.role)
        self._switch = TrainingStateSwitch(self._opt, self._device)

    # ------------------------------------------------------------------ protocol properties
    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """What this engine supports (``packed_sequences`` when its micro-batches run packed)."""
        return training_capabilities(self._spec.role, packed=self._packed)

    @property
    def packs_sequences(self) -> bool:
        """Whether micro-batches run packed, without padding (``MegatronOptions.pack_sequences`` resolved)."""
        return self._packed

    @property
    def tokenizer(self) -> Tokenizer:
        """Tokenizer of the model folder."""
        return self._tokenizer

    @property
    def options(self) -> MegatronOptions:
        """The validated backend options of the spec."""
        return self._options

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch AdamW (None with megatron's optimizer or for a frozen reference)."""
        return self._opt.optimizer if self._opt is not None else None

    @property
    def _core(self) -> CoreOptimizer | None:
        return self._opt.core if self._opt is not None else None

    @property
    def _master(self) -> MasterWeights | None:
        return self._opt.master if self._opt is not None else None

    def _stepped(self, param: Tensor) -> Tensor:
        """The tensor the optimizer steps for ``param``: its float32 master, or the parameter itself."""
        return self._opt.stepped(param) if self._opt is not None else param

    def _grad(self, param: Tensor) -> Tensor | None:
        """The gradient of ``param`` wherever it is (on its master between ``load_grads`` and the step)."""
        return self._opt.grad(param) if self._opt is not None else param.grad

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (each parameter counted once over all ranks)."""
        return self._opt.grad_norm() if self._opt is not None else 0.0

    # ------------------------------------------------------------------ input handling
    def _validate(self, batch: TensorBatch, where: str, outputs: Collection[str]) -> None:
        self._check_outputs(outputs, where)
        check_model_inputs(batch, self._spec, where=where, vocab_size=self.dims.vocab_size)

    # ------------------------------------------------------------------ compute
    def _forward(self, batch: TensorBatch, outputs: Collection[ModelOutput], *, where: str) -> TensorBatch:
        """Compute ``outputs`` for the response tokens, without gradients (see TrainingEngine).

        A 0-row share (more than one process; the base answers a one-process engine's) gets
        ``[0, width]`` float32 outputs without running the model.
        """
        needed = frozenset(outputs)
        self._validate(batch, where, needed)
        if batch.batch_size == 0:
            return batch.update({n: torch.zeros(0, batch.response_len, dtype=torch.float32, device=batch.device)
                                 for n in needed})
        if not needed:
            return batch
        return self._loop.forward(batch, needed)

    def _forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None,
        where: str,
    ) -> Metrics:
        """The gradients of ``loss_fn`` over this rank's share of one optimizer step.

        Megatron's schedule (``num_microbatches``) runs the micro-batches the kernel partitioner
        cuts under ``max_tokens`` (else the spec's budget or size). A 0-row share (more than one
        process; the base refuses a one-process engine's) runs padding micro-batches only, joining the
        other ranks' collectives, and adds nothing to the gradients or metrics.
        """
        self._validate(mini_batch, where, frozenset(loss_fn.needs))
        onload_s = self._switch.ensure_onloaded()
        metrics = self._loop.forward_backward(mini_batch, loss_fn, stats, max_tokens)
        if onload_s is not None:
            metrics["switch_to_rollout_s"] = self._switch.offload_s
            metrics["switch_to_training_s"] = onload_s
        return metrics

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """Clip, step and zero gradients; all ranks skip together when the grad norm is not finite; after a
        call with no loss token, drop the gradients and change nothing else."""
        if self._opt is None:
            raise ConfigError(f"{where}: the reference engine has no optimizer")
        if self._opt.core is None:
            self._switch.ensure_onloaded()
        return self._opt.step(self._step, learn=not self._nothing_to_learn)

    # ------------------------------------------------------------------ weights
    def _full_tensor(self, name: str, *, what: Gatherable = "param") -> Tensor:
        """Gather the full Megatron tensor ``name`` onto every rank (see :meth:`StageWeights.full_tensor`)."""
        return self._weights.full_tensor(name, what=what)

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Stream the full weights in transformers naming (see TrainingEngine.export_weights).

        Every rank of the group must iterate the stream to the end (the gathers are collectives).
        With the ``export_ranks="first"`` option only global rank 0's chunks carry tensors.
        """
        return self._weights.stream(self._step, dtype=dtype, bucket_bytes=bucket_bytes)

    def hf_state_dict(self, *, grads: bool = False) -> dict[str, Tensor]:
        """The full weights (or their accumulated gradients) in transformers naming, on every rank.

        A collective: every rank of the group must call it.
        """
        return {n: t.clone() for n, t in self._weights.hf_tensors(grad=grads)}

    def stage_parameters(self) -> dict[str, Tensor]:
        """This rank's parameter shards by Megatron global name (each tensor of its stage once).

        The last stage's copy of a tied embedding is left out: the first stage's is the source.
        """
        params = dict(self.model.named_parameters())
        return {g: params[local] for g, local in self.adapter.stage_names(self.pp_rank, self.pp)
                if local == self.adapter.local_name(g, self.pp)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save weights, float32 masters (when kept), Adam moments, step and RNG atomically to ``path``.

        Tensors are stored whole (TP shards joined, PP stages gathered) under Megatron's global
        names, so the checkpoint loads at any TP/PP layout. Global rank 0 writes into a temporary
        folder and swaps it into place, so a crash leaves the previous checkpoint intact. A
        collective: every rank must call it.
        """
        self._switch.ensure_onloaded()
        self._checkpoint.save(path, self._step)

    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Restore a checkpoint written by :meth:`save_checkpoint`, at this engine's TP/PP layout; returns its step.

        Everything is checked before anything is restored (see :meth:`StageCheckpoint.verify`), on
        every rank alike (each reads the whole file), so a refused load raises on all ranks and
        leaves the engine as it was. A checkpoint without float32 masters (saved with
        ``master_weights=False``) starts this engine's masters from its weights.

        Raises:
            ConfigError: the folder is not a verl-megatron checkpoint.
            CheckpointError: the checkpoint does not fit this engine (a tensor missing,
                unexpected or of another shape or dtype, a broken step counter or RNG state); the
                message names the tensor, what was saved, what this engine expects and the folder.
        """
        payload = self._checkpoint.read(path)
        self._switch.ensure_onloaded()
        step = self._checkpoint.restore(payload)
        if self._opt is not None:
            self._opt.clear_grads()
        torch.distributed.barrier()
        return step

    # ------------------------------------------------------------------ colocated switching
    @property
    def training_state_offloaded(self) -> bool:
        """Whether optimizer state and gradients are in CPU memory (see :meth:`offload_training_state`)."""
        return self._switch.offloaded

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
        return self._switch.offload()

    def onload_training_state(self) -> float:
        """Undo :meth:`offload_training_state`; returns the seconds the switch took."""
        return self._switch.onload()

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """No-op: parameters and optimizer state stay where they are (capability ``offload`` is False)."""

    def onload(self) -> None:
        """No-op counterpart of :meth:`offload`."""

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays for other engines)."""
        if self._opt is not None:
            self._opt.close()
        self._opt = None
        self.model = None
        for part in ("_loop", "_weights", "_checkpoint", "_switch"):  # idempotent: close() may come twice
            self.__dict__.pop(part, None)


def _resolve_packing(options: MegatronOptions, *, pp: int) -> bool:
    """``MegatronOptions.pack_sequences`` decided for this layout: True where asked for and possible
    (a ConfigError naming why not otherwise); None (auto) is off until the path has run on a GPU."""
    if not options.pack_sequences:
        return False
    reason = packing_unsupported(attention=options.attention, pp=pp)
    if reason is not None:
        raise ConfigError(f"megatron option pack_sequences=True cannot run here: {reason}; "
                          "set pack_sequences to false or leave it unset")
    return True


def _resolve_device(device: str) -> torch.device:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"EngineSpec.device={device!r} but no CUDA device is available; use 'cpu'")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device != "cpu":
        raise ConfigError(f"EngineSpec.device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device("cpu")
