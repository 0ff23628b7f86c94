"""Helpers of the Ray executor tests: the GRPO demo config cut to a few steps, metric comparison, killing a worker."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from verl_core.trainer.config import RunConfig, load_config
from verl_core.trainer.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "configs" / "grpo_token_demo.toml"
STEPS = 3
RAY_SPLIT = ("executor=ray", "ray.placement=split", "ray.num_cpus_per_worker=1")


def demo_config(out: Path, *extra: str) -> RunConfig:
    """The GRPO demo (batch and model as shipped) cut to :data:`STEPS` steps, writing to ``out``."""
    return load_config(DEMO, [
        f"steps={STEPS}", "logging.progress=false", "logging.plot=false", "checkpoint.every=0",
        f"output_dir={json.dumps(str(out))}", *extra,
    ])


def train(cfg: RunConfig, *, resume: bool = False) -> list[dict[str, Any]]:
    """Run ``cfg`` to the end and return the metrics of every step."""
    with Trainer(cfg) as trainer:
        return trainer.train(resume=resume)


def kill(pid: int) -> None:
    """SIGKILL process ``pid`` (a Ray worker) and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} survived SIGKILL")


def comparable(m: dict[str, Any]) -> dict[str, Any]:
    """The metrics that do not depend on timing (nor on this process's device: the memory plan is
    made where the engines run, here for the local executor only; nor on the executor: ``ray/``, and
    ``weight_sync/direct``, since split groups move the weights by the stream where one process
    copies them directly)."""
    return {k: v for k, v in m.items()
            if not k.startswith(("time/", "throughput/", "memory_plan/", "ray/")) and k != "weight_sync/direct"}


def assert_same_metrics(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Per step: the same metric names, numbers equal within float tolerance, other values equal."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        g, w = comparable(g), comparable(w)
        assert sorted(g) == sorted(w), f"step {step}: metric names differ: {sorted(set(g) ^ set(w))}"
        for key, value in w.items():
            if isinstance(value, float):
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"step {step}: {key}"
            else:
                assert g[key] == value, f"step {step}: {key}"
