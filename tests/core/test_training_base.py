"""TrainingEngineBase answers a batch of 0 rows itself: forward's ``[0, width]`` outputs, forward_backward's refusal."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Iterator

import pytest
import torch

from verl_conformance.testkit import random_batch
from verl_core import (
    BatchValidationError,
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    LossOutput,
    Metrics,
    ModelOutput,
    StepMetrics,
    TensorBatch,
    Tokenizer,
    TrainingCapabilities,
    WeightMessage,
)
from verl_core.enginekit.byo import in_memory_spec
from verl_core.enginekit.training_base import TrainingEngineBase
from verl_core.kernel.engine import ParallelSizes
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES


class _NoModel(TrainingEngineBase):
    """An engine whose hooks record their calls and compute zeros (no model)."""

    def __init__(self, role: str = "actor", dp: int = 1) -> None:
        spec = in_memory_spec(dtype=torch.float32, device="cpu")
        self._spec = dataclasses.replace(spec, role=role, parallel=ParallelSizes(dp=dp))  # type: ignore[arg-type]
        self._caps = TrainingCapabilities(log_probs=role != "critic", entropy=role != "critic",
                                          values=role == "critic")
        self.calls: list[tuple[str, int]] = []
        self._init_training()

    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        return self._caps

    @property
    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    def _forward(self, batch: TensorBatch, outputs: Collection[ModelOutput], *, where: str) -> TensorBatch:
        self.calls.append(("_forward", batch.batch_size))
        rows, width = batch["response_ids"].shape
        return batch.update({name: torch.zeros(rows, width) for name in outputs})

    def _forward_backward(self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *,
                          max_tokens: int | None, where: str) -> Metrics:
        self.calls.append(("_forward_backward", mini_batch.batch_size))
        return {"loss": 0.0, "num_micro_batches": 1.0}

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        return StepMetrics(grad_norm=0.0, lr=1e-3, skipped=False)

    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        return 0

    def export_weights(self, *, dtype: torch.dtype | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        return iter(())

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        pass

    def offload(self) -> None:
        pass

    def onload(self) -> None:
        pass


class _Loss:
    needs: frozenset[ModelOutput] = frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        raise AssertionError("the loss must not run")


def _batches() -> tuple[TensorBatch, TensorBatch]:
    """A batch of three samples (response width 8) and its first 0 rows (the widths kept)."""
    full = random_batch(batch_size=3, max_prompt=6, max_response=8, seed=1, with_rl_fields=True)
    return full, full.index(slice(0, 0))


@pytest.mark.parametrize(("role", "outputs"), [("actor", ("log_probs", "entropy")), ("reference", ("log_probs",)),
                                               ("critic", ("values",))])
def test_forward_of_zero_rows_is_answered_without_the_model(role: str, outputs: tuple[ModelOutput, ...]) -> None:
    engine = _NoModel(role)
    full, empty = _batches()
    out = engine.forward(empty, outputs)
    assert engine.calls == [], f"_forward ran on 0 rows: {engine.calls}"
    assert out.batch_size == 0
    for name in outputs:
        assert tuple(out[name].shape) == (0, full.response_len) and out[name].dtype == torch.float32, name
    assert set(empty.keys()) <= set(out.keys()), "forward dropped input fields"
    engine.forward(full, outputs)
    assert engine.calls == [("_forward", 3)]


def test_forward_of_zero_rows_is_validated() -> None:
    engine = _NoModel()
    _, empty = _batches()
    with pytest.raises(BatchValidationError, match=r"_NoModel\.forward \(actor\).*response_mask"):
        engine.forward(empty.drop("response_mask"))
    with pytest.raises(ConfigError, match=r"unknown model outputs \['logits'\]"):
        engine.forward(empty, ["logits"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"actor engine computes \['entropy', 'log_probs'\], not \['values'\]"):
        engine.forward(empty, ["values"])
    with pytest.raises(ConfigError, match=r"critic engine computes \['values'\], not \['log_probs'\]"):
        _NoModel("critic").forward(empty)
    assert engine.calls == []


def test_forward_backward_of_zero_rows_is_refused_and_leaves_nothing_pending() -> None:
    engine = _NoModel()
    full, empty = _batches()
    with pytest.raises(BatchValidationError, match=r"forward_backward \(actor\): the mini-batch has 0 rows.*"
                                                   r"skips its update"):
        engine.forward_backward(empty, _Loss(), GlobalBatchStats.of(full))
    assert engine.calls == []
    engine.forward_backward(full, _Loss(), GlobalBatchStats.of(full))  # not refused as a second call
    assert engine.calls == [("_forward_backward", 3)]


def test_a_zero_row_share_of_several_processes_goes_to_the_hooks() -> None:
    """With dp > 1 the ranks' collectives need every rank: the 0-row share reaches the engine's hooks."""
    engine = _NoModel(dp=2)
    full, empty = _batches()
    out = engine.forward(empty, ["log_probs"])
    assert tuple(out["log_probs"].shape) == (0, full.response_len)
    engine.forward_backward(empty, _Loss(), GlobalBatchStats.of(full))
    assert engine.calls == [("_forward", 0), ("_forward_backward", 0)]


def test_an_engine_that_overrides_forward_itself_still_builds_and_runs() -> None:
    """Engines written before the ``_forward`` hook override ``forward``: they build, their forward
    runs (0 rows included: the answer is theirs), and one with neither fails at its first forward."""

    class _OwnForward(_NoModel):
        _forward = TrainingEngineBase._forward  # type: ignore[assignment]  # the base's: not implemented

        def forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
            self.calls.append(("forward", batch.batch_size))
            return batch.update({name: torch.ones(batch.batch_size, batch.response_len) for name in outputs})

    own = _OwnForward()
    batch = random_batch(batch_size=2, max_prompt=4, max_response=3, seed=1)
    assert float(own.forward(batch)["log_probs"].sum()) == batch.batch_size * batch.response_len
    assert own.calls == [("forward", 2)]

    class _Neither(_NoModel):
        _forward = TrainingEngineBase._forward  # type: ignore[assignment]

    with pytest.raises(NotImplementedError, match=r"_Neither implements neither _forward"):
        _Neither().forward(batch)


class _Recording(_NoModel):
    """Records what :attr:`_nothing_to_learn` said at each ``_optimizer_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        self.seen.append(self._nothing_to_learn)
        return super()._optimizer_step(where=where)


def test_nothing_to_learn_follows_the_global_loss_tokens_of_the_pending_call() -> None:
    from verl_conformance.testkit import emptied

    engine = _Recording()
    full, _ = _batches()
    empty = emptied(full)
    assert GlobalBatchStats.of(empty).num_tokens == 0 and GlobalBatchStats.of(full).num_tokens > 0
    # the flag follows the global stats, not this rank's share: a rank whose share is all empty learns
    # when the global batch has loss tokens
    for batch, stats, expected in [(empty, GlobalBatchStats.of(empty), True), (full, GlobalBatchStats.of(full), False),
                                   (empty, GlobalBatchStats.of(full), False)]:
        engine.forward_backward(batch, _Loss(), stats)
        engine.optimizer_step()
        assert engine.seen[-1] is expected
    assert engine.step == 3, "a step with nothing to learn still counts (the schedule moves on)"
    assert engine._nothing_to_learn is False, "the flag outlives its step"
    engine.forward_backward(empty, _Loss(), GlobalBatchStats.of(empty))
    engine.load_checkpoint("unused")
    assert engine._nothing_to_learn is False, "a load drops the pending call and its flag"
