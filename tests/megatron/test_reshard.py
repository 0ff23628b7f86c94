"""Direct resharding from a Megatron training layout to a colocated Megatron rollout layout.

The planner is checked in-process against every layout hypothesis draws (each rollout shard is
rebuilt exactly, from training shards only, within the bucket bound). The 4-rank torchrun launch
of engine_checks.py at TP=2 x PP=2 (shared with test_engine.py, see conftest.py) runs
reshard_checks.py: training TP=2 x PP=2 against rollout TP=2 (2 replicas) and TP=1 (4 replicas): the
direct sync must give the canonical stream's parameters and log-probs bitwise, stay within its
memory bound, pass the conformance suite's sync check and switch the optimizer state out and back.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import WeightSyncError, get_weight_sync
from verl_megatron.convert import ModelDims, StateDictAdapter
from verl_megatron.reshard import Layout, MegatronDirectSync, RankPlace, plan_reshard


def _dims(layers: int, kv: int, tied: bool, bias: bool, qk_norm: bool) -> ModelDims:
    return ModelDims(num_layers=layers, hidden_size=8, num_heads=4, num_kv_heads=kv, head_dim=2, ffn_size=8,
                     vocab_size=16, qkv_bias=bias, qk_norm=qk_norm, tied=tied, head="lm", rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position=32)


def _megatron_places(tp: int, pp: int, rollout_tp: int, world: int) -> list[RankPlace]:
    # Megatron's order: TP fastest, then DP, then PP; rollout groups are consecutive ranks
    dp = world // (tp * pp)
    return [RankPlace(g % tp, g // (tp * dp), g % rollout_tp) for g in range(world)]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ModelDims, Layout]:
    dims = _dims(draw(st.sampled_from([2, 4])), draw(st.sampled_from([1, 2, 4])), draw(st.booleans()),
                 draw(st.booleans()), draw(st.booleans()))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if dims.num_kv_heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2) if dims.num_layers % p == 0]))
    dp = draw(st.sampled_from([1, 2]))
    world = tp * pp * dp
    rtp = draw(st.sampled_from([t for t in (1, 2, 4) if world % t == 0 and dims.num_kv_heads % t == 0]))
    places = _megatron_places(tp, pp, rtp, world)
    if draw(st.booleans()):  # the plan must not rely on any particular rank order
        random.Random(draw(st.integers(0, 1000))).shuffle(places)
    return dims, Layout(tp, pp, rtp, tuple(places))


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from([64, 700, 1 << 20]))
def test_plan_rebuilds_every_rollout_shard_within_the_bucket_bound(case: tuple[ModelDims, Layout], bucket: int) -> None:
    dims, layout = case
    adapter = StateDictAdapter(dims)
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(adapter.megatron_shape(n), generator=gen) for n in adapter.megatron_names()}
    # what each rank holds: only its own training shards (the stage owning the tensor)
    train = [{n: adapter.shard(n, t, p.train_tp_rank, layout.train_tp) for n, t in full.items()
              if adapter.stage_of(n, layout.train_pp) == p.train_pp_rank} for p in layout.places]
    rollout = [{n: torch.full_like(adapter.shard(n, t, p.rollout_tp_rank, layout.rollout_tp), float("nan"))
                for n, t in full.items()} for p in layout.places]
    writes = [{n: torch.zeros_like(t, dtype=torch.int64) for n, t in r.items()} for r in rollout]
    plan = plan_reshard(adapter, layout, bucket_bytes=bucket, element_size=4)
    for b in plan.buckets:
        for t in b.transfers:
            src = train[t.src][t.name][tuple(slice(*r) for r in t.src_box)]
            rollout[t.dst][t.name][tuple(slice(*r) for r in t.dst_box)] = src
            writes[t.dst][t.name][tuple(slice(*r) for r in t.dst_box)] += 1
    row_bytes = max(4 * t.numel() // t.shape[0] for t in full.values()) * layout.world_size
    for g, p in enumerate(layout.places):
        for n, t in full.items():
            assert torch.equal(rollout[g][n], adapter.shard(n, t, p.rollout_tp_rank, layout.rollout_tp)), (g, n)
            assert bool((writes[g][n] == 1).all()), f"rank {g} {n}: every element written exactly once"
        # one bucket's send + receive buffer: within the bound, or one row of a tensor at most
        assert plan.peak_buffer_bytes(g) <= max(bucket, row_bytes)
    if bucket >= 1 << 20:
        assert len(plan.buckets) == 1
    # a rank that holds a shard it needs copies it locally
    for b in plan.buckets:
        for t in b.transfers:
            p = layout.places[t.dst]
            if t.remote:
                stage = adapter.stage_of(t.name, layout.train_pp)
                assert not (p.train_pp_rank == stage and (layout.train_tp == 1 or adapter.partition(t.name) == "replicated")
                            ), f"{t.name} sent to rank {t.dst} which holds it"


def test_same_layout_is_all_local_copies() -> None:
    adapter = StateDictAdapter(_dims(2, 2, False, True, True))
    layout = Layout(2, 1, 2, tuple(_megatron_places(2, 1, 2, 2)))
    plan = plan_reshard(adapter, layout, bucket_bytes=64, element_size=4)
    assert all(not t.remote for b in plan.buckets for t in b.transfers)
    assert plan.peak_buffer_bytes(0) == 0 and plan.received_bytes(0, remote_only=True) == 0


def test_bad_plans_are_rejected() -> None:
    adapter = StateDictAdapter(_dims(2, 2, False, False, False))
    with pytest.raises(WeightSyncError, match="ranks do not hold whole"):
        Layout(2, 2, 1, tuple(_megatron_places(2, 1, 1, 2)))
    with pytest.raises(WeightSyncError, match="bucket_bytes"):
        plan_reshard(adapter, Layout(1, 1, 1, (RankPlace(0, 0, 0),)), bucket_bytes=0, element_size=4)
    value = StateDictAdapter(ModelDims(**{**_dims(2, 2, False, False, False).__dict__, "head": "value"}))
    with pytest.raises(WeightSyncError, match="value head"):
        plan_reshard(value, Layout(1, 1, 1, (RankPlace(0, 0, 0),)), bucket_bytes=64, element_size=4)


def test_registry_picks_the_direct_path_for_megatron_pairs_only() -> None:
    assert isinstance(get_weight_sync("megatron", "megatron"), MegatronDirectSync)
    assert not isinstance(get_weight_sync("megatron", "hf"), MegatronDirectSync)
    assert not isinstance(get_weight_sync("hf", "megatron"), MegatronDirectSync)


@pytest.fixture(scope="module")
def ranks(megatron_launch: Any) -> list[dict[str, Any]]:
    """Each rank's reshard_checks.py results, from the TP=2 x PP=2 launch shared with test_engine.py."""
    import reshard_checks  # noqa: F401  (fail fast on an import error, before launching)

    return [r["reshard"] for r in megatron_launch((2, 2, 1))]


