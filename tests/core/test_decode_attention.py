"""verl_core.enginekit.decode_attention: one decode step's grouped attention, the matrix-product
path everywhere and the fused Triton kernel on CUDA, against float64 attention with repeated heads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from verl_core.enginekit.decode_attention import (
    fused_decode_kernel,
    fused_decode_takes,
    grouped_decode_attention,
)

CUDA_TRITON = torch.cuda.is_available() and fused_decode_kernel() is not None


def reference(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """float64 attention with every key/value head repeated for its query heads (``repeat_kv``)."""
    heads, width = query.shape[1], mask.shape[-1]
    groups = heads // key.shape[1]
    k = key[:, :, :width].double().repeat_interleave(groups, 1)
    v = value[:, :, :width].double().repeat_interleave(groups, 1)
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scale  # [rows, heads, 1, width]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2)  # [rows, 1, heads, dim]


def inputs(rows: int, kv: int, groups: int, slots: int, dim: int, width: int, dtype: torch.dtype,
           device: str = "cpu", seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    # the query as transformers hands it over: a transposed view of [rows, 1, heads, dim]
    query = torch.randn(rows, 1, kv * groups, dim, generator=g).transpose(1, 2)
    key, value = torch.randn(rows, kv, slots, dim, generator=g), torch.randn(rows, kv, slots, dim, generator=g)
    pad = torch.arange(rows) % 5  # left padding of 0..4 slots, then the slots written so far
    written = torch.randint(width // 2, width + 1, (rows,), generator=g)
    s = torch.arange(width)
    mask = ((s[None] >= pad[:, None]) & (s[None] < written[:, None]))[:, None, None, :]
    return query.to(device, dtype), key.to(device, dtype), value.to(device, dtype), mask.to(device)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("width", [37, 64])
def test_the_matrix_product_path_equals_attention_with_repeated_heads(groups: int, width: int) -> None:
    query, key, value, mask = inputs(6, 2, groups, 64, 16, width, torch.float32)
    got = grouped_decode_attention(query, key, value, mask, 0.25)
    assert got.shape == (6, 1, 2 * groups, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(query, key, value, mask, 0.25), rtol=1e-5, atol=1e-6)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    torch.testing.assert_close(grouped_decode_attention(query, key, value, additive, 0.25), got, rtol=1e-5, atol=1e-6)


def test_fused_falls_back_where_the_kernel_does_not_take_the_tensors() -> None:
    """On CPU, in float32 or with an additive mask, ``fused=True`` is the matrix-product path, bit for bit."""
    query, key, value, mask = inputs(4, 2, 2, 40, 16, 40, torch.float32)
    assert not fused_decode_takes(query, key, value, mask)
    assert torch.equal(grouped_decode_attention(query, key, value, mask, 0.3, fused=True),
                       grouped_decode_attention(query, key, value, mask, 0.3))


INTERPRETER = Path(sys.prefix) / "triton-interpreter"  # scripts/setup.sh installs Triton there on CPU machines


@pytest.mark.skipif(not (INTERPRETER / "triton").is_dir(), reason=f"Triton's interpreter is not in {INTERPRETER}: scripts/setup.sh installs it there on machines without a GPU")
def test_the_fused_kernel_in_tritons_interpreter_matches_float64_and_reads_no_hidden_slot() -> None:
    """The kernel itself, on CPU: Triton's interpreter runs it on CPU tensors (float32 and float16),
    with the default launch and two others."""
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(INTERPRETER), str(here), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(here / "decode_kernel_interpreted.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("hidden slots unread: True") == 36, done.stdout
    assert done.stdout.count("a row attending nothing gives zeros: True") == 3, done.stdout


needs_kernel = pytest.mark.skipif(not CUDA_TRITON, reason="the fused decode-attention kernel needs CUDA and Triton")


@needs_kernel
@pytest.mark.parametrize(("groups", "dim"), [(1, 64), (2, 128), (4, 128), (8, 96)])
@pytest.mark.parametrize("width", [1, 63, 200, 1056])
def test_the_fused_kernel_is_at_least_as_close_to_float64_as_the_matrix_products(
    groups: int, dim: int, width: int
) -> None:
    query, key, value, mask = inputs(9, 2, groups, 1100, dim, width, torch.bfloat16, "cuda", seed=width)
    mask[:, ..., 0] = True  # every row attends somewhere
    assert fused_decode_takes(query, key, value, mask)
    want = reference(query, key, value, mask, dim**-0.5)
    fused = grouped_decode_attention(query, key, value, mask, dim**-0.5, fused=True)
    plain = grouped_decode_attention(query, key, value, mask, dim**-0.5)
    assert fused.shape == plain.shape and fused.dtype == torch.bfloat16
    err, err_plain = (fused.double() - want).abs().max().item(), (plain.double() - want).abs().max().item()
    assert err <= max(1.5 * err_plain, 8e-3), (err, err_plain)


@needs_kernel
def test_the_fused_kernel_never_reads_a_masked_slot() -> None:
    """NaN in every slot the mask hides (padding, unwritten slots, past the mask's width) changes nothing."""
    query, key, value, mask = inputs(7, 4, 2, 300, 128, 257, torch.bfloat16, "cuda")
    clean = grouped_decode_attention(query, key, value, mask, 0.1, fused=True)
    hidden = torch.ones(7, 300, dtype=torch.bool, device="cuda")
    hidden[:, :257] = ~mask[:, 0, 0]
    poisoned_k, poisoned_v = key.clone(), value.clone()
    poisoned_k.masked_fill_(hidden[:, None, :, None], float("nan"))
    poisoned_v.masked_fill_(hidden[:, None, :, None], float("nan"))
    again = grouped_decode_attention(query, poisoned_k, poisoned_v, mask, 0.1, fused=True)
    assert torch.isfinite(again).all() and torch.equal(again, clean)


@needs_kernel
def test_the_fused_kernel_replays_in_a_cuda_graph_and_compiles() -> None:
    query, key, value, mask = inputs(16, 2, 2, 512, 128, 512, torch.bfloat16, "cuda")
    want = grouped_decode_attention(query, key, value, mask, 0.1, fused=True)
    compiled = torch.compile(lambda q, k, v, m: grouped_decode_attention(q, k, v, m, 0.1, fused=True), fullgraph=True)
    torch.testing.assert_close(compiled(query, key, value, mask), want)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compiled(query, key, value, mask)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = compiled(query, key, value, mask)
    mask[:, ..., 300:] = False  # the graph reads the mask's new contents
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, grouped_decode_attention(query, key, value, mask, 0.1, fused=True))
