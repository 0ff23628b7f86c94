"""HFTrainingEngine: actor, frozen reference and critic over transformers models.

The engine validates inputs and composes its parts, each in its own module: the micro-batch loop
(:mod:`verl_hf.micro_batches`), AdamW with its schedule and float32 masters (:mod:`verl_hf.optim`),
the exported weights and their stream (:mod:`verl_hf.weight_export`), checkpoints
(:mod:`verl_hf.engine_checkpoint`) and offloading (:mod:`verl_hf.offload`).

Layout of one ``forward_backward``: the rank's share of the mini-batch is split into micro-batches
by the kernel partitioner (under the call's token budget, else the spec's budget or size), every
rank runs the same number of them (padding with empty ones that contribute zero gradient), the
outputs the loss needs are computed with autograd, and each micro-batch's loss (already normalised
by the global counts) is backpropagated. Gradients are summed over micro-batches and, once at the
end of the call, over ranks, so results do not depend on micro-batch size or data-parallel degree.
A call that raises clears the gradients it left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Collection, Iterator
from typing import Any, Final

import torch
from torch import Tensor

from verl_core.enginekit.gates import check_model_inputs, refuse_undeclared
from verl_core.enginekit.packed_attention import varlen_attn_available
from verl_core.enginekit.precision import MasterWeights
from verl_core.enginekit.training_base import TrainingEngineBase
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import TrainingCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.registry import parse_options
from verl_core.kernel.training import (
    DEFAULT_BUCKET_BYTES,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
)
from verl_core.kernel.weights import WeightMessage
from verl_hf.capabilities import training_capabilities
from verl_hf.config import HFOptions
from verl_hf.distributed import DataParallel, init_data_parallel
from verl_hf.engine_checkpoint import EngineCheckpoint
from verl_hf.fused_elementwise import (
    compile_decoder_layers,
    compiled_layers,
    fuse_elementwise,
    fused_modules,
)
from verl_hf.lora import HFLora
from verl_hf.micro_batches import MicroBatchLoop
from verl_hf.modeling import (
    FlatParameters,
    ModelKind,
    load_model,
    packing_unsupported,
    register_packed_sdpa,
)
from verl_hf.offload import Offloader
from verl_hf.optim import HFOptimizer
from verl_hf.tokenizer import HFTokenizer, load_tokenizer
from verl_hf.weight_export import LoraWeightExport, WeightExport

__all__ = ["HFTrainingEngine", "build_training_engine"]

_LOG_PROBS_ONLY: Final[frozenset[ModelOutput]] = frozenset({"log_probs"})


class HFTrainingEngine(TrainingEngineBase):
    """A transformers model as a verl TrainingEngine (roles actor, reference and critic).

    The actor and reference load ``AutoModelForCausalLM``; the critic loads
    ``AutoModelForTokenClassification`` with one label (a value head on the final hidden state),
    initialising the head from ``spec.seed`` when the folder holds a causal LM. Dropout is off.
    Parameters are kept in ``spec.dtype``; with bfloat16 the optimizer updates float32 master
    copies and rounds them into the model after each step (``HFOptions.master_weights``), and
    log-probs, entropy and values are always computed in float32 from upcast logits. The optimizer is AdamW with
    linear warmup and constant or cosine decay (``spec.optim``), applying weight decay to every
    trained parameter.

    With ``spec.lora`` (actor only) the engine trains a LoRA adapter injected by peft
    (:class:`~verl_hf.lora.HFLora`): only the adapter and the ``full`` modules get gradients and
    optimizer state (adapters in float32, the frozen base in ``spec.dtype``); ``export_weights``
    streams the merged weights, ``export_adapter`` the adapter, ``base_forward`` runs the base
    model with the adapter disabled, and checkpoints hold the adapter, its optimizer state and the
    base's identity. Forwards of one engine run one at a time then (the disabled state belongs to
    the model).

    Args:
        spec: The engine spec (role actor, reference or critic; ``parallel.tp == parallel.pp == 1``).
        options: Backend options (default: parsed from ``spec.options``).

    Raises:
        ConfigError: wrong role, tensor/pipeline parallel requested, dp > 1 outside torchrun, a
            model folder that cannot be loaded as needed, or a ``spec.lora`` that does not fit
            the model (a pattern matching no module), another role than actor, or FSDP2.
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
        refuse_undeclared(spec, training_capabilities(spec.role), engine="the hf training engine",
                          why="float16 would need loss scaling")
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
            sequence_len=spec.max_prompt_len + spec.max_response_len,
        )
        self._packed = _resolve_packing(self._options.pack_sequences, model, self._device, spec.torch_dtype)
        if self._packed:
            model.set_attn_implementation(register_packed_sdpa())
            # the trainer's scheduler reads it to count a micro-batch's real tokens, as the loop cuts them
            self._caps = dataclasses.replace(self._caps, packed_sequences=True)
        tied = bool(getattr(model.config, "tie_word_embeddings", False)) and self._kind == "causal_lm"
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        fsdp = self._dp.active and self._dp_mode == "fsdp2"
        self._lora: HFLora | None = None
        if spec.lora is not None:
            if spec.role != "actor":
                raise ConfigError(f"EngineSpec.lora: the hf backend trains LoRA adapters for the actor, not the "
                                  f"{spec.role}; build the {spec.role} without lora")
            if fsdp:
                raise ConfigError("EngineSpec.lora with FSDP2 data parallelism is not supported by the hf backend; "
                                  "set options={'data_parallel': 'allreduce'} (the trained adapter is small)")
            self._lora = HFLora(model, spec.lora, tied=tied, seed=spec.seed)
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cuda_bf16 = self._device.type == "cuda" and spec.torch_dtype == torch.bfloat16
        if self._options.fuses_elementwise(self._device, spec.torch_dtype):
            fuse_elementwise(model)
        if not self._trainable:
            model.requires_grad_(False)
        if fsdp:
            _apply_fsdp2(model)
        whole = self._options.compile_layers
        # auto: one-process engines only (measured there; data-parallel ranks keep eager layers unless asked)
        if whole or (whole is None and cuda_bf16 and not self._dp.active):
            compile_decoder_layers(model)  # after FSDP2's wrapping, as torch recommends
        self._model: Any = model
        self._weights = (LoraWeightExport(self._lora) if self._lora is not None
                         else WeightExport(model, tied=tied, fsdp=fsdp, flat=spec.role == "actor" and not fsdp))
        self._tokenizer: HFTokenizer | None = None
        self._init_training()
        self._optim: HFOptimizer | None = None
        if self._trainable:
            self._optim = HFOptimizer(model, spec.optim, self._device, self._dp, fsdp=fsdp,
                                      master_weights=self._options.master_weights)
        self._loop = MicroBatchLoop(model, self._kind, self._device, self._dp, fsdp=fsdp,
                                    allreduce_bucket_bytes=self._options.allreduce_bucket_bytes,
                                    packed=self._packed)
        self._checkpoint = EngineCheckpoint(model, self._weights, self._optim, self._dp, fsdp=fsdp, role=spec.role,
                                            lora=self._lora)
        self._offloader = Offloader(model, self._device, self._weights, self._optim)

    # ------------------------------------------------------------------ properties
    @property
    def fused_elementwise_modules(self) -> int:
        """How many modules run through the compiled element-wise functions (``HFOptions.fused_elementwise``)."""
        return fused_modules(self._model)

    @property
    def compiled_layers(self) -> int:
        """How many decoder layers run ``torch.compile``d whole (``HFOptions.compile_layers``)."""
        return compiled_layers(self._model)

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
    def packs_sequences(self) -> bool:
        """Whether micro-batches run packed, without padding (``HFOptions.pack_sequences`` resolved)."""
        return self._packed

    @property
    def lora(self) -> HFLora | None:
        """The LoRA adapter the engine trains (``spec.lora``), or None."""
        return self._lora

    @property
    def data_parallel_mode(self) -> str:
        """``fsdp2`` or ``allreduce`` (what ``HFOptions.data_parallel='auto'`` resolved to)."""
        return self._dp_mode

    # The one-buffer weight layout and the live tensors are read by the direct weight sync.
    @property
    def _flat(self) -> FlatParameters | None:
        return self._weights.flat

    @_flat.setter
    def _flat(self, value: FlatParameters | None) -> None:
        self._weights.flat = value

    def _live_state(self) -> dict[str, Tensor]:
        return self._weights.live_state()

    def _move(self, device: torch.device) -> None:
        self._offloader.move(device)

    @property
    def _optimizer(self) -> torch.optim.Optimizer | None:
        return self._optim.optimizer if self._optim is not None else None

    @property
    def _master(self) -> MasterWeights | None:
        return self._optim.master if self._optim is not None else None

    # ------------------------------------------------------------------ validation
    def _require_onloaded(self, where: str) -> None:
        if self._offloader.offloaded:
            raise ConfigError(f"{where}: the engine is offloaded; call onload() first")

    # ------------------------------------------------------------------ compute
    def _forward(self, batch: TensorBatch, outputs: Collection[ModelOutput], *, where: str) -> TensorBatch:
        """Compute ``outputs`` (float32, 0 where ``batch.loss_mask`` is False) without gradients.

        A rank's 0-row share (data parallel) runs padding micro-batches, so the ranks' collectives match.
        """
        wanted = set(outputs)
        self._check_outputs(wanted, where)
        self._require_onloaded(where)
        check_model_inputs(batch, self._spec, where=where, vocab_size=self._vocab_size)
        max_tokens = self._options.forward_micro_batch_tokens or self._spec.micro_batch_tokens
        size = None if max_tokens is not None else self._spec.micro_batch_size
        with self._one_at_a_time():
            results = self._loop.forward(batch.to(self._device), wanted, max_tokens, size)
        return batch.update({k: v.to(batch.device) for k, v in results.items()})

    def base_forward(
        self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS_ONLY
    ) -> TensorBatch:
        """:meth:`forward` of the base model: the adapter disabled (peft's ``disable_adapter()``).

        Raises:
            ConfigError: the engine trains no adapter (``spec.lora`` is None).
        """
        if self._lora is None:
            return super().base_forward(batch, outputs)
        with self._lora.disabled():
            return self.forward(batch, outputs)

    def _one_at_a_time(self) -> contextlib.AbstractContextManager[Any]:
        """The model's lock under LoRA (a forward must not see another thread's disabled adapter)."""
        return self._lora.lock if self._lora is not None else contextlib.nullcontext()

    def _forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None,
        where: str,
    ) -> Metrics:
        """The gradients of ``loss_fn`` over this rank's share of one optimizer step.

        Micro-batches hold at most ``max_tokens`` tokens (else ``spec.micro_batch_tokens``, else
        ``spec.micro_batch_size`` samples): padded tokens, or the real tokens when the engine packs
        (:attr:`packs_sequences`, declared as ``capabilities.packed_sequences``).
        """
        self._check_outputs(set(loss_fn.needs), where)
        self._require_onloaded(where)
        check_model_inputs(mini_batch, self._spec, where=where, vocab_size=self._vocab_size)
        budget: int | None = max_tokens if max_tokens is not None else self._spec.micro_batch_tokens
        size = None if max_tokens is not None else self._spec.micro_batch_size
        with self._one_at_a_time():
            return self._loop.forward_backward(
                mini_batch.to(self._device), loss_fn, stats, max_tokens=budget, size=size, where=where
            )

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """Clip, step AdamW and the schedule, zero the gradients; skip on a non-finite grad norm; after
        a call with no loss token, drop the gradients and step the schedule only."""
        if self._optim is None:
            raise ConfigError(f"{where}: the reference engine has no optimizer")
        self._require_onloaded(where)
        return self._optim.step(learn=not self._nothing_to_learn)

    # ------------------------------------------------------------------ weights and checkpoints
    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Stream the weights in transformers naming (manifest, chunks, commit).

        Under FSDP2 every rank must consume the stream (each tensor is gathered collectively).
        """
        self._require_onloaded("HFTrainingEngine.export_weights")
        return self._weights.stream(self._step, dtype=dtype, bucket_bytes=bucket_bytes)

    def export_adapter(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        """Stream the LoRA adapter (``<module>.lora_A.weight``, ``.lora_B.weight``, fully trained tensors).

        Raises:
            ConfigError: the engine trains no adapter (``spec.lora`` is None).
        """
        if not isinstance(self._weights, LoraWeightExport):
            return super().export_adapter(bucket_bytes=bucket_bytes)
        self._require_onloaded("HFTrainingEngine.export_adapter")
        return self._weights.adapter_stream(self._step, bucket_bytes=bucket_bytes)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model (safetensors), optimizer, scheduler, RNG and step atomically under ``path``.

        ``path`` is a folder holding committed states and a ``latest`` pointer; a crash at any
        point leaves the previous state loadable. Every data-parallel rank must call this.
        """
        self._require_onloaded("HFTrainingEngine.save_checkpoint")
        self._checkpoint.save(path, self._step)

    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Restore the state :meth:`save_checkpoint` committed under ``path`` exactly; returns its step.

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
        return self._checkpoint.load(path)

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU (a no-op on CPU)."""
        self._offloader.offload()

    def onload(self) -> None:
        """Move everything back to the engine's device."""
        self._offloader.onload()

    def close(self) -> None:
        """Drop the model and optimizer (and every part holding them)."""
        self._optim = None
        self._model = None
        for part in ("_loop", "_checkpoint", "_offloader"):  # idempotent: close() may come twice
            self.__dict__.pop(part, None)


def _resolve_packing(option: bool | None, model: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """``HFOptions.pack_sequences`` decided for this model, device and dtype (see the option)."""
    if option is False:
        return False
    reason = packing_unsupported(model)
    if option:
        if reason is not None:
            raise ConfigError(f"HFOptions.pack_sequences=True cannot run this model: {reason}; "
                              "set pack_sequences to false or null (auto)")
        return True
    return reason is None and dtype == torch.bfloat16 and varlen_attn_available(device)


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
