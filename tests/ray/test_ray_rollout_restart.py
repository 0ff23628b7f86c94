"""A rollout worker that dies is replaced and the run goes on with the uninterrupted run's numbers.

The rollout worker's process is killed right before a ``generate`` call of a chosen step: the call
meets the dead worker, the executor places a fresh rollout group, gives it the weights the old one
served (sent again by the actor in a synchronous run; the copy kept in the object store under
asynchronous training, where the actor has been updated since) and retries the call. Sampling is
seeded per sample, so every step's numbers equal the uninterrupted run's, bit for bit. With
``ray.max_rollout_restarts = 0``, or a rollout that shares its processes with the actor, the step
fails as before; so does sampling when the served weights are nowhere left (the actor trained on
and no copy was kept), until the next weight sync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ray_helpers import RAY_SPLIT, demo_config, kill, train

from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model
from verl_core import EngineSpec, GlobalBatchStats, OptimConfig, SamplingParams, TensorBatch
from verl_core.algorithms import Algorithm
from verl_core.trainer.executor import RayConfig, WorkerFailedError
from verl_core.trainer.rl.trainer import Trainer
from verl_core.trainer.run.context import StepFailedError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
]

LOGGER = "verl_core.trainer.executor.ray_executor"
# the timings, the producer's thread timing and the restart count differ; nothing else may
_VARIES = ("time/", "throughput/", "memory_plan/", "ray/", "async/wait_s", "async/ahead")


def _fixed(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if not k.startswith(_VARIES)} for m in history]


def _kill_before_generate(trainer: Trainer, call: int, *, before: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Kill the rollout's worker process right before generate call ``call`` (1-based) reaches it;
    returns what the call saw: the killed pid, and the weight version of the samples it returned."""
    ex: Any = trainer.executor
    generate = trainer.rollout.generate
    seen: dict[str, Any] = {"calls": 0}

    def killing(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        seen["calls"] += 1
        if seen["calls"] != call:
            return generate(prompts, params)
        [pid] = ex.worker_pids("rollout")
        kill(pid)
        seen["killed"] = pid
        before()
        out = generate(prompts, params)
        seen["version"] = out.meta.weight_version
        return out

    trainer.rollout.generate = killing  # type: ignore[method-assign]
    return seen


def _restart_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_sync_run_replaces_a_killed_rollout_worker_and_keeps_the_uninterrupted_numbers(
    ray_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    want = train(demo_config(tmp_path / "plain", *RAY_SPLIT, "steps=2"))
    with Trainer(demo_config(tmp_path / "killed", *RAY_SPLIT, "steps=2")) as trainer:
        trainer.setup()
        seen = _kill_before_generate(trainer, call=2)  # step 2's rollout: the actor still holds version 1
        history = trainer.train()
        ex: Any = trainer.executor
        [pid] = ex.worker_pids("rollout")
        served = trainer.rollout.weight_version
    assert pid != seen["killed"]
    assert seen["version"] == 1  # the fresh worker sampled from the version the dead one served
    assert served == 2  # and took step 2's weights after it
    assert [m["ray/rollout_restarts"] for m in history] == [0, 1]
    [line] = _restart_lines(caplog)
    assert f"rollout worker rank 0 (pid {seen['killed']}) died during generate" in line
    assert "restart 1 of 3" in line
    assert any("serves weight version 1 again (sent by the actor)" in r.getMessage() for r in caplog.records)
    assert history[-1]["actor/grad_norm"] > 0
    assert _fixed(history) == _fixed(want)  # bit for bit


def test_async_run_gives_a_replaced_rollout_the_kept_weights_while_the_actor_trains(
    ray_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    staleness = ("async_training.mode=async", "async_training.max_staleness=1")
    want = train(demo_config(tmp_path / "plain", *RAY_SPLIT, *staleness))
    with Trainer(demo_config(tmp_path / "killed", *RAY_SPLIT, *staleness)) as trainer:
        trainer.setup()
        actor: Any = trainer.actor
        updated: list[bool] = []

        def until_the_actor_moves_on() -> None:
            # step 3's rollout (on the producer's thread) samples from version 1, sent after the
            # actor's first optimizer step, while step 2 trains: wait for step 2's optimizer step
            # (if it is not done yet), so the actor no longer holds what the rollout served
            deadline = time.monotonic() + 60
            while actor.weight_changes < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            updated.append(actor.weight_changes >= 2)

        seen = _kill_before_generate(trainer, call=3, before=until_the_actor_moves_on)
        history = trainer.train()
    assert updated == [True]
    assert seen["version"] == 1
    # the trainer's thread may meet the dead worker first (step 2 asks the rollout about its log-probs)
    restarts = [m["ray/rollout_restarts"] for m in history]
    assert restarts in ([0, 1, 1], [0, 0, 1]), restarts
    assert [m["async/staleness"] for m in history] == [0, 1, 1]
    [line] = _restart_lines(caplog)
    assert f"rollout worker rank 0 (pid {seen['killed']}) died during" in line and "restart 1 of 3" in line
    assert any("serves weight version 1 again (from the copy kept in the object store)" in r.getMessage()
               for r in caplog.records)
    assert _fixed(history) == _fixed(want)  # bit for bit


def test_without_restarts_a_dead_rollout_worker_fails_the_step(ray_cluster: Any, tmp_path: Path) -> None:
    with Trainer(demo_config(tmp_path, *RAY_SPLIT, "ray.max_rollout_restarts=0")) as trainer:
        trainer.setup()
        seen = _kill_before_generate(trainer, call=1)
        with pytest.raises(StepFailedError) as info:
            trainer.train()
        ex: Any = trainer.executor
        assert ex.rollout_restarts == 0
    cause = info.value.__cause__
    assert isinstance(cause, WorkerFailedError), repr(cause)
    assert (cause.role, cause.rank) == ("rollout", 0)
    assert f"worker rank 0 of role 'rollout' (Ray worker group 'rollout', pid {seen['killed']}) died" in str(cause)
    assert "--resume" in str(cause)
    assert info.value.step == 1


def test_a_rollout_sharing_its_process_with_the_actor_is_not_replaced(ray_cluster: Any) -> None:
    from verl_core.trainer.executor.ray_executor import RayExecutor

    model = str(tiny_model(TinyModelSpec(arch="llama", tied=False)))
    ex = RayExecutor(RayConfig(placement="colocated", num_cpus_per_worker=0.5))
    try:
        ex.training_engine("actor", "hf", EngineSpec(model_path=model, role="actor"))
        rollout = ex.rollout_engine("hf", EngineSpec(model_path=model, role="rollout"))
        [pid] = ex.worker_pids("rollout")
        kill(pid)
        with pytest.raises(WorkerFailedError) as info:
            rollout.log_probs_exact(SamplingParams())
        assert ex.rollout_restarts == 0
    finally:
        ex.close()
    err = info.value
    assert (err.role, err.rank) == ("rollout", 0)
    assert any("not replaced: its processes also host actor" in note for note in err.__notes__)


def test_a_replaced_rollout_gets_the_actors_weights_until_the_actor_moves_on(ray_cluster: Any) -> None:
    from verl_core.trainer.executor.ray_executor import RayExecutor

    model = str(tiny_model(TinyModelSpec(arch="llama", tied=False)))
    prompts = random_batch(batch_size=5, max_prompt=6, max_response=1, seed=3).select(
        "prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(max_new_tokens=6, n=2, seed=7)
    ex = RayExecutor(RayConfig(num_cpus_per_worker=0.5))
    try:
        actor = ex.training_engine("actor", "hf", EngineSpec(model_path=model, role="actor", optim=OptimConfig(lr=0.1),
                                                             max_prompt_len=16, max_response_len=16))
        rollout = ex.rollout_engine("hf", EngineSpec(model_path=model, role="rollout", max_prompt_len=16,
                                                     max_response_len=6))
        sync = ex.weight_sync("hf", "hf")
        batch = random_batch(batch_size=4, max_prompt=7, max_response=6, seed=11, with_rl_fields=True)
        actor.forward_backward(batch, Algorithm.grpo().actor_loss, GlobalBatchStats.of(batch))
        actor.optimizer_step()
        sync.sync(actor, rollout, version=1)
        want = rollout.generate(prompts, params)

        # the rollout worker dies: it is replaced, and the actor (unchanged since) sends version 1 again
        [old] = ex.worker_pids("rollout")
        kill(old)
        got = rollout.generate(prompts, params)
        assert ex.rollout_restarts == 1
        assert ex.worker_pids("rollout") != [old]
        assert rollout.weight_version == got.meta.weight_version == 1
        for name in ("response_ids", "response_mask", "rollout_log_probs", "sample_index"):
            assert torch.equal(got[name], want[name]), name

        # now the actor trains on before the next death: version 1 is nowhere left (no copy is
        # kept outside asynchronous training), so sampling fails instead of using other weights
        actor.forward_backward(batch, Algorithm.grpo().actor_loss, GlobalBatchStats.of(batch))
        actor.optimizer_step()
        kill(ex.worker_pids("rollout")[0])
        with pytest.raises(WorkerFailedError, match=r"weights it served \(version 1\) cannot be given to the fresh "
                                                    r"workers: the actor has been updated since") as info:
            rollout.generate(prompts, params)
        assert ex.rollout_restarts == 2
        assert info.value.role == "rollout"
        # the next weight sync gives the fresh workers the actor's weights, and sampling goes on
        sync.sync(actor, rollout, version=2)
        assert rollout.generate(prompts, params).meta.weight_version == 2
    finally:
        ex.close()
