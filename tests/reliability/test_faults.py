"""Engine faults during a step, out-of-memory recovery, and the non-finite guard, on real engines.

- An exception in rollout, reward, the actor's forward or update, or the weight sync stops the
  step with a StepFailedError naming the stage and the backend; nothing of the step is written, the
  trainer refuses more steps, and a new trainer resumed from the last checkpoint reproduces the
  uninterrupted run exactly.
- The DynamicBatchScheduler's out-of-memory recovery runs the whole call again on a halved budget,
  and the call that finishes runs every sample exactly once (sample ids counted); with the hf
  engine an OOM in the middle of a call (after earlier micro-batches' backward) leaves no
  gradients, and the retried call gives exactly the gradients of a run without OOM.
- A NaN/inf loss or gradient skips the update (weights untouched), is counted in the metrics, and
  ``max_consecutive_skips`` skips in a row stop the run with TrainingDivergedError after a
  checkpoint holding the last finite weights.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reliability_helpers import comparable, tiny_config

from verl_conformance.testkit import TinyModelSpec, build_tiny_model, random_batch
from verl_core import (
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    TensorBatch,
    get_training_engine,
)
from verl_core.algorithms import Algorithm
from verl_core.kernel.training import LossOutput
from verl_core.trainer import (
    DynamicBatchScheduler,
    MemoryInfo,
    MicroBatchOOMError,
    SchedulerConfig,
    StepFailedError,
    Trainer,
    TrainingDivergedError,
    latest_checkpoint,
)

STEPS = 3
# the actor's separate forward for old log-probs runs (by default one update per batch skips it), so
# a fault in it can be injected like in every other stage
RECOMPUTE = "batch.old_log_probs=recompute"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder every run here shares (built once by a throwaway trainer)."""
    out = tmp_path_factory.mktemp("model-run")
    with Trainer(tiny_config(out, "steps=1")) as t:
        t.setup()
    return out / "model"


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Metrics of the uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    with Trainer(tiny_config(out, f"steps={STEPS}", "checkpoint.every=1", RECOMPUTE, model=model)) as t:
        return comparable(t.train())


class InjectedFaultError(RuntimeError):
    """The injected fault."""


def _raise(*_: Any, **__: Any) -> Any:
    raise InjectedFaultError("injected fault")


def _after(real: Callable[..., Any]) -> Callable[..., Any]:
    """Run the real method (changing engine state), then fail."""

    def wrapped(*a: Any, **k: Any) -> Any:
        real(*a, **k)
        raise InjectedFaultError("injected fault after the engine ran")

    return wrapped


FAULTS: dict[str, tuple[str, Callable[[Trainer], None]]] = {
    # name -> (stage it must be reported as, injection)
    "rollout": ("rollout", lambda t: setattr(t.rollout, "generate", _raise)),
    "reward": ("reward", lambda t: setattr(t.reward, "score", _raise)),
    "actor_forward": ("actor_forward", lambda t: setattr(t.actor, "forward", _raise)),
    "actor_backward": ("actor_update", lambda t: setattr(t.actor, "forward_backward", _after(t.actor.forward_backward))),
    "optimizer_step": ("actor_update", lambda t: setattr(t.actor, "optimizer_step", _after(t.actor.optimizer_step))),
    "oom_in_update": ("actor_update", lambda t: setattr(t.actor, "forward_backward", _oom)),
    "weight_sync": ("weight_sync", lambda t: setattr(t.sync, "sync", _raise)),
}


def _oom(*_: Any, **__: Any) -> Any:
    raise torch.OutOfMemoryError("injected: a single sample does not fit")


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_an_engine_fault_stops_the_step_and_resume_reproduces_the_run(
    fault: str, model: Path, reference: list[dict[str, Any]], tmp_path: Path, tally: Counter[str]
) -> None:
    stage, inject = FAULTS[fault]
    cfg = tiny_config(tmp_path, f"steps={STEPS}", "checkpoint.every=1", RECOMPUTE, model=model)
    with Trainer(cfg) as trainer:
        trainer.setup()
        trainer.train_step()
        first = trainer.save_checkpoint()
        inject(trainer)
        tally[f"fault/engine exception ({fault})"] += 1
        with pytest.raises(StepFailedError) as info:
            trainer.train_step()
        err = info.value
        backend = {"reward": "rule", "weight_sync": "hf -> hf"}.get(stage, "hf")
        assert (err.stage, err.backend, err.step) == (stage, backend, 2)
        assert f"stage {stage!r}" in str(err) and f"backend {backend!r}" in str(err) and str(first) in str(err)
        assert trainer.step == 1
        with pytest.raises(ConfigError, match="failed"):
            trainer.train_step()  # a trainer whose step failed does not go on from a dirty state
    assert latest_checkpoint(tmp_path) == first
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1], "the failed step left metrics behind"
    with Trainer(cfg) as resumed:
        assert comparable(resumed.train(resume=True)) == reference


