"""Step 3: mixed backends with different tokenizers.

Megatron generates; a transformers sequence-classification reward model scores. The two models
have different tokenizers (a character-level one for the policy, a byte-level BPE one for the
reward model), so the same id means different text on the two sides. ``CrossTokenizerReward``
notices that the vocabularies differ and converts every sample through text; you write no
conversion code.

    python examples/tutorial/03_mixed_backends.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from verl_conformance.testkit import tiny_model
from verl_core import EngineSpec, SamplingParams, TensorBatch, get_reward_engine, get_rollout_engine
from verl_core.enginekit.retokenize import CrossTokenizerReward
from verl_core.trainer import prompt_batch


def build_reward_model(folder: Path) -> None:
    """A tiny Qwen2 reward model with its own byte-level BPE tokenizer, saved as a transformers folder."""
    bpe = Tokenizer(models.BPE(unk_token="<|unk|>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|pad|>", "<|unk|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["c123=123", "r456=654", "hello world", "a12+34=46", "the cat sat"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", unk_token="<|unk|>",
                                        eos_token="<|end|>")
    config = Qwen2Config(vocab_size=len(tokenizer) + len(tokenizer) % 2, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def reference_scores(folder: Path, texts: list[tuple[str, str, bool]]) -> torch.Tensor:
    """Check only: the reward model run by hand on each sample's text (prompt + response [+ EOS])."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    for prompt, response, ended in texts:
        ids = tok.encode(prompt, add_special_tokens=False) + tok.encode(response, add_special_tokens=False) + ([tok.eos_token_id] if ended else [])
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0])
    return torch.stack(out)


def main() -> None:
    policy_folder = tiny_model()  # a tiny Llama with a character-level tokenizer
    rollout = get_rollout_engine("megatron", EngineSpec(model_path=str(policy_folder), role="rollout",
                                                        max_prompt_len=16, max_response_len=8))
    with tempfile.TemporaryDirectory() as tmp:
        reward_folder = Path(tmp)
        build_reward_model(reward_folder)
        rm = get_reward_engine("hf", EngineSpec(model_path=str(reward_folder), role="reward", device="cpu"))

        reward = CrossTokenizerReward(rm, rollout.tokenizer)  # the only line that mentions tokenizers
        assert reward.converts  # the vocabularies differ: samples go through text

        prompts = prompt_batch(["c123=", "hello", "a12+34="], rollout.tokenizer, group_ids=[0, 1, 2])
        samples = rollout.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=0))
        scored: TensorBatch = reward.score(samples)

        scores = scored["scores"]
        assert scores.shape == (6,) and bool(torch.isfinite(scores).all())
        assert torch.equal(scored["response_ids"], samples["response_ids"])  # the policy's ids are untouched
        tok, eos = rollout.tokenizer, rollout.tokenizer.eos_token_id
        texts = []
        for i in range(samples.batch_size):
            p = samples["prompt_ids"][i][samples["prompt_mask"][i]].tolist()
            r = samples["response_ids"][i][samples["response_mask"][i]].tolist()
            texts.append((tok.decode(p), tok.decode(r), bool(r) and r[-1] == eos))
        expected = reference_scores(reward_folder, texts)
        torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-4)
        for (prompt, response, _), s in zip(texts, scores.tolist(), strict=True):
            print(f"{prompt!r:>10} -> {response!r:<10} score {s:+.4f}")
        print("megatron samples scored by a transformers reward model with another tokenizer")


if __name__ == "__main__":
    main()
