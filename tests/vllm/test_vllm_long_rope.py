"""LongRoPE on the vLLM rollout engine: cos and sin scaled by transformers' attention factor.

vLLM's LongRoPE ignores ``attention_factor`` (it derives the scale from ``max_position_embeddings``),
so the engine writes transformers' value into the config vLLM loads (``short_mscale`` and
``long_mscale``). Past the trained range, where vLLM and transformers both use the long factors,
the engine then samples the float64 reference's log-probs.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from vllm_testing import KV_CACHE_BYTES, make_prompts, reference_log_probs

from verl_conformance.testkit import (
    LONG_ROPE_TRAINED,
    assert_close,
    long_rope_model,
    rope_scaled_model,
)
from verl_core import EngineSpec, SamplingParams
from verl_vllm.config import VllmRolloutConfig
from verl_vllm.llm_process import long_rope_attention_factor
from verl_vllm.rollout import VllmRolloutEngine


def _rope(config: transformers.PretrainedConfig) -> dict[str, object]:
    params = config.rope_parameters
    assert isinstance(params, dict)
    return params


def test_explicit_attention_factor_becomes_both_mscales() -> None:
    config = long_rope_attention_factor(transformers.AutoConfig.from_pretrained(long_rope_model()))
    params = _rope(config)
    assert params["attention_factor"] == 1.0
    assert (params["short_mscale"], params["long_mscale"]) == (1.0, 1.0)


def test_default_attention_factor_follows_the_configs_factor() -> None:
    # factor 4 from the config, not max_position_embeddings / original_max_position_embeddings
    config = transformers.AutoConfig.from_pretrained(rope_scaled_model("longrope"))
    config.max_position_embeddings = 512
    params = _rope(long_rope_attention_factor(config))
    want = math.sqrt(1 + math.log(4.0) / math.log(LONG_ROPE_TRAINED))
    assert params["short_mscale"] == params["long_mscale"] == pytest.approx(want, rel=1e-6)


def test_other_configs_are_left_alone() -> None:
    config = transformers.AutoConfig.from_pretrained(rope_scaled_model("yarn"))
    before = dict(_rope(config))
    assert _rope(long_rope_attention_factor(config)) == before
    config = transformers.AutoConfig.from_pretrained(long_rope_model())
    config.rope_parameters = {**_rope(config), "short_mscale": 0.5, "long_mscale": 2.0}
    params = _rope(long_rope_attention_factor(config))
    assert (params["short_mscale"], params["long_mscale"]) == (0.5, 2.0)


def test_long_rope_past_the_trained_range_matches_the_reference() -> None:
    path = long_rope_model()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 128, (n,), generator=g).tolist() for n in (LONG_ROPE_TRAINED + 9, LONG_ROPE_TRAINED + 3)]
    spec = EngineSpec(str(path), "rollout", max_prompt_len=48, max_response_len=8)
    engine = VllmRolloutEngine(spec, VllmRolloutConfig(kv_cache_bytes=KV_CACHE_BYTES))
    try:
        out = engine.generate(make_prompts(rows, [0, 1]), SamplingParams(temperature=1.0, max_new_tokens=6, seed=4))
    finally:
        engine.close()
    assert_close(out["rollout_log_probs"], reference_log_probs(path, out), dtype="float32", quantity="log_probs",
                 what="rollout_log_probs on the LongRoPE folder (attention_factor 1) past the trained range")
