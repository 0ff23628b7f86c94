"""HybridPipeline: concurrency, graph validation, failure semantics, timings."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from verl_core.trainer.pipeline import (
    HybridPipeline,
    PipelineError,
    Stage,
    StageError,
    StageThreads,
)


def _sleeper(out: str, seconds: float) -> Stage:
    def fn(x: int) -> Mapping[str, Any]:
        time.sleep(seconds)
        return {out: x + 1}

    return Stage(out, fn, inputs=("x",), outputs=(out,))


def test_ready_stages_overlap_and_timings_are_reported() -> None:
    def join(a: int, b: int) -> Mapping[str, Any]:
        return {"c": a + b}

    pipe = HybridPipeline(
        [_sleeper("a", 0.3), _sleeper("b", 0.3), Stage("join", join, ("a", "b"), ("c",))], inputs=("x",)
    )
    t = time.perf_counter()
    res = pipe.run(x=1)
    wall = time.perf_counter() - t
    assert res["c"] == 4
    assert wall < 0.55, f"two 0.3 s stages took {wall:.2f} s: they did not overlap"
    assert res.timings["time/a"] >= 0.29
    assert res.timings["time/b"] >= 0.29
    assert res.timings["time/pipeline"] < res.timings["time/a"] + res.timings["time/b"]
    assert set(res.outputs) == {"a", "b", "c"}


def test_independent_stages_run_at_the_same_time() -> None:
    # each stage waits for the other to arrive: a sequential runner would time out
    barrier = threading.Barrier(2, timeout=10)

    def meet(name: str) -> Stage:
        def fn() -> Mapping[str, Any]:
            barrier.wait()
            return {name: threading.get_ident()}

        return Stage(name, fn, (), (name,))

    res = HybridPipeline([meet("reward"), meet("ref")]).run()
    assert res["reward"] != res["ref"]


def test_dependent_stage_waits_for_its_inputs() -> None:
    seen: list[str] = []

    def first(x: int) -> Mapping[str, Any]:
        time.sleep(0.05)
        seen.append("first")
        return {"y": x * 2}

    def second(y: int) -> Mapping[str, Any]:
        seen.append("second")
        return {"z": y + 1}

    pipe = HybridPipeline([Stage("second", second, ("y",), ("z",)), Stage("first", first, ("x",), ("y",))],
                          inputs=("x",))
    assert pipe.stages == ("first", "second")
    assert pipe.run(x=3)["z"] == 7
    assert seen == ["first", "second"]


def test_missing_input_rejected_at_build_naming_stage_and_input() -> None:
    with pytest.raises(PipelineError, match=r"stage 'ref'.*'old_log_probs'"):
        HybridPipeline([Stage("ref", lambda old_log_probs: {}, ("old_log_probs",), ())], inputs=("batch",))


def test_cycle_rejected_at_build_naming_the_cycle() -> None:
    stages = [
        Stage("a", lambda c: {"a": 1}, ("c",), ("a",)),
        Stage("b", lambda a: {"b": 1}, ("a",), ("b",)),
        Stage("c", lambda b: {"c": 1}, ("b",), ("c",)),
    ]
    with pytest.raises(PipelineError, match="cycle") as info:
        HybridPipeline(stages)
    for name in ("a", "b", "c"):
        assert name in str(info.value)


def test_duplicate_producer_and_unknown_after_rejected() -> None:
    with pytest.raises(PipelineError, match="both output 'v'"):
        HybridPipeline([Stage("p", lambda: {"v": 1}, (), ("v",)), Stage("q", lambda: {"v": 2}, (), ("v",))])
    with pytest.raises(PipelineError, match="unknown stage 'nope'"):
        HybridPipeline([Stage("p", lambda: {}, after=("nope",))])


def test_failing_stage_stops_the_step_and_publishes_nothing() -> None:
    ran_after = threading.Event()

    def boom(x: int) -> Mapping[str, Any]:
        raise ValueError("reward model exploded")

    def later(bad: int) -> Mapping[str, Any]:
        ran_after.set()
        return {"never": bad}

    pipe = HybridPipeline(
        [_sleeper("slow", 0.1), Stage("reward", boom, ("x",), ("bad",)), Stage("later", later, ("bad",), ("never",))],
        inputs=("x",),
    )
    with pytest.raises(StageError, match=r"stage 'reward' failed: ValueError: reward model exploded") as info:
        pipe.run(x=0)
    assert info.value.stage == "reward"
    assert isinstance(info.value.__cause__, ValueError)
    assert not ran_after.is_set()
    # the pipeline is reusable after a failure
    ok = HybridPipeline([_sleeper("a", 0.0)], inputs=("x",))
    assert ok.run(x=1)["a"] == 2


def test_stage_returning_wrong_names_is_an_error() -> None:
    pipe = HybridPipeline([Stage("s", lambda: {"other": 1}, (), ("want",))])
    with pytest.raises(StageError, match=r"stage 's'.*declared outputs \['want'\]"):
        pipe.run()


def test_run_checks_inputs() -> None:
    pipe = HybridPipeline([_sleeper("a", 0.0)], inputs=("x",))
    with pytest.raises(PipelineError, match="missing"):
        pipe.run()


def _thread_recorder(seen: dict[str, list[threading.Thread]]) -> list[Stage]:
    """start -> (a, b) -> join, each stage recording the thread it ran on."""

    def rec(name: str, out: str) -> Any:
        def fn(**kwargs: Any) -> Mapping[str, Any]:
            seen.setdefault(name, []).append(threading.current_thread())
            return {out: 1}

        return fn

    return [
        Stage("start", rec("start", "s"), ("x",), ("s",)),
        Stage("a", rec("a", "va"), ("s",), ("va",)),
        Stage("b", rec("b", "vb"), ("s",), ("vb",)),
        Stage("join", rec("join", "j"), ("va", "vb"), ("j",)),
    ]


def _stage_threads_alive(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_stages_keep_their_threads_across_steps_and_close_ends_them() -> None:
    # thread objects (not idents, which the OS reuses) are compared: a fresh thread per step
    # would give a new object every run
    seen: dict[str, list[threading.Thread]] = {}
    with StageThreads(name_prefix="test-keep") as threads:
        for _ in range(3):  # a new pipeline per step, as the trainer builds them
            assert HybridPipeline(_thread_recorder(seen), inputs=("x",), threads=threads).run(x=0)["j"] == 1
        assert all(len(v) == 3 for v in seen.values())
        # stages ordered against all others run on the caller's thread, the others on their own
        assert all(t is threading.current_thread() for t in seen["start"] + seen["join"])
        for name in ("a", "b"):
            assert all(t is seen[name][0] for t in seen[name]), name
            assert seen[name][0].name.startswith(f"test-keep-{name}")
        assert seen["a"][0] is not seen["b"][0]
        assert sorted(_stage_threads_alive("test-keep")) == sorted(t.name for t in (seen["a"][0], seen["b"][0]))
    assert _stage_threads_alive("test-keep") == []
    # closed threads are started anew by the next run (an owner may close and run again)
    seen.clear()
    HybridPipeline(_thread_recorder(seen), inputs=("x",), threads=threads).run(x=0)
    assert seen["a"][0].is_alive()
    threads.close()
    assert _stage_threads_alive("test-keep") == []


def test_a_stage_that_runs_alone_behaves_like_a_direct_call() -> None:
    def state() -> Mapping[str, Any]:
        return {"grad": torch.is_grad_enabled(), "thread": threading.current_thread()}

    pipe = HybridPipeline([Stage("rollout", state, (), ("grad", "thread"))])
    with torch.no_grad():  # the caller's thread-local torch state reaches the stage
        res = pipe.run()
    assert res["grad"] is False
    assert res["thread"] is threading.current_thread()
    assert "time/rollout" in res.timings

    def boom() -> Mapping[str, Any]:
        raise ValueError("generation exploded")

    with pytest.raises(StageError, match=r"stage 'rollout' failed: ValueError: generation exploded") as info:
        HybridPipeline([Stage("rollout", boom, (), ("samples",))]).run()
    assert info.value.stage == "rollout"
    assert isinstance(info.value.__cause__, ValueError)


def test_pipeline_without_given_threads_ends_its_own_on_close() -> None:
    barrier = threading.Barrier(2, timeout=10)

    def meet(name: str) -> Stage:
        def fn() -> Mapping[str, Any]:
            barrier.wait()
            return {name: threading.current_thread().name}

        return Stage(name, fn, (), (name,))

    with HybridPipeline([meet("p"), meet("q")]) as pipe:
        res = pipe.run()
        assert res["p"].startswith("verl-stage-p") and res["q"].startswith("verl-stage-q")
        assert len(_stage_threads_alive("verl-stage-p")) == 1
    assert _stage_threads_alive("verl-stage-p") == _stage_threads_alive("verl-stage-q") == []
