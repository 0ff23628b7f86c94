"""The hf rollout engine: schema, stopping, grouping, seeding, exact log-probs, weight updates."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import actor_spec, model_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_conformance.testkit import assert_close, random_batch
from verl_core import (
    EngineSpec,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    WeightCommit,
    WeightManifest,
    WeightSyncError,
)
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine

_ENGINES: dict[str, HFRolloutEngine] = {}


def rollout(arch: str = "llama", tied: bool = False) -> HFRolloutEngine:
    key = f"{arch}-{tied}"
    if key not in _ENGINES:
        spec = EngineSpec(model_path=model_path(arch, tied), role="rollout", max_prompt_len=32, max_response_len=32)
        _ENGINES[key] = HFRolloutEngine(spec)
    return _ENGINES[key]


def prompts(batch_size: int = 4, seed: int = 0, first_group: int = 0) -> TensorBatch:
    b = random_batch(batch_size=batch_size, max_prompt=6, max_response=1, seed=seed)
    b = b.select("prompt_ids", "prompt_mask", "group_ids")
    return b.update(group_ids=b["group_ids"] + first_group)


def check_schema(out: TensorBatch, n: int, pad: int, eos: int, stops: tuple[int, ...] = ()) -> None:
    out.check(where="test")
    mask, ids = out["response_mask"], out["response_ids"]
    assert bool((ids[~mask] == pad).all())
    assert bool((out["rollout_log_probs"][~mask] == 0).all())
    assert bool((out["rollout_log_probs"][mask] < 0).all())
    lengths = mask.sum(1)
    ends = {eos, *stops}
    for i in range(out.batch_size):
        real = ids[i, : int(lengths[i])].tolist()
        stopped = [j for j, t in enumerate(real) if t in ends]
        if out["truncated"][i]:
            assert not stopped
        else:
            assert stopped == [len(real) - 1], "a response ends exactly at its first stop token"
    assert out["sample_index"].tolist() == list(range(n)) * (out.batch_size // n)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_generate_schema_and_grouping(arch: str, tied: bool) -> None:
    engine = rollout(arch, tied)
    tok = engine.tokenizer
    p = prompts(3, first_group=10)
    stops = tuple(range(4, 24))
    out = engine.generate(p, SamplingParams(n=3, max_new_tokens=8, seed=1, stop_token_ids=stops, temperature=0.9))
    assert out.batch_size == 9
    assert out["group_ids"].tolist() == [10, 10, 10, 11, 11, 11, 12, 12, 12]
    assert torch.equal(out["prompt_ids"], p["prompt_ids"].repeat_interleave(3, 0))
    assert out.meta.temperature == 0.9 and out.meta.pad_token_id == tok.pad_token_id
    check_schema(out, 3, tok.pad_token_id, tok.eos_token_id, stops)
    assert not bool(out["truncated"].all()), "with 20 stop tokens some response should stop"


def test_truncation_flag_and_eos_at_first_token() -> None:
    engine = rollout()
    p = prompts(2)
    out = engine.generate(p, SamplingParams(max_new_tokens=3, seed=0, stop_token_ids=()))
    for i in range(2):
        if out["truncated"][i]:
            assert int(out["response_mask"][i].sum()) == 3
    # Every token is a stop token: each response is exactly one token, which is kept.
    every = tuple(range(engine.tokenizer.vocab_size))
    out = engine.generate(p, SamplingParams(max_new_tokens=5, seed=0, stop_token_ids=every))
    assert out.response_len == 1 and bool(out["response_mask"].all()) and not bool(out["truncated"].any())


def test_seeded_sampling_is_reproducible_and_order_invariant() -> None:
    engine = rollout("qwen3")
    p = prompts(4, seed=3)
    params = SamplingParams(n=2, max_new_tokens=6, seed=123, top_k=20, top_p=0.9)
    a = engine.generate(p, params)
    b = engine.generate(p, params)
    assert torch.equal(a["response_ids"], b["response_ids"])
    perm = [2, 0, 3, 1]
    c = engine.generate(p.index(perm), params)
    for new, old in enumerate(perm):
        for s in range(2):
            row_c, row_a = c.index([2 * new + s]).trim(), a.index([2 * old + s]).trim()
            assert torch.equal(row_c["response_ids"], row_a["response_ids"])
    other = engine.generate(p, SamplingParams(n=2, max_new_tokens=6, seed=124, top_k=20, top_p=0.9))
    assert not torch.equal(other["response_ids"], a["response_ids"])
    # A sample does not depend on the other prompts of its batch.
    alone = engine.generate(p.index([1]), params)
    assert torch.equal(alone.index([0]).trim()["response_ids"], a.index([2]).trim()["response_ids"])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, max_new_tokens=7, seed=5),
        SamplingParams(n=2, max_new_tokens=7, seed=5, temperature=0.6, top_k=10, top_p=0.8),
        SamplingParams(max_new_tokens=7, greedy=True, temperature=1.3),
    ],
)
def test_rollout_log_probs_equal_training_log_probs(params: SamplingParams) -> None:
    path = model_path("qwen2", True)
    engine = rollout("qwen2", True)
    assert engine.log_probs_exact(params)
    out = engine.generate(prompts(3, seed=4), params)
    actor = HFTrainingEngine(actor_spec(path))
    lp = actor.forward(out, ["log_probs"])
    assert_close(out["rollout_log_probs"], lp["log_probs"], dtype="float32", quantity="log_probs")


def test_greedy_picks_the_argmax_token() -> None:
    path = model_path()
    engine = rollout()
    out = engine.generate(prompts(2, seed=8), SamplingParams(max_new_tokens=5, greedy=True))
    actor = HFTrainingEngine(actor_spec(path))
    lp = actor.forward(out, ["log_probs", "entropy"])
    # The chosen token is the most likely one: its probability is at least exp(-entropy)... more
    # directly, re-running greedy on the prompt plus the first k tokens reproduces token k.
    first = out.index([0]).trim()
    again = engine.generate(first.select("prompt_ids", "prompt_mask", "group_ids"),
                            SamplingParams(max_new_tokens=5, greedy=True))
    assert torch.equal(again["response_ids"], first["response_ids"])
    assert bool((lp["log_probs"][out["response_mask"]] > -5).all())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), batch_size=st.integers(1, 3), max_new=st.integers(1, 5), seed=st.integers(0, 99))
def test_generate_schema_property(n: int, batch_size: int, max_new: int, seed: int) -> None:
    engine = rollout()
    out = engine.generate(prompts(batch_size, seed=seed), SamplingParams(n=n, max_new_tokens=max_new, seed=seed))
    assert out.batch_size == n * batch_size and 1 <= out.response_len <= max_new
    tok = engine.tokenizer
    check_schema(out, n, tok.pad_token_id, tok.eos_token_id)
    lengths = out["response_mask"].sum(1)
    assert bool((lengths[out["truncated"]] == max_new).all())


def test_failed_weight_sync_makes_the_engine_stale_until_a_complete_one() -> None:
    path = model_path("llama")
    engine = HFRolloutEngine(EngineSpec(model_path=path, role="rollout", max_response_len=8))
    actor = HFTrainingEngine(actor_spec(path))
    msgs = list(actor.export_weights(dtype=engine.weight_dtype, bucket_bytes=10_000))
    assert isinstance(msgs[0], WeightManifest)
    with pytest.raises(WeightSyncError, match="without a WeightCommit"):
        engine.update_weights(msgs[:-2])
    with pytest.raises(StaleWeightsError):
        engine.generate(prompts(1), SamplingParams(max_new_tokens=2))
    assert isinstance(msgs[-1], WeightCommit)
    engine.update_weights(actor.export_weights(dtype=engine.weight_dtype, bucket_bytes=10_000))
    assert engine.generate(prompts(1), SamplingParams(max_new_tokens=2)).batch_size == 1
    bad = WeightManifest(0, {"nope": msgs[0].tensors["model.norm.weight"]})
    with pytest.raises(WeightSyncError, match="does not match"):
        engine.update_weights([bad, WeightCommit(0)])
    with pytest.raises(StaleWeightsError):
        engine.generate(prompts(1), SamplingParams(max_new_tokens=2))


def test_eos_ends_the_response_and_is_kept() -> None:
    engine = HFRolloutEngine(EngineSpec(model_path=model_path("llama"), role="rollout", max_response_len=8))
    p = prompts(1, seed=9)
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    first = int(engine.generate(p, greedy)["response_ids"][0, 0])
    eos = engine.tokenizer.eos_token_id
    assert first != eos
    # Swap the LM-head rows of the greedy token and EOS: greedy now emits EOS first.
    head = engine.model.lm_head.weight
    with torch.no_grad():
        head[[first, eos]] = head[[eos, first]].clone()
    out = engine.generate(p.index([0, 0]).update(group_ids=torch.tensor([0, 1])), greedy)
    assert out["response_ids"].tolist() == [[eos], [eos]]
    assert bool(out["response_mask"].all()) and not bool(out["truncated"].any())
    assert bool((out["rollout_log_probs"] < 0).all())


def test_the_kv_cache_keyword_follows_the_model_s_forward() -> None:
    """transformers >= 5.2x renamed ``past_key_values`` to ``cache``; the engine passes what the forward takes."""
    import inspect
    from typing import Any

    import transformers

    from verl_hf.modeling import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids: Any = None, cache: Any = None, use_cache: bool = False) -> Any:
            return None

    class Old(torch.nn.Module):
        def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> Any:
            return None

    class Loose(torch.nn.Module):
        def forward(self, **kwargs: Any) -> Any:
            return None

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Loose()) == "past_key_values"
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32))
    assert cache_keyword(llama) in inspect.signature(llama.forward).parameters  # the installed release's name
