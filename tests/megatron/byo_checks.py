"""Launched under torchrun by test_megatron_byo.py: a user-built GPTModel through verl_megatron.byo.

The model is built by a builder the SDK calls after it set up the process groups; its weights come
from a test-kit folder through a weight stream, so its samples can be compared with the hf engine
on the same folder (both backends share the per-sample seeded sampling). Usage: ``byo_checks.py TP``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from verl_conformance.testkit import TinyModelSpec, load_tokenizer, tiny_model, write_rank_result
from verl_core import (
    ConfigError,
    EngineSpec,
    ParallelSizes,
    SamplingParams,
    TensorInfo,
    WeightManifest,
    stream_weights,
)
from verl_core.trainer import prompt_batch
from verl_hf.rollout import HFRolloutEngine
from verl_megatron.byo import rollout_from_model
from verl_megatron.model import load_hf_state_dict
from verl_megatron.parallel import ParallelConfig, ParallelState
from verl_megatron.rollout import MegatronRolloutEngine

SPEC = TinyModelSpec()  # llama, untied, hidden 128, 4 heads, 2 kv heads, head_dim 32, vocab 128


def gpt_class() -> Any:
    from megatron.core.models.gpt import GPTModel

    class ScriptedGPT(GPTModel):  # type: ignore[misc]
        """A GPTModel that brings its own generation: it replays ``script``."""

        script: torch.Tensor | None = None

        def generate_tokens(
            self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, seeds: Sequence[int]
        ) -> torch.Tensor:
            assert self.script is not None
            return self.script

    return ScriptedGPT


def builder(cls: Any, parallel_output: bool = True) -> Any:
    def build(state: ParallelState) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        config = TransformerConfig(
            num_layers=SPEC.num_layers, hidden_size=SPEC.hidden_size, num_attention_heads=SPEC.num_heads,
            num_query_groups=SPEC.num_kv_heads, kv_channels=SPEC.head_dim, ffn_hidden_size=SPEC.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=state.tp,
            use_cpu_initialization=True, bias_dropout_fusion=False, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
        )
        return cls(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=SPEC.vocab_size, max_sequence_length=64, position_embedding_type="rope",
                   parallel_output=parallel_output, share_embeddings_and_output_weights=False)

    return build


def main() -> None:
    tp = int(sys.argv[1])
    path = tiny_model(SPEC)
    tok = load_tokenizer(path)
    from megatron.core.models.gpt import GPTModel

    state = load_hf_state_dict(path)
    manifest = WeightManifest(3, {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in state.items()})
    engine = rollout_from_model(builder(GPTModel), tok, parallel=ParallelConfig(tp=tp), max_response_len=8)
    engine.update_weights(stream_weights(state.items(), manifest, bucket_bytes=200_000))
    prompts = prompt_batch(["c12=", "hello", "r345="], tok, group_ids=[4, 5, 6])
    hf = HFRolloutEngine(EngineSpec(model_path=str(path), role="rollout", max_response_len=8))
    folder = MegatronRolloutEngine(EngineSpec(model_path=str(path), role="rollout", parallel=ParallelSizes(tp=tp)))
    missing = sorted(set(vars(folder)) - set(vars(engine)))
    out: dict[str, Any] = {"version": engine.weight_version, "user_generates": engine.user_generates,
                           "missing": missing}
    for name, params in (("sampled", SamplingParams(max_new_tokens=6, n=2, seed=11, top_k=20)),
                         ("greedy", SamplingParams(max_new_tokens=6, greedy=True))):
        mine, ref = engine.generate(prompts, params), hf.generate(prompts, params)
        for key in ("response_ids", "response_mask", "rollout_log_probs"):
            out[f"{name}/{key}"] = mine[key]
            out[f"{name}/hf/{key}"] = ref[key]
    # the model's own generation: replay the greedy ids; the SDK adds vocabulary-parallel log-probs
    own = rollout_from_model(builder(gpt_class()), tok, parallel=ParallelConfig(tp=tp), max_response_len=8)
    own.update_weights(stream_weights(state.items(), manifest, bucket_bytes=200_000))
    out["own_generates"] = own.user_generates
    own.model.script = out["greedy/response_ids"].clone()
    replay = own.generate(prompts, SamplingParams(max_new_tokens=6, seed=1))
    out["replay/response_ids"] = replay["response_ids"]
    out["replay/rollout_log_probs"] = replay["rollout_log_probs"]
    errors = []
    for kwargs in ({"parallel": ParallelConfig(tp=tp, pp=2)},):
        try:
            rollout_from_model(builder(gpt_class()), tok, **kwargs)
        except ConfigError as e:
            errors.append(str(e))
    if tp > 1:
        try:
            rollout_from_model(builder(gpt_class(), parallel_output=False), tok, parallel=ParallelConfig(tp=tp))
        except ConfigError as e:
            errors.append(str(e))
    out["errors"] = errors
    # a tokenizer given a special token past the embedding's rows (128 over all ranks) is refused at build
    from transformers import AutoTokenizer

    refusals = []
    for token in ("eos", "pad"):
        grown = AutoTokenizer.from_pretrained(str(path))
        grown.add_special_tokens({f"{token}_token": f"<|{token}|>"})
        try:
            rollout_from_model(builder(GPTModel), grown, parallel=ParallelConfig(tp=tp))
        except ConfigError as e:
            refusals.append(str(e))
    out["refusals"] = refusals
    write_rank_result(out)


if __name__ == "__main__":
    main()
