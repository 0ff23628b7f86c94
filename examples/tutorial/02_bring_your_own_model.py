"""Step 2: bring your own model.

You built a model your own way: a megatron-core GPTModel from your own TransformerConfig, or a
plain transformers model. It needs only its forward; the SDK supplies generation (seeded, with
exact log-probs) and hands back a RolloutEngine. A model that also has ``generate_tokens`` keeps
its own sampler and the SDK adds the log-probs.

One switch turns on tensor parallelism: ``parallel=ParallelConfig(tp=2)``. The SDK then sets up
torch.distributed and Megatron's process groups before calling your builder.

    python examples/tutorial/02_bring_your_own_model.py --out tp1.json
    torchrun --nproc_per_node 2 examples/tutorial/02_bring_your_own_model.py --tp 2 --expect tp1.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from verl_conformance.testkit import tiny_model
from verl_core import SamplingParams, TensorBatch, Tokenizer
from verl_core.trainer import prompt_batch
from verl_hf.byo import rollout_from_model as hf_rollout
from verl_megatron.byo import rollout_from_model as megatron_rollout
from verl_megatron.parallel import ParallelConfig, ParallelState

PROMPTS = ["c123=", "c45=", "hello", "r9876="]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=7)


def build_gpt(state: ParallelState) -> torch.nn.Module:
    """Your own GPTModel: any TransformerConfig and layer spec megatron-core accepts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
        tensor_model_parallel_size=state.tp,
        use_cpu_initialization=True,  # full weights drawn from the seed: the same model at any TP
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=128, max_sequence_length=64, position_embedding_type="rope",
    )


class MyLlama(LlamaForCausalLM):
    """A transformers model that brings its own (greedy) generation: forward + generate."""

    def generate_tokens(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, seeds: list[int]
    ) -> torch.Tensor:
        ids, mask = prompt_ids, prompt_mask.long()
        for _ in range(params.max_new_tokens):
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            nxt = self(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        return ids[:, prompt_ids.shape[1]:]


def prompts(tokenizer: Tokenizer) -> TensorBatch:
    return prompt_batch(PROMPTS, tokenizer, group_ids=range(len(PROMPTS)))


def megatron_part(tp: int, tokenizer: object) -> dict[str, list]:
    engine = megatron_rollout(build_gpt, tokenizer, parallel=ParallelConfig(tp=tp), max_response_len=8)
    batch = prompts(engine.tokenizer)
    out = engine.generate(batch, PARAMS)
    # seeded per sample: the same samples in any batch order
    flipped = engine.generate(batch.index([3, 2, 1, 0]), PARAMS)
    order = [6, 7, 4, 5, 2, 3, 0, 1]  # the n=2 samples of prompt k sit in rows 2k and 2k+1
    assert torch.equal(flipped["response_ids"][order], out["response_ids"])
    assert out["rollout_log_probs"].shape == out["response_ids"].shape
    assert bool(out["response_mask"][:, 0].all()) and bool((out["rollout_log_probs"] <= 0).all())
    ids = [row[m].tolist() for row, m in zip(out["response_ids"], out["response_mask"], strict=True)]
    return {"ids": ids, "log_prob_sums": out["rollout_log_probs"].sum(1).tolist()}


def transformers_part(tokenizer: object) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, initializer_range=0.1)
    plain = LlamaForCausalLM(config)  # forward only: the SDK generates
    own = MyLlama(config)  # forward + generate: the model generates, the SDK adds log-probs
    own.load_state_dict(plain.state_dict())
    sdk, mine = hf_rollout(plain, tokenizer, max_response_len=8), hf_rollout(own, tokenizer, max_response_len=8)
    assert mine.user_generates and not sdk.user_generates
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    a = sdk.generate(prompts(sdk.tokenizer), greedy)
    b = mine.generate(prompts(mine.tokenizer), greedy)
    assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["response_mask"], b["response_mask"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=0)
    sampled = sdk.generate(prompts(sdk.tokenizer), PARAMS)
    assert torch.equal(sampled["response_ids"], sdk.generate(prompts(sdk.tokenizer), PARAMS)["response_ids"])
    print(f"transformers: {sampled.batch_size} samples; greedy ids and log-probs agree between both protocols")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun)")
    parser.add_argument("--out", help="write the Megatron samples to this JSON file")
    parser.add_argument("--expect", help="assert the Megatron samples equal this JSON file's")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model())  # a tiny character-level tokenizer
    samples = megatron_part(args.tp, tokenizer)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"megatron tp={args.tp}: {[len(s) for s in samples['ids']]} tokens per sample")
    if args.out and rank == 0:
        with open(args.out, "w") as fh:
            json.dump(samples, fh)
    if args.expect:
        with open(args.expect) as fh:
            expected = json.load(fh)
        assert samples["ids"] == expected["ids"], (samples["ids"], expected["ids"])
        for got, want in zip(samples["log_prob_sums"], expected["log_prob_sums"], strict=True):
            assert abs(got - want) < 1e-3, (got, want)
        print(f"rank {rank}: tp={args.tp} samples equal the expected ones")
    if args.tp == 1:
        transformers_part(tokenizer)


if __name__ == "__main__":
    main()
