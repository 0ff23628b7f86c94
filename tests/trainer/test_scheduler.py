"""DynamicBatchScheduler: budgets from an injected probe, whole-call OOM back-off without loss, budget replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.kernel.batch import TensorBatch, micro_batch_cost, partition_by_token_budget
from verl_core.kernel.errors import ConfigError
from verl_core.trainer.batching.scheduler import (
    Decision,
    DynamicBatchScheduler,
    MemoryInfo,
    MicroBatchOOMError,
    PeakReading,
    SchedulerConfig,
    default_peak_probe,
    host_memory_probe,
)

GiB = 1 << 30


def make_batch(lengths: list[int]) -> TensorBatch:
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    n = len(lengths)
    return TensorBatch(
        {
            "prompt_ids": torch.ones(n, 2, dtype=torch.int64),
            "prompt_mask": torch.ones(n, 2, dtype=torch.bool),
            "response_ids": torch.where(mask, 5, 0),
            "response_mask": mask,
            "group_ids": torch.arange(n),
        }
    )


class DeviceWithLimit:
    """An engine stand-in for memory: raises the real torch.OutOfMemoryError over a token limit.

    :meth:`call` behaves like ``forward_backward``: it cuts the whole batch with the kernel
    partitioner under the budget it is given, and a call that runs out of memory keeps nothing.
    ``packed``: a micro-batch costs its real tokens, as on an engine that packs sequences.
    """

    def __init__(self, limit_tokens: int, *, packed: bool = False) -> None:
        self.limit = limit_tokens
        self.packed = packed
        self.seen: list[int] = []
        self.calls = 0
        self.ooms = 0

    def forward(self, mb: TensorBatch) -> TensorBatch:
        self.calls += 1
        cost = micro_batch_cost(mb.seq_lengths().tolist(), packed=self.packed)
        if cost > self.limit:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"tried to allocate for {cost} tokens")
        self.seen.extend(mb["group_ids"].tolist())
        return mb.update(scores=mb["group_ids"].float() * 2)

    def caller(self, batch: TensorBatch) -> Callable[[int], list[list[int]]]:
        def call(budget: int) -> list[list[int]]:
            mbs = batch.micro_batches(max_tokens=budget, packed=self.packed)
            ran = [self.forward(mb)["group_ids"].tolist() for mb in mbs]
            return ran  # only a call that finished counts (an engine call that raises leaves nothing)

        return call


def probe_of(free: int) -> MemoryInfo:
    return MemoryInfo(free, 16 * GiB)


def test_budget_follows_the_probe_within_bounds() -> None:
    cfg = SchedulerConfig(min_tokens=32, max_tokens=4096, bytes_per_token=1024, memory_fraction=0.5)
    free = [1 << 20]
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(free[0]))
    assert sched.probe_budget() == 512  # 1 MiB * 0.5 / 1 KiB
    free[0] = 1 << 30
    assert sched.probe_budget() == 4096  # clamped to max
    free[0] = 1000
    assert sched.probe_budget() == 32  # clamped to min


def test_host_probe_reads_real_memory() -> None:
    info = host_memory_probe()
    assert 0 < info.free_bytes <= info.total_bytes


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    limit=st.integers(14, 200),
)
def test_oom_halves_and_retries_without_losing_or_repeating_samples(lengths: list[int], limit: int) -> None:
    batch = make_batch(lengths)
    device = DeviceWithLimit(limit)
    cfg = SchedulerConfig(min_tokens=1, max_tokens=1024, bytes_per_token=1, memory_fraction=1.0, grow_after=1000)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    ran = sched.run(batch, device.caller(batch), key="k")
    assert sorted(i for g in ran for i in g) == list(range(len(lengths)))  # the successful call: each sample once
    assert sched.metrics()["scheduler/ooms"] == device.ooms
    (decision,) = sched.plan
    assert decision.ooms == device.ooms
    if device.ooms:
        assert sched.ceiling < 1024
    # the decision holds the partition the successful call ran, at the budget it ran under
    assert [list(g) for g in decision.groups] == partition_by_token_budget(batch.seq_lengths().tolist(), decision.budget)
    assert ran == [list(g) for g in decision.groups]


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    limit=st.integers(14, 200),
)
def test_forward_runs_every_sample_once_in_input_order(lengths: list[int], limit: int) -> None:
    batch = make_batch(lengths)
    device = DeviceWithLimit(limit)
    cfg = SchedulerConfig(min_tokens=1, max_tokens=1024, bytes_per_token=1, memory_fraction=1.0, grow_after=1000)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    out = sched.run_forward(batch, device.forward, key="k")
    assert torch.equal(out["scores"], torch.arange(len(lengths)).float() * 2)  # input order restored
    assert torch.equal(out["response_ids"], batch["response_ids"])
    (decision,) = sched.plan
    n_ok = sum(len(g) for g in decision.groups)
    assert sorted(device.seen[-n_ok:]) == list(range(len(lengths)))  # the last (successful) pass: each once


def test_ceiling_grows_back_after_successes() -> None:
    batch = make_batch([4] * 16)  # 16 x 6 tokens
    device = DeviceWithLimit(48)
    cfg = SchedulerConfig(min_tokens=6, max_tokens=96, bytes_per_token=1, memory_fraction=1.0, grow_after=2)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    sched.run(batch, device.caller(batch), key="a")
    assert device.ooms == 1
    assert sched.ceiling == 96  # halved to 48, then doubled back after 2 successful micro-batches
    lowered = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    device2 = DeviceWithLimit(48)
    small = make_batch([4] * 8)
    lowered.run(small, device2.caller(small), key="b")  # 8 x 6 = 48 fits in one
    assert device2.ooms == 0
    # a long run of successes at a lowered ceiling doubles it
    s3 = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    dev3 = DeviceWithLimit(24)
    big = make_batch([4] * 16)
    s3.run(big, dev3.caller(big), key="c")
    assert dev3.ooms >= 1
    ceilings = []
    for i in range(4):
        pair = make_batch([4] * 2)
        s3.run(pair, dev3.caller(pair), key=f"d{i}")
        ceilings.append(s3.ceiling)
    assert max(ceilings) > min(ceilings)


def test_single_sample_oom_is_a_clear_error() -> None:
    device = DeviceWithLimit(3)
    sched = DynamicBatchScheduler(SchedulerConfig(min_tokens=1, bytes_per_token=1), probe=lambda: probe_of(1 << 40))
    one = make_batch([10])
    with pytest.raises(MicroBatchOOMError, match="one sample of 12 tokens ran out of memory") as info:
        sched.run(one, device.caller(one), key="x")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_other_errors_are_not_swallowed() -> None:
    def broken(budget: int) -> int:
        raise RuntimeError("not memory")

    sched = DynamicBatchScheduler(probe=lambda: probe_of(1 << 40))
    with pytest.raises(RuntimeError, match="not memory"):
        sched.run(make_batch([3, 3]), broken, key="x")


def test_resumed_run_replays_the_recorded_plan() -> None:
    lengths = [5, 3, 8, 2, 7, 7, 1, 4, 6, 2]
    batch = make_batch(lengths)
    cfg = SchedulerConfig(min_tokens=4, max_tokens=1000, bytes_per_token=1, memory_fraction=1.0, grow_after=3)
    first = DynamicBatchScheduler(cfg, probe=lambda: probe_of(60))
    dev = DeviceWithLimit(40)
    for step in range(3):
        first.run(batch, dev.caller(batch), key=f"step{step}")
    plan = [Decision.from_json(d.to_json()) for d in first.plan]
    # the resumed run sees plenty of memory, yet runs the same micro-batches at the same budgets
    resumed = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40), replay=plan[1:])
    resumed.load_state_dict({"ceiling": plan[0].ceiling, "successes": plan[0].successes})
    dev2 = DeviceWithLimit(40)
    budgets: list[int] = []
    for step in (1, 2):
        resumed.run(batch, lambda b: budgets.append(b) or dev2.caller(batch)(b), key=f"step{step}")
    assert budgets == [d.budget for d in plan[1:]]
    assert [d.groups for d in resumed.plan] == [d.groups for d in plan[1:]]
    assert dev2.ooms == 0  # the recorded budget already fits
    assert resumed.metrics()["scheduler/replayed_calls"] == 2
    # a plan that does not cover the batch is refused
    bad = DynamicBatchScheduler(cfg, replay=[Decision("z", ((0,),), 4)])
    pair = make_batch([1, 1])
    with pytest.raises(ConfigError, match="covers 1 samples, the batch has 2"):
        bad.run(pair, dev.caller(pair), key="z")


def test_a_fixed_budget_ignores_later_memory_and_travels_in_the_state() -> None:
    cfg = SchedulerConfig(min_tokens=4, max_tokens=1000, bytes_per_token=1, memory_fraction=1.0)
    free = [60]
    reads = [0]

    def probe() -> MemoryInfo:
        reads[0] += 1
        return probe_of(free[0])

    sched = DynamicBatchScheduler(cfg, probe=probe)
    assert sched.fixed_budget is None and sched.probe_budget() == 60  # read at every call by default
    assert sched.fix_budget() == 60 and sched.fixed_budget == 60
    free[0], before = 1 << 40, reads[0]
    assert sched.probe_budget() == 60 and reads[0] == before  # fixed: the probe is not read again
    lengths = [5, 3, 8, 2, 7, 7]
    six = make_batch(lengths)
    seen: list[int] = []
    sched.run(six, lambda b: seen.append(b) or DeviceWithLimit(1000).caller(six)(b), key="a")
    assert seen == [60]
    # an OOM still halves the budget; the state carries the fixed budget to a resumed scheduler
    sched.run(six, DeviceWithLimit(20).caller(six), key="b")
    assert sched.ceiling < 60 and sched.probe_budget() == sched.ceiling
    resumed = DynamicBatchScheduler(cfg, probe=lambda: probe_of(8))
    resumed.fix_budget()
    resumed.load_state_dict(sched.state_dict())
    assert resumed.fixed_budget == 60 and resumed.probe_budget() == sched.probe_budget()
    # a state written before budgets were stored keeps the scheduler's own
    older = DynamicBatchScheduler(cfg, probe=lambda: probe_of(8))
    older.fix_budget()
    older.load_state_dict({"ceiling": 1000, "successes": 0})
    assert older.fixed_budget == 8
    assert DynamicBatchScheduler(cfg).fix_budget(5000) == 1000  # within the bounds
    with pytest.raises(ConfigError, match="needs an integer >= 1"):
        sched.fix_budget(0)


def test_budget_never_falls_below_the_longest_sample() -> None:
    # the partitioner needs every sample to fit one micro-batch: a budget from scarce memory is raised
    cfg = SchedulerConfig(min_tokens=1, max_tokens=1000, bytes_per_token=1, memory_fraction=1.0)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(5))
    batch = make_batch([10, 3, 3])
    budgets: list[int] = []
    sched.run(batch, lambda b: budgets.append(b) or DeviceWithLimit(100).caller(batch)(b), key="k")
    assert budgets == [12]  # 2 prompt + 10 response tokens
    # an OOM at the smallest budget the batch allows is a clear error naming the floor
    with pytest.raises(MicroBatchOOMError, match="cannot go below 12"):
        sched.run(batch, DeviceWithLimit(11).caller(batch), key="k2")


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="min_tokens <= max_tokens"):
        SchedulerConfig(min_tokens=10, max_tokens=5)
    with pytest.raises(ConfigError, match="min_tokens <= max_tokens"):
        SchedulerConfig(min_tokens=0)
    with pytest.raises(ConfigError, match="reserved_bytes must be >= 0, got -1"):
        SchedulerConfig(reserved_bytes=-1)
    with pytest.raises(ConfigError, match="memory_fraction"):
        SchedulerConfig(memory_fraction=0)


def test_the_budget_is_bounded_by_the_batch() -> None:
    # no fixed cap: plenty of memory gives the whole batch (padded), never more
    sched = DynamicBatchScheduler(SchedulerConfig(min_tokens=4, bytes_per_token=1), probe=lambda: probe_of(1 << 40))
    assert sched.config.max_tokens is None and sched.probe_budget() == (1 << 40) // 2
    batch = make_batch([5, 3, 8])  # 3 x (2 + 8) padded tokens
    budgets: list[int] = []
    sched.run(batch, lambda b: budgets.append(b) or DeviceWithLimit(1000).caller(batch)(b), key="k")
    assert budgets == [30] and len(sched.plan[-1].groups) == 1
    assert sched.fix_budget() == (1 << 40) // 2 and sched.ceiling == 1 << 40
    # a halving after an OOM starts from the batch, not from the huge budget
    sched.run(batch, DeviceWithLimit(20).caller(batch), key="oom")
    assert sched.plan[-1].ooms == 1 and sched.plan[-1].budget == 15


class FixedPeak:
    """A peak probe reporting a set reading (the host has no allocator statistics)."""

    def __init__(self, reading: PeakReading | None) -> None:
        self.reading = reading
        self.calls = 0

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, PeakReading | None]:
        self.calls += 1
        return fn(), self.reading


def test_the_first_training_call_refines_the_budget_once() -> None:
    cfg = SchedulerConfig(min_tokens=4, bytes_per_token=100, memory_fraction=0.5, reserved_bytes=1000)
    peak = FixedPeak(PeakReading(before=500, peak=500 + 40 * 60 + 7, after=520))  # 40 B/token above the after
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(9000), peak_probe=peak)
    assert sched.fix_budget() == (9000 - 1000) // 2 // 100 == 40
    assert sched.available_bytes == 8000 and sched.refinement_pending
    batch = make_batch([4] * 10)  # 10 x 6 tokens: micro-batches of 6 samples (36 tokens) at budget 40
    sched.run_forward(batch, DeviceWithLimit(1000).forward, key="fwd")  # a forward does not refine
    assert peak.calls == 0 and sched.refinement_pending and sched.plan[-1].refined == 0
    sched.run(batch, DeviceWithLimit(1000).caller(batch), key="train0", training=True)
    assert peak.calls == 1 and not sched.refinement_pending
    # transient = peak - after = 40 x 60 + 7 -20 over the largest micro-batch, 6 x 6 = 36 tokens
    measured = -(-(40 * 60 + 7 - 20) // 36)
    assert sched.bytes_per_token == measured == 67
    assert sched.fixed_budget == 4000 // 67 == sched.plan[-1].refined == 59
    assert sched.plan[-1].budget == 40  # the measured call itself ran at the estimate's budget
    for i in range(3):  # later training calls never measure again
        sched.run(batch, DeviceWithLimit(1000).caller(batch), key=f"train{i + 1}", training=True)
    assert peak.calls == 1 and sched.fixed_budget == 59 and sched.plan[-1].refined == 0
    assert sched.metrics()["scheduler/bytes_per_token"] == 67
    state = sched.state_dict()
    assert state["budget"] == 59 and state["refine_from"] is None


def test_the_budget_is_read_again_before_the_first_update_and_never_after() -> None:
    """The trainer reads the free memory again once the rollout slept (its weights left the device
    after the budget was fixed at setup); the refinement then starts from that reading."""
    cfg = SchedulerConfig(min_tokens=4, bytes_per_token=100, memory_fraction=0.5, reserved_bytes=1000)
    free = {"bytes": 3000}
    peak = FixedPeak(PeakReading(before=500, peak=500 + 40 * 60 + 7, after=520))
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(free["bytes"]), peak_probe=peak)
    assert sched.fix_budget() == (3000 - 1000) // 2 // 100 == 10
    free["bytes"] = 9000  # the rollout slept
    assert sched.reread_budget() == (9000 - 1000) // 2 // 100 == 40
    assert sched.available_bytes == 8000 and sched.refinement_pending
    batch = make_batch([4] * 10)
    sched.run(batch, DeviceWithLimit(1000).caller(batch), key="train0", training=True)
    assert sched.plan[-1].budget == 40 and sched.fixed_budget == 8000 // 2 // 67 == 59  # refined from the new reading
    free["bytes"] = 100  # later readings change nothing: the budget is the run's
    assert sched.reread_budget() == 59 and sched.fixed_budget == 59
    restored = DynamicBatchScheduler(cfg, probe=lambda: probe_of(free["bytes"]), peak_probe=peak)
    restored.fix_budget(48)  # a resumed run's budget, from its checkpoint
    free["bytes"] = 9000
    assert restored.reread_budget() == 48


def test_no_reading_keeps_the_estimate_and_a_given_budget_is_never_refined() -> None:
    cfg = SchedulerConfig(min_tokens=4, bytes_per_token=100, memory_fraction=1.0)
    batch = make_batch([4] * 4)
    blind = FixedPeak(None)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(5000), peak_probe=blind)
    sched.fix_budget()
    sched.run(batch, DeviceWithLimit(1000).caller(batch), key="t", training=True)
    assert blind.calls == 1 and not sched.refinement_pending and sched.fixed_budget == 50
    assert sched.plan[-1].refined == 50  # recorded: the refinement happened (and changed nothing)
    peak = FixedPeak(PeakReading(0, 10**9, 0))
    given = DynamicBatchScheduler(cfg, probe=lambda: probe_of(5000), peak_probe=peak)
    given.fix_budget(48)
    given.run(batch, DeviceWithLimit(1000).caller(batch), key="t", training=True)
    assert peak.calls == 0 and given.fixed_budget == 48
    assert default_peak_probe("cpu") is None  # the host has no allocator peak


def test_a_resume_reuses_the_refined_budget_from_the_state_or_the_plan() -> None:
    cfg = SchedulerConfig(min_tokens=4, bytes_per_token=10, memory_fraction=1.0)
    batch = make_batch([4] * 10)

    def fresh(peak: FixedPeak, free: int) -> DynamicBatchScheduler:
        s = DynamicBatchScheduler(cfg, probe=lambda: probe_of(free), peak_probe=peak)
        s.fix_budget()
        return s

    first = fresh(FixedPeak(PeakReading(0, 60 * 30, 0)), 600)  # estimate 60 tokens; measured 30 B/token
    seen: list[int] = []
    before = first.state_dict()
    for step in range(3):
        first.run(batch, lambda b: seen.append(b) or DeviceWithLimit(1000).caller(batch)(b), key=f"s{step}",
                  training=True)
    assert seen == [60, 20, 20]
    plan = [Decision.from_json(d.to_json()) for d in first.plan]
    assert plan[0].refined == 20
    # from a state written after the refinement: another memory and another peak change nothing
    other = FixedPeak(PeakReading(0, 1, 0))
    after = fresh(other, 1 << 30)
    after.load_state_dict(first.state_dict())
    assert after.probe_budget() == 20 and not after.refinement_pending
    after.run(batch, DeviceWithLimit(1000).caller(batch), key="s3", training=True)
    assert other.calls == 0
    # from a state written before it, with the interrupted run's plan: the replayed call restores it
    replayed = fresh(other, 1 << 30)
    replayed.load_state_dict(before)
    assert replayed.refinement_pending and replayed.probe_budget() == 60
    replayed.add_replay(plan)
    for step in range(3):
        replayed.run(batch, DeviceWithLimit(1000).caller(batch), key=f"s{step}", training=True)
    assert other.calls == 0 and [d.groups for d in replayed.plan] == [d.groups for d in plan]
    assert replayed.fixed_budget == 20 and not replayed.refinement_pending
    # a state of an older version (no refine_from) refines nothing
    old = fresh(other, 1 << 30)
    old.load_state_dict({"ceiling": 1 << 40, "successes": 0, "budget": 60})
    assert not old.refinement_pending and old.probe_budget() == 60


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    limit=st.integers(14, 200),
)
def test_packed_calls_back_off_and_record_the_engines_partition(lengths: list[int], limit: int) -> None:
    batch = make_batch(lengths)
    device = DeviceWithLimit(limit, packed=True)
    cfg = SchedulerConfig(min_tokens=1, max_tokens=1024, bytes_per_token=1, memory_fraction=1.0, grow_after=1000)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    ran = sched.run(batch, device.caller(batch), key="k", packed=True)
    assert sorted(i for g in ran for i in g) == list(range(len(lengths)))
    (decision,) = sched.plan
    assert decision.ooms == device.ooms
    assert decision.budget <= sum(n + 2 for n in lengths)  # bounded by the whole batch's real tokens
    lens = batch.seq_lengths().tolist()
    assert [list(g) for g in decision.groups] == partition_by_token_budget(lens, decision.budget, packed=True)
    assert ran == [list(g) for g in decision.groups]
    assert all(micro_batch_cost([lens[i] for i in g], packed=True) <= min(limit, decision.budget)
               for g in decision.groups)
    # a forward through the scheduler packs alike and restores the input order
    fwd = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    out = fwd.run_forward(batch, DeviceWithLimit(limit, packed=True).forward, key="f", packed=True)
    assert torch.equal(out["scores"], torch.arange(len(lengths)).float() * 2)
    assert [list(g) for g in fwd.plan[0].groups] == partition_by_token_budget(lens, fwd.plan[0].budget, packed=True)


def test_packed_budget_holds_more_samples_per_micro_batch() -> None:
    batch = make_batch([10, 1, 1, 1, 1, 1, 1])  # 12 and six times 3 tokens with the prompts
    cfg = SchedulerConfig(min_tokens=4, max_tokens=15, bytes_per_token=1, memory_fraction=1.0)
    padded, packed = (DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40)) for _ in range(2))
    padded.run(batch, DeviceWithLimit(1000).caller(batch), key="k")
    packed.run(batch, DeviceWithLimit(1000, packed=True).caller(batch), key="k", packed=True)
    assert padded.plan[0].budget == packed.plan[0].budget == 15
    assert padded.plan[0].groups == ((0,), (1, 2, 3, 4, 5), (6,))  # size x longest <= 15
    assert packed.plan[0].groups == ((0, 1), (2, 3, 4, 5, 6))  # 12 + 3 | 5 x 3
    # the whole batch's budget bound counts real tokens too: 30 of them, not 7 x 12 padded
    whole = DynamicBatchScheduler(SchedulerConfig(min_tokens=4, bytes_per_token=1), probe=lambda: probe_of(1 << 40))
    budgets: list[int] = []
    whole.run(batch, lambda b: budgets.append(b) or DeviceWithLimit(1000, packed=True).caller(batch)(b), key="w",
              packed=True)
    assert budgets == [30] and len(whole.plan[0].groups) == 1


def test_packed_refinement_measures_per_real_token_and_a_resume_replays_it() -> None:
    cfg = SchedulerConfig(min_tokens=4, bytes_per_token=10, memory_fraction=1.0)
    batch = make_batch([4, 4, 1, 1, 1, 1])  # 6, 6, 3, 3, 3, 3 tokens
    peak = FixedPeak(PeakReading(0, 21 * 20, 0))  # 20 bytes per token over the largest packed micro-batch
    first = DynamicBatchScheduler(cfg, probe=lambda: probe_of(210), peak_probe=peak)
    assert first.fix_budget() == 21
    seen: list[int] = []
    for step in range(2):
        first.run(batch, lambda b: seen.append(b) or DeviceWithLimit(1000, packed=True).caller(batch)(b),
                  key=f"s{step}", training=True, packed=True)
    # at 21 tokens: 6+6+3+3+3 | 3 packed; the largest micro-batch holds 21 real tokens (padded: 5 x 6 = 30)
    assert [len(g) for g in first.plan[0].groups] == [5, 1]
    assert first.bytes_per_token == 20 and first.fixed_budget == 210 // 20 == 10 == first.plan[0].refined
    assert seen == [21, 10]
    plan = [Decision.from_json(d.to_json()) for d in first.plan]
    resumed = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 30), peak_probe=FixedPeak(None), replay=plan)
    resumed.fix_budget()
    for step in range(2):
        resumed.run(batch, DeviceWithLimit(1000, packed=True).caller(batch), key=f"s{step}", training=True,
                    packed=True)
    assert [d.groups for d in resumed.plan] == [d.groups for d in plan]
    assert resumed.fixed_budget == 10


def test_the_time_lost_to_out_of_memory_attempts_is_counted_per_call() -> None:
    import time

    batch = make_batch([4, 4, 4, 4])
    cfg = SchedulerConfig(min_tokens=1, max_tokens=64, bytes_per_token=1, memory_fraction=1.0)
    sched = DynamicBatchScheduler(cfg, probe=lambda: probe_of(1 << 40))
    attempts: list[int] = []

    def slow_then_fits(budget: int) -> int:
        attempts.append(budget)
        if budget > 8:
            time.sleep(0.05)  # work done before the allocation that fails
            raise torch.OutOfMemoryError("out of memory")
        return budget

    got = sched.run(batch, slow_then_fits, key="step0/actor_update/0")
    assert got == attempts[-1] <= 8 and len(attempts) >= 2
    assert sched.oom_seconds("step0/") >= 0.05 * (len(attempts) - 1)
    sched.run(batch, lambda budget: budget, key="step1/actor_update/0")
    assert sched.oom_seconds("step1/") == 0.0 and sched.oom_seconds() == sched.oom_seconds("step0/")
    assert sched.metrics()["scheduler/oom_seconds"] == sched.oom_seconds()
