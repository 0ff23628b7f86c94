"""Meta-tests: deliberately broken backends, installed through real entry points, fail the suite.

Each broken backend (tests/plugins/verl-broken-backends) is the example backend with one fault;
each test runs only the checks that fault targets and asserts the failure message points at it.
The unbroken example passing those same checks is proven by test_suite_example.py.
"""

from __future__ import annotations

import pytest

from verl_conformance import ConformanceError, check_backend

FAULTS = [
    # (backend, checks to run, checks that must fail, fragments the message must contain)
    ("broken-shifted-log-probs", ["numerics::log_probs_match_reference"],
     ["numerics::log_probs_match_reference"], ["log_probs of llama at temperature 1.0", "float64 reference"]),
    ("broken-temperature", ["numerics::log_probs_match_reference", "numerics::entropy_matches_reference"],
     ["numerics::log_probs_match_reference", "numerics::entropy_matches_reference"], ["temperature 0.7"]),
    ("broken-response-mask", ["schema::forward_layout"], ["schema::forward_layout"],
     ["not 0 where response_mask is False"]),
    ("broken-padding-side", ["schema::generate_layout"], ["schema::generate_layout"],
     ["response_mask", "not right-padded"]),
    ("broken-micro-batch-loss", ["invariance::micro_batch_invariance", "numerics::loss_and_grads_match_reference"],
     ["invariance::micro_batch_invariance", "numerics::loss_and_grads_match_reference"],
     ["micro_batch_size", "loss"]),
    ("broken-weight-sync", ["weight_sync::rollout_applies_stream", "weight_sync::trainer_to_rollout_sync"],
     ["weight_sync::rollout_applies_stream", "weight_sync::trainer_to_rollout_sync"],
     ["a sync that does not apply the weights"]),
    ("broken-optimizer-state", ["numerics::loss_and_grads_match_reference", "differential::trajectory_matches_reference"],
     ["differential::trajectory_matches_reference"], ["3-step GRPO trajectory", "grad norm at step"]),
    ("broken-unseeded", ["invariance::seeded_sampling_reproducible"], ["invariance::seeded_sampling_reproducible"],
     ["not reproducible under a fixed seed"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "checks", "must_fail", "fragments"), FAULTS, ids=[f[0] for f in FAULTS])
def test_broken_backend_fails_targeted_checks(
    backend: str, checks: list[str], must_fail: list[str], fragments: list[str]
) -> None:
    with pytest.raises(ConformanceError) as info:
        check_backend(backend, checks=checks)
    report = info.value.report
    assert report is not None
    failed = sorted(r.id for r in report.failures)
    assert failed == sorted(must_fail), f"{backend}: failed {failed}, expected {must_fail}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{backend}: the error does not point at the fault ({fragment!r}):\n{message}"
    assert "reproduce:" in message and f"--verl-backend {backend}" in message


def test_unknown_backend_is_a_clear_error() -> None:
    from verl_core import UnknownNameError

    with pytest.raises(UnknownNameError, match="installed:.*example"):
        check_backend("no-such-backend", checks=["schema::forward_layout"])


@pytest.mark.slow
def test_check_backends_match_points_at_the_differing_backend() -> None:
    from verl_conformance import check_backends_match

    with pytest.raises(ConformanceError) as info:
        check_backends_match("broken-temperature", "example", checks=["differential::against_log_probs"])
    assert "log_probs of llama: broken-temperature vs example" in str(info.value)
    report = check_backends_match("broken-unseeded", "example", checks=["differential::against_log_probs"])
    assert [r.status for r in report.results] == ["passed"]


@pytest.mark.slow
def test_check_backend_with_own_factories() -> None:
    """Engines that are not installed as a plugin are checked through factories."""
    from verl_broken_backends.engines import IgnoredWeightSync
    from verl_example_backend.training import ExampleTrainingEngine

    report = check_backend("mine", make_training_engine=ExampleTrainingEngine,
                           checks=["schema::forward_layout", "schema::generate_layout"])
    assert [(r.id, r.status) for r in report.results] == [
        ("schema::forward_layout", "passed"), ("schema::generate_layout", "skipped")]
    assert "provides no rollout engine" in report.results[1].message
    with pytest.raises(ConformanceError, match="a sync that does not apply the weights"):
        check_backend("mine", make_rollout_engine=IgnoredWeightSync, checks=["weight_sync::rollout_applies_stream"])
