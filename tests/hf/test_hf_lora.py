"""LoRA on the hf engines (EngineSpec.lora, through peft): what trains, the numbers, syncs, checkpoints."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hf_helpers import actor_spec, flat_grads, model_path
from safetensors.torch import load_file

from verl_conformance.harness import collect_stream
from verl_conformance.testkit import (
    TinyModelSpec,
    assert_close,
    random_batch,
    reference_forward,
    tiny_model,
)
from verl_conformance.testkit.lora import (
    LORA_ALPHA,
    LORA_RANK,
    lora_adapter,
    lora_spec,
    merged_model,
)
from verl_core import (
    CheckpointError,
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LoraSpec,
    OptimConfig,
    SamplingParams,
    StreamWeightSync,
    TensorBatch,
    WeightChunk,
    get_backend,
    get_training_engine,
)
from verl_core.algorithms import Algorithm
from verl_core.enginekit.lora import LORA_A, LORA_B
from verl_hf.rollout import HFDirectSync, HFRolloutEngine
from verl_hf.training import HFTrainingEngine

LOSS = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
LORA = LoraSpec(rank=4, alpha=8.0)


def _batch(seed: int, size: int = 4) -> TensorBatch:
    return random_batch(batch_size=size, max_prompt=6, max_response=6, seed=seed, with_rl_fields=True).select(
        "prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "old_log_probs", "advantages")


def _train(engine: HFTrainingEngine, seed: int) -> None:
    b = _batch(seed)
    b = b.update(old_log_probs=engine.forward(b)["log_probs"])
    engine.forward_backward(b, LOSS, GlobalBatchStats.of(b))
    assert not engine.optimizer_step().skipped


def _adapter(engine: HFTrainingEngine) -> dict[str, torch.Tensor]:
    return collect_stream(engine.export_adapter())[1]


def _merged(engine: HFTrainingEngine) -> dict[str, torch.Tensor]:
    return collect_stream(engine.export_weights())[1]


def _rollout(path: str, **kw: object) -> HFRolloutEngine:
    return HFRolloutEngine(EngineSpec(model_path=path, role="rollout", max_prompt_len=64, max_response_len=64,
                                      **kw))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- what trains
def test_only_the_adapter_trains_and_the_base_keeps_its_dtype() -> None:
    engine = HFTrainingEngine(actor_spec(model_path(), dtype="bfloat16", lora=LORA))
    trained = {n: p for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), sorted(trained)[:4]
    assert all(p.dtype == torch.float32 for p in trained.values())  # peft keeps adapters in float32
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    # 2 layers x 7 projections, A and B each
    assert len(trained) == 2 * 7 * 2
    _train(engine, 0)
    state = engine._optimizer.state  # type: ignore[union-attr]
    optimized = {id(p) for group in engine._optimizer.param_groups for p in group["params"]}  # type: ignore[union-attr]
    assert optimized == {id(p) for p in trained.values()}  # no masters: the adapters are float32 already
    assert len(state) == len(trained)
    assert all(p.grad is None for p in engine.model.parameters())


def test_bad_lora_specs_are_refused_before_any_step() -> None:
    with pytest.raises(ConfigError, match=r"LoraSpec.rank must be an integer >= 1 .*got 0"):
        LoraSpec(rank=0)
    with pytest.raises(ConfigError, match=r"LoraSpec.rank must be an integer >= 1 .*got -2"):
        LoraSpec(rank=-2)
    with pytest.raises(ConfigError, match=r"pattern 'qproj' matches no linear module of this LlamaForCausalLM; "
                                          r"its linear modules end with \['q_proj', 'k_proj'"):
        HFTrainingEngine(actor_spec(model_path(), lora=LoraSpec(targets=("q_proj", "qproj"))))
    with pytest.raises(ConfigError, match=r"pattern 'embed_tokens' matches no linear module.*not linear layers: "
                                          r"train them with LoraSpec.full"):
        HFTrainingEngine(actor_spec(model_path(), lora=LoraSpec(targets=("embed_tokens",))))
    with pytest.raises(ConfigError, match=r"LoraSpec.full: pattern 'embeddings' matches no module"):
        HFTrainingEngine(actor_spec(model_path(), lora=LoraSpec(full=("embeddings",))))
    with pytest.raises(ConfigError, match="trains LoRA adapters for the actor, not the critic"):
        HFTrainingEngine(actor_spec(model_path(head="value"), role="critic", lora=LORA))


def test_a_backend_that_does_not_declare_lora_is_refused_by_the_registry() -> None:
    assert get_backend("hf").capabilities("actor").lora  # type: ignore[union-attr]
    assert get_backend("megatron").capabilities("actor").lora is False  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"backend 'example' does not train LoRA adapters for role 'actor' "
                                          r"\(capabilities.lora is False\)"):
        get_training_engine("example", actor_spec(model_path(), lora=LORA))


def test_regex_targets_pick_modules_by_their_full_name() -> None:
    engine = HFTrainingEngine(actor_spec(model_path(), lora=LoraSpec(rank=2, targets=(r"model\.layers\.1\..*_proj",))))
    names = sorted({n.rsplit(".lora_", 1)[0] for n in _adapter(engine)})
    assert names == sorted(f"model.layers.1.{m}" for m in (
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
        "self_attn.q_proj", "self_attn.v_proj"))


# ---------------------------------------------------------------------------- numbers
def test_adapted_forward_equals_the_float64_merged_model() -> None:
    """Nonzero A and B (a crafted adapter): the forward is the reference of W + alpha / rank * B A."""
    engine = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec()))
    batch = _batch(3, size=5)
    got = engine.forward(batch, ["log_probs", "entropy"])
    ref = reference_forward(str(merged_model()), batch, ("log_probs", "entropy"))
    base = reference_forward(model_path(), batch, ("log_probs",))
    mask = batch["response_mask"]
    assert float((ref["log_probs"] - base["log_probs"]).abs()[mask].max()) > 1e-2  # the adapter matters
    assert_close(got["log_probs"], ref["log_probs"], dtype="float32", quantity="log_probs")
    assert_close(got["entropy"], ref["entropy"], dtype="float32", quantity="entropy")


def test_base_forward_is_the_base_model_and_never_changes() -> None:
    engine = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec()))
    batch = _batch(4)
    before = engine.base_forward(batch)["log_probs"]
    assert_close(before, reference_forward(model_path(), batch, ("log_probs",))["log_probs"], dtype="float32",
                 quantity="log_probs")
    adapted = engine.forward(batch)["log_probs"]
    _train(engine, 0)
    _train(engine, 1)
    assert torch.equal(engine.base_forward(batch)["log_probs"], before)  # the base is bit-unchanged
    assert not torch.equal(engine.forward(batch)["log_probs"], adapted)  # the adapter moved
    folder = load_file(f"{model_path()}/model.safetensors")
    merged = _merged(engine)
    adapter = _adapter(engine)
    scale = LORA_ALPHA / LORA_RANK
    for name, w in folder.items():
        module = name.removesuffix(".weight")
        if module + LORA_A in adapter:
            want = w.double() + scale * adapter[module + LORA_B].double() @ adapter[module + LORA_A].double()
            assert torch.allclose(merged[name].double(), want, atol=1e-6), name
        else:
            assert torch.equal(merged[name], w), name  # every other tensor is the base's, bit for bit


def test_an_engine_without_lora_refuses_base_forward_and_export_adapter() -> None:
    engine = HFTrainingEngine(actor_spec(model_path()))
    with pytest.raises(ConfigError, match="trains no LoRA adapter"):
        engine.base_forward(_batch(0))
    with pytest.raises(ConfigError, match="trains no LoRA adapter"):
        engine.export_adapter()


def test_base_and_adapted_forwards_on_two_threads_do_not_mix() -> None:
    """The trainer runs the reference (base) and actor forwards concurrently: each must see its own model."""
    engine = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec()))
    batch = _batch(5)
    want_base = engine.base_forward(batch)["log_probs"]
    want = engine.forward(batch)["log_probs"]
    assert not torch.equal(want, want_base)
    bad: list[str] = []

    def run(base: bool) -> None:
        for _ in range(15):
            got = (engine.base_forward if base else engine.forward)(batch)["log_probs"]
            if not torch.equal(got, want_base if base else want):
                bad.append("base" if base else "adapted")

    threads = [threading.Thread(target=run, args=(b,)) for b in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_tied_model_trains_its_embedding_fully_and_stays_tied() -> None:
    path = model_path(tied=True)
    engine = HFTrainingEngine(actor_spec(path, optim=OptimConfig(lr=1e-2, grad_clip=0.0),
                                         lora=LoraSpec(rank=2, targets=("q_proj",), full=("embed_tokens",))))
    names = set(_adapter(engine))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    _train(engine, 0)
    merged = _merged(engine)
    assert "lm_head.weight" not in merged  # a tied stream: the receiver ties lm_head to the embedding
    assert torch.equal(merged["model.embed_tokens.weight"], _adapter(engine)["model.embed_tokens.weight"])
    assert not torch.equal(merged["model.embed_tokens.weight"],
                           load_file(f"{path}/model.safetensors")["model.embed_tokens.weight"])
    # the trained embedding is also the output projection: a rollout of the merged weights agrees
    batch = _batch(6)
    rollout = _rollout(path)
    StreamWeightSync().sync(engine, rollout, version=1)
    out = rollout.generate(batch.select("prompt_ids", "prompt_mask", "group_ids"), SamplingParams(max_new_tokens=5, seed=1))
    again = engine.forward(out.select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids"))
    assert_close(out["rollout_log_probs"], again["log_probs"], dtype="float32", quantity="log_probs")


# ---------------------------------------------------------------------------- weight sync
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_and_merged_syncs_serve_the_trained_policy(dtype: str) -> None:
    path = model_path()
    engine = HFTrainingEngine(actor_spec(path, dtype=dtype, lora=LORA, optim=OptimConfig(lr=1e-2, grad_clip=0.0)))
    _train(engine, 0)
    _train(engine, 1)
    merged_rollout = _rollout(path, dtype=dtype)
    adapter_rollout = _rollout(path, dtype=dtype, lora=LORA)
    sync = HFDirectSync()
    m = sync.sync(engine, merged_rollout, version=2)
    a = sync.sync(engine, adapter_rollout, version=2)
    assert (m.version, a.version) == (2, 2) and merged_rollout.weight_version == adapter_rollout.weight_version == 2
    assert a.bytes < m.bytes / 3  # the adapter only: rank 4 of 64-wide projections
    prompts = _batch(7, size=6).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(max_new_tokens=6, seed=5, n=2)
    out_m = merged_rollout.generate(prompts, params)
    out_a = adapter_rollout.generate(prompts, params)
    actor = engine.forward(out_a.select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids"))
    assert_close(out_a["rollout_log_probs"], actor["log_probs"], dtype=dtype, quantity="log_probs")
    if dtype == "float32":  # bfloat16 rounds the merged weights: the two may then sample apart
        assert torch.equal(out_m["response_ids"], out_a["response_ids"])
        assert_close(out_m["rollout_log_probs"], out_a["rollout_log_probs"], dtype=dtype, quantity="log_probs")


@pytest.mark.parametrize("tied", [False, True])
def test_a_colocated_adapter_rollout_serves_the_actor_s_base_instead_of_a_copy(tied: bool) -> None:
    """Item 2 of LoRA: the rollout shares the actor's frozen base (one copy) and samples exactly as
    a rollout holding its own copy, before and after updates; sleep never moves the actor's base."""
    import gc
    import weakref

    path = model_path(tied=tied)
    lora = LoraSpec(rank=2, targets=("q_proj", "v_proj"), full=("embed_tokens",) if tied else ())
    engine = HFTrainingEngine(actor_spec(path, lora=lora, optim=OptimConfig(lr=1e-2, grad_clip=0.0)))
    shared, own = _rollout(path, lora=lora), _rollout(path, lora=lora)
    frozen = {n: p for n, p in engine.model.named_parameters() if not p.requires_grad}
    base_bytes = sum(p.numel() * p.element_size() for n, p in frozen.items())
    old = weakref.ref(dict(shared.model.named_parameters())["model.layers.0.mlp.up_proj.weight"])
    HFDirectSync().sync(engine, shared, version=0)  # the trainer's first sync, before any rollout
    StreamWeightSync().sync(engine, own, version=0)
    assert shared.shares_base and not own.shares_base
    mine = dict(shared.model.named_parameters())
    assert all(mine[n] is p for n, p in frozen.items())  # one copy: the actor's tensors themselves
    assert not any(mine[n] is p for n, p in engine.model.named_parameters() if p.requires_grad)
    gc.collect()
    assert old() is None  # the rollout's own copy is gone
    assert shared.share_base(engine) == 0  # idempotent
    prompts = _batch(7, size=6).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(max_new_tokens=6, seed=5, n=2)
    for version in (1, 2):
        a, b = shared.generate(prompts, params), own.generate(prompts, params)
        assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["rollout_log_probs"],
                                                                                 b["rollout_log_probs"])
        _train(engine, version)
        shared.sleep()
        shared.wake()
        HFDirectSync().sync(engine, shared, version=version)
        StreamWeightSync().sync(engine, own, version=version)
    assert all(mine[n] is p for n, p in frozen.items()) and base_bytes > 0
    folder = load_file(f"{path}/model.safetensors")
    assert torch.equal(frozen["model.layers.0.self_attn.q_proj.base_layer.weight"],
                       folder["model.layers.0.self_attn.q_proj.weight"])  # the base never changed
    # another base: nothing is shared
    other = _rollout(model_path(arch="qwen3"), lora=lora)
    assert other.share_base(engine) == 0 and not other.shares_base


