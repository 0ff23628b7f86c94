"""TrainingEngineBase: what every training engine shares, so a backend writes only its compute.

The rules of :class:`~verl_core.kernel.training.TrainingEngine` that do not depend on the engine
live here once (architecture.md, "Loss and distribution"):

* a reference engine is frozen: :meth:`forward_backward` and :meth:`optimizer_step` refuse it;
* a batch of 0 rows on a one-process engine never reaches the backend's model code: :meth:`forward`
  answers it with ``[0, width]`` float32 outputs (the batch validated as usual), and
  :meth:`forward_backward` refuses it with ``BatchValidationError`` (a step with no samples skips its
  update); with more than one process a rank's 0-row share goes to the hooks, which join the other
  ranks' collectives;
* ``forward_backward`` takes the whole mini-batch of one optimizer step: a second call before
  :meth:`optimizer_step` is refused, and a call that raises leaves no gradients pending;
* ``optimizer_step`` counts a step only when it was not skipped (a non-finite grad norm);
* ``load_checkpoint`` restores the step counter and allows the next ``forward_backward``
  (the gradients themselves are the subclass's to clear in :meth:`_load_checkpoint`).

A backend subclasses it (the way a rollout engine subclasses
:class:`~verl_core.enginekit.rollout_base.RolloutEngineBase`), calls :meth:`_init_training` in its
constructor and implements :meth:`_forward`, :meth:`_forward_backward`, :meth:`_optimizer_step` and
:meth:`_load_checkpoint`, plus the rest of the protocol: the abstract properties ``spec``,
``capabilities`` and ``tokenizer``, and ``export_weights``, ``save_checkpoint``,
``offload`` and ``onload``. ``close`` is a no-op and ``base_forward``/``export_adapter`` refuse
unless overridden.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Collection

import torch

from verl_core.enginekit.gates import MODEL_INPUTS, check_model_inputs
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import BatchValidationError, ConfigError
from verl_core.kernel.training import (
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TrainingEngine,
)

__all__ = ["MODEL_INPUTS", "TrainingEngineBase", "check_model_inputs"]

_LOG_PROBS_ONLY: frozenset[ModelOutput] = frozenset({"log_probs"})
_OUTPUTS = ("log_probs", "entropy", "values")


class TrainingEngineBase(TrainingEngine):
    """A training engine's shared gates: the frozen reference, pending gradients, the step counter."""

    _step: int
    _grads_pending: bool
    _pending_loss_tokens: int | None

    def _init_training(self) -> None:
        """Start with step 0 and no pending gradients (call from the subclass's constructor)."""
        self._step = 0
        self._grads_pending = False
        self._pending_loss_tokens = None

    @property
    def _nothing_to_learn(self) -> bool:
        """Whether the pending gradients come from a call whose global mini-batch has no loss token
        (``GlobalBatchStats.num_tokens == 0``). Read it in :meth:`_optimizer_step`: such a step drops
        the gradients, steps the schedule only and returns grad norm 0, not skipped (see
        :meth:`TrainingEngine.optimizer_step`); ``stats`` is global, so every rank agrees."""
        return getattr(self, "_pending_loss_tokens", None) == 0

    @property
    @abstractmethod
    def spec(self) -> EngineSpec:
        """The spec this engine was built from. Abstract: a backend implements it (usually
        ``return self._spec``); the base class does not store the spec."""

    @property
    def step(self) -> int:
        """Optimizer steps applied (skipped steps are not counted)."""
        return self._step

    @property
    def trainable(self) -> bool:
        """False for a reference engine, which is frozen."""
        return self.spec.role != "reference"

    def _where(self, method: str) -> str:
        """The prefix of the errors of ``method``: ``"MyEngine.method (role)"`` (use it for your own)."""
        return f"{type(self).__name__}.{method} ({self.spec.role})"

    def _no_rows(self, batch: object) -> bool:
        """Whether the base answers ``batch`` itself: a TensorBatch of 0 rows on a one-process engine.

        With more than one process a rank's share may have 0 rows while the others' do not, and
        the engine's collectives (FSDP's gathers, the gradient all-reduce) need every rank: such
        a share goes to the hooks.
        """
        return isinstance(batch, TensorBatch) and batch.batch_size == 0 and self.spec.parallel.world_size == 1

    def _check_outputs(self, outputs: Collection[str], where: str) -> None:
        """Refuse output names other than ``log_probs``, ``entropy`` and ``values``, ``values`` of an
        engine that does not declare ``capabilities.values`` and ``log_probs``/``entropy`` of one that
        does (a critic computes values only).

        Raises:
            ConfigError: naming ``where``, the names refused and what the engine computes.
        """
        unknown = sorted(set(outputs) - set(_OUTPUTS))
        if unknown:
            raise ConfigError(f"{where}: unknown model outputs {unknown}; known: {', '.join(_OUTPUTS)}")
        allowed = {"values"} if self.capabilities.values else {"log_probs", "entropy"}
        bad = sorted(set(outputs) - allowed)
        if bad:
            raise ConfigError(
                f"{where}: the {self.spec.role} engine computes {sorted(allowed)}, not {bad}"
                + ("; values need a critic engine" if "values" in bad else "; log-probs need a causal-LM engine")
            )

    def forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS_ONLY) -> TensorBatch:
        """Compute ``outputs`` for the response tokens, without gradients (see :meth:`TrainingEngine.forward`).

        A batch of 0 rows on a one-process engine is answered here, without :meth:`_forward`:
        the output names are checked (:meth:`_check_outputs`), the batch is validated as a
        backend validates (the model's inputs required, rebuilt through the ``TensorBatch``
        constructor, value-checked), and each requested output comes back float32, shaped
        ``[0, batch.response_len]``, on the batch's device. Any other batch goes to
        :meth:`_forward`.

        Raises:
            ConfigError: an output name the engine does not compute (0 rows).
            BatchValidationError: the 0-row batch misses a model input or is malformed.
        """
        where = self._where("forward")
        if not self._no_rows(batch):
            return self._forward(batch, outputs, where=where)
        self._check_outputs(outputs, where)
        batch.require(*MODEL_INPUTS, where=where)
        try:
            rebuilt = TensorBatch(dict(batch.items()), batch.extras, batch.meta, batch_size=0)
        except BatchValidationError as e:
            raise BatchValidationError(f"{where}: {e}") from None
        rebuilt.check(where=where)
        width = rebuilt.response_len
        return rebuilt.update(
            {name: torch.zeros(0, width, dtype=torch.float32, device=rebuilt.device) for name in outputs}
        )

    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """Compute the gradients of ``loss_fn`` over this rank's share of one optimizer step.

        See :meth:`TrainingEngine.forward_backward` for the contract, including what a call that
        raises leaves (no gradients). A mini-batch of 0 rows on a one-process engine is refused
        before :meth:`_forward_backward` runs: a step with no samples skips its update, so the
        caller calls neither ``forward_backward`` nor ``optimizer_step`` for it (nothing is left
        pending; the gradients of an earlier call stay).

        Raises:
            ConfigError: the engine is a frozen reference, or the previous call's gradients have
                not been applied by :meth:`optimizer_step`.
            BatchValidationError: a mini-batch of 0 rows on a one-process engine.
        """
        where = self._where("forward_backward")
        if not self.trainable:
            raise ConfigError(f"{where}: the reference engine is frozen; train the actor or critic")
        if self._grads_pending:
            raise ConfigError(
                f"{where}: the gradients of the previous call have not been applied; call optimizer_step() "
                "first (forward_backward takes the whole mini-batch of one optimizer step)"
            )
        if self._no_rows(mini_batch):
            raise BatchValidationError(
                f"{where}: the mini-batch has 0 rows; expected at least one sample (a step with no samples "
                "skips its update: call neither forward_backward nor optimizer_step for it)"
            )
        metrics = self._forward_backward(mini_batch, loss_fn, stats, max_tokens=max_tokens, where=where)
        self._grads_pending = True
        self._pending_loss_tokens = stats.num_tokens
        return metrics

    def optimizer_step(self) -> StepMetrics:
        """Apply the pending gradients; the step counts unless it was skipped (non-finite grad norm).

        After a call with no loss token the backend's :meth:`_optimizer_step` reads
        :attr:`_nothing_to_learn` and changes no weight (see :meth:`TrainingEngine.optimizer_step`).

        Raises:
            ConfigError: the engine is a frozen reference (it has no optimizer).
        """
        where = self._where("optimizer_step")
        if not self.trainable:
            raise ConfigError(f"{where}: the reference engine has no optimizer")
        self._grads_pending = False
        try:
            result = self._optimizer_step(where=where)
        finally:
            self._pending_loss_tokens = None
        if not result.skipped:
            self._step += 1
        return result

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` committed under ``path``, then the step counter.

        The pending-call flag is reset, so the next :meth:`forward_backward` is allowed; the
        parameters' gradients are cleared by :meth:`_load_checkpoint`.
        """
        self._step = self._load_checkpoint(path)
        self._grads_pending = False
        self._pending_loss_tokens = None

    # ------------------------------------------------------------------ what a backend implements
    def _forward(self, batch: TensorBatch, outputs: Collection[ModelOutput], *, where: str) -> TensorBatch:
        """The engine's forward of a batch of at least one row (a one-process engine's 0-row batch is
        answered by :meth:`forward`; with more processes a rank's 0-row share comes here too, and
        must join the other ranks' collectives and return ``[0, width]`` outputs).

        Not abstract, so that an engine written before this hook, which overrides :meth:`forward`
        itself, still builds (it then answers 0-row batches itself, as ``robustness::batch_of_zero``
        checks); an engine that overrides neither raises ``NotImplementedError`` at its first forward.

        Validate the batch at the boundary (:meth:`_check_outputs`, then
        :func:`~verl_core.enginekit.gates.check_model_inputs`: the fields, ``batch.check`` and the
        spec's length limits) and return it updated with ``outputs``, float32, shaped like ``response_ids``, 0 where
        ``batch.loss_mask`` is False. ``where`` is ``"<class>.forward (<role>)"``, for the messages
        of the errors you raise.
        """
        raise NotImplementedError(
            f"{where}: {type(self).__name__} implements neither _forward(batch, outputs, *, where) (the hook "
            "TrainingEngineBase.forward calls for a batch of at least one row) nor forward itself"
        )

    @abstractmethod
    def _forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None,
        where: str,
    ) -> Metrics:
        """The engine's gradient computation (the gates above already passed).

        An exception must leave no gradients: clear them (``param.grad = None``) before it
        propagates; the base only refuses a second call before :meth:`optimizer_step`.

        ``where`` names the call for error messages, ``"<class>.forward_backward (<role>)"``
        (``MyEngine.forward_backward (actor)``), as the base's own refusals do: pass it to
        ``batch.require``/``batch.check`` and start the messages of the errors you raise with it.
        """

    @abstractmethod
    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """Clip, step and zero the gradients; all ranks skip together on a non-finite grad norm.

        ``self.step`` is the count of applied steps before this one (the learning rate is
        ``spec.optim.lr_at(self.step)``); do not count the step here: :meth:`optimizer_step`
        counts it when the result is not ``skipped``. ``where`` is ``"<class>.optimizer_step
        (<role>)"``, for the messages of the errors you raise.
        """

    @abstractmethod
    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Check and restore the checkpoint under ``path``; return its step counter.

        Clear the gradients too (``optimizer.zero_grad(set_to_none=True)``): a ``forward_backward``
        before the load may have left some, and the base resets only its pending-call flag, so they
        would add to the next call's.
        """