LAYOUTS = ["tp2", "tp1"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_sync_equals_canonical_sync_bitwise(ranks: list[dict[str, Any]], layout: str) -> None:
    for rank, res in enumerate(ranks):
        r = res["layouts"][layout]
        assert r["params_equal"], f"rank {rank}: rollout parameters differ between the direct and canonical sync"
        assert r["versions"] == (1, 1)
        for field in ("response_ids", "response_mask", "rollout_log_probs"):
            assert torch.equal(r["direct"][field], r["canonical"][field]), f"rank {rank} {layout} {field}"
        # and the rollout serves the trained weights: its log-probs are the trainer's
        m = r["direct"]["response_mask"]
        assert float((r["direct"]["rollout_log_probs"] - r["train_lp"]).abs()[m].max()) < 1e-4
    # every replica generated the same samples (same prompts, same seeds)
    for res in ranks[1:]:
        assert torch.equal(res["layouts"][layout]["direct"]["response_ids"], ranks[0]["layouts"][layout]["direct"]["response_ids"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_sync_peak_memory_is_one_bucket(ranks: list[dict[str, Any]], layout: str) -> None:
    import reshard_checks

    for rank, res in enumerate(ranks):
        r = res["layouts"][layout]
        # measured: tensor bytes the sync allocated beyond this rank's training and rollout shards
        # (a few bytes of layout metadata ride along with the one bucket buffer)
        assert r["direct_peak"] <= reshard_checks.BUCKET + 1024, (rank, layout, r["direct_peak"])
        assert r["plan_peak"] <= reshard_checks.BUCKET
        assert r["details"]["peak_buffer_bytes"] == r["plan_peak"]
        # the canonical stream gathers whole tensors: the comparison this path is for
        assert r["canonical_peak"] > 4 * r["direct_peak"], (rank, layout, r["canonical_peak"], r["direct_peak"])
        # the whole rollout shard was written, part of it by local copies
        assert r["plan_received"] == r["shard_bytes"]
        assert 0 < r["details"]["local_bytes"] < r["shard_bytes"]
        assert r["details"]["received_bytes"] == r["plan_remote"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_conformance_sync_check_passes_through_the_direct_path(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert res["conformance"] == {"sync": "MegatronDirectSync", "trainer_to_rollout_sync": "passed"}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_colocated_switch_offloads_and_restores_training_state(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert res["offloaded_after_sync"] is True
        assert res["offloaded_after_step"] is False
        assert set(res["switch_metrics"]) == {"switch_to_rollout_s", "switch_to_training_s"}
        assert all(v >= 0 for v in res["switch_metrics"].values())
        assert res["layouts"]["tp2"]["details"]["switch_to_rollout_s"] >= 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_export_weights_holds_one_bucket_and_the_tensor_in_flight(ranks: list[dict[str, Any]]) -> None:
    import reshard_checks

    for rank, res in enumerate(ranks):
        ex = res["export"]
        for bucket in reshard_checks.EXPORT_BUCKETS:
            for dtype in ("None", "torch.bfloat16"):
                peak = ex[f"{bucket}-{dtype}"]
                # one bucket of chunk tensors, plus the Megatron tensor in flight: its TP shards
                # (gloo's worker may hold them a little after the gather), their concatenation and
                # the converted pieces, each at most the largest tensor's float32 bytes; never the model
                assert peak <= bucket + 3 * ex["largest"], (rank, bucket, dtype, peak)
                assert peak < ex["model"], (rank, bucket, dtype, peak)