def test_an_adapter_stream_into_a_full_weight_rollout_is_refused_and_leaves_it_stale() -> None:
    from verl_core import StaleWeightsError, WeightSyncError

    engine = HFTrainingEngine(actor_spec(model_path(), lora=LORA))
    rollout = _rollout(model_path())
    with pytest.raises(WeightSyncError, match="weight manifest does not match"):
        rollout.update_weights(engine.export_adapter())
    with pytest.raises(StaleWeightsError):
        rollout.generate(_batch(0).select("prompt_ids", "prompt_mask", "group_ids"), SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_continues_exactly(tmp_path: Path) -> None:
    spec = actor_spec(model_path(), lora=LORA, optim=OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10,
                                                                  schedule="cosine"))
    a = HFTrainingEngine(spec)
    _train(a, 0)
    a.save_checkpoint(tmp_path / "ck")
    files = sorted(p.name for p in next((tmp_path / "ck").glob("state-*")).iterdir())
    saved = load_file(str(next((tmp_path / "ck").glob("state-*")) / "model.safetensors"))
    assert set(saved) == set(_adapter(a))  # the adapter only, not the frozen base
    assert files == ["model.safetensors", "rng_rank0.pt", "trainer_state.pt"]
    _train(a, 1)
    _train(a, 2)
    b = HFTrainingEngine(spec)
    b.load_checkpoint(tmp_path / "ck")
    _train(b, 1)
    _train(b, 2)
    for name, t in _adapter(a).items():
        assert torch.equal(t, _adapter(b)[name]), name


