"""The weight stream: bucketing, fusion groups, and a receiver that rejects malformed streams."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import (
    TensorInfo,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSyncError,
    apply_weight_stream,
    stream_weights,
)
from verl_core.enginekit.weight_stream import fusion_group


def state(layers: int = 2, width: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(8, width, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            out[p + name + ".weight"] = torch.randn(width, width, generator=g)
        out[p + "self_attn.q_proj.bias"] = torch.randn(width, generator=g)
    out["model.norm.weight"] = torch.ones(width)
    return out


def manifest(sd: dict[str, torch.Tensor], version: int = 1, dtype: torch.dtype | None = None) -> WeightManifest:
    return WeightManifest(version, {k: TensorInfo(tuple(v.shape), dtype or v.dtype) for k, v in sd.items()})


def test_fusion_groups() -> None:
    assert fusion_group("model.layers.3.self_attn.q_proj.weight") == fusion_group("model.layers.3.self_attn.v_proj.bias")
    assert fusion_group("model.layers.3.mlp.gate_proj.weight") == fusion_group("model.layers.3.mlp.up_proj.weight")
    assert fusion_group("model.layers.3.mlp.up_proj.weight") != fusion_group("model.layers.4.mlp.up_proj.weight")
    assert fusion_group("model.layers.3.self_attn.o_proj.weight") == "model.layers.3.self_attn.o_proj.weight"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2000))
def test_buckets_respect_size_and_never_split_fusion_groups(bucket: int) -> None:
    sd = state()
    msgs = list(stream_weights(sd.items(), manifest(sd), bucket_bytes=bucket))
    assert isinstance(msgs[0], WeightManifest) and isinstance(msgs[-1], WeightCommit)
    chunks = [m for m in msgs[1:-1] if isinstance(m, WeightChunk)]
    assert len(chunks) == len(msgs) - 2
    where: dict[str, int] = {}
    for i, c in enumerate(chunks):
        groups = {fusion_group(n) for n, _ in c.tensors}
        for g in groups:
            assert where.setdefault(g, i) == i, f"group {g} split across chunks"
        if len(groups) > 1:
            assert c.nbytes <= bucket, "a multi-group chunk exceeds the bucket"
    sent = [n for c in chunks for n, _ in c.tensors]
    assert sorted(sent) == sorted(sd), "every tensor exactly once"


def test_sender_casts_to_receiver_dtype() -> None:
    sd = state(1)
    msgs = list(stream_weights(sd.items(), manifest(sd, dtype=torch.bfloat16), bucket_bytes=1 << 20, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for m in msgs if isinstance(m, WeightChunk) for _, t in m.tensors)


def receive(stream: Iterator[WeightMessage] | list[WeightMessage], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    expected = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in sd.items()}
    apply_weight_stream(stream, expected, lambda items: got.update(items))
    return got


def test_round_trip_applies_copies() -> None:
    sd = state()
    got = receive(stream_weights(sd.items(), manifest(sd), bucket_bytes=256), sd)
    assert got.keys() == sd.keys()
    for k in sd:
        assert torch.equal(got[k], sd[k]) and got[k].data_ptr() != sd[k].data_ptr()


def broken_streams() -> dict[str, tuple[list[WeightMessage], str]]:
    sd = state(1)
    m = manifest(sd)
    items = list(sd.items())
    ok = list(stream_weights(items, m, bucket_bytes=1 << 20))
    chunk = ok[1]
    assert isinstance(chunk, WeightChunk)
    wrong_shape = WeightChunk(((items[0][0], torch.zeros(3, 3)),) + chunk.tensors[1:])
    nan = WeightChunk(((items[0][0], torch.full_like(items[0][1], float("nan"))),) + chunk.tensors[1:])
    return {
        "no manifest": ([chunk, ok[-1]], "must start with a WeightManifest"),
        "no commit": (ok[:-1], "ended without a WeightCommit"),
        "missing tensor": ([m, WeightChunk(chunk.tensors[1:]), ok[-1]], "committed with 1 tensor"),
        "duplicate": ([m, chunk, WeightChunk(chunk.tensors[:1]), ok[-1]], "sent twice"),
        "wrong shape": ([m, wrong_shape, ok[-1]], r"chunk tensor is \(3, 3\)"),
        "nan": ([m, nan, ok[-1]], "holds NaN/inf"),
        "manifest mismatch": ([WeightManifest(1, {"x": TensorInfo((1,), torch.float32)}), ok[-1]], "unexpected \\['x'\\]"),
        "version": ([m, chunk, WeightCommit(7)], "commit version 7 != manifest version 1"),
    }


@pytest.mark.parametrize("case", list(broken_streams()))
def test_malformed_streams_are_rejected_with_the_first_mismatch(case: str) -> None:
    msgs, message = broken_streams()[case]
    with pytest.raises(WeightSyncError, match=message):
        receive(msgs, state(1))


def test_manifest_mismatch_is_rejected_before_any_chunk_is_applied() -> None:
    sd = state(1)
    bad = {k: TensorInfo((99,), v.dtype) for k, v in sd.items()}
    applied: list[object] = []
    with pytest.raises(WeightSyncError, match="manifest says"):
        apply_weight_stream(stream_weights(sd.items(), manifest(sd), bucket_bytes=64), bad, applied.append)
    assert applied == []
