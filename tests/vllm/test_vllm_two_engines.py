"""Two in-process vLLM engines: closing one leaves the other serving (they share vLLM's process-wide state)."""

from __future__ import annotations

from pathlib import Path

import torch
from vllm_testing import KV_CACHE_BYTES, MAX_PROMPT, MAX_RESPONSE, make_prompts

from verl_core import EngineSpec, SamplingParams, TensorBatch
from verl_vllm.config import VllmRolloutConfig
from verl_vllm.rollout import VllmRolloutEngine


def _engines(llama_path: Path) -> tuple[EngineSpec, VllmRolloutConfig, TensorBatch, SamplingParams]:
    """The spec, config, prompts and greedy sampling both tests build their engines and calls from."""
    spec = EngineSpec(str(llama_path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE)
    config = VllmRolloutConfig(kv_cache_bytes=KV_CACHE_BYTES, max_num_seqs=16)
    return spec, config, make_prompts([[4, 5, 6], [7, 8]], [0, 1]), SamplingParams(greedy=True, max_new_tokens=4)


def test_closing_one_engine_keeps_the_other_serving(llama_path: Path) -> None:
    spec, config, prompts, greedy = _engines(llama_path)
    first = VllmRolloutEngine(spec, config)
    try:
        before = first.generate(prompts, greedy)
        second = VllmRolloutEngine(spec, config)
        second.generate(prompts, greedy)
        second.close()
        after = first.generate(prompts, greedy)  # raised "pipeline model parallel group is not initialized"
        assert torch.equal(after["response_ids"], before["response_ids"])
    finally:
        first.close()


def test_dropping_one_engine_without_close_keeps_the_other_serving(llama_path: Path) -> None:
    """An engine dropped without close() is shut down by its finalizer, its own parts only while another
    is open: vLLM's client finalizer alone ran the full shutdown when the dropped LLM was collected."""
    import gc

    spec, config, prompts, greedy = _engines(llama_path)
    first = VllmRolloutEngine(spec, config)
    try:
        before = first.generate(prompts, greedy)
        second = VllmRolloutEngine(spec, config)
        second.generate(prompts, greedy)
        del second
        gc.collect()
        after = first.generate(prompts, greedy)  # raised "pipeline model parallel group is not initialized"
        assert torch.equal(after["response_ids"], before["response_ids"])
    finally:
        first.close()
