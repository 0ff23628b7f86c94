"""An off-policy correction is refused at set-up when vLLM's log-probs are not exact under the run's sampling.

The correction weighs the loss by ``pi_old / pi_rollout``; with ``raw_logprobs`` vLLM reports
log softmax(logits) at T = 1 whatever the sampling temperature, and no mode is exact with top-k or
top-p, so such a run would be reweighed by the difference of definitions. The check asks the real
engine (``RolloutEngine.log_probs_exact``) with the run's sampling parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_testing import KV_CACHE_BYTES, MAX_PROMPT, MAX_RESPONSE

from verl_core import EngineSpec, RolloutEngine, get_rollout_engine
from verl_core.kernel.errors import ConfigError
from verl_core.trainer.config import load_config
from verl_core.trainer.rl.algorithm_setup import check_offpolicy_rollout


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Iterator[RolloutEngine]:
    spec = EngineSpec(str(llama_path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE,
                      options={"kv_cache_bytes": KV_CACHE_BYTES, "logprobs_mode": "raw_logprobs"})
    eng = get_rollout_engine("vllm", spec)
    yield eng
    eng.close()


@pytest.mark.parametrize("sampling", [["rollout.temperature=0.7"], ["rollout.top_k=5"], ["rollout.top_p=0.9"]])
def test_inexact_rollout_log_probs_are_refused_naming_the_key(engine: RolloutEngine, sampling: list[str]) -> None:
    cfg = load_config(None, ["backends.rollout=vllm", "algorithm.offpolicy.mode=mis", *sampling])
    with pytest.raises(ConfigError, match=r"'algorithm.offpolicy.mode' = 'mis' .*rollout backend 'vllm' reports "
                                          r"log-probs that are not exact .*set algorithm.offpolicy.mode = 'none'"):
        check_offpolicy_rollout(cfg, engine)
    check_offpolicy_rollout(load_config(None, ["backends.rollout=vllm", *sampling]), engine)  # no correction


def test_exact_rollout_log_probs_pass(engine: RolloutEngine) -> None:
    check_offpolicy_rollout(load_config(None, ["backends.rollout=vllm", "algorithm.offpolicy.mode=tis"]), engine)