def test_a_checkpoint_on_another_base_or_of_another_kind_is_refused(tmp_path: Path) -> None:
    a = HFTrainingEngine(actor_spec(model_path(), lora=LORA))
    _train(a, 0)
    a.save_checkpoint(tmp_path / "lora")
    other = HFTrainingEngine(actor_spec(str(tiny_model(TinyModelSpec(seed=1))), lora=LORA))  # same shapes
    before = _adapter(other)
    with pytest.raises(CheckpointError, match=r"its adapter was trained on another base model .*resume with the "
                                              r"model folder the run trained from"):
        other.load_checkpoint(tmp_path / "lora")
    assert all(torch.equal(t, _adapter(other)[n]) for n, t in before.items())  # nothing was restored
    full = HFTrainingEngine(actor_spec(model_path()))
    with pytest.raises(CheckpointError, match="holds a LoRA adapter .* but this engine trains full weights"):
        full.load_checkpoint(tmp_path / "lora")
    full.save_checkpoint(tmp_path / "full")
    with pytest.raises(CheckpointError, match="holds full weights, but this engine trains a LoRA adapter"):
        a.load_checkpoint(tmp_path / "full")
    wider = HFTrainingEngine(actor_spec(model_path(), lora=LoraSpec(rank=8, alpha=8.0)))
    with pytest.raises(CheckpointError, match="its adapter has rank 4, this engine's 8"):
        wider.load_checkpoint(tmp_path / "lora")


