"""The registered hf -> hf direct weight sync: same result and failure semantics as the stream."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import actor_spec, model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import (
    EngineSpec,
    SamplingParams,
    StaleWeightsError,
    StreamWeightSync,
    WeightSyncError,
    get_weight_sync,
)
from verl_hf.rollout import HFDirectSync, HFRolloutEngine
from verl_hf.training import HFTrainingEngine


def rollout(path: str, dtype: str = "float32") -> HFRolloutEngine:
    return HFRolloutEngine(EngineSpec(model_path=path, role="rollout", dtype=dtype, max_response_len=8))  # type: ignore[arg-type]


def nudged_actor(path: str) -> HFTrainingEngine:
    actor = HFTrainingEngine(actor_spec(path))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    return actor


@pytest.mark.parametrize("tied", [False, True])
def test_direct_sync_gives_the_stream_s_result(tied: bool) -> None:
    path = model_path("qwen2", tied)
    sync = get_weight_sync("hf", "hf")
    assert isinstance(sync, HFDirectSync)
    actor = nudged_actor(path)
    direct, streamed = rollout(path), rollout(path)
    ptrs = {n: p.data_ptr() for n, p in direct.model.named_parameters()}
    report = sync.sync(actor, direct, version=3)
    StreamWeightSync(bucket_bytes=50_000).sync(actor, streamed, version=3)
    assert direct.weight_version == 3 and report.version == 3
    assert report.bytes == sum(p.numel() * p.element_size() for p in streamed.model.parameters())
    assert {n: p.data_ptr() for n, p in direct.model.named_parameters()} == ptrs, "copied into the live tensors"
    want = dict(streamed.model.state_dict())
    for name, t in direct.model.state_dict().items():
        assert torch.equal(t, want[name]), name
    prompts = random_batch(batch_size=2, max_prompt=5, max_response=1, seed=2).select(
        "prompt_ids", "prompt_mask", "group_ids")
    out = direct.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))
    assert_close(out["rollout_log_probs"], actor.forward(out, ["log_probs"])["log_probs"], dtype="float32",
                 quantity="log_probs")


def test_non_finite_actor_weights_leave_the_rollout_stale_until_a_good_sync() -> None:
    path = model_path("llama")
    actor = nudged_actor(path)
    engine = rollout(path)
    sync = HFDirectSync()
    sync.sync(actor, engine, version=1)
    with torch.no_grad():
        actor.model.model.norm.weight[2] = float("nan")
    with pytest.raises(WeightSyncError, match="'model.norm.weight' holds NaN/inf"):
        sync.sync(actor, engine, version=2)
    with pytest.raises(StaleWeightsError):
        engine.generate(random_batch(batch_size=1, max_prompt=4, max_response=1, seed=0).select(
            "prompt_ids", "prompt_mask", "group_ids"), SamplingParams(max_new_tokens=2))
    assert engine.weight_version == 1
    with torch.no_grad():
        actor.model.model.norm.weight[2] = 1.0
    sync.sync(actor, engine, version=3)
    assert engine.weight_version == 3
    assert torch.equal(engine.model.model.norm.weight, actor.model.model.norm.weight)


def test_other_dtypes_and_architectures_go_through_the_stream() -> None:
    path = model_path("llama")
    actor = nudged_actor(path)
    half = rollout(path, dtype="bfloat16")
    report = HFDirectSync().sync(actor, half, version=4)
    assert half.weight_version == 4
    assert report.bytes == sum(p.numel() * 2 for p in half.model.parameters())
    for name, p in actor.model.named_parameters():
        assert torch.equal(dict(half.model.named_parameters())[name], p.detach().bfloat16()), name
    other = rollout(model_path("llama", tied=True))
    with pytest.raises(WeightSyncError, match="does not match the receiving model"):
        HFDirectSync().sync(actor, other, version=5)
    with pytest.raises(StaleWeightsError):
        other.generate(random_batch(batch_size=1, max_prompt=4, max_response=1, seed=0).select(
            "prompt_ids", "prompt_mask", "group_ids"), SamplingParams(max_new_tokens=2))


def test_same_layout_engines_sync_through_one_buffer_and_fall_back_when_it_breaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = model_path("qwen2")
    actor, engine = nudged_actor(path), rollout(path)
    assert actor._flat is not None and engine._flat is not None and actor._flat.same_layout(engine._flat)
    for flat, model in ((actor._flat, actor.model), (engine._flat, engine.model)):
        base = flat.buffer.data_ptr()
        assert all((p.data_ptr() - base) % 16 == 0 for p in model.parameters()), "views start aligned"
    calls: list[str] = []
    real = HFRolloutEngine._load_local

    def spy(self: HFRolloutEngine, *args: object, **kwargs: object) -> int:
        calls.append("per-tensor")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(HFRolloutEngine, "_load_local", spy)
    sync = HFDirectSync()
    report = sync.sync(actor, engine, version=1)
    assert calls == [] and report.bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    for name, p in actor.model.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p), name
    # A parameter re-homed outside the buffer (as moving a model does) is noticed: the per-tensor
    # path runs, with the same result.
    weight = actor.model.model.norm.weight
    weight.data = weight.data.clone() + 1.0
    sync.sync(actor, engine, version=2)
    assert calls == ["per-tensor"] and engine.weight_version == 2
    assert torch.equal(engine.model.model.norm.weight, weight)


def test_a_stream_between_same_layout_engines_copies_whole_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_path("qwen2")
    actor, engine, other = nudged_actor(path), rollout(path), rollout(path)
    calls: list[int] = []
    real = torch._foreach_copy_

    def spy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        calls.append(len(dst))
        real(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    StreamWeightSync(bucket_bytes=20_000).sync(actor, engine, version=2)
    assert calls == [], "every chunk lies back to back in the actor's buffer: one copy each"
    weight = actor.model.model.norm.weight
    weight.data = weight.data.clone() + 1.0  # re-homed: its chunk is no longer one span
    StreamWeightSync(bucket_bytes=20_000).sync(actor, other, version=2)
    assert calls, "the chunk holding the re-homed tensor is copied tensor by tensor"
    for e in (engine, other):
        assert e.weight_version == 2
    for name, p in actor.model.named_parameters():
        assert torch.equal(dict(other.model.named_parameters())[name], p), name


def test_moving_the_actor_drops_and_rebuilds_its_weight_buffer() -> None:
    actor = nudged_actor(model_path("llama"))
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    old = actor._flat
    actor._move(actor._device)  # what offload/onload do (each a no-op on a CPU-only machine)
    assert actor._flat is not None and actor._flat is not old and actor._flat.intact(actor._live_state())
    for n, p in actor.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_weight_buffer_moves_in_one_copy_and_the_parameters_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the rollout's sleep and wake do on CUDA (into pinned host memory and back; each a no-op
    on a CPU-only machine): FlatParameters.moved re-homes every parameter into the new buffer."""
    path = model_path("llama")
    actor, engine = nudged_actor(path), rollout(path)
    old = engine._flat
    assert old is not None
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    targets = engine._targets()
    into = torch.full_like(old.buffer, float("nan"))
    moved = old.moved(targets, into)
    assert moved.buffer is into and moved.intact(engine._targets()) and moved.same_layout(old)
    base = into.data_ptr()
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert base <= p.data_ptr() < base + into.numel() * into.element_size(), f"{n} is not a view of the new buffer"
    old.buffer.fill_(float("nan"))  # the old buffer is no longer read
    assert all(bool(p.isfinite().all()) for p in engine.model.parameters())
    with pytest.raises(ValueError, match="1-D torch.float32 buffer"):
        moved.moved(targets, torch.empty(3))
    engine._flat = moved  # the direct sync still takes the one-copy path with the moved layout
    monkeypatch.setattr(HFRolloutEngine, "_load_local", lambda *a, **k: pytest.fail("took the per-tensor path"))
    HFDirectSync().sync(actor, engine, version=1)
    for name, p in actor.model.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p), name


def test_a_weight_buffer_moved_without_its_values_is_refilled_by_one_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the rollout's sleep_until_sync and wake do on CUDA (a no-op on a CPU-only machine): the
    layout moves with copy=False, the parameters become views of a buffer whose values are not
    theirs, and the direct sync's one copy writes every weight again."""
    path = model_path("llama")
    actor, engine = nudged_actor(path), rollout(path)
    old = engine._flat
    assert old is not None
    into = torch.full_like(old.buffer, float("nan"))
    moved = old.moved(engine._targets(), into, copy=False)
    assert moved.buffer is into and moved.intact(engine._targets()) and moved.same_layout(old)
    assert all(bool(p.isnan().all()) for p in engine.model.parameters()), "copy=False copied values"
    engine._flat = moved
    monkeypatch.setattr(HFRolloutEngine, "_load_local", lambda *a, **k: pytest.fail("took the per-tensor path"))
    HFDirectSync().sync(actor, engine, version=1)
    for name, p in actor.model.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p), name

