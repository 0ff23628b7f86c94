"""The vLLM rollout engine in bfloat16: log-probs within the bfloat16 tier, a bfloat16 weight sync."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm_testing import (
    KV_CACHE_BYTES,
    MAX_PROMPT,
    MAX_RESPONSE,
    load_state_dict,
    make_prompts,
    reference_log_probs,
    save_variant,
    weight_stream,
)

from verl_conformance.testkit import assert_close
from verl_core import EngineSpec, RolloutEngine, SamplingParams, WeightSyncError, get_rollout_engine

PARAMS = SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=1)


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Iterator[RolloutEngine]:
    spec = EngineSpec(str(llama_path), "rollout", dtype="bfloat16", max_prompt_len=MAX_PROMPT,
                      max_response_len=MAX_RESPONSE, options={"kv_cache_bytes": KV_CACHE_BYTES})
    eng = get_rollout_engine("vllm", spec)
    yield eng
    eng.close()


def test_bfloat16_generation_and_sync(engine: RolloutEngine, llama_path: Path, tmp_path: Path) -> None:
    assert engine.weight_dtype == torch.bfloat16
    prompts = make_prompts([[4, 5, 6, 7], [8, 9], [10, 11, 12]], [0, 1, 2])
    out = engine.generate(prompts, PARAMS)
    assert_close(out["rollout_log_probs"], reference_log_probs(llama_path, out), dtype="bfloat16",
                 quantity="log_probs")

    g = torch.Generator().manual_seed(3)
    state = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
             for k, v in load_state_dict(llama_path).items()}
    with pytest.raises(WeightSyncError, match="float32"):  # the sender must cast to the receiver's dtype
        engine.update_weights(weight_stream({k: v.float() for k, v in state.items()}, 1))
    engine.update_weights(weight_stream(state, 2))
    folder = save_variant(llama_path, tmp_path / "bf16", state)
    out = engine.generate(prompts, PARAMS)
    assert out.meta.weight_version == 2
    assert_close(out["rollout_log_probs"], reference_log_probs(folder, out), dtype="bfloat16",
                 quantity="log_probs")