# ---------------------------------------------------------------------------------------- OOM
def _id_batch(lengths: list[int]) -> TensorBatch:
    """One sample per length (prompt 1 + response length - 1), group id = sample id."""
    width = max(lengths)
    n = len(lengths)
    resp = torch.arange(width).unsqueeze(0) < (torch.tensor(lengths) - 1).clamp_min(0).unsqueeze(1)
    return TensorBatch({
        "prompt_ids": torch.full((n, 1), 5), "prompt_mask": torch.ones(n, 1, dtype=torch.bool),
        "response_ids": torch.full((n, width), 6), "response_mask": resp,
        "group_ids": torch.arange(n),
    })


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    capacity=st.integers(1, 400),
    transient=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=200, deadline=None)
def test_oom_recovery_runs_every_sample_exactly_once(
    lengths: list[int], capacity: int, transient: float, seed: int, tally: Counter[str]
) -> None:
    batch = _id_batch(lengths)
    rng = random.Random(seed)
    ooms = [0]
    longest = max(lengths)

    def call(budget: int) -> list[list[int]]:
        # like an engine's forward_backward: the whole batch under one budget, nothing kept on failure
        ran = []
        for mb in batch.micro_batches(max_tokens=budget):
            cost = mb.batch_size * int(mb.seq_lengths().max())
            # a transient OOM strikes a micro-batch larger than the longest sample alone
            if cost > capacity or (cost > longest and rng.random() < transient):
                ooms[0] += 1
                raise torch.OutOfMemoryError(f"injected: {cost} tokens")
            ran.append(mb["group_ids"].tolist())
        return ran

    sched = DynamicBatchScheduler(
        SchedulerConfig(min_tokens=1, max_tokens=4096, grow_after=2),
        probe=lambda: MemoryInfo(free_bytes=1 << 40, total_bytes=1 << 40),
    )
    error: MicroBatchOOMError | None = None
    try:
        ran = sched.run(batch, call, key="k")
    except MicroBatchOOMError as e:
        error = e
    tally["fault/OOM (scheduler)"] += ooms[0]
    if error is not None:  # only a sample too large on its own may fail, and the error names the floor
        msg = str(error)
        assert longest > capacity and ("on its own" in msg or f"longest sample {longest} tokens" in msg)
        return
    seen = Counter(i for ids in ran for i in ids)
    assert sorted(seen) == list(range(len(lengths))), "a sample was lost"
    assert set(seen.values()) == {1}, "a sample ran twice"
    (decision,) = sched.plan
    assert [list(g) for g in decision.groups] == ran  # the recorded partition is the one that ran


def test_oom_in_the_middle_of_an_hf_call_leaves_exactly_the_gradients_of_a_clean_run(
    tmp_path: Path, tally: Counter[str]
) -> None:
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                                                          head_dim=32, intermediate_size=64))
    batch = random_batch(batch_size=12, max_prompt=6, max_response=6, seed=3, with_rl_fields=True, group_size=2)
    loss = Algorithm.grpo().actor_loss
    stats = GlobalBatchStats.of(batch)
    longest = int(batch.seq_lengths().max())

    def engine() -> Any:
        spec = EngineSpec(model_path=str(path), role="actor", optim=OptimConfig(lr=1e-2))
        return get_training_engine("hf", spec)

    faulty = engine()
    passes = [0]
    budget_now = [0]

    def oom_on_second_pass(module: Any, args: Any, kwargs: Any) -> None:
        passes[0] += 1
        # calls on budgets over two of the longest samples fail on their 2nd pass, after a backward
        if passes[0] >= 2 and budget_now[0] > 2 * longest:
            raise torch.OutOfMemoryError("injected after an earlier micro-batch's backward")

    faulty.model.register_forward_pre_hook(oom_on_second_pass, with_kwargs=True)

    def call(budget: int) -> Any:
        passes[0] = 0
        budget_now[0] = budget
        try:
            return faulty.forward_backward(batch, loss, stats, max_tokens=budget)
        except torch.OutOfMemoryError:
            left = [n for n, p in faulty.model.named_parameters() if p.grad is not None]
            assert not left, f"a failed call left gradients on {left[:3]}"
            raise

    sched = DynamicBatchScheduler(SchedulerConfig(min_tokens=1, max_tokens=8 * longest),
                                  probe=lambda: MemoryInfo(1 << 40, 1 << 40))
    metrics = sched.run(batch, call, key="update")
    ooms = sched.metrics()["scheduler/ooms"]
    tally["fault/OOM (hf engine, mid-call)"] += int(ooms)
    (decision,) = sched.plan
    assert ooms >= 1 and decision.budget <= 2 * longest
    assert metrics["num_micro_batches"] == len(decision.groups) > 1
    clean = engine()
    clean.forward_backward(batch, loss, stats, max_tokens=decision.budget)
    want = {n: p.grad.clone() for n, p in clean.model.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in faulty.model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------------------------------- non-finite guard
class _Poison:
    """Wraps a loss; on the chosen calls makes the loss NaN/inf, or keeps it finite with a NaN gradient."""

    def __init__(self, inner: Any, mode: str | None) -> None:
        self.inner = inner
        self.mode = mode
        self.needs = inner.needs

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        out = self.inner(batch, stats)
        lp = batch["log_probs"]
        # a small extra term so that a finite update always moves the weights (the tiny task's
        # first rewards are all equal, which gives zero advantages)
        loss = out.loss - 1e-2 * (lp * batch["response_mask"]).sum() / max(stats.num_tokens, 1)
        if self.mode == "finite_loss_nan_grad":
            loss = loss + (lp * 0.0).abs().sqrt().sum()  # value 0, gradient 0 * inf = NaN
        elif self.mode is not None:
            loss = loss * float(self.mode)
        return LossOutput(loss, out.metrics)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["nan", "inf", "finite_loss_nan_grad"])
