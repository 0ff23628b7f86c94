"""Fast unit tests of the suite's machinery: known-gap files, check selection, reports."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_conformance.checks import AREAS, CHECKS
from verl_conformance.runner import (
    CheckResult,
    ConformanceReport,
    load_known_gaps,
    pytest_suffix,
    select_checks,
)


def test_every_area_has_checks_and_ids_are_area_name() -> None:
    assert {c.area for c in CHECKS.values()} == set(AREAS)
    for cid, c in CHECKS.items():
        assert cid == f"{c.area}::{c.name}"
        assert c.doc and not c.doc.endswith(":"), cid


def test_known_gaps_match_check_ids_patterns_and_pytest_ids(tmp_path: Path) -> None:
    f = tmp_path / "gaps.txt"
    f.write_text(
        "# comment\n\n"
        "numerics::log_probs_match_reference  # reason one\n"
        "weight_sync::*  # all sync checks\n"
        "TestRobustness::test_batch_of_one\n"
        "schema::not_a_check  # typo\n"
    )
    gaps = load_known_gaps(f)
    assert gaps.reason("numerics::log_probs_match_reference") == "reason one"
    assert gaps.reason("weight_sync::bad_streams_rejected") == "all sync checks"
    assert gaps.reason("robustness::batch_of_one") == "declared known gap"
    assert gaps.reason("numerics::entropy_matches_reference") is None
    assert gaps.unmatched() == ["schema::not_a_check"]


def test_select_checks_by_area_and_pattern() -> None:
    assert {c.area for c in select_checks(areas=["schema"])} == {"schema"}
    assert [c.id for c in select_checks(["numerics::log_probs_*"])] == ["numerics::log_probs_match_reference"]
    with pytest.raises(ValueError, match="no check matches"):
        select_checks(["nope::*"])
    with pytest.raises(ValueError, match="unknown area"):
        select_checks(areas=["speed"])
    # a pattern that matches checks of other areas only: the message says the two filters intersect
    with pytest.raises(ValueError, match=r"no check of area\(s\) \['schema'\] matches.*a check must match both"):
        select_checks(["numerics::log_probs_*"], areas=["schema"])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["passed", "failed", "skipped", "xfailed", "xpassed"]), min_size=1, max_size=12))
def test_report_counts_and_json_round_trip(statuses: list[str]) -> None:
    import json

    ids = list(CHECKS)
    report = ConformanceReport("b", "dist 1", None)
    for i, s in enumerate(statuses):
        c = CHECKS[ids[i % len(ids)]]
        report.results.append(CheckResult(c.id, c.area, s, "why" if s != "passed" else "", 0.1))  # type: ignore[arg-type]
    assert len(report.failures) == statuses.count("failed")
    data = json.loads(report.to_json())
    assert [r["status"] for r in data["results"]] == statuses
    table = report.table()
    assert f"{statuses.count('passed')} passed" in table or not statuses.count("passed")


def test_report_names_the_suite_that_made_it() -> None:
    """Two reports from different suites are told apart: the suite's distribution version and its number of checks."""
    import json
    from importlib.metadata import version

    from verl_conformance.runner import suite_version

    data = json.loads(ConformanceReport("b", "dist 1", None).to_json())
    assert data["suite_version"] == suite_version() == version("verl-conformance")
    assert data["checks_registered"] == len(CHECKS)
    assert list(data) == ["backend", "version", "against", "suite_version", "checks_registered", "results", "seconds",
                          "dtype", "device"]
    result = CheckResult("schema::forward_layout", "schema", "passed", "", 0.1)
    report = ConformanceReport("b", "dist 1", None, results=[result])
    assert json.loads(report.to_json())["results"] == [
        {"id": "schema::forward_layout", "area": "schema", "status": "passed", "message": "", "seconds": 0.1}]


def test_table_shows_whole_skip_reasons() -> None:
    """A skip reason of any length is shown whole under its check; a failure's first line likewise."""
    reason = "the backend refuses every RoPE-scaled folder: " + "; ".join(f"actor on folder {i}: refused" for i in range(12))
    report = ConformanceReport("b", "dist 1", None)
    report.results.append(CheckResult("numerics::rope_scaling_matches_reference", "numerics", "skipped", reason, 0.1))
    report.results.append(CheckResult("schema::forward_layout", "schema", "failed", "first line " * 30 + "\ndetails", 0.1))
    table = report.table()
    assert reason in table
    assert ("first line " * 30).rstrip() in table and "details" not in table


def test_pytest_suffix_names_the_collected_test() -> None:
    assert pytest_suffix(CHECKS["weight_sync::bad_streams_rejected"]) == "TestWeightSync::test_bad_streams_rejected"


