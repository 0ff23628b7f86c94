"""Multi-turn responses in the Megatron engine (one TP=1 x PP=2 launch of ``loss_mask_checks.py``):
observation tokens (``loss_mask`` False) are attended to but get no log-prob or entropy, and change
neither the loss nor the gradients. PP=2 also pads the last micro-batch with samples whose loss
mask must be empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_conformance.testkit import assert_close, launch_torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    script = Path(__file__).with_name("loss_mask_checks.py")
    return launch_torchrun(script, 2, ["1", "2"], timeout=300, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})


def test_observation_tokens_get_no_outputs_but_are_attended_to(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    lm, rm = r["loss_mask"], r["response_mask"]
    assert bool((rm & ~lm).any())
    for k in ("log_probs", "entropy"):
        out, full = r["out"][k], r["full"][k]
        assert not bool(out[~lm].any()), f"{k} not 0 at observation tokens"
        assert bool(full[rm & ~lm].ne(0).any())
        assert_close(out[lm], full[lm], dtype="float32", quantity=k)


def test_observation_tokens_change_neither_loss_nor_gradients(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        a, b = r["metrics"]
        assert a == b
        ga, gb = r["grads"]
        assert set(ga) == set(gb) and ga
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    assert any(float(g.abs().max()) > 0 for r in ranks for g in r["grads"][0].values())
