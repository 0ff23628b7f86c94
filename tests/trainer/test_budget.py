"""The model-aware micro-batch budget: the estimate's terms, its set-up, its fallback and its log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from verl_core.trainer.batching.budget import (
    LOGITS_FLOAT32_COPIES,
    ModelShape,
    estimate_token_bytes,
    layer_bytes,
    lora_parameters,
    make_schedulers,
    pending_state_bytes,
    trained_parameters,
)
from verl_core.trainer.batching.scheduler import MemoryInfo, SchedulerConfig
from verl_core.trainer.config import RunConfig, load_config

GiB = 1 << 30
# the 0.89B Llama of the GPU benchmarks
LLAMA_09B = {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 5632, "vocab_size": 32000,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}


def test_the_terms_of_a_known_model() -> None:
    shape = ModelShape.from_config(LLAMA_09B)
    assert shape == ModelShape(2048, 16, 5632, 32000, 16, 8, 128, tied=False)
    est = estimate_token_bytes(shape, "bfloat16")
    # one layer, by the documented counts: bf16 (2 B) x (4 x hidden + 2 x query width 2048 + 2 x
    # key/value width 1024 + 4 x FFN 5632), float32 (4 B) x (2 x hidden + 16 heads + 2)
    layer = 2 * (4 * 2048 + 2 * 2048 + 2 * 1024 + 4 * 5632) + 4 * (2 * 2048 + 16 + 2)
    assert layer == 90184 and layer_bytes(shape, "bfloat16") == layer
    assert est.term("layers") == 16 * layer
    assert est.term("backward") == layer
    assert est.term("head") == (4 + 2) * 2048
    assert LOGITS_FLOAT32_COPIES == 0  # log-probs are chunked: no float32 copy per token
    assert est.term("logits") == 32000 * (2 + 2) == 128000
    assert est.bytes_per_token == 17 * 90184 + 12288 + 128000 == 1673416
    # checkpointing keeps each layer's input only, and recomputes one layer in backward
    ckpt = estimate_token_bytes(shape, "bfloat16", gradient_checkpointing=True)
    assert ckpt.term("layers") == 16 * 2048 * 2 and ckpt.term("backward") == 2 * layer
    assert ckpt.term("logits") == est.term("logits")
    # float32: every model-dtype element costs 4 B
    f32 = estimate_token_bytes(shape, "float32")
    assert f32.term("layers") == 16 * (4 * (4 * 2048 + 2 * 2048 + 2 * 1024 + 4 * 5632) + 4 * (2 * 2048 + 18))
    assert f32.term("logits") == 32000 * (4 + 4)
    line = est.describe()
    assert line.startswith("1,673,416 bytes/token = layers 1,442,944 (16 layers x 90,184)") and "bfloat16" in line


def test_pending_state_of_a_known_model() -> None:
    shape = ModelShape.from_config(LLAMA_09B)
    assert shape is not None
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5632 + 2 * 2048
    params = 2 * 32000 * 2048 + 16 * per_layer + 2048  # untied embedding and LM head
    assert shape.parameters == params
    # with float32 masters: a bf16 gradient in backward and two float32 AdamW moments (the float32
    # master gradient lives only in the optimizer step, when the activations are gone)
    assert pending_state_bytes(shape, "bfloat16") == params * (2 + 8)
    # pure bf16: torch's AdamW keeps its moments in the parameters' dtype
    assert pending_state_bytes(shape, "bfloat16", master_weights=False) == params * (2 + 4)
    assert pending_state_bytes(shape, "float32") == params * (4 + 8)
    assert pending_state_bytes(shape, "float32", master_weights=False) == params * (4 + 8)
    tied = ModelShape.from_config({**LLAMA_09B, "tie_word_embeddings": True})
    assert tied is not None and tied.parameters == params - 32000 * 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_term_counts_what_a_transformers_layer_saves_for_backward(dtype: torch.dtype) -> None:
    """The ``layers`` term against the bytes autograd really saves per token and layer (Llama, SDPA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {"hidden_size": 64, "intermediate_size": 160, "vocab_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}

    def saved_per_token(layers: int) -> int:
        torch.manual_seed(0)
        cfg = LlamaConfig(num_hidden_layers=layers, attn_implementation="sdpa", **sizes)
        model = LlamaForCausalLM(cfg).to(dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t

        ids = torch.randint(0, 128, (2, 16))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=ids)
        return sum(seen.values()) // ids.numel()

    shape = ModelShape.from_config({**sizes, "num_hidden_layers": 1})
    assert shape is not None
    measured = saved_per_token(3) - saved_per_token(2)
    expected = layer_bytes(shape, "float32" if dtype == torch.float32 else "bfloat16")
    assert abs(measured - expected) <= 0.1 * expected, (measured, expected)


def test_config_json_defaults_nesting_and_refusals(tmp_path: Path) -> None:
    plain = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000}
    shape = ModelShape.from_config({**plain, "num_attention_heads": 8})
    assert shape is not None and (shape.num_kv_heads, shape.head_dim) == (8, 32)  # as transformers defaults
    assert ModelShape.from_config(plain) == ModelShape(256, 2, 512, 1000, 1, 1, 256)
    assert ModelShape.from_config({"model_type": "vl", "text_config": plain}) == ModelShape.from_config(plain)
    assert ModelShape.from_config({**plain, "head_dim": None, "num_attention_heads": 4}) is not None
    for bad in ({k: v for k, v in plain.items() if k != "vocab_size"}, {**plain, "hidden_size": 0},
                {**plain, "num_hidden_layers": "2"}, {**plain, "intermediate_size": True}):
        assert ModelShape.from_config(bad) is None
    assert ModelShape.from_model_folder(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    assert ModelShape.from_model_folder(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(plain))
    assert ModelShape.from_model_folder(tmp_path) == ModelShape.from_config(plain)


def _run_config(tmp_path: Path, *extra: str) -> RunConfig:
    return load_config(None, [f"output_dir={json.dumps(str(tmp_path / 'out'))}", "model.dtype=float32", *extra])


def test_schedulers_take_the_estimate_reserve_the_state_and_log_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_09B))
    cfg = _run_config(tmp_path, "model.dtype=bfloat16")
    free = 139 * GiB
    with caplog.at_level(logging.INFO, logger="verl_core.trainer.batching.budget"):
        scheds = make_schedulers(cfg, ("actor", "reference", "critic"), model_path=str(model),
                                 training=("actor", "critic"), probe=lambda: MemoryInfo(free, free))
    shape = ModelShape.from_config(LLAMA_09B)
    assert shape is not None
    bpt = estimate_token_bytes(shape, "bfloat16").bytes_per_token
    reserved = 2 * pending_state_bytes(shape, "bfloat16")  # actor and critic train
    expected = int((free - reserved) * 0.5) // bpt
    assert expected > 20480  # a 128 x 160-token GRPO batch runs whole on an H200
    for s in scheds.values():
        assert s.config.bytes_per_token == bpt and s.config.reserved_bytes == reserved
        assert s.config.max_tokens is None  # no fixed cap by default
        assert s.fixed_budget == expected
        assert s.refinement_pending is False  # CPU run: no allocator peak to read
    (line,) = [r.getMessage() for r in caplog.records if r.name == "verl_core.trainer.batching.budget"]
    assert line.startswith(f"micro-batch budget: {expected} tokens") and "layers" in line and "logits" in line
    assert str(model / "config.json") in line and f"{reserved:,}" in line


