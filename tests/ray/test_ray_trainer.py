"""The trainer on Ray worker groups gives the local run's metrics; a killed training worker fails the step clearly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import start_cluster
from ray_helpers import RAY_SPLIT, STEPS, assert_same_metrics, demo_config, kill, train

from verl_core.trainer.executor import WorkerFailedError
from verl_core.trainer.rl.trainer import Trainer, latest_checkpoint
from verl_core.trainer.run.context import StepFailedError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The demo on the local executor (engines in this process), one step longer than the Ray runs."""
    return train(demo_config(tmp_path_factory.mktemp("local"), f"steps={STEPS + 1}"))


def test_split_groups_give_the_local_metrics_and_a_killed_worker_fails_the_step_then_the_run_resumes(
    ray_cluster: Any, local_run: list[dict[str, Any]], tmp_path: Path
) -> None:
    cfg = demo_config(tmp_path, *RAY_SPLIT, "checkpoint.every=1")
    with Trainer(cfg) as trainer:
        history = trainer.train()
        ex: Any = trainer.executor
        actor, rollout = ex.worker_group("actor"), ex.worker_group("rollout")
        # rollout and actor live in separate groups of separate processes, not in this one
        assert actor is not rollout
        pids = {*ex.worker_pids("actor"), *ex.worker_pids("rollout")}
        assert len(pids) == 2 and os.getpid() not in pids
        assert actor.pg.bundle_specs == [{"CPU": 1.0}]
        assert len(history) == STEPS and history[-1]["weight_version"] == STEPS
        assert_same_metrics(history, local_run[:STEPS])

        assert [m["ray/rollout_restarts"] for m in history] == [0] * STEPS

        # one step more, with the actor's worker process killed first: rollout workers are replaced
        # (ray.max_rollout_restarts, default 3), a training engine's never (its state is in checkpoints)
        ckpt = latest_checkpoint(tmp_path)
        assert ckpt is not None and ckpt.name == f"step-{STEPS:06d}"
        kill(ex.worker_pids("actor")[0])
        with pytest.raises(StepFailedError) as info:
            trainer.train_step()
        assert ex.rollout_restarts == 0
    err = info.value
    cause = err.__cause__
    assert isinstance(cause, WorkerFailedError), repr(cause)
    assert (cause.role, cause.rank) == ("actor", 0)
    assert "worker rank 0 of role 'actor'" in str(err) and "died" in str(err)
    assert err.step == STEPS + 1 and err.checkpoint == ckpt
    # the controller kept the last checkpoint and recorded nothing of the failed step
    assert latest_checkpoint(tmp_path) == ckpt
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == STEPS

    # a fresh cluster resumes from it and finishes with the local run's metrics
    ray_cluster.shutdown()
    start_cluster()
    resumed = train(demo_config(tmp_path, *RAY_SPLIT, f"steps={STEPS + 1}"), resume=True)
    assert_same_metrics(resumed, local_run)


# PPO with a KL penalty: actor, critic, reference and rollout all share one process
PPO = ("algorithm.name=ppo", "algorithm.options={kl_coef=0.001, entropy_coef=0.01}", "batch.mini_batch_size=128")


def test_colocated_group_of_every_role_gives_the_local_metrics(ray_cluster: Any, tmp_path: Path) -> None:
    want = train(demo_config(tmp_path / "local", *PPO))
    cfg = demo_config(tmp_path / "ray", *PPO, "executor=ray", "ray.placement=colocated", "ray.num_cpus_per_worker=2")
    with Trainer(cfg) as trainer:
        history = trainer.train()
        ex: Any = trainer.executor
        assert sorted(ex.placed_roles()) == ["actor", "critic", "reference", "rollout"]
        assert len({id(ex.worker_group(r)) for r in ex.placed_roles()}) == 1
    assert "critic/vf_loss" in history[-1] or "critic/loss" in history[-1]
    assert "actor/kl_ref" in history[-1]
    assert_same_metrics(history, want)
