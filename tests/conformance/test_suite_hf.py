"""The whole conformance suite on the in-tree `hf` backend (differential checks against `example`),
in float32 and, since a float32 run cannot see what float32 master weights change, in bfloat16."""

from __future__ import annotations

import pytest
from suite_runner import run_suite

from verl_conformance.harness import EngineCache, Harness, Subject
from verl_conformance.runner import run_checks, select_checks


@pytest.mark.slow
def test_suite_hf() -> None:
    run_suite("hf", against="example")


@pytest.mark.slow
def test_suite_hf_in_bfloat16() -> None:
    """The run ``pytest --pyargs verl_conformance --verl-backend hf --verl-dtype bfloat16`` makes: the
    actor keeps float32 masters beside its bfloat16 weights, so checkpoint, gradient and update
    checks meet state a float32 run does not have."""
    harness = Harness(Subject.from_registry("hf"), None, EngineCache(), dtype="bfloat16")
    try:
        report = run_checks(harness, select_checks(None, None), None)
    finally:
        harness.cache.close()
    print(report.table())
    assert not report.failures, "\n".join(f"{r.id}: {r.message}" for r in report.failures)
    assert len([r for r in report.results if r.status == "passed"]) >= 50
