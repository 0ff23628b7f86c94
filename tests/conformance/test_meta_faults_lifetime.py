"""Meta-tests of what the suite checks of an engine's lifetime across calls and processes.

``robustness::close_ends_what_the_engine_started``: engines whose close() leaves a worker process or a
thread running, or raises when called twice, fail it (the example backend they are built on passes it:
test_suite_example.py). ``stateful::multi_rank_checkpoint_round_trip``: a checkpoint that only
data-parallel rank 0 loads fails it (the hf backend passes it: test_suite_hf.py). The check time
limit: a generate that never returns fails its check, naming the backend's frame, and the run goes on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import faulty_engines as faulty
import psutil
import pytest
from verl_tiny_backend.training import TinyTrainingEngine

from verl_conformance import ConformanceError, check_backend

pytestmark = pytest.mark.usefixtures("broken_backends")

CHECK = "robustness::close_ends_what_the_engine_started"


@pytest.fixture(autouse=True)
def _end_what_the_faults_left() -> Iterator[None]:
    """Stop the workers and threads the faulty engines leave, whatever the test's outcome."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    from verl_broken_backends.lifetime import RELEASE

    RELEASE.set()
    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            p.kill()
            p.wait(10)
    RELEASE.clear()


@pytest.mark.parametrize(("backend", "fragments"), [
    ("broken-close-worker-left", ["the rollout engine left 1 child process(es) running 10 s after close()",
                                  "time.sleep(120)"]),
    ("broken-close-thread-left", ["the rollout engine left 1 non-daemon thread(s) running 10 s after close()",
                                  "['prefetch']"]),
    ("broken-close-twice", ["the actor engine's second close() raised AttributeError",
                            "the critic engine's second close() raised AttributeError"]),
])
def test_an_engine_whose_close_leaves_work_running_or_fails_twice_fails(backend: str, fragments: list[str]) -> None:
    with pytest.raises(ConformanceError) as info:
        check_backend(backend, checks=[CHECK])
    message = str(info.value)
    assert CHECK in message
    for fragment in fragments:
        assert fragment in message, message


def test_a_checkpoint_loaded_on_one_data_parallel_rank_only_fails_the_multi_rank_round_trip() -> None:
    """The single-process round trip cannot see it: one process is rank 0."""
    check_backend("broken-only-rank-zero-loads", checks=["stateful::checkpoint_round_trip"])
    with pytest.raises(ConformanceError) as info:
        check_backend("broken-only-rank-zero-loads", checks=["stateful::multi_rank_checkpoint_round_trip"])
    message = str(info.value)
    # the loss and grad norm are global (summed over the ranks): rank 0's differ too
    assert "of dp=2, after every rank's save_checkpoint and a fresh engine's load_checkpoint: the first update" \
        in message, message


def test_a_checkpoint_whose_optimizer_state_is_dropped_at_another_layout_fails_the_one_process_load() -> None:
    """Each rank loads the two-rank checkpoint whole (the ranks' round trip passes); one process restores
    the weights and the schedule but restarts Adam's moments, so its second update differs."""
    with pytest.raises(ConformanceError) as info:
        check_backend("broken-other-layout-drops-optimizer", checks=["stateful::multi_rank_checkpoint_round_trip"])
    message = str(info.value)
    assert "one process, after load_checkpoint of the checkpoint saved under dp=2" in message, message
    assert "rank 0 of dp=2, after every rank's save_checkpoint" not in message, message


def test_a_generate_that_never_returns_fails_its_check_within_the_limit_and_the_run_goes_on() -> None:
    t0 = time.monotonic()
    with pytest.raises(ConformanceError) as info:
        check_backend("waits-for-a-second-row", make_training_engine=TinyTrainingEngine,
                      make_rollout_engine=faulty.WaitsForASecondRow, check_timeout_s=20,
                      checks=["robustness::batch_of_one", "schema::generate_layout"])
    assert time.monotonic() - t0 < 120
    report = info.value.report
    assert report is not None
    assert {r.id: r.status for r in report.results} == {"robustness::batch_of_one": "failed",
                                                         "schema::generate_layout": "passed"}
    message = str(info.value)
    assert "robustness::batch_of_one did not finish within 20 s" in message, message
    assert "faulty_engines.py" in message and "in generate" in message, message


def test_a_critic_whose_gradients_are_not_summed_over_the_ranks_fails_the_dp_check() -> None:
    """The dp check built the actor only: a critic stepping on its own rank's gradient (loss and metrics
    still summed, so they look global) passed every check. Its gradients under dp=2 now differ from one
    process's; the actor's (correct) pass."""
    with pytest.raises(ConformanceError) as info:
        check_backend("broken-critic-dp-unreduced", checks=["invariance::data_parallel_invariance"])
    message = str(info.value)
    assert "critic grad norm with dp=2 on the value-head folder vs one process" in message, message
    assert "actor " not in message, message


def test_an_engine_dropped_without_close_that_leaves_its_worker_running_fails() -> None:
    """close() ended the worker, so the close check passed an engine without the weakref.finalize the docs ask
    for; a user's script that stops early drops the engine and its worker ran on. The check now drops an engine
    of each role too (built through the factory, no reference kept, gc.collect()): the same engine with the
    finalizer passes."""
    report = check_backend("dropped-worker-finalized", make_training_engine=TinyTrainingEngine,
                           make_rollout_engine=faulty.WorkerEndedByClose, checks=[CHECK])
    assert [r.status for r in report.results] == ["passed"], report.table()
    with pytest.raises(ConformanceError) as info:
        check_backend("dropped-worker-left", make_training_engine=TinyTrainingEngine,
                      make_rollout_engine=faulty.WorkerEndedByCloseOnly, checks=[CHECK])
    message = str(info.value)
    assert ("the rollout engine, dropped without close(), left 1 child process(es) running 10 s after its last "
            "reference went and gc.collect() ran") in message, message
    assert "a dropped engine's worker" in message and "weakref.finalize" in message, message
    assert "after close()" not in message and "actor" not in message, message
