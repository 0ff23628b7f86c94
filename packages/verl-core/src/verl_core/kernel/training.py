"""The TrainingEngine protocol and the loss-function contract it runs.

Loss and distribution (docs/architecture.md): the controller holds the global batch and computes
:class:`GlobalBatchStats` for each optimizer step's mini-batch. ``forward_backward`` is called once
per optimizer step with this rank's share of the whole mini-batch; the engine splits it into
micro-batches with the kernel's one partitioner (:func:`~verl_core.kernel.batch.partition_by_token_budget`,
through :meth:`TensorBatch.micro_batches <verl_core.kernel.batch.TensorBatch.micro_batches>`) under
the token budget the caller passes (else the spec's). A :class:`LossFn` returns a scalar already
normalised by the *global* counts, so the sum of its gradients over all micro-batches and ranks is
the gradient of the global loss. Engines undo framework averaging (DDP/FSDP mean over ranks,
Megatron's division by the number of micro-batches), so results do not depend on micro-batch size
or data-parallel degree. Gradients are reduced over data-parallel ranks once per call, at its end;
a call that raises leaves no gradients, so the caller may run the whole call again (e.g. on a
smaller budget after an out-of-memory error).
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import Tensor

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import TrainingCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError

if TYPE_CHECKING:
    from verl_core.kernel.tokenizer import Tokenizer
    from verl_core.kernel.weights import WeightMessage

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GlobalBatchStats",
    "LossFn",
    "LossOutput",
    "Metrics",
    "ModelOutput",
    "StepMetrics",
    "TrainingEngine",
    "dp_shard",
]

Metrics = dict[str, float]
"""Named scalar metrics of one call."""

ModelOutput = Literal["log_probs", "entropy", "values"]
"""An output a training engine's forward computes, named as the batch field it fills."""