def test_without_config_json_the_constant_is_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _run_config(tmp_path, "batch.min_tokens=8")
    with caplog.at_level(logging.INFO, logger="verl_core.trainer.batching.budget"):
        (s,) = make_schedulers(cfg, ("actor",), model_path=str(tmp_path), probe=lambda: MemoryInfo(GiB, GiB)).values()
    assert s.config.bytes_per_token == SchedulerConfig().bytes_per_token == 256 * 1024
    assert s.config.reserved_bytes == 0
    assert s.fixed_budget == GiB // 2 // (256 * 1024)
    assert any("the constant 262,144 bytes/token" in r.getMessage() for r in caplog.records)


def test_a_hand_set_budget_is_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _run_config(tmp_path, "batch.micro_batch_tokens=4096")
    with caplog.at_level(logging.INFO, logger="verl_core.trainer.batching.budget"):
        scheds = make_schedulers(cfg, ("actor",), model_path=str(tmp_path), probe=lambda: MemoryInfo(0, 1))
    assert scheds["actor"].fixed_budget == 4096 and not scheds["actor"].refinement_pending
    assert "micro-batch budget: 4096 tokens (batch.micro_batch_tokens)" in caplog.text


def test_the_reserved_state_follows_each_role_s_master_weights(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_09B))
    shape = ModelShape.from_config(LLAMA_09B)
    assert shape is not None
    cfg = _run_config(tmp_path, "model.dtype=bfloat16", "backends.options.actor.master_weights=false")
    scheds = make_schedulers(cfg, ("actor", "critic"), model_path=str(model), training=("actor", "critic"),
                             probe=lambda: MemoryInfo(139 * GiB, 139 * GiB))
    pure, masters = (pending_state_bytes(shape, "bfloat16", master_weights=m) for m in (False, True))
    assert pure == shape.parameters * 6 and masters == shape.parameters * 10
    assert scheds["actor"].config.reserved_bytes == pure + masters  # the actor in pure bf16, the critic with masters


