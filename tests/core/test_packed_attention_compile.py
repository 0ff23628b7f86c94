"""Packed attention under torch.compile: its call counter must not become a guard.

A counter incremented while dynamo traces is a guard on its value, so every later call recompiles
(up to the recompile limit, then eager): the whole-layer compile experiment of
``benchmarks/gpu/profile_update.py --compile-layers`` hit that limit on CUDA.
"""

from __future__ import annotations

import torch
import torch._dynamo

from verl_core.enginekit.packed_attention import packed_attention_counts, packed_causal_attention


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 8, generator=g)
    k = torch.randn(7, 2, 8, generator=g)
    v = torch.randn(7, 2, 8, generator=g)
    return q, k, v, torch.tensor([0, 3, 7])


def test_compiled_calls_do_not_recompile_on_the_counter() -> None:
    q, k, v, cu = _inputs()
    eager = packed_causal_attention(q, k, v, cu, 4, 0.35)

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return packed_causal_attention(q * 1.0, k, v, cu, 4, 0.35) + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs = [compiled(q, k, v) for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_eager_calls_are_counted() -> None:
    q, k, v, cu = _inputs()
    before = sum(packed_attention_counts().values())
    packed_causal_attention(q, k, v, cu, 4, 0.35)
    assert sum(packed_attention_counts().values()) == before + 1
