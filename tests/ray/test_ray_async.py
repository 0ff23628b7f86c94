"""Asynchronous training on split Ray worker groups: the rollout and the update run at once, in
separate processes, with the local executor's numbers; ``max_staleness = 0`` is the synchronous run."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import RAY_SPLIT, STEPS, assert_same_metrics, demo_config, train

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.rl.trainer import Trainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
]


def _async(k: int) -> tuple[str, ...]:
    return ("async_training.mode=async", f"async_training.max_staleness={k}")


def _without(history: list[dict[str, Any]], *prefixes: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if not k.startswith(prefixes)} for m in history]


# async/wait_s and async/ahead depend on thread timing; async/staleness does not
_TIMING = ("async/wait_s", "async/ahead")


def test_staleness_1_overlaps_rollout_and_update_in_separate_processes_with_the_local_numbers(
    ray_cluster: Any, tmp_path: Path
) -> None:
    want = train(demo_config(tmp_path / "local", *_async(1)))
    cfg = demo_config(tmp_path / "ray", *RAY_SPLIT, *_async(1))
    # step 2's rollout (producer thread) and step 1's first forward_backward (trainer thread) each
    # wait for the other before their remote call: both are in flight at once, or the run fails
    both = threading.Barrier(2, timeout=60)
    spans: dict[str, tuple[float, float]] = {}
    with Trainer(cfg) as trainer:
        trainer.setup()
        ex: Any = trainer.executor
        rollout_pids, actor_pids = ex.worker_pids("rollout"), ex.worker_pids("actor")
        generate, forward_backward = trainer.rollout.generate, trainer.actor.forward_backward
        generated = 0

        def meet_generate(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
            nonlocal generated
            generated += 1
            if generated != 2:
                return generate(prompts, params)
            both.wait()
            t = time.perf_counter()
            out = generate(prompts, params)
            spans["generate"] = (t, time.perf_counter())
            return out

        def meet_update(*args: Any, **kwargs: Any) -> Any:
            if "update" in spans:
                return forward_backward(*args, **kwargs)
            spans["update"] = (0.0, 0.0)
            both.wait()
            t = time.perf_counter()
            out = forward_backward(*args, **kwargs)
            spans["update"] = (t, time.perf_counter())
            return out

        trainer.rollout.generate = meet_generate  # type: ignore[method-assign]
        trainer.actor.forward_backward = meet_update  # type: ignore[method-assign]
        history = trainer.train()
    assert len(rollout_pids) == len(actor_pids) == 1 and rollout_pids != actor_pids
    assert os.getpid() not in {*rollout_pids, *actor_pids}
    (g0, g1), (u0, u1) = spans["generate"], spans["update"]
    assert g0 < u1 and u0 < g1, f"the rollout {spans['generate']} and the update {spans['update']} did not overlap"
    assert [m["async/staleness"] for m in history] == [0, *[1] * (STEPS - 1)]
    assert [m["weight_version"] for m in history] == list(range(1, STEPS + 1))
    assert all(m["rollout/slept"] == 0 for m in history)
    assert history[-1]["actor/grad_norm"] > 0
    # the schedule is fixed: every step's numbers are the local executor's
    assert_same_metrics(_without(history, *_TIMING), _without(want, *_TIMING))


def test_staleness_0_on_ray_is_the_synchronous_ray_run(ray_cluster: Any, tmp_path: Path) -> None:
    sync = train(demo_config(tmp_path / "sync", *RAY_SPLIT))
    produced = train(demo_config(tmp_path / "async0", *RAY_SPLIT, *_async(0)))
    assert [m["async/staleness"] for m in produced] == [0] * STEPS
    assert sync[-1]["actor/grad_norm"] > 0
    assert_same_metrics(_without(produced, "async/"), sync)


def test_a_call_from_another_thread_waits_until_a_sequence_holding_the_group_ends(ray_cluster: Any) -> None:
    from verl_core.trainer.executor.ray_executor import WorkerGroup

    group = WorkerGroup("probe", 1, num_cpus=0.25, num_gpus=0, strategy="PACK", timeout_s=60)
    done: list[str] = []
    try:

        def call() -> None:
            group.run("<group>", "pid", [()])
            done.append("other call")

        other = threading.Thread(target=call)
        with group.exclusive():  # what a weight sync holds, on the actor's and the rollout's groups
            assert group.run("<group>", "pid", [()]) == group.pids()  # the holder's own calls go through
            other.start()
            time.sleep(0.5)  # a call that did not wait would be back long before this
            done.append("sequence")
        other.join(timeout=60)
        assert done == ["sequence", "other call"]
    finally:
        group.shutdown()