def test_reproduction_names_the_backend_or_the_factories() -> None:
    from verl_conformance.harness import Subject
    from verl_conformance.runner import reproduction

    text = reproduction("schema::forward_layout", "hf", "example")
    assert "--verl-backend hf --verl-against example" in text and "check_backend('hf', against='example'" in text
    # a run in bfloat16 reproduces through pytest only (check_backend runs float32)
    text = reproduction("invariance::truncated_sampling_keeps_top_token", "hf",
                        pytest_flags=["--verl-dtype bfloat16", "--verl-options '{\"rollout_cache\": \"static\"}'"])
    assert text == ("pytest --pyargs verl_conformance --verl-backend hf --verl-dtype bfloat16 --verl-options "
                    "'{\"rollout_cache\": \"static\"}' -k 'TestInvariance and test_truncated_sampling_keeps_top_token'")
    from verl_example_backend.training import ExampleTrainingEngine

    mine = Subject("mine", ExampleTrainingEngine, lambda spec: None)
    text = reproduction("schema::forward_layout", mine)
    assert "--verl-backend" not in text
    assert "from verl_example_backend.training import ExampleTrainingEngine" in text
    assert "make_training_engine=ExampleTrainingEngine" in text
    assert "make_rollout_engine=<" in text and "<lambda>: not importable, pass the same factory>" in text


def test_differential_skip_names_both_flags() -> None:
    from verl_conformance.api import run_conformance

    report = run_conformance("example", checks=["differential::against_greedy"])
    [result] = report.results
    assert result.status == "skipped"
    assert "--against NAME to `verl conformance`" in result.message and "--verl-against NAME" in result.message


def test_one_role_sync_skip_names_the_against_flag() -> None:
    """A backend with a rollout engine only, checked alone, is told how to pair it with a trainer."""
    from verl_example_backend.rollout import ExampleRolloutEngine

    from verl_conformance.api import run_conformance
    from verl_conformance.harness import Subject

    report = run_conformance(Subject("rollout-only", None, ExampleRolloutEngine),
                             checks=["weight_sync::trainer_to_rollout_sync"])
    [result] = report.results
    assert result.status == "skipped", result
    assert "provides no training engine" in result.message and "--against NAME to `verl conformance`" in result.message


def test_a_crash_in_the_backend_names_the_line_that_raised() -> None:
    """A check that crashes in a backend's code reports where: the type and text alone ("'list'
    object has no attribute 'items'") do not say which of the backend's functions failed."""
    from verl_tiny_backend.rollout import build_rollout_engine

    from verl_conformance import ConformanceError, check_backend

    class ChunksAsDict:
        def __init__(self, spec: object) -> None:
            self.engine = build_rollout_engine(spec)  # type: ignore[arg-type]

        def __getattr__(self, name: str) -> object:
            return getattr(self.engine, name)

        def update_weights(self, stream: object) -> None:
            for msg in stream:  # type: ignore[attr-defined]
                msg.tensors.items()  # a chunk's tensors are a list of (name, tensor) pairs

    with pytest.raises(ConformanceError) as info:
        check_backend("dict-chunks", make_rollout_engine=ChunksAsDict, checks=["weight_sync::rollout_applies_stream"])
    assert info.value.report is not None
    [result] = info.value.report.results
    assert result.message.startswith("AttributeError: "), result.message
    assert f"(raised at {__file__}:" in result.message and "in update_weights)" in result.message, result.message


def test_against_greedy_fails_a_backend_apart_where_the_reference_has_no_near_tie() -> None:
    """Two backends may break a near-tie of their dtype apart (bfloat16); a token apart where the
    float64 reference's choice is decided fails, naming the reference's tokens."""
    import faulty_engines as faulty

    from verl_conformance import ConformanceError, check_backend

    check = ["differential::against_greedy"]
    report = check_backend("example-rollout", make_rollout_engine=faulty._SamplerRollout, against="example",
                           checks=check)
    assert [r.status for r in report.results] == ["passed"]
    with pytest.raises(ConformanceError, match=r"apart at token 2, where the float64 reference .* has no near-tie"):
        check_backend("runner-up", make_rollout_engine=faulty.RunnerUpAtThirdToken, against="example", checks=check)


def test_the_check_time_limit_interrupts_a_wait_that_swallows_exceptions_and_restores_the_handler() -> None:
    import contextlib
    import signal
    import threading
    import time

    from verl_conformance.timelimit import CheckTimedOut, check_time_limit

    def backend_call() -> None:
        with contextlib.suppress(Exception):  # a backend's broad handler must not swallow the limit
            threading.Event().wait()

    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with pytest.raises(CheckTimedOut) as info, check_time_limit(0.3, "area::name"):
        backend_call()
    assert time.monotonic() - t0 < 5
    assert "area::name did not finish within 0.3 s" in str(info.value)
    assert "in backend_call" in str(info.value) and "test_runner.py" in str(info.value)
    assert signal.getsignal(signal.SIGALRM) == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with check_time_limit(None, "area::name"):  # no limit: nothing installed
        assert signal.getsignal(signal.SIGALRM) == before


def test_the_check_time_limit_leaves_another_alarm_handler_alone() -> None:
    import signal

    from verl_conformance.timelimit import check_time_limit

    def theirs(signum: int, frame: object) -> None:
        raise AssertionError("their timer")

    previous = signal.signal(signal.SIGALRM, theirs)
    try:
        with check_time_limit(0.1, "area::name"):
            assert signal.getsignal(signal.SIGALRM) is theirs
            assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_the_check_timeout_option_reads_none_as_the_default_and_zero_as_no_limit() -> None:
    from verl_conformance.timelimit import DEFAULT_CHECK_TIMEOUT_S, limit_from_option

    assert limit_from_option(None) == DEFAULT_CHECK_TIMEOUT_S
    assert limit_from_option(0) is None
    assert limit_from_option(12.5) == 12.5
