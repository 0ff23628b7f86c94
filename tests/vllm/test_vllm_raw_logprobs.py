"""The ``raw_logprobs`` option: exact at T = 1 only, and what it reports at another temperature."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_testing import KV_CACHE_BYTES, MAX_PROMPT, MAX_RESPONSE, make_prompts, reference_log_probs

from verl_conformance.testkit import assert_close
from verl_core import EngineSpec, RolloutEngine, SamplingParams, get_rollout_engine

PROMPTS = make_prompts([[4, 5, 6, 7], [8, 9], [10, 11, 12]], [0, 1, 2])


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Iterator[RolloutEngine]:
    spec = EngineSpec(str(llama_path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE,
                      options={"kv_cache_bytes": KV_CACHE_BYTES, "logprobs_mode": "raw_logprobs"})
    eng = get_rollout_engine("vllm", spec)
    yield eng
    eng.close()


def test_raw_mode_is_exact_at_temperature_one(engine: RolloutEngine, llama_path: Path) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=2)
    assert engine.log_probs_exact(params)
    out = engine.generate(PROMPTS, params)
    assert_close(out["rollout_log_probs"], reference_log_probs(llama_path, out), dtype="float32",
                 quantity="log_probs")


def test_raw_mode_reports_temperature_one_values_at_another_temperature(
    engine: RolloutEngine, llama_path: Path
) -> None:
    params = SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=2)
    assert not engine.log_probs_exact(params)
    out = engine.generate(PROMPTS, params)
    at_one = reference_log_probs(llama_path, out.with_meta(temperature=1.0))
    assert_close(out["rollout_log_probs"], at_one, dtype="float32", quantity="log_probs",
                 what="raw_logprobs at T=0.7 vs the T=1 reference")
    at_t = reference_log_probs(llama_path, out)
    mask = out["response_mask"]
    assert float((out["rollout_log_probs"].double() - at_t).abs()[mask].max()) > 1e-2
