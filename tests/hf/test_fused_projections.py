"""Fused q/k/v and gate/up projections in the hf rollout: same outputs, weights that follow syncs,
and every projection's own forward wherever a group is not back to back."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import actor_spec, model_path
from torch import nn

from verl_conformance.testkit import random_batch
from verl_core import (
    ConfigError,
    EngineSpec,
    SamplingParams,
    StreamWeightSync,
    TensorBatch,
    get_weight_sync,
)
from verl_hf.config import HFOptions
from verl_hf.fused_projections import FusedProjections
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine


def engine(arch: str, fused: bool, *, cache: str = "dynamic") -> HFRolloutEngine:
    spec = EngineSpec(model_path=model_path(arch), role="rollout", max_prompt_len=32, max_response_len=16,
                      options={"rollout_fused_projections": fused, "rollout_cache": cache})
    return HFRolloutEngine(spec)


def prompts() -> TensorBatch:
    b = random_batch(batch_size=4, max_prompt=6, max_response=1, seed=3)
    return b.select("prompt_ids", "prompt_mask", "group_ids")


def layers(e: HFRolloutEngine) -> int:
    return int(e.model.config.num_hidden_layers)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_fused_rollout_samples_what_the_unfused_one_does(arch: str, cache: str) -> None:
    fused, plain = engine(arch, True, cache=cache), engine(arch, False, cache=cache)
    assert fused.fused_projection_groups == 2 * layers(fused)  # q/k/v and gate/up in every layer
    assert plain.fused_projection_groups == 0
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=5)
    a, b = fused.generate(prompts(), params), plain.generate(prompts(), params)
    assert torch.equal(a["response_ids"], b["response_ids"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], rtol=0, atol=1e-5)


def test_a_sync_reaches_the_fused_weights() -> None:
    """The fused matrix is a view of the projections' weights: whatever a sync writes, it reads."""
    path = model_path("llama")
    actor = HFTrainingEngine(actor_spec(path))
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if name.endswith(("k_proj.weight", "up_proj.weight")):
                p.mul_(-1.5)  # weights a fresh load does not have
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    outs = []
    for fused, sync in ((True, get_weight_sync("hf", "hf")), (False, StreamWeightSync())):
        e = engine("llama", fused)
        sync.sync(actor, e, version=1)
        outs.append(e.generate(prompts(), params))
    assert torch.equal(outs[0]["response_ids"], outs[1]["response_ids"])
    torch.testing.assert_close(outs[0]["rollout_log_probs"], outs[1]["rollout_log_probs"], rtol=0, atol=1e-5)


def test_groups_not_back_to_back_keep_their_own_forwards() -> None:
    """A model whose weights are separate allocations (not one buffer) fuses nothing; a follower
    called on another input than its lead's computes its own product; remove() restores the forwards."""
    e = engine("llama", True)
    attn = e.model.model.layers[0].self_attn
    x = torch.randn(2, 3, attn.q_proj.in_features)
    y = torch.randn_like(x)
    attn.q_proj(x)  # stashes k and v of x
    torch.testing.assert_close(attn.k_proj(y), nn.functional.linear(y, attn.k_proj.weight), rtol=0, atol=0)
    attn.q_proj(x)
    torch.testing.assert_close(attn.v_proj(x), nn.functional.linear(x, attn.v_proj.weight), rtol=1e-6, atol=1e-6)

    separate = nn.Module()
    separate.q_proj, separate.k_proj, separate.v_proj = (nn.Linear(8, 8, bias=False) for _ in range(3))
    state = {f"{n}.weight": getattr(separate, n).weight for n in ("q_proj", "k_proj", "v_proj")}
    assert FusedProjections.install(separate, state).groups == 0

    fused = FusedProjections.install(e.model, {})  # no names match: nothing fused a second time
    assert fused.groups == 0
    assert "forward" in attn.q_proj.__dict__
    e._fused.remove()  # type: ignore[union-attr]
    assert all("forward" not in m.__dict__ for m in e.model.modules())


def test_a_rebuilt_buffer_turns_fusion_off_before_the_next_generate() -> None:
    e = engine("llama", True)
    attn = e.model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.clone(), requires_grad=False)  # re-homed
    out = e.generate(prompts(), SamplingParams(max_new_tokens=4, greedy=True))
    assert out.batch_size == 4 and e.fused_projection_groups == 0
    assert all("forward" not in m.__dict__ for m in e.model.modules())


def test_the_option_is_validated_and_resolved() -> None:
    with pytest.raises(ConfigError, match="rollout_fused_projections.: expected true or false, got .yes."):
        HFOptions(rollout_fused_projections="yes")  # type: ignore[arg-type]
    assert HFOptions().resolve_rollout(torch.device("cpu")).rollout_fused_projections is False
    assert HFOptions().resolve_rollout(torch.device("cuda")).rollout_fused_projections is True
    assert HFOptions(rollout_fused_projections=False).resolve_rollout(
        torch.device("cuda")).rollout_fused_projections is False