def test_init_path_starts_from_a_peft_folder_and_refuses_another_rank() -> None:
    engine = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec()))
    folder = load_file(f"{lora_adapter()}/adapter_model.safetensors")
    got = _adapter(engine)
    assert set(got) == {n.removeprefix("base_model.model.") for n in folder}
    assert all(torch.equal(got[n.removeprefix("base_model.model.")], t) for n, t in folder.items())
    with pytest.raises(ConfigError, match=r"has rank 4 and alpha 8.0; the spec asks for rank 8"):
        HFTrainingEngine(actor_spec(model_path(), lora=LoraSpec(rank=8, alpha=8.0, init_path=str(lora_adapter()))))


def test_the_merged_stream_keeps_no_second_copy_of_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each target is merged when the stream reaches it and freed once its chunk has been consumed:
    at most one fusion group (q/k/v: three tensors) of merged weights is alive at a time."""
    import weakref

    import verl_hf.lora

    merged: list[weakref.ref[torch.Tensor]] = []
    merge = verl_hf.lora.merge_lora

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        out = merge(*args, **kwargs)  # type: ignore[arg-type]
        merged.append(weakref.ref(out))
        return out

    monkeypatch.setattr(verl_hf.lora, "merge_lora", recording)
    engine = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec()))
    most = 0
    for msg in engine.export_weights(bucket_bytes=1):  # one fusion group per chunk
        if isinstance(msg, WeightChunk):
            most = max(most, sum(r() is not None for r in merged))
        del msg
    assert len(merged) == 2 * 7  # every target of the 2 layers was merged
    assert most <= 3, f"{most} merged tensors alive at once"
    assert all(r() is None for r in merged)


@pytest.mark.parametrize("option", ["gradient_checkpointing", "pack_sequences"])
def test_gradient_checkpointing_and_packing_change_no_lora_update(option: str) -> None:
    """The adapter's update is the same with activations recomputed, or with packed micro-batches."""
    kw: dict[str, object] = ({"gradient_checkpointing": True} if option == "gradient_checkpointing"
                             else {"options": {"pack_sequences": True}})
    plain = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec()))
    other = HFTrainingEngine(actor_spec(model_path(), lora=lora_spec(), **kw))
    assert other.packs_sequences == (option == "pack_sequences")
    batch = _batch(8, size=5)
    assert_close(other.forward(batch)["log_probs"], plain.forward(batch)["log_probs"], dtype="float32",
                 quantity="log_probs")
    b = _batch(9, size=5)
    b = b.update(old_log_probs=plain.forward(b)["log_probs"])
    for engine in (plain, other):
        engine.forward_backward(b, LOSS, GlobalBatchStats.of(b))
    want = flat_grads(plain.model)
    assert float(want.abs().max()) > 0
    assert_close(flat_grads(other.model), want, dtype="float32", quantity="grad")
