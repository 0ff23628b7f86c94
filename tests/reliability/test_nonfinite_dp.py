"""Under data parallelism a NaN loss on one rank skips the update on every rank, and the ranks agree.

Two ranks (torchrun, gloo) of a real training engine (hf in both data-parallel modes, megatron); rank 1's loss is NaN, rank 0's is finite.
Every rank must report the step skipped and keep its weights; the next finite update must be taken
by both, with identical weights on both ranks.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_conformance.testkit import TinyModelSpec, launch_torchrun, tiny_model

HERE = Path(__file__).parent
CASES = [("hf", ("allreduce", "fsdp2")), ("megatron", ("dp",))]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "modes"), CASES)
def test_a_nan_on_one_rank_skips_the_update_on_every_rank(
    backend: str, modes: tuple[str, ...], tally: Counter[str]
) -> None:
    path = str(tiny_model(TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32,
                                        intermediate_size=64)))
    ranks: list[dict[str, Any]] = launch_torchrun(HERE / "nonfinite_worker.py", 2, [backend, path, *modes],
                                                  timeout=300, env={"OMP_NUM_THREADS": "1"})
    for mode in modes:
        tally[f"fault/NaN loss on one data-parallel rank ({backend} {mode})"] += 1
        rs = [r[mode] for r in ranks]
        for i, r in enumerate(rs):
            assert r["bad_skipped"], f"{mode}: rank {i} did not skip the update rank 1 poisoned"
            assert not r["bad_norm_finite"], f"{mode}: rank {i} reports a finite grad norm"
            assert r["unchanged"], f"{mode}: rank {i}'s weights changed on a skipped update"
            assert not r["good_skipped"] and r["moved"], f"{mode}: rank {i} did not take the finite update"
        for name, w in rs[0]["after"].items():
            assert torch.equal(w, rs[1]["after"][name]), f"{mode}: ranks disagree on {name}"
