"""The buffer area on the project's HybridReplayBuffer, from Python and through pytest's --verl-buffer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_conformance import check_backend, check_buffer
from verl_core.trainer.batching.replay import HybridReplayBuffer

REPO = Path(__file__).resolve().parents[2]


def test_hybrid_replay_buffer_passes_the_buffer_checks() -> None:
    report = check_buffer(HybridReplayBuffer)
    assert [(r.id, r.status) for r in report.results] == [
        ("buffer::buffer_capacity", "passed"), ("buffer::buffer_order", "passed"),
        ("buffer::buffer_spill", "passed"), ("buffer::buffer_seeded_sampling", "passed")]


def test_a_buffer_without_disk_tier_skips_the_spill_check() -> None:
    def memory_only(**kw: object) -> HybridReplayBuffer:
        kw.pop("memory_samples", None)
        return HybridReplayBuffer(spill=False, **kw)  # type: ignore[arg-type]

    report = check_buffer(memory_only, disk_tier=False)
    assert {r.id: r.status for r in report.results}["buffer::buffer_spill"] == "skipped"
    assert [r.status for r in report.results].count("passed") == 3


def test_without_a_buffer_the_skip_names_pytest_s_option() -> None:
    """The buffer area of a backend's run (check_backend, `verl conformance`) has no buffer: the skip says
    where one is given, which is pytest's option (the `verl conformance` command has none) or check_buffer."""
    report = check_backend("toy", checks=["buffer::buffer_capacity"])
    [result] = report.results
    assert result.status == "skipped"
    assert result.message.startswith("no replay buffer selected: pass pytest's --verl-buffer MODULE:FACTORY"), result
    assert "check_buffer" in result.message


def test_check_buffer_runs_buffer_checks_only() -> None:
    with pytest.raises(ValueError, match="check_buffer runs buffer checks only"):
        check_buffer(HybridReplayBuffer, checks=["schema::forward_layout"])


@pytest.mark.slow
def test_verl_buffer_option_without_a_backend() -> None:
    """--verl-buffer alone runs the buffer area and skips the engine checks, saying why."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "--pyargs",
                        "verl_conformance", "--verl-buffer", "verl_core.trainer.batching.replay:HybridReplayBuffer",
                        "-k", "TestBuffer or test_forward_layout"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "4 passed, 1 skipped" in r.stdout, r.stdout[-3000:]
    assert "no backend selected" in r.stdout
