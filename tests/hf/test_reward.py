"""The reward-model engine scores prompt + response at the last real token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_helpers import model_path

from verl_conformance.testkit import nan_reward_model, random_batch
from verl_core import ConfigError, EngineSpec, ParallelSizes, RewardError
from verl_hf.reward import HFRewardEngine


def _plain_scores(path: str, ids: list[list[int]]) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64)
    model.eval()
    out = []
    with torch.no_grad():
        for seq in ids:  # one unpadded sequence at a time: no padding semantics involved
            out.append(model(input_ids=torch.tensor([seq])).logits[0, 0])
    return torch.stack(out)


def test_scores_match_an_unpadded_transformers_forward() -> None:
    path = model_path("qwen2", head="reward")
    engine = HFRewardEngine(EngineSpec(model_path=path, role="reward"))
    batch = random_batch(batch_size=5, max_prompt=6, max_response=5, seed=2, empty_responses=1)
    # Pad id inside a response must not confuse the scorer (pad may equal EOS in real tokenizers).
    rid = batch["response_ids"].clone()
    rid[0, 1] = batch.meta.pad_token_id
    batch = batch.update(response_ids=rid)
    out = engine.score(batch)
    assert out["scores"].dtype == torch.float32 and out["scores"].shape == (5,)
    seqs = []
    for i in range(5):
        p = batch["prompt_ids"][i][batch["prompt_mask"][i]].tolist()
        r = batch["response_ids"][i][batch["response_mask"][i]].tolist()
        seqs.append(p + r)
    expected = _plain_scores(path, seqs)
    assert torch.allclose(out["scores"].double(), expected, atol=5e-5, rtol=1e-5)


def test_batched_and_single_scores_agree() -> None:
    path = model_path("llama", head="reward")
    batch = random_batch(batch_size=4, max_prompt=7, max_response=4, seed=5)
    whole = HFRewardEngine(EngineSpec(model_path=path, role="reward")).score(batch)
    single = HFRewardEngine(EngineSpec(model_path=path, role="reward", options={"rollout_batch_size": 1}))
    assert torch.allclose(whole["scores"], single.score(batch)["scores"], atol=1e-5)
    by_spec = HFRewardEngine(EngineSpec(model_path=path, role="reward", micro_batch_size=1))
    assert torch.allclose(whole["scores"], by_spec.score(batch)["scores"], atol=1e-5)


def test_non_finite_scores_raise_naming_the_samples() -> None:
    engine = HFRewardEngine(EngineSpec(model_path=str(nan_reward_model()), role="reward"))
    with pytest.raises(RewardError, match=r"non-finite scores \(NaN or inf\) to samples \[0, 1, 2\] of 3"):
        engine.score(random_batch(batch_size=3, seed=1))


def test_a_causal_lm_folder_is_not_a_reward_model() -> None:
    with pytest.raises(ConfigError, match=r"ForSequenceClassification.*set the config key reward_model"):
        HFRewardEngine(EngineSpec(model_path=model_path("llama"), role="reward"))


def test_a_folder_without_the_score_head_s_weights_is_refused(tmp_path: Path) -> None:
    """A causal LM's folder whose config names no architecture loads as a sequence classifier with a
    random head (transformers says so only in its load report): refused, naming the folder and the key."""
    folder = tmp_path / "no-head"
    shutil.copytree(model_path("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=(
        rf"reward model '{folder}' holds no weights for the score head \(score.weight missing\): transformers "
        r"would initialise it at random.*set the config key reward_model to the reward model's folder")):
        HFRewardEngine(EngineSpec(model_path=str(folder), role="reward"))
    # the same folder with a trained head is a reward model (its weights hold score.weight)
    reward = tmp_path / "with-head"
    shutil.copytree(model_path("llama", head="reward"), reward)
    config = json.loads((reward / "config.json").read_text())
    del config["architectures"]
    (reward / "config.json").write_text(json.dumps(config))
    assert HFRewardEngine(EngineSpec(model_path=str(reward), role="reward")).score(random_batch(batch_size=2))[
        "scores"].shape == (2,)


@pytest.mark.parametrize("parallel", [ParallelSizes(tp=2), ParallelSizes(pp=2), ParallelSizes(dp=2)])
def test_parallel_sizes_are_refused(parallel: ParallelSizes) -> None:
    """One engine scores on one device: a spec asking for tensor, pipeline or data parallelism is
    refused before the weights load, not built as one process that ignores it."""
    with pytest.raises(ConfigError, match=r"the hf reward engine runs on one device, got parallel=ParallelSizes"):
        HFRewardEngine(EngineSpec(model_path=model_path("llama", head="reward"), role="reward", parallel=parallel))
