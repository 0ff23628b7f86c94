"""The receiving side of the weight stream: fused finiteness check and the no-copy mode."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import (
    TensorInfo,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightSyncError,
    apply_weight_stream,
    stream_weights,
)
from verl_core.enginekit.weight_stream import all_finite_flag, first_non_finite


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(6, 5, generator=g),
        "b.weight": torch.randn(7, generator=g).bfloat16(),
        "c.weight": torch.randn(3, 4, generator=g),
        "steps": torch.arange(4),
        "empty": torch.zeros(0, 3),
    }


def manifest(sd: dict[str, torch.Tensor]) -> WeightManifest:
    return WeightManifest(3, {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in sd.items()})


def expected(sd: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in sd.items()}


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["a.weight", "b.weight", "c.weight", None]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.integers(0, 5),
)
def test_first_non_finite_names_the_bad_tensor(bad: str | None, value: float, at: int) -> None:
    sd = tensors()
    if bad is not None:
        flat = sd[bad].view(-1)
        flat[at % flat.numel()] = value
    assert first_non_finite(list(sd.items())) == bad


def test_a_finite_tensor_whose_norm_overflows_is_accepted() -> None:
    big = torch.full((64,), 3e37)  # every element finite; the sum of squares overflows float32
    assert not bool(torch.isfinite(torch.linalg.vector_norm(big)))
    assert first_non_finite([("big", big), ("small", torch.ones(2))]) is None
    big[3] = float("nan")
    assert first_non_finite([("small", torch.ones(2)), ("big", big)]) == "big"


def test_half_precision_norms_do_not_overflow_in_the_fast_check() -> None:
    # Every element is finite; the float16 norm (about 9.5e4) would overflow float16's 65504.
    half = torch.full((100_000,), 300.0, dtype=torch.float16)
    flag = all_finite_flag([half, torch.ones(3, dtype=torch.bfloat16)])
    assert flag is not None and bool(flag)
    assert all_finite_flag([torch.arange(3)]) is None


def test_no_copy_mode_hands_over_the_chunk_tensors() -> None:
    sd = tensors()
    seen: dict[str, torch.Tensor] = {}
    apply_weight_stream(stream_weights(sd.items(), manifest(sd), bucket_bytes=64), expected(sd),
                        lambda items: seen.update(items), copy=False)
    assert seen.keys() == sd.keys()
    for k, t in sd.items():
        assert torch.equal(seen[k], t)
        assert seen[k].numel() == 0 or seen[k].data_ptr() == t.data_ptr()


@pytest.mark.parametrize("copy", [True, False])
def test_a_chunk_with_a_non_finite_tensor_is_never_applied(copy: bool) -> None:
    sd = tensors()
    m = manifest(sd)
    bad = dict(sd, **{"c.weight": sd["c.weight"].clone().fill_(float("inf"))})
    chunk = WeightChunk(tuple(bad.items()))
    applied: list[list[tuple[str, torch.Tensor]]] = []
    with pytest.raises(WeightSyncError, match="'c.weight' holds NaN/inf"):
        apply_weight_stream([m, chunk, WeightCommit(3)], expected(sd), applied.append, copy=copy)
    assert applied == [], "no tensor of a chunk holding a non-finite value may be applied"


def test_a_name_repeated_inside_one_chunk_is_rejected() -> None:
    sd = tensors()
    chunk = WeightChunk((*sd.items(), ("a.weight", sd["a.weight"])))
    with pytest.raises(WeightSyncError, match="sent twice"):
        apply_weight_stream([manifest(sd), chunk, WeightCommit(3)], expected(sd), lambda items: None)


def test_tensor_info_bytes() -> None:
    assert TensorInfo((3, 4), torch.bfloat16).nbytes == 24
    assert TensorInfo((), torch.float64).nbytes == 8


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["a.weight", "b.weight", "c.weight", None]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.integers(0, 5),
    st.sampled_from([16, 64, 1 << 20]),
)
def test_deferred_checks_apply_every_chunk_then_refuse_at_the_commit(
    bad: str | None, value: float, at: int, bucket: int
) -> None:
    sd = tensors()
    if bad is not None:
        flat = sd[bad].view(-1)
        flat[at % flat.numel()] = value
    applied: list[str] = []
    stream = stream_weights(sd.items(), manifest(sd), bucket_bytes=bucket)
    if bad is None:
        apply_weight_stream(stream, expected(sd), lambda items: applied.extend(n for n, _ in items),
                            defer_checks=True)
    else:
        with pytest.raises(WeightSyncError, match=f"{bad}.*NaN/inf"):
            apply_weight_stream(stream, expected(sd), lambda items: applied.extend(n for n, _ in items),
                                defer_checks=True)
    # Every chunk reached the receiver before the verdict (the receiver stays stale on a raise).
    assert sorted(applied) == sorted(sd)


def test_tensor_norms_are_exact_about_finiteness() -> None:
    from verl_core.enginekit.weight_stream import tensor_norms

    big = torch.full((64,), 3e38)  # finite; its float32 2-norm would overflow
    nan = torch.ones(5, dtype=torch.bfloat16)
    nan[2] = float("nan")
    norms = tensor_norms([big, torch.arange(3), nan, torch.full((4,), -3e4, dtype=torch.float16)])
    assert norms is not None and norms.dtype == torch.float64
    assert norms.isfinite().tolist() == [True, True, False, True]
    assert norms[[0, 1, 3]].tolist() == pytest.approx([2.4e39, 0.0, 6e4], rel=1e-3)
    assert tensor_norms([torch.arange(3), torch.zeros(0)]) is None


def test_contiguous_span_covers_back_to_back_views_only() -> None:
    from verl_core.enginekit.weight_stream import contiguous_span

    flat = torch.arange(20, dtype=torch.float32)
    a, b, c = flat[0:6].view(2, 3), flat[6:10], flat[10:20].view(5, 2)
    span = contiguous_span([a, b, c])
    assert span is not None and torch.equal(span, flat) and span.data_ptr() == flat.data_ptr()
    assert contiguous_span([b, c]) is not None and torch.equal(contiguous_span([b, c]), flat[6:20])  # type: ignore[arg-type]
    assert contiguous_span([a, c]) is None, "a gap"
    assert contiguous_span([b, a]) is None, "out of order"
    assert contiguous_span([flat[0:4].view(2, 2).t(), flat[4:8]]) is None, "not contiguous"
    assert contiguous_span([a.clone(), b]) is None, "another allocation"
    assert torch.equal(contiguous_span([a]), flat[0:6]) and contiguous_span([]) is None  # type: ignore[arg-type]


def test_a_non_finite_chunk_sent_back_to_back_is_refused_naming_its_tensors() -> None:
    flat = torch.randn(30)
    sd = {"a.weight": flat[0:12].view(3, 4), "b.weight": flat[12:20], "c.weight": flat[20:30]}
    flat[15] = float("nan")
    applied: list[str] = []
    with pytest.raises(WeightSyncError, match=r"a weight among 'a.weight', 'b.weight', 'c.weight' \(3 tensors"):
        apply_weight_stream(stream_weights(sd.items(), manifest(sd), bucket_bytes=1 << 20), expected(sd),
                            lambda items: applied.extend(n for n, _ in items), defer_checks=True)
    assert sorted(applied) == sorted(sd)


def test_a_receivers_own_check_is_the_chunks_check() -> None:
    """A receiver that checks while it copies returns a flag; a False flag refuses the update at
    the commit, naming the chunk, after every chunk was applied."""
    sd = tensors()
    stream = stream_weights(sd.items(), manifest(sd), bucket_bytes=64)
    calls: list[list[str]] = []

    def apply(items: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        calls.append([n for n, _ in items])
        return torch.tensor(len(calls) != 2)  # the second chunk "saw" a NaN

    with pytest.raises(WeightSyncError, match="NaN/inf"):
        apply_weight_stream(stream, expected(sd), apply, defer_checks=True)
    assert len(calls) >= 3 and sorted(n for c in calls for n in c) == sorted(sd)
    named = calls[1]
    calls.clear()
    with pytest.raises(WeightSyncError, match=re.escape(repr(named[0]))):
        apply_weight_stream(stream_weights(sd.items(), manifest(sd), bucket_bytes=64), expected(sd), apply,
                            defer_checks=True)
    calls.clear()
    apply_weight_stream(stream_weights(sd.items(), manifest(sd), bucket_bytes=64), expected(sd),
                        lambda items: torch.tensor(True), defer_checks=True)


def test_copy_checked_copies_and_checks_exactly_on_cpu() -> None:
    from verl_core.enginekit.weight_stream import copy_checked

    src = torch.randn(37).bfloat16()
    dst = torch.zeros_like(src)
    assert bool(copy_checked(dst, src))
    for value in (float("nan"), float("inf"), float("-inf")):
        src[3] = value
        flag = copy_checked(dst, src)
        assert flag is not None and not bool(flag)
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    big = torch.full((64,), 3e38)  # finite, though its float32 2-norm overflows
    assert bool(copy_checked(torch.empty_like(big), big))
    assert bool(copy_checked(torch.empty(3, dtype=torch.int64), torch.arange(3)))
    with pytest.raises(ValueError, match="contiguous 1-D tensors of one size and dtype"):
        copy_checked(torch.zeros(36, dtype=torch.bfloat16), src)
    with pytest.raises(ValueError, match="one size and dtype"):
        copy_checked(torch.zeros(37), src)


def test_a_failing_fused_kernel_falls_back_to_two_passes_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_core.enginekit import weight_stream

    def broken(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(weight_stream, "_fusable", lambda dst, src: True)
    monkeypatch.setattr(weight_stream, "_fused_copy", lambda: broken)
    monkeypatch.setattr(weight_stream, "_FUSED_OFF", [])
    src = torch.randn(20)
    src[4] = float("inf")
    dst = torch.zeros_like(src)
    with pytest.warns(RuntimeWarning, match="no kernel for this device.*two passes"):
        flag = weight_stream.copy_checked(dst, src)
    assert flag is not None and not bool(flag) and torch.equal(dst, src)
    assert weight_stream._FUSED_OFF == ["RuntimeError: no kernel for this device"]
    src[4] = 1.0
    assert bool(weight_stream.copy_checked(dst, src))  # no second warning: the kernel stays off
    assert torch.equal(dst, src)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _triton_available(), reason="the fused copy-and-check kernel needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_copy_is_bit_exact_and_finds_every_non_finite_value(dtype: torch.dtype) -> None:
    from verl_core.enginekit.weight_stream import copy_checked

    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    info = torch.finfo(dtype)
    for n in (1, 8191, 8192, 8193, 3 * 8192 + 5):
        src = torch.randn(n, device="cuda").to(dtype)
        src[0] = info.max
        src[-1] = -info.max
        if n > 3:
            src[1], src[2] = -0.0, info.tiny / 4  # signed zero and a subnormal are finite
        dst = torch.full_like(src, 7.0)
        flag = copy_checked(dst, src)
        assert flag is not None and flag.dim() == 0 and bool(flag), (dtype, n)
        assert torch.equal(dst.view(ints), src.view(ints))
        for at in sorted({0, n // 2, n - 1}):
            for value in (float("nan"), float("inf"), float("-inf")):
                bad = src.clone()
                bad[at] = value
                out = torch.zeros_like(bad)
                flag = copy_checked(out, bad)
                assert flag is not None and not bool(flag), (dtype, n, at, value)
                assert torch.equal(out.view(ints), bad.view(ints))