_LOG_PROBS_ONLY: frozenset[ModelOutput] = frozenset({"log_probs"})

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Bytes per weight-stream chunk by default (export and StreamWeightSync): a chunk costs host work."""


@dataclass(frozen=True)
class GlobalBatchStats:
    """Counts over the whole mini-batch of one optimizer step, across all data-parallel ranks.

    Attributes:
        num_samples: Samples in the mini-batch, including empty responses and padding samples.
        num_sequences: Samples with at least one loss token (``TensorBatch.loss_mask``).
        num_tokens: Loss tokens in the mini-batch.
        max_response_len: Padded response width of the mini-batch (for length-normalised modes).
    """

    num_samples: int
    num_sequences: int
    num_tokens: int
    max_response_len: int

    @classmethod
    def of(cls, batch: TensorBatch) -> GlobalBatchStats:
        """Counts of a global mini-batch (needs ``response_mask``; counts over ``batch.loss_mask``)."""
        batch.require("response_mask", where="GlobalBatchStats.of")
        mask = batch.loss_mask
        per_seq = mask.sum(1)
        return cls(
            num_samples=batch.batch_size,
            num_sequences=int((per_seq > 0).sum()),
            num_tokens=int(per_seq.sum()),
            max_response_len=int(mask.shape[1]),
        )


@dataclass(frozen=True)
class LossOutput:
    """What a loss function returns for one micro-batch.

    Attributes:
        loss: Scalar tensor, this micro-batch's contribution to the global loss (already divided by
            the global counts); backward of it accumulates this share of the global gradient.
        metrics: Detached scalar contributions; summing each over micro-batches and ranks gives the
            global value (e.g. clip fraction = clipped tokens / global tokens).
    """

    loss: Tensor
    metrics: Mapping[str, Tensor] = field(default_factory=dict)


class LossFn(Protocol):
    """A loss over a micro-batch whose model outputs the engine has filled in (with gradients)."""

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """The model outputs the engine must compute and put in the batch (with autograd)."""
        ...

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """Compute the loss of ``batch`` (a micro-batch holding the fields of ``needs``)."""
        ...


@dataclass(frozen=True)
class StepMetrics:
    """Result of one optimizer step.

    Attributes:
        grad_norm: Global L2 norm of the gradients before clipping (inf/nan when not finite).
        lr: Learning rate used for this step.
        skipped: True when the update was skipped on every rank because the grad norm was not finite.
    """

    grad_norm: float
    lr: float
    skipped: bool


def dp_shard(batch: TensorBatch, rank: int, world: int) -> TensorBatch:
    """The share of ``batch`` that data-parallel ``rank`` of ``world`` processes.

    Pieces are consecutive and differ in size by at most one sample.
    """
    return batch.chunk(world)[rank]


class TrainingEngine(Protocol):
    """A model that computes log-probs, entropy and values, and trains under any Algorithm loss.

    Inputs are validated at the boundary: a batch missing a needed field, with a wrong dtype or
    shape, NaN/inf in a float field, wrong padding sides or ids outside the vocabulary raises
    :class:`~verl_core.kernel.errors.BatchValidationError` before any model code runs, and the engine's
    state (weights, optimizer, gradients) is unchanged.
    """

    @property
    @abstractmethod
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""

    @property
    @abstractmethod
    def capabilities(self) -> TrainingCapabilities:
        """What this engine supports."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """Tokenizer of the model."""

    @abstractmethod
    def forward(
        self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS_ONLY
    ) -> TensorBatch:
        """Compute ``outputs`` for the response tokens, without gradients.

        Needs ``prompt_ids``, ``prompt_mask``, ``response_ids``, ``response_mask``; the temperature is
        ``batch.meta.temperature`` (always a float: a batch always has a ``meta``, whose temperature
        defaults to 1.0). Position ids are ``cumsum(attention_mask) - 1`` clipped at 0.
        Log-probs and entropy are computed in float32 from float32-upcast logits, with the
        semantics of the schema's ``log_probs`` field; values are read at the same positions and do
        not depend on the temperature (the value head's output as it is: the trainer's critic
        forward receives the rollout's batch, whose meta holds the sampling temperature).
        A bfloat16 model keeps transformers' float32 islands: RMSNorm normalises in float32 and
        rounds once, the attention softmax runs in float32.

        Returns:
            The input batch updated with the requested fields (float32, 0 where ``batch.loss_mask`` is False).
        """

    @abstractmethod
    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """Compute the gradients of ``loss_fn`` over this rank's share of one optimizer step's mini-batch.

        The engine owns the micro-batch loop: it partitions ``mini_batch`` with
        ``mini_batch.micro_batches(max_tokens=...)`` (the kernel's one partitioner) under the budget
        ``max_tokens`` (tokens per micro-batch; ``micro_batch_cost``), else ``spec.micro_batch_tokens``, else into
        ``spec.micro_batch_size`` samples (the whole share when neither is set), whatever the role (a
        critic's micro-batches are bounded as an actor's). It fills the outputs
        ``loss_fn.needs`` with autograd, calls ``loss_fn`` with the global ``stats`` and
        backpropagates each micro-batch. Every data-parallel rank runs the same number of
        micro-batches (padded with empty ones); the gradients are summed over ranks once, at the end
        of the call, and stay until :meth:`optimizer_step` consumes them.

        Call it once per optimizer step: the gradients of a mini-batch are those of one call.

        A call that raises (invalid input, out of memory, an error of the loss function) leaves no
        gradients: the engine's weights, optimizer state and step count are as before the call and
        its gradients are cleared, so the caller can run the same call again (the trainer's
        scheduler does so with a halved budget after ``torch.OutOfMemoryError``).

        Args:
            mini_batch: This rank's share of the mini-batch (all of it when there is one rank).
            loss_fn: The loss; its ``needs`` name the model outputs to compute.
            stats: Counts of the global mini-batch (over every rank).
            max_tokens: Token budget of one micro-batch for this call (>= the longest sample's
                prompt plus response tokens); None uses the spec's.

        Returns:
            ``loss`` and every metric of the loss function, summed over micro-batches and ranks
            (so they are global values), plus ``num_micro_batches``.

        Raises:
            ConfigError: the previous call's gradients were not consumed by :meth:`optimizer_step`.
            BatchValidationError: invalid input, or ``max_tokens`` below 1 or below a sample's length.
        """

    @abstractmethod
    def optimizer_step(self) -> StepMetrics:
        """Clip gradients, step the optimizer and schedule, and zero the gradients.

        Every role follows ``spec.optim`` alike (a critic clips at ``grad_clip`` as an actor does);
        the grad norm reported is the global one before clipping.

        If the global grad norm is not finite on any rank, every rank skips the update (agreed by
        all-reduce), the weights and optimizer state are untouched, and ``skipped`` is True (a
        critic's non-finite value loss as an actor's policy loss).

        A step whose mini-batch has no loss token (the ``stats.num_tokens`` of the
        :meth:`forward_backward` call before it is 0: every response empty or masked out) has nothing
        to learn: it changes no weight and no optimizer state (no weight decay, no momentum, Adam's
        step counter as it was), drops the call's gradients, and returns grad norm 0 with
        ``skipped`` False; it counts as an applied step, so the learning-rate schedule moves on.
        Every rank agrees, since ``stats`` is global. (Gradients of zero through the model, as a
        data-parallel backward gives, would let AdamW decay the weights and move them along its
        momentum.)
        """

    @abstractmethod
    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Stream the full weights in transformers naming: a manifest, chunks, then a commit.

        Tensors are cast to ``dtype`` (the receiver's) when given; a chunk is valid only until the
        next one is requested. A tied lm_head is not sent. An engine training a LoRA adapter
        (``spec.lora``) streams the merged weights ``W + alpha / rank * B A`` of the base model's
        tensors, each merged as the stream reaches it. See :mod:`verl_core.kernel.weights`.
        """

    def base_forward(
        self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS_ONLY
    ) -> TensorBatch:
        """:meth:`forward` of the base model: the LoRA adapter (and fully trained modules) left out.

        An engine built with ``spec.lora`` (``capabilities.lora``) computes what an engine without
        it computes on the base weights, with the same rules as :meth:`forward`: a frozen reference
        policy that costs no second model. The trainer calls it and :meth:`forward` on one engine
        at the same time, from two threads (a step's reference and actor forwards run
        concurrently): neither may see the other's adapter state, so pass the choice down the call
        or hold one lock around every forward that switches it (peft's ``disable_adapter()``
        does). The default refuses.

        Raises:
            ConfigError: the engine trains no adapter.
        """
        raise ConfigError(
            f"{type(self).__name__}.base_forward: the engine trains no LoRA adapter (spec.lora is None or "
            "capabilities.lora is False); use a reference engine of the base model instead"
        )

    def export_adapter(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        """Stream the trained part of a LoRA engine: a manifest, chunks, then a commit.

        Names are transformers module paths: ``<module>.lora_A.weight`` (rank x in) and
        ``<module>.lora_B.weight`` (out x rank) for each target module, and the tensors of the
        fully trained modules (``spec.lora.full``) under their own names. Tensors keep their
        dtypes; the manifest's version is the optimizer step. A rollout engine built with the same
        ``spec.lora`` (``RolloutCapabilities.lora_adapters``) applies it with ``update_weights``.
        The default refuses.

        Raises:
            ConfigError: the engine trains no adapter.
        """
        raise ConfigError(
            f"{type(self).__name__}.export_adapter: the engine trains no LoRA adapter (spec.lora is None or "
            "capabilities.lora is False); export_weights streams its full weights"
        )

    @abstractmethod
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer, scheduler, RNG states and step atomically to the folder ``path``.

        The model is every trained tensor (a critic's value head, ``score.*``, with its backbone), and
        the optimizer state is that of each of them: an engine loaded from the folder gives the same
        forward and the same next updates as the engine that saved it.

        The folder is created when missing (parents included). A crash at any point leaves a
        previous checkpoint at ``path`` loadable: write each file with
        :func:`~verl_core.enginekit.checkpoint.write_atomic`, or a temporary folder renamed into place.
        """

    @abstractmethod
    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` exactly (weights-only loading).

        Every rank calls it with the same ``path``. A checkpoint saved under another parallel layout
        (``EngineSpec.parallel``) is restored whole, optimizer state included, or refused with a
        :class:`~verl_core.kernel.errors.CheckpointError` naming both layouts; never loaded in part.
        """

    @abstractmethod
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state off the accelerator (no-op on CPU),
        releasing their device memory (a critic's value head and its optimizer state too).

        :meth:`onload` brings every one of them back unchanged, a critic's value head and its
        optimizer state included: the next updates are those of an engine never offloaded.
        """

    @abstractmethod
    def onload(self) -> None:
        """Undo :meth:`offload`."""

    def close(self) -> None:
        """Release resources (processes, memory). The engine is unusable afterwards.

        Ends every child process and non-daemon thread the engine started, and may be called
        more than once (``robustness::close_ends_what_the_engine_started``).
        """
        return None

