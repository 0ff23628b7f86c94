"""Converters, layout validation, the plugin spec and the CPU shims (in-process, no process group)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_conformance.testkit import (
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    TinyModelSpec,
    absolute_position_model,
    out_of_vocab_file_model,
    out_of_vocab_model,
    rope_scaled_model,
    tiny_model,
)
from verl_core import ConfigError, EngineSpec
from verl_megatron.convert import ModelDims, StateDictAdapter
from verl_megatron.model import load_hf_state_dict, model_dims
from verl_megatron.parallel import ParallelConfig

SPECS = [
    TinyModelSpec(arch="llama"),
    TinyModelSpec(arch="llama", tied=True),
    TinyModelSpec(arch="qwen2", tied=True),
    TinyModelSpec(arch="qwen3"),
    TinyModelSpec(arch="qwen2", head="value"),
]


@functools.cache
def _load(spec: TinyModelSpec) -> tuple[StateDictAdapter, dict[str, torch.Tensor]]:
    path = tiny_model(spec)
    dims = model_dims(path, "value" if spec.head == "value" else "lm")
    return StateDictAdapter(dims), load_hf_state_dict(path)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.arch}-{s.head}-{'tied' if s.tied else 'untied'}")
def test_round_trip_is_exact(spec: TinyModelSpec) -> None:
    adapter, hf = _load(spec)
    mg = adapter.from_hf(hf)
    assert list(mg) == adapter.megatron_names()
    for name, t in mg.items():
        assert tuple(t.shape) == adapter.megatron_shape(name), name
    back = adapter.to_hf(mg)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    assert list(back) == list(adapter.hf_shapes())
    assert {n: tuple(t.shape) for n, t in back.items()} == adapter.hf_shapes()


def test_qkv_layout_is_grouped_per_query_group() -> None:
    adapter, hf = _load(TinyModelSpec(arch="qwen2"))
    d = adapter.dims
    qkv = adapter.from_hf(hf)["decoder.layers.0.self_attention.linear_qkv.weight"]
    hpg = d.num_heads // d.num_kv_heads
    per_group = (hpg + 2) * d.head_dim
    for g in range(d.num_kv_heads):
        block = qkv[g * per_group : (g + 1) * per_group]
        q = hf["model.layers.0.self_attn.q_proj.weight"][g * hpg * d.head_dim : (g + 1) * hpg * d.head_dim]
        k = hf["model.layers.0.self_attn.k_proj.weight"][g * d.head_dim : (g + 1) * d.head_dim]
        v = hf["model.layers.0.self_attn.v_proj.weight"][g * d.head_dim : (g + 1) * d.head_dim]
        assert torch.equal(block, torch.cat([q, k, v]))


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([1, 2]), spec_index=st.integers(0, len(SPECS) - 1), data=st.data())
def test_tp_shards_rejoin_exactly(tp: int, spec_index: int, data: st.DataObject) -> None:
    adapter, hf = _load(SPECS[spec_index])
    full = adapter.from_hf(hf)
    name = data.draw(st.sampled_from(adapter.megatron_names()))
    shards = [adapter.shard(name, full[name], r, tp) for r in range(tp)]
    assert torch.equal(adapter.unshard(name, shards), full[name])
    if adapter.partition(name) != "replicated" and tp > 1:
        assert sum(s.numel() for s in shards) == full[name].numel()


def test_fc1_shard_holds_its_gate_and_up_slices() -> None:
    adapter, hf = _load(TinyModelSpec())
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    shard = adapter.shard(name, adapter.from_hf(hf)[name], 1, 2)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(shard, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_cover_every_tensor_once(pp: int, tied: bool) -> None:
    adapter, _ = _load(TinyModelSpec(tied=tied))
    seen = [g for rank in range(pp) for g, local in adapter.stage_names(rank, pp) if local != "output_layer.weight" or not tied]
    assert sorted(seen) == sorted(adapter.megatron_names())
    last = dict((local, g) for g, local in adapter.stage_names(pp - 1, pp))
    if tied and pp > 1:
        assert last["output_layer.weight"] == "embedding.word_embeddings.weight"
    assert any(local == "decoder.layers.0.input_layernorm.weight" for _, local in adapter.stage_names(pp - 1, pp))


def test_parallel_sizes_that_do_not_divide_the_model_are_rejected() -> None:
    adapter, _ = _load(TinyModelSpec())
    with pytest.raises(ConfigError, match=r"tp=3 does not divide the model's attention heads \(4\)"):
        adapter.dims.check_parallel(3, 1)
    with pytest.raises(ConfigError, match=r"pp=3 does not divide the model's layers \(2\)"):
        adapter.dims.check_parallel(1, 3)
    adapter.dims.check_parallel(2, 2)


def test_parallel_config_is_checked_against_the_world_size() -> None:
    with pytest.raises(ConfigError, match="world size 3 is not divisible by tp \\* pp = 2"):
        ParallelConfig(tp=2).resolve(3)
    with pytest.raises(ConfigError, match="needs 4 processes, but the world size is 2"):
        ParallelConfig(tp=2, dp=2).resolve(2)
    assert ParallelConfig(tp=2, pp=2).resolve(8).dp == 2
    with pytest.raises(ConfigError, match="must be >= 1"):
        ParallelConfig(tp=0)


def test_unsupported_architecture_is_named() -> None:
    class Cfg:
        model_type = "gpt2"

    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        ModelDims.from_hf_config(Cfg())


@pytest.mark.parametrize("key", OUT_OF_VOCAB_IDS)
def test_special_token_ids_outside_the_vocabulary_are_refused(key: str) -> None:
    # before: the pad id was dropped silently (no padding_idx) and the others built; both engines read model_dims
    for head in ("lm", "value"):
        with pytest.raises(ConfigError, match=rf"config.json sets {key} = .*not in \[0, 128\)"):
            model_dims(out_of_vocab_model(key), head)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", OUT_OF_VOCAB_FILES)
def test_tokenizer_and_generation_config_ids_outside_the_vocabulary_are_refused(name: str) -> None:
    # config.json is right; the tokenizer's EOS (id 128) or generation_config.json's EOS list is not
    file, key, _ = OUT_OF_VOCAB_FILES[name]
    for head in ("lm", "value"):
        with pytest.raises(ConfigError, match=rf"{file} sets {key} = .*not in \[0, 128\)"):
            model_dims(out_of_vocab_file_model(name), head)  # type: ignore[arg-type]


def _missing_config(tmp: Path) -> Path:
    (tmp / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp


def _unreadable_config(tmp: Path) -> Path:
    (tmp / "config.json").write_text("{not json")
    return tmp


# each folder a megatron engine refuses, and the fragment its refusal names
_BAD_FOLDERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "config-pad-id": (lambda _: out_of_vocab_model("pad_token_id"), "config.json sets pad_token_id = 128"),
    "tokenizer-eos": (lambda _: out_of_vocab_file_model("tokenizer-eos"), "tokenizer_config.json sets eos_token"),
    "generation-eos": (lambda _: out_of_vocab_file_model("generation-eos"), "generation_config.json sets eos_token_id"),
    "family": (lambda _: absolute_position_model(), "model_type='gpt2'"),
    "rope-scaling": (lambda _: rope_scaled_model("linear"), "only default RoPE is supported"),
    "no-config": (_missing_config, "cannot read the config of model folder"),
    "bad-json": (_unreadable_config, "cannot read the config of model folder"),
}


@pytest.mark.parametrize("role", ["actor", "critic", "rollout"])
@pytest.mark.parametrize("folder", _BAD_FOLDERS)
def test_bad_folders_are_refused_before_any_process_group(
    role: str, folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every refusal of a folder comes before init_distributed / rollout_groups: no process group is set up
    import verl_megatron.rollout as rollout
    import verl_megatron.training as training

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group was set up before the model folder was refused")

    monkeypatch.setattr(training, "init_distributed", never)
    monkeypatch.setattr(rollout, "rollout_groups", never)
    make, fragment = _BAD_FOLDERS[folder]
    path = make(tmp_path)
    assert not torch.distributed.is_initialized()
    build = rollout.MegatronRolloutEngine if role == "rollout" else training.MegatronTrainingEngine
    with pytest.raises(ConfigError, match=fragment) as info:
        build(EngineSpec(str(path), role, device="cpu"))  # type: ignore[arg-type]
    assert str(path) in str(info.value)
    assert not torch.distributed.is_initialized()


def test_plugin_is_import_light_and_cpu_shims_do_nothing_with_cuda() -> None:
    # One fresh interpreter for both checks (each needs a process that never imported megatron).
    code = textwrap.dedent(
        """
        import sys, torch
        from verl_megatron.plugin import verl_backend
        from verl_core import PROTOCOL_VERSION
        spec = verl_backend()
        assert spec.name == "megatron" and spec.protocol_version == PROTOCOL_VERSION
        assert set(spec.roles) == {"actor", "reference", "critic", "rollout"}
        assert spec.capabilities["rollout"].tensor_parallel and not spec.capabilities["rollout"].pipeline_parallel
        assert spec.capabilities["critic"].values and not spec.capabilities["actor"].values
        assert spec.capabilities["actor"].tensor_parallel and spec.capabilities["actor"].pipeline_parallel
        from verl_core.kernel.registry import import_string
        import_string(spec.config_class)(attention="local")
        assert not any(m.startswith("megatron") for m in sys.modules), "the plugin imported megatron"

        torch.cuda.is_available = lambda: True
        original = torch.cuda.current_device
        from verl_megatron.cpu_shims import apply_cpu_shims, cpu_shims_active
        assert apply_cpu_shims() is False
        assert torch.cuda.current_device is original and not cpu_shims_active()
        assert not any(m.startswith("megatron") for m in sys.modules), "the shims imported megatron"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
