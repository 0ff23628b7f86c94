"""rollout.sleep: when the rollout engine sleeps during the update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from verl_core.kernel.errors import ConfigError
from verl_core.trainer.rl.weight_sync import FILL_LIMIT, SleepPolicy

GB = 10**9


class FakeDevice:
    """A device of ``total`` bytes: what is in use, the allocator's reserved bytes and its peak."""

    def __init__(self, total: int, in_use: int, rollout: int) -> None:
        self.total, self.in_use, self.rollout = total, in_use, rollout
        self.reserved = in_use
        self.peak = in_use
        self.resets = 0

    def used(self) -> tuple[int, int]:
        return self.in_use, self.total

    def peaks(self) -> tuple[int, int]:
        return self.reserved, self.peak

    def reset(self) -> None:
        self.resets += 1
        self.peak = self.reserved

    def sleep(self) -> None:
        self.in_use -= self.rollout
        self.reserved -= self.rollout

    def wake(self) -> None:
        self.in_use += self.rollout
        self.reserved += self.rollout

    def update(self, extra: int) -> None:
        """An update whose activations need ``extra`` bytes at their peak (freed at its end)."""
        self.peak = max(self.peak, self.reserved + extra)


def run_steps(policy: SleepPolicy, dev: FakeDevice, extras: list[int]) -> list[bool]:
    """What a trainer does around each update; returns whether each step slept."""
    slept = []
    for extra in extras:
        s = policy.sleeps()
        if s:
            dev.sleep()
        policy.after_sleep()
        dev.update(extra)
        policy.after_update()
        if s:
            dev.wake()
        slept.append(s)
    return slept


def policy_on(dev: FakeDevice, mode: str = "auto", measurable: bool = True) -> SleepPolicy:
    return SleepPolicy(mode, measurable=measurable, used=dev.used, peak=dev.peaks, reset=dev.reset)  # type: ignore[arg-type]


def test_auto_sleeps_first_then_stays_awake_while_both_fit() -> None:
    dev = FakeDevice(total=100 * GB, in_use=30 * GB, rollout=10 * GB)
    policy = policy_on(dev)
    assert run_steps(policy, dev, [20 * GB] * 4) == [True, False, False, False]
    assert policy.rollout_bytes == 10 * GB  # measured by the first sleep, not given


def test_auto_sleeps_again_once_the_update_grows_past_the_limit() -> None:
    dev = FakeDevice(total=100 * GB, in_use=30 * GB, rollout=10 * GB)
    policy = policy_on(dev)
    # awake steps peak at 30 + 20 = 50 GB; then an update needing 60 GB more: 90 GB > 85 GB
    assert run_steps(policy, dev, [20 * GB, 20 * GB, 60 * GB, 20 * GB, 20 * GB]) == [True, False, False, True, False]


def test_auto_keeps_sleeping_when_the_two_do_not_fit() -> None:
    dev = FakeDevice(total=100 * GB, in_use=50 * GB, rollout=30 * GB)
    policy = policy_on(dev)
    # slept: 20 GB in use + 50 GB of update + the rollout's 30 GB = 100 GB > 85 GB
    assert run_steps(policy, dev, [50 * GB] * 3) == [True, True, True]


def test_the_limit_is_inclusive() -> None:
    total = 100 * GB
    dev = FakeDevice(total=total, in_use=40 * GB, rollout=10 * GB)
    extra = int(FILL_LIMIT * total) - 40 * GB
    assert run_steps(policy_on(dev), dev, [extra, extra]) == [True, False]
    dev = FakeDevice(total=total, in_use=40 * GB, rollout=10 * GB)
    assert run_steps(policy_on(dev), dev, [extra + 1, extra + 1]) == [True, True]


@pytest.mark.parametrize(("mode", "expected"), [("always", [True] * 3), ("never", [False] * 3)])
def test_always_and_never(mode: str, expected: list[bool]) -> None:
    dev = FakeDevice(total=100 * GB, in_use=10 * GB, rollout=1 * GB)
    policy = policy_on(dev, mode)
    assert run_steps(policy, dev, [1 * GB] * 3) == expected
    assert dev.resets == 0  # nothing is measured


def test_auto_without_readings_always_sleeps() -> None:
    dev = FakeDevice(total=100 * GB, in_use=10 * GB, rollout=1 * GB)
    policy = policy_on(dev, measurable=False)
    assert run_steps(policy, dev, [1 * GB] * 3) == [True, True, True]
    assert dev.resets == 0


def test_the_config_key_is_checked() -> None:
    from verl_core.trainer.config import load_config

    with pytest.raises(ConfigError, match="rollout.sleep"):
        load_config(overrides=["rollout.sleep=sometimes"])


def test_a_run_that_never_sleeps_trains_exactly_like_one_that_always_does(tmp_path: Path) -> None:
    import json

    import torch

    from verl_core.trainer.config import load_config
    from verl_core.trainer.rl.trainer import Trainer

    base = ["task.name=copy", "task.digits=2", "seed=3", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_heads=2", "model.num_kv_heads=1", "rollout.n=4", "rollout.max_new_tokens=4",
            "batch.prompts_per_step=4", "steps=3", "optim.lr=1e-2", "logging.progress=false",
            "logging.plot=false", "checkpoint.final=false"]
    runs = {}
    for mode in ("always", "never"):
        cfg = load_config(None, [*base, f"output_dir={json.dumps(str(tmp_path / mode))}", f"rollout.sleep={mode}"])
        with Trainer(cfg) as trainer:
            trainer.setup()
            calls = {"sleep_until_sync": 0, "wake": 0}
            rollout = trainer.engines.rollout
            for name in calls:
                method = getattr(rollout, name)

                def counted(method: Any = method, name: str = name, calls: dict[str, int] = calls) -> None:
                    calls[name] += 1
                    method()

                setattr(rollout, name, counted)
            history = trainer.train()
            weights = [t.detach().clone() for t in trainer.actor.model.parameters()]  # type: ignore[attr-defined]
        runs[mode] = (history, weights, calls)
    (h_always, w_always, c_always), (h_never, w_never, c_never) = runs["always"], runs["never"]
    assert c_always["sleep_until_sync"] == 3 and c_never["sleep_until_sync"] == 0
    assert [m["rollout/slept"] for m in h_always] == [1, 1, 1] and [m["rollout/slept"] for m in h_never] == [0, 0, 0]
    for a, b in zip(h_always, h_never, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean"):
            assert a[key] == b[key], key
    assert all(torch.equal(a, b) for a, b in zip(w_always, w_never, strict=True))
