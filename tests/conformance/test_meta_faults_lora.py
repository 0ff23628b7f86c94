"""Meta-tests of the LoRA checks: each broken LoRA backend (the hf backend with one LoRA fault,
tests/plugins/verl-broken-backends/src/verl_broken_backends/lora.py) fails the check that targets it.

The checks run on the unbroken hf backend in test_suite_hf.py; here each fault must fail its check
with a message that points at it, and pass the LoRA checks it does not target where that shows
the checks tell faults apart.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_conformance import ConformanceError, check_backend
from verl_core.kernel.registry import PLUGINS_ENV, reset_registry

BROKEN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "verl-broken-backends" / "src"
ALL = ["numerics::lora_forward_and_grads_match_reference", "numerics::lora_base_forward_is_base_model",
       "stateful::lora_base_unchanged", "weight_sync::lora_sync_serves_merged_weights",
       "stateful::lora_checkpoint_round_trip", "stateful::lora_forwards_on_two_threads",
       "numerics::lora_dropout_only_while_training", "numerics::lora_fresh_adapter_is_seeded",
       "weight_sync::lora_adapter_stream_version", "numerics::lora_lm_head_target"]

FAULTS = [
    # (backend, checks to run, checks that must fail, fragments the message must contain)
    ("broken-lora-scale", ALL[:2], ALL[:1],
     ["LoRA log_probs at temperature 1.0 vs the float64 reference of W + alpha/rank * B A"]),
    ("broken-lora-base-trained", ALL[1:3], ALL[2:3], ["base_forward changed after two updates"]),
    ("broken-lora-unmerged", [ALL[0], ALL[3]], ALL[3:4],
     ["after a LoRA sync of merged weights", "a rollout loaded with the merged weights"]),
    ("broken-lora-base-forward", ALL[:2], ALL[1:2],
     ["base_forward log_probs at temperature 1.0 vs the float64 reference of the base folder"]),
    ("broken-lora-base-forward-full", ALL[1:3], ALL[2:3],
     ["base_forward of an engine that trains model.norm fully (LoraSpec.full) changed after two updates"]),
    ("broken-lora-checkpoint", [ALL[2], ALL[4]], ALL[4:5],
     ["after save_checkpoint and load_checkpoint of a LoRA engine", "update 1"]),
    ("broken-lora-forward-switch", [ALL[1], ALL[5]], ALL[5:6],
     ["forward called while base_forward ran on another thread", "pass the choice down the call"]),
    ("broken-lora-sync-full", [ALL[3]], ALL[3:4],
     ["after a LoRA sync of the adapter (LoraSpec.full=('model.norm',))"]),
    ("broken-lora-rollout-init", [ALL[3]], ALL[3:4],
     ["a rollout declaring lora_adapters built with LoraSpec.init_path", "before any sync",
      "an adapter rollout starts from init_path like the actor"]),
    ("broken-lora-full-swap", [ALL[2], ALL[5]], ALL[5:6],
     ["forward called while base_forward ran on another thread (LoraSpec.full=('model.norm',))",
      "values swapped between trained and base"]),
    ("broken-lora-dropout-always-on", [ALL[0], ALL[6]], ALL[6:7],
     ["forward of an engine with LoraSpec.dropout=0.5 gave different log_probs on two calls"]),
    ("broken-lora-dropout-ignored", [ALL[0], ALL[6]], ALL[6:7],
     ["the adapter's dropout is not applied while training"]),
    ("broken-lora-unseeded-init", [ALL[0], ALL[7]], ALL[7:8],
     ["differs between two engines built from the same spec: A must be a deterministic function of spec.seed"]),
    ("broken-lora-adapter-version", [ALL[0], ALL[8]], ALL[8:9],
     ["export_adapter after 1 optimizer step(s) streams version 0 (commit 0)"]),
    ("broken-lora-lm-head", [ALL[0], ALL[9]], ALL[9:10],
     ["log_probs vs the float64 reference with every target merged, lm_head included"]),
]


@pytest.fixture
def broken_lora_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Register the broken LoRA backends for this test (and the processes it starts), then forget them."""
    monkeypatch.syspath_prepend(str(BROKEN_SRC))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(BROKEN_SRC), os.environ.get("PYTHONPATH")) if p))
    from verl_broken_backends.lora import verl_plugins

    monkeypatch.setenv(PLUGINS_ENV, verl_plugins())
    reset_registry()
    yield
    reset_registry()


@pytest.mark.slow
@pytest.mark.usefixtures("broken_lora_backends")
@pytest.mark.parametrize(("backend", "checks", "must_fail", "fragments"), FAULTS, ids=[f[0] for f in FAULTS])
def test_broken_lora_backend_fails_targeted_checks(
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


@pytest.mark.slow
@pytest.mark.usefixtures("broken_lora_backends")
def test_the_unbroken_hf_backend_passes_every_lora_check() -> None:
    report = check_backend("hf", checks=ALL)
    assert sorted(r.id for r in report.results if r.status == "passed") == sorted(ALL)


@pytest.mark.slow
@pytest.mark.usefixtures("broken_lora_backends")
@pytest.mark.parametrize(("backend", "status"), [("broken-lora-stale-masters", "failed"), ("hf", "passed")])
def test_a_lora_load_that_leaves_the_masters_stale_fails_the_round_trip_in_bfloat16(backend: str, status: str) -> None:
    """In bfloat16 the hf engine keeps float32 masters of the fully trained module (adapters are
    float32 already); a load that restores the weights but not those masters resumes wrong from
    the first step after it. float32 has no masters, so the fault shows in bfloat16 only."""
    from verl_conformance.harness import EngineCache, Harness, Subject
    from verl_conformance.runner import run_checks, select_checks

    harness = Harness(Subject.from_registry(backend), None, EngineCache(), dtype="bfloat16")
    try:
        report = run_checks(harness, select_checks(["stateful::lora_checkpoint_round_trip"], None), None)
    finally:
        harness.cache.close()
    (result,) = report.results
    assert result.status == status, result.message
    if status == "failed":
        assert "after save_checkpoint and load_checkpoint of a LoRA engine into a fresh one" in result.message
        assert "after update 1" in result.message or "of update 1" in result.message, result.message