def test_non_finite_updates_are_skipped_counted_and_stop_the_run(
    mode: str, model: Path, tmp_path: Path, tally: Counter[str]
) -> None:
    cfg = tiny_config(tmp_path, "steps=6", "max_consecutive_skips=2", model=model)
    with Trainer(cfg) as trainer:
        trainer.setup()
        m1 = trainer.train_step()
        assert m1["update/nonfinite_skips"] == 0 and m1["actor/skipped"] == 0
        good = _weights(trainer)
        real = trainer.actor.forward_backward
        poisoned = [True]

        def fb(mb: TensorBatch, loss: Any, stats: GlobalBatchStats, **kw: Any) -> Any:
            return real(mb, _Poison(loss, mode if poisoned[0] else None), stats, **kw)

        trainer.actor.forward_backward = fb  # type: ignore[method-assign]
        tally[f"fault/non-finite loss or gradient ({mode})"] += 3
        m2 = trainer.train_step()
        assert m2["update/nonfinite_skips"] == 1 and m2["update/consecutive_nonfinite_skips"] == 1
        assert m2["actor/skipped"] == 1 and not torch.isfinite(torch.tensor(m2["actor/grad_norm"]))
        after = _weights(trainer)
        assert all(torch.equal(good[k], after[k]) for k in good), "a skipped update reached the weights"
        poisoned[0] = False
        m3 = trainer.train_step()  # a finite update resets the count
        assert m3["update/nonfinite_skips"] == 0 and m3["update/consecutive_nonfinite_skips"] == 0
        last_good = _weights(trainer)
        assert not all(torch.equal(good[k], last_good[k]) for k in good)
        poisoned[0] = True
        trainer.train_step()
        with pytest.raises(TrainingDivergedError, match=r"2 optimizer steps in a row.*max_consecutive_skips=2") as info:
            trainer.train_step()
        ckpt = latest_checkpoint(tmp_path)
        assert ckpt is not None and ckpt.name == "step-000005" and str(ckpt) in str(info.value)
    with Trainer(cfg) as check:
        check.setup()
        check.load_checkpoint(ckpt)
        saved = _weights(check)
        assert all(torch.equal(saved[k], last_good[k]) for k in saved), "the checkpoint does not hold the last finite weights"


def test_a_fault_during_evaluation_names_the_stage_and_writes_nothing(
    model: Path, tmp_path: Path, tally: Counter[str]
) -> None:
    cfg = tiny_config(tmp_path, "steps=2", "task.eval_prompts=2", "task.eval_every=1", model=model)
    with Trainer(cfg) as trainer:
        trainer.setup()
        trainer.rollout.generate = _raise_when_greedy(trainer.rollout.generate)  # type: ignore[method-assign]
        tally["fault/engine exception (evaluation)"] += 1
        with pytest.raises(StepFailedError, match=r"step 1: stage 'evaluation' \(backend 'hf'\)"):
            trainer.train_step()
        assert trainer.step == 0
    assert not (tmp_path / "metrics.jsonl").exists()


def _raise_when_greedy(real: Callable[..., Any]) -> Callable[..., Any]:
    def generate(prompts: TensorBatch, params: Any) -> Any:
        if params.greedy:  # only the evaluation samples greedily
            raise InjectedFaultError("injected fault in evaluation")
        return real(prompts, params)

    return generate
