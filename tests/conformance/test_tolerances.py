"""The bfloat16 tiers of scores and values hold a faithful engine on samples the checks never draw.

``reward::scores_match_reference`` compares six samples per reward folder. Its tier must hold a
correct bfloat16 engine on any six, not only on the suite's: the hf engine (a transformers
sequence-classification forward) is scored here on 64 other random samples of each folder against
the float64 reference the check uses. The ``values`` tier failed such a draw on a few samples in
a hundred (docs/conformance.md, "Tolerances"). ``numerics::values_match_reference`` compares one
batch of a critic's per-token values; the hf critic is held to the ``values`` tier here on three
other batches of 64 samples of both value-head folders.
"""

from __future__ import annotations

import pytest
import torch

from verl_conformance.checks.reward import _reference_scores
from verl_conformance.harness import Harness
from verl_conformance.reference import cached_outputs
from verl_conformance.testkit.tolerances import tolerance
from verl_core import EngineSpec, TensorBatch, get_reward_engine, get_training_engine

pytest.importorskip("verl_hf")


def _batch(seed: int, rows: int) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, 10, (rows,), generator=g)
    response_len = torch.randint(0, 8, (rows,), generator=g)
    width_p, width_r = int(prompt_len.max()), int(response_len.max())
    prompt_ids = torch.zeros(rows, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.bool)
    response_ids = torch.zeros(rows, width_r, dtype=torch.long)
    response_mask = torch.zeros(rows, width_r, dtype=torch.bool)
    for i in range(rows):
        p, r = int(prompt_len[i]), int(response_len[i])
        prompt_ids[i, width_p - p:] = torch.randint(4, 128, (p,), generator=g)
        prompt_mask[i, width_p - p:] = True
        response_ids[i, :r] = torch.randint(4, 128, (r,), generator=g)
        response_mask[i, :r] = True
    return TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                        "response_ids": response_ids, "response_mask": response_mask})


@pytest.mark.parametrize("folder", ["reward", "reward-qwen2", "reward-qwen3"])
def test_hf_bfloat16_scores_stay_in_the_scores_tier(folder: str) -> None:
    path = Harness.model_path(folder)
    batch = _batch(seed=2, rows=64)
    engine = get_reward_engine("hf", EngineSpec(model_path=path, role="reward", dtype="bfloat16"))
    got = engine.score(batch)["scores"].double()
    want = _reference_scores(path, batch).double()
    tier = tolerance("bfloat16", "scores")
    excess = (got - want).abs() - (tier.atol + tier.rtol * want.abs())
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0, (
        f"{folder}: {int((excess > 0).sum())} of 64 bfloat16 scores outside the scores tier; worst sample {worst}: "
        f"got {float(got[worst]):.5g}, float64 reference {float(want[worst]):.5g}")
    assert not torch.equal(got, want), "the engine scored in float64: the test would not test the tier"


@pytest.mark.parametrize("folder", ["value", "value-biased"])
def test_hf_bfloat16_values_stay_in_the_values_tier(folder: str) -> None:
    path = Harness.model_path(folder)
    engine = get_training_engine("hf", EngineSpec(model_path=path, role="critic", dtype="bfloat16"))
    tier = tolerance("bfloat16", "values")
    for seed in (3, 4, 5):
        batch = _batch(seed=seed, rows=64)
        mask = batch["response_mask"]
        got = engine.forward(batch, ["values"])["values"].double()[mask]
        want = cached_outputs(path, batch, ("values",))["values"].double()[mask]
        excess = (got - want).abs() - (tier.atol + tier.rtol * want.abs())
        worst = int(excess.argmax())
        assert float(excess.max()) <= 0, (
            f"{folder}, batch {seed}: {int((excess > 0).sum())} of {int(mask.sum())} bfloat16 values outside the "
            f"values tier; worst: got {float(got[worst]):.5g}, float64 reference {float(want[worst]):.5g}")
        assert not torch.equal(got, want), "the critic ran in float64: the test would not test the tier"
