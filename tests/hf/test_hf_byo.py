"""Bring your own transformers model: verl_hf.byo.rollout_from_model against the folder-built engine."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hf_helpers import model_path
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_core import BatchValidationError, ConfigError, EngineSpec, SamplingParams, TensorBatch
from verl_core.trainer import prompt_batch
from verl_hf.byo import HFModelRollout, rollout_from_model
from verl_hf.rollout import HFRolloutEngine

TEXTS = ["c12=", "hello", "r345=", "a"]


def _prompts(engine: HFRolloutEngine) -> TensorBatch:
    return prompt_batch(TEXTS, engine.tokenizer, group_ids=[10, 11, 12, 13])


def _model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32)


class _Scripted(torch.nn.Module):
    """A model whose own generation returns fixed ids (wraps a real causal LM for the forward)."""

    def __init__(self, inner: torch.nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.ids = ids
        self.config = inner.config
        self.seen_seeds: list[int] = []

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()  # type: ignore[operator,no-any-return]

    def forward(self, **kw: object) -> object:
        return self.inner(**kw)

    def generate_tokens(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, seeds: Sequence[int]
    ) -> torch.Tensor:
        self.seen_seeds = list(seeds)
        return self.ids[: prompt_ids.shape[0]]


def test_model_object_samples_exactly_like_the_folder_engine() -> None:
    folder = HFRolloutEngine(EngineSpec(model_path=model_path(), role="rollout", max_prompt_len=16, max_response_len=8))
    model = _model()
    mine = rollout_from_model(model, AutoTokenizer.from_pretrained(model_path()), max_prompt_len=16, max_response_len=8)
    assert not mine.user_generates and mine.model is model  # shared, not copied
    assert mine.spec.role == "rollout" and mine.weight_dtype == torch.float32
    missing = sorted(set(vars(folder)) - set(vars(mine)))
    assert not missing, f"HFModelRollout.__init__ must set {missing} like HFRolloutEngine.__init__ does"
    for params in (SamplingParams(max_new_tokens=6, n=3, seed=5, temperature=0.8, top_p=0.9),
                   SamplingParams(max_new_tokens=6, greedy=True)):
        a = folder.generate(_prompts(folder), params)
        b = mine.generate(_prompts(mine), params)
        assert torch.equal(a["response_ids"], b["response_ids"])
        assert torch.equal(a["response_mask"], b["response_mask"])
        assert torch.equal(a["truncated"], b["truncated"])
        torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-6, rtol=0)
    assert all(p.requires_grad for p in model.parameters())  # the caller's model is not frozen


def test_own_generation_is_cut_at_eos_and_scored_by_the_forward() -> None:
    base = rollout_from_model(_model(), AutoTokenizer.from_pretrained(model_path()), max_response_len=8)
    greedy = SamplingParams(max_new_tokens=5, greedy=True)
    ref = base.generate(_prompts(base), greedy)
    eos = base.tokenizer.eos_token_id
    # the model's own ids: row 0 ends with EOS at position 1 and keeps going (ignored), row 1 never stops
    ids = ref["response_ids"].clone()
    ids[:, :2] = ref["response_ids"][:, :2].clamp(min=5)
    ids[0, 1] = eos
    ids[1] = ids[1].clamp(min=5)
    scripted = _Scripted(_model(), ids)
    mine = rollout_from_model(scripted, AutoTokenizer.from_pretrained(model_path()), max_response_len=8)
    assert isinstance(mine, HFModelRollout) and mine.user_generates
    out = mine.generate(_prompts(mine), SamplingParams(max_new_tokens=5, seed=3))
    assert len(scripted.seen_seeds) == 4 and len(set(scripted.seen_seeds)) == 4
    assert out["response_mask"][0].tolist() == [True, True, False, False, False]
    assert out["response_ids"][0, 2:].tolist() == [base.tokenizer.pad_token_id] * 3
    assert not bool(out["truncated"][0]) and bool(out["truncated"][1])
    # teacher-forced log-probs equal the decoding loop's for the same tokens (greedy rows are exact copies)
    same = _Scripted(_model(), ref["response_ids"])
    again = rollout_from_model(same, AutoTokenizer.from_pretrained(model_path()), max_response_len=8).generate(
        _prompts(base), greedy
    )
    assert torch.equal(again["response_mask"], ref["response_mask"])
    torch.testing.assert_close(again["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0)


def test_bad_own_generation_and_bad_models_are_rejected() -> None:
    tok = AutoTokenizer.from_pretrained(model_path())
    too_long = rollout_from_model(_Scripted(_model(), torch.full((4, 9), 5)), tok, max_response_len=16)
    with pytest.raises(BatchValidationError, match="more than max_new_tokens=4"):
        too_long.generate(_prompts(too_long), SamplingParams(max_new_tokens=4))
    out_of_vocab = rollout_from_model(_Scripted(_model(), torch.full((4, 3), 10_000)), tok)
    with pytest.raises(BatchValidationError, match="outside the vocabulary"):
        out_of_vocab.generate(_prompts(out_of_vocab), SamplingParams(max_new_tokens=4))
    with pytest.raises(ConfigError, match="transformers causal LM"):
        rollout_from_model(torch.nn.Linear(2, 2), tok)


def test_weight_stream_into_a_model_object_matches_the_folder_engine() -> None:
    from verl_conformance.testkit import TinyModelSpec, tiny_model
    from verl_core import TensorInfo, WeightManifest, stream_weights

    other = tiny_model(TinyModelSpec(seed=1))
    theirs = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict()
    mine = rollout_from_model(_model(), AutoTokenizer.from_pretrained(model_path()), max_response_len=8)
    manifest = WeightManifest(4, {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in theirs.items()})
    mine.update_weights(stream_weights(theirs.items(), manifest, bucket_bytes=100_000))
    assert mine.weight_version == 4
    folder = HFRolloutEngine(EngineSpec(model_path=str(other), role="rollout", max_response_len=8))
    params = SamplingParams(max_new_tokens=5, n=2, seed=9)
    a, b = folder.generate(_prompts(folder), params), mine.generate(_prompts(mine), params)
    assert torch.equal(a["response_ids"], b["response_ids"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("token", "fragments"), [
    ("eos", ["its eos_token_id = 128 ('<|end|>') is not in [0, 128)", "never stops before max_new_tokens"]),
    ("pad", ["its pad_token_id = 128 ('<|pad|>') is not in [0, 128)", "batches are padded with it"]),
])
def test_a_tokenizer_whose_special_id_is_past_the_embedding_is_refused(token: str, fragments: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(model_path())
    model = _model()
    rows = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    assert len(tok) == rows == 128  # the tokenizer fits the model until a token is added without resizing
    tok.add_special_tokens({f"{token}_token": f"<|{'end' if token == 'eos' else token}|>"})
    with pytest.raises(ConfigError) as info:
        rollout_from_model(model, tok)
    message = str(info.value)
    for fragment in [*fragments, "the model's vocabulary (128 rows of its input embedding)",
                     "resize the model's embedding to the tokenizer"]:
        assert fragment in message, message
    # resizing the embedding to the tokenizer makes it a row: the same tokenizer is accepted and generates
    model.resize_token_embeddings(len(tok))  # type: ignore[operator]
    engine = rollout_from_model(model, tok, max_response_len=4)
    out = engine.generate(_prompts(engine), SamplingParams(max_new_tokens=3, seed=1))
    assert out["response_ids"].shape == (4, 3) and int(out["response_ids"].max()) < 129