# Qwen2.5-14B's body, the shape of the LoRA benchmark's largest model
QWEN_14B = {"hidden_size": 5120, "num_hidden_layers": 48, "intermediate_size": 13824, "vocab_size": 32000,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}


def test_under_lora_only_the_adapter_s_state_is_reserved(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 14B LoRA run on an 80 GB device: the frozen base gets no gradients or moments, so the
    budget is not cut to one sequence a micro-batch by 135 GB of state that never exists."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_14B))
    shape = ModelShape.from_config(QWEN_14B)
    assert shape is not None
    free = 24 * GiB  # an 80 GB device holding the base and the rollout's copy (27 GB each)
    lora = ("model.lora.enabled=true", "model.lora.rank=16")
    cfg = _run_config(tmp_path, "model.dtype=bfloat16", *lora)
    with caplog.at_level(logging.INFO, logger="verl_core.trainer.batching.budget"):
        (s,) = make_schedulers(cfg, ("actor",), model_path=str(model), probe=lambda: MemoryInfo(free, 80 * GiB)).values()
    adapter = trained_parameters(shape, cfg, "actor")
    assert adapter == lora_parameters(shape, cfg.model.lora) and 60e6 < adapter < 80e6
    assert trained_parameters(shape, cfg, "critic") == shape.parameters  # the critic trains fully
    assert s.config.reserved_bytes == pending_state_bytes(shape, "bfloat16", parameters=adapter) == adapter * 10
    bpt = estimate_token_bytes(shape, "bfloat16").bytes_per_token
    assert s.fixed_budget == int((free - adapter * 10) * 0.5) // bpt > 8 * 133  # 8 sequences or more at once
    assert "smallest budget" not in caplog.text
    # the same run trained fully reserves 13.5B x 10 B, more than is free: said, not silent
    caplog.clear()
    full = _run_config(tmp_path, "model.dtype=bfloat16")
    with caplog.at_level(logging.INFO, logger="verl_core.trainer.batching.budget"):
        (s,) = make_schedulers(full, ("actor",), model_path=str(model), probe=lambda: MemoryInfo(free, 80 * GiB)).values()
    assert s.config.reserved_bytes == shape.parameters * 10 > free
    assert s.fixed_budget == full.batch.min_tokens
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "smallest budget" in warning.getMessage() and "model.lora.enabled=true" in warning.getMessage()
