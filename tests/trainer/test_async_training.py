"""Asynchronous training: the rollout producer's schedule, and runs with ``[async_training]``.

The producer generates the samples of released steps only, in order; what it raises reaches the
trainer. A run with ``mode = "async"`` and ``max_staleness = 0`` is bit for bit the synchronous run
(metrics and weights); with ``max_staleness = 1`` each step's samples are one weight version old,
except the first step and the first after a checkpoint, and ``--resume`` from that checkpoint
continues exactly.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import CLOCK, TINY_RUN, cli_run, comparable

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.config import load_config
from verl_core.trainer.rl.producer import RolloutProducer, release_limit
from verl_core.trainer.rl.step_state import StepState
from verl_core.trainer.rl.trainer import Trainer
from verl_core.trainer.run.context import StepFailedError

RUN = TINY_RUN
ASYNC = '\n[async_training]\nmode = "async"\nmax_staleness = {k}\n'
_CLOCK = (*CLOCK, "async/")  # the producer's waits differ from run to run too


# ----------------------------------------------------------------------------- the schedule
def test_release_limit_is_the_staleness_bound_cut_at_the_next_checkpoint_and_the_run_end() -> None:
    assert release_limit(0, max_staleness=0, checkpoint_every=0, steps=10) == 0
    assert release_limit(3, max_staleness=2, checkpoint_every=0, steps=10) == 5
    assert release_limit(3, max_staleness=2, checkpoint_every=4, steps=10) == 3  # step 4 follows a checkpoint
    assert release_limit(4, max_staleness=2, checkpoint_every=4, steps=10) == 6
    assert release_limit(8, max_staleness=5, checkpoint_every=0, steps=10) == 9


def _state(step: int) -> StepState:
    prompts = TensorBatch({"prompt_ids": torch.full((1, 2), step, dtype=torch.int64),
                           "prompt_mask": torch.ones(1, 2, dtype=torch.bool)})
    return StepState(step, prompts, SamplingParams(max_new_tokens=2))


def test_the_producer_makes_released_steps_in_order_and_no_further() -> None:
    made: list[int] = []

    def make(step: int) -> StepState:
        made.append(step)
        return _state(step)

    producer = RolloutProducer(make, lambda state, slot: None, first=2, snapshot=lambda: {"row": len(made)})
    try:
        producer.release(4)
        state, _ = producer.take(2)
        assert state.step == 2
        producer.wait_idle()
        assert made == [2, 3, 4] and producer.ahead == 2
        assert producer.data_state(3) == {"row": 1}  # the data order before step 3's prompts were drawn
        with pytest.raises(RuntimeError, match="step 6 was not released"):
            producer.take(5)
        assert [producer.take(s)[0].step for s in (3, 4)] == [3, 4]
        assert made == [2, 3, 4]
    finally:
        producer.close()


@pytest.mark.parametrize("parallel", [1, 3])
def test_what_the_producer_raises_is_raised_by_take(parallel: int) -> None:
    def sample(state: StepState, slot: int) -> None:
        if state.step == 1:
            raise ValueError("the rollout engine failed")

    producer = RolloutProducer(_state, sample, first=0, snapshot=lambda: None, parallel=parallel)
    try:
        producer.release(3)
        assert producer.take(0)[0].step == 0
        with pytest.raises(ValueError, match="the rollout engine failed"):
            producer.take(1)
        producer.wait_idle()  # returns: the producer stopped
    finally:
        producer.close()


def test_with_parallel_slots_a_released_step_starts_before_the_one_before_it_ends() -> None:
    """Steps are drawn in order; with 2 slots step 1 is sampled while step 0 still is, each on a slot
    of its own, and a step under way when another fails is still handed over."""
    drawn: list[int] = []
    started = {s: threading.Event() for s in range(4)}
    finish = {s: threading.Event() for s in range(4)}
    slots: dict[int, int] = {}

    def draw(step: int) -> StepState:
        drawn.append(step)
        return _state(step)

    def sample(state: StepState, slot: int) -> None:
        slots[state.step] = slot
        started[state.step].set()
        assert finish[state.step].wait(30)
        if state.step == 1:
            raise ValueError("step 2's rollout failed")

    producer = RolloutProducer(draw, sample, first=0, snapshot=lambda: None, parallel=2)
    try:
        producer.release(3)
        assert started[0].wait(30) and started[1].wait(30)  # step 1 runs while step 0 does
        assert producer.in_flight == 2 and drawn == [0, 1] and slots[0] != slots[1]
        time.sleep(0.05)
        assert not started[2].is_set()  # no third slot
        finish[1].set()  # step 1 fails while step 0 is under way
        with pytest.raises(ValueError, match="step 2's rollout failed"):
            producer.take(1)
        finish[0].set()  # step 0 still finishes and is handed over
        assert producer.take(0)[0].step == 0
        assert drawn == [0, 1]  # nothing more is drawn after a failure
    finally:
        for e in finish.values():
            e.set()
        producer.close()


def test_async_runs_where_the_rollout_can_overlap_the_update() -> None:
    for executor in (["executor=local"], ["executor=ray", "ray.placement=split"]):
        assert load_config(None, ["async_training.mode=async", *executor]).async_training.lookahead == 1
    with pytest.raises(ConfigError, match=r"'ray.placement' = 'colocated'.*could never overlap.*placement = \"split\""):
        load_config(None, ["async_training.mode=async", "executor=ray", "ray.placement=colocated"])
    assert load_config(None, ["executor=ray", "ray.placement=colocated"]).async_training.mode == "sync"
    with pytest.raises(ConfigError, match=r"'async_training.max_staleness' = -1 is out of range"):
        load_config(None, ["async_training.max_staleness=-1"])


# ----------------------------------------------------------------------------- runs
def _comparable(m: dict[str, Any]) -> dict[str, Any]:
    return comparable(m, _CLOCK)


def _weights(run: Path, step: int) -> bytes:
    (path,) = sorted((run / "checkpoints" / f"step-{step:06d}" / "actor").rglob("model.safetensors"))
    return path.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_staleness_0_is_the_synchronous_run_bit_for_bit(tmp_path: Path, algorithm: str) -> None:
    sync = cli_run(tmp_path, "sync", RUN, "steps=3", f"algorithm.name={algorithm}")
    produced = cli_run(tmp_path, "async0", RUN + ASYNC.format(k=0), "steps=3", f"algorithm.name={algorithm}")
    assert [_comparable(m) for m in sync] == [_comparable(m) for m in produced]
    assert [m["async/staleness"] for m in produced] == [0, 0, 0]
    assert sync[-1]["actor/grad_norm"] > 0  # the runs learned something, identically
    assert _weights(tmp_path / "sync", 3) == _weights(tmp_path / "async0", 3)


@pytest.mark.slow
def test_staleness_1_samples_one_version_behind_and_resumes_exactly(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    text = RUN + ASYNC.format(k=1)
    whole = cli_run(tmp_path, "whole", text, "steps=4", "checkpoint.every=2")
    # the first step and the first after a checkpoint sample from the newest weights
    assert [m["async/staleness"] for m in whole] == [0, 1, 0, 1]
    assert [m["weight_version"] for m in whole] == [1, 2, 3, 4]
    assert all(m["actor/grad_norm"] > 0 for m in whole)
    sync = cli_run(tmp_path, "sync", RUN, "steps=4", "checkpoint.every=2")
    # step 1: the same samples, the same update; the rollout stays awake to sample step 2 meanwhile,
    # so the memory plan counts it in the update too
    plan = "memory_plan/peak_gb"
    assert {**_comparable(sync[0]), "rollout/slept": 0, plan: None} == {**_comparable(whole[0]), plan: None}
    assert whole[0][plan] > sync[0][plan]
    assert _comparable(sync[1]) != _comparable(whole[1])  # step 2: samples of the older policy
    # stopped after the checkpoint of step 2, then resumed to step 4: the same numbers
    cli_run(tmp_path, "resumed", text, "steps=2", "checkpoint.every=2")
    from verl_core.cli import main

    out = tmp_path / "resumed"
    capsys.readouterr()
    assert main(["train", str(tmp_path / "resumed.toml"), f"output_dir={json.dumps(str(out))}", "steps=4",
                 "checkpoint.every=2", "--resume"]) == 0
    # the summary counts the steps this process ran, not the run's
    assert "done: 2 steps after resuming at step 2, reward" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "resumed.toml"), f"output_dir={json.dumps(str(out))}", "steps=4",
                 "checkpoint.every=2", "--resume"]) == 0
    assert "done: nothing left to run, the checkpoint is at step 4 of steps=4" in capsys.readouterr().err
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [_comparable(m) for m in resumed] == [_comparable(m) for m in whole]
    assert _weights(out, 4) == _weights(tmp_path / "whole", 4)


@pytest.mark.slow
def test_a_rollout_failing_on_the_producer_thread_fails_the_step_naming_the_stage(tmp_path: Path) -> None:
    cfg = load_config(None, ["steps=3", "logging.progress=false", "logging.plot=false",
                             "async_training.mode=async", "async_training.max_staleness=1",
                             f"output_dir={json.dumps(str(tmp_path / 'run'))}", "rollout.n=2", "task.digits=1",
                             "batch.prompts_per_step=2"])
    with Trainer(cfg) as trainer:
        trainer.setup()
        generate = trainer.rollout.generate
        calls = threading.Semaphore(1)

        def flaky(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
            if not calls.acquire(blocking=False):
                raise RuntimeError("the rollout engine lost its device")
            return generate(prompts, params)

        trainer.rollout.generate = flaky  # type: ignore[method-assign]
        with pytest.raises(StepFailedError, match=r"step 2.*'rollout'.*the rollout engine lost its device"):
            trainer.train()
        assert trainer.step == 1  # step 1 trained on the samples made before the failure


@pytest.mark.slow
def test_the_data_epoch_of_a_step_is_read_when_its_rows_are_drawn(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    rows = (root / "examples/demo/train.jsonl").read_text().splitlines()[:12]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    text = RUN + f'\n[data]\ntrain = {json.dumps(str(data))}\n[reward]\nfunctions = ' \
        f'[{json.dumps(str(root / "examples/demo/reward.py:exact_answer_then_eos"))}]\n'
    text = text.replace("max_new_tokens = 3", "max_new_tokens = 6")
    sync = cli_run(tmp_path, "sync", text, "steps=4")
    ahead = cli_run(tmp_path, "ahead", text + ASYNC.format(k=2), "steps=4")
    # 8 rows a step from 12: the third step starts the third epoch, whatever the producer drew ahead
    assert [m["data/epoch"] for m in sync] == [m["data/epoch"] for m in ahead] == [0, 1, 2, 2]
