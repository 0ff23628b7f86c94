"""Training-engine forward: log-probs, entropy and values against the float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_helpers import actor_spec, model_path, unpadded_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_conformance.testkit import (
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    TinyModelSpec,
    assert_close,
    out_of_vocab_file_model,
    out_of_vocab_model,
    random_batch,
    tiny_model,
)
from verl_core import BatchValidationError, ConfigError, EngineSpec, NonFiniteError, ParallelSizes
from verl_hf.reward import HFRewardEngine
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_log_probs_and_entropy_match_reference(arch: str, tied: bool) -> None:
    path = model_path(arch, tied)
    engine = HFTrainingEngine(actor_spec(path))
    batch = random_batch(batch_size=5, max_prompt=7, max_response=6, temperature=0.7, seed=3)
    out = engine.forward(batch, ["log_probs", "entropy"])
    ref = unpadded_reference(path, batch, ["log_probs", "entropy"])
    assert out["log_probs"].dtype == torch.float32
    assert_close(out["log_probs"], ref["log_probs"], dtype="float32", quantity="log_probs")
    assert_close(out["entropy"], ref["entropy"], dtype="float32", quantity="entropy")
    assert bool((out["log_probs"][~batch["response_mask"]] == 0).all())
    assert bool((out["entropy"][~batch["response_mask"]] == 0).all())


def test_micro_batching_and_padding_do_not_change_log_probs() -> None:
    path = model_path()
    batch = random_batch(batch_size=6, max_prompt=9, max_response=7, seed=5, empty_responses=1)
    full = HFTrainingEngine(actor_spec(path)).forward(batch, ["log_probs"])
    budget = HFTrainingEngine(actor_spec(path, micro_batch_tokens=20)).forward(batch, ["log_probs"])
    single = HFTrainingEngine(actor_spec(path, micro_batch_size=1)).forward(batch, ["log_probs"])
    assert_close(budget["log_probs"], full["log_probs"], dtype="float32", quantity="log_probs")
    assert_close(single["log_probs"], full["log_probs"], dtype="float32", quantity="log_probs")
    assert bool((full["log_probs"][-1] == 0).all())  # the empty response


def test_critic_values_match_reference() -> None:
    path = model_path("qwen2", head="value")
    engine = HFTrainingEngine(actor_spec(path, role="critic"))
    batch = random_batch(batch_size=4, max_prompt=6, max_response=5, seed=1)
    out = engine.forward(batch, ["values"])
    ref = unpadded_reference(path, batch, ["values"])
    assert_close(out["values"], ref["values"], dtype="float32", quantity="values")
    with pytest.raises(ConfigError, match="critic"):
        engine.forward(batch, ["log_probs"])


def test_critic_over_causal_lm_folder_has_seeded_value_head() -> None:
    path = model_path("llama")
    batch = random_batch(batch_size=3, max_prompt=5, max_response=4, seed=2)
    a = HFTrainingEngine(actor_spec(path, role="critic", seed=7)).forward(batch, ["values"])
    b = HFTrainingEngine(actor_spec(path, role="critic", seed=7)).forward(batch, ["values"])
    c = HFTrainingEngine(actor_spec(path, role="critic", seed=8)).forward(batch, ["values"])
    assert torch.equal(a["values"], b["values"])
    assert not torch.equal(a["values"], c["values"])


def test_bfloat16_log_probs_within_tier() -> None:
    path = model_path("qwen3")
    engine = HFTrainingEngine(actor_spec(path, dtype="bfloat16"))
    batch = random_batch(batch_size=3, max_prompt=6, max_response=5, seed=4)
    out = engine.forward(batch, ["log_probs"])
    assert out["log_probs"].dtype == torch.float32
    ref = unpadded_reference(path, batch, ["log_probs"])
    assert_close(out["log_probs"], ref["log_probs"], dtype="bfloat16", quantity="log_probs")


def test_bad_input_is_rejected_before_model_code() -> None:
    path = model_path()
    engine = HFTrainingEngine(actor_spec(path, max_prompt_len=8, max_response_len=8))
    batch = random_batch(batch_size=3, max_prompt=6, max_response=5, seed=6)
    with pytest.raises(BatchValidationError, match="response_ids"):
        engine.forward(batch.update(response_ids=batch["response_ids"] + 1000))
    flipped = batch.update(prompt_mask=batch["prompt_mask"].flip(1), prompt_ids=batch["prompt_ids"].flip(1))
    with pytest.raises(BatchValidationError, match="left-padded"):
        engine.forward(flipped)
    with pytest.raises(BatchValidationError, match="needs field"):
        engine.forward(batch.drop("response_mask"))
    long = random_batch(batch_size=2, max_prompt=12, max_response=3, seed=1)
    with pytest.raises(BatchValidationError, match="max_prompt_len"):
        engine.forward(long)
    rl = random_batch(batch_size=2, max_prompt=3, max_response=3, with_rl_fields=True)
    nan = rl.update(advantages=torch.full_like(rl["advantages"], float("nan")))
    with pytest.raises(NonFiniteError):
        engine.forward(nan)


def test_wrong_role_and_parallel_are_config_errors() -> None:
    path = str(tiny_model(TinyModelSpec()))
    with pytest.raises(ConfigError, match="tensor or pipeline"):
        HFTrainingEngine(EngineSpec(model_path=path, role="actor", parallel=ParallelSizes(tp=2)))
    with pytest.raises(ConfigError, match="roles actor"):
        HFTrainingEngine(EngineSpec(model_path=path, role="rollout"))


@pytest.mark.parametrize("key", OUT_OF_VOCAB_IDS)
def test_special_token_ids_outside_the_vocabulary_are_refused_at_build(key: str) -> None:
    # transformers' nn.Embedding(padding_idx=...) would raise a bare AssertionError for the pad id,
    # and build the others; every engine refuses them all by name before any weight loads
    causal, reward = str(out_of_vocab_model(key)), str(out_of_vocab_model(key, "reward"))
    for build in (lambda: HFTrainingEngine(actor_spec(causal)),
                  lambda: HFTrainingEngine(actor_spec(causal, role="critic")),
                  lambda: HFRolloutEngine(actor_spec(causal, role="rollout")),
                  lambda: HFRewardEngine(EngineSpec(model_path=reward, role="reward"))):
        with pytest.raises(ConfigError, match=rf"config.json sets {key} = .*not in \[0, 128\)"):
            build()


@pytest.mark.parametrize("name", OUT_OF_VOCAB_FILES)
def test_tokenizer_and_generation_config_ids_outside_the_vocabulary_are_refused_at_build(name: str) -> None:
    # config.json is right: the tokenizer's EOS (id 128, which HFTokenizer took as is) or generation_config.json's
    # EOS list lies past the vocabulary, and every engine built
    file, key, _ = OUT_OF_VOCAB_FILES[name]
    causal, reward = str(out_of_vocab_file_model(name)), str(out_of_vocab_file_model(name, "reward"))
    for build in (lambda: HFTrainingEngine(actor_spec(causal)),
                  lambda: HFRolloutEngine(actor_spec(causal, role="rollout")),
                  lambda: HFRewardEngine(EngineSpec(model_path=reward, role="reward"))):
        with pytest.raises(ConfigError, match=rf"{file} sets {key} = .*not in \[0, 128\)"):
            build()


@functools.cache
def _engine(budget: int | None) -> HFTrainingEngine:
    return HFTrainingEngine(actor_spec(model_path("qwen3"), micro_batch_tokens=budget))


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), batch_size=st.integers(1, 6), budget=st.integers(12, 40),
       empty=st.integers(0, 1), temperature=st.sampled_from([0.5, 1.0, 1.7]))
def test_forward_is_invariant_to_the_micro_batch_budget(
    seed: int, batch_size: int, budget: int, empty: int, temperature: float
) -> None:
    batch = random_batch(batch_size=batch_size, max_prompt=6, max_response=6, seed=seed,
                         empty_responses=min(empty, batch_size), temperature=temperature)
    full = _engine(None).forward(batch, ["log_probs", "entropy"])
    split = _engine(budget).forward(batch, ["log_probs", "entropy"])
    for name in ("log_probs", "entropy"):
        assert split[name].shape == batch["response_mask"].shape
        assert bool((split[name][~batch["response_mask"]] == 0).all())
        assert_close(split[name], full[name], dtype="float32", quantity=name)
