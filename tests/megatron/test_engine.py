"""The Megatron training engine at TP=1, TP=2, PP=2 and TP2xPP2 against each other and the float64 reference.

Each layout is one torchrun launch of ``engine_checks.py`` (several models and checks per launch,
since a launch costs seconds); the comparisons run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import BASE, CROSS_LOADS, NOT_ACTORS, RUNS
from safetensors.torch import load_file

from verl_conformance.testkit import TinyModelSpec, assert_close, tiny_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LAYOUTS = list(RUNS)
PAIRS = [(lay, name) for lay, names in RUNS.items() if lay != BASE for name in names if name not in NOT_ACTORS]


def _id(layout: tuple[int, int, int]) -> str:
    return "tp{}pp{}dp{}".format(*layout)


@pytest.fixture(scope="module")
def runs(megatron_launch: Any) -> dict[tuple[int, int, int], list[dict[str, Any]]]:
    """Each layout's launch of engine_checks.py (shared with test_reshard.py; see conftest.py)."""
    return {layout: megatron_launch(layout) for layout in LAYOUTS}


def _batch(arch: str) -> Any:
    import engine_checks

    for i, (a, _, temp) in enumerate(engine_checks.ACTORS):
        if a == arch:
            return engine_checks.actor_batch(i, temp)
    return engine_checks.actor_batch(7, 1.0)


def _path(arch: str) -> Path:
    import engine_checks

    if arch == "critic":
        return tiny_model(TinyModelSpec(arch="qwen2", head="value"))
    tied = {a: t for a, t, _ in engine_checks.ACTORS}[arch]
    return tiny_model(TinyModelSpec(arch=arch, tied=tied))


def _reference(arch: str) -> dict[str, Any]:
    """Outputs, loss and gradients of the engine_checks losses in float64 with transformers.

    Each sample runs alone without padding (positions 0..L-1), so no attention mask is involved.
    """
    import transformers

    path, batch = _path(arch), _batch(arch)
    critic = arch == "critic"
    auto = transformers.AutoModelForTokenClassification if critic else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager")
    n = max(int(batch["response_mask"].sum()), 1)
    shape = batch["response_mask"].shape
    outs = {k: torch.zeros(shape, dtype=torch.float64) for k in ("log_probs", "entropy", "values")}
    loss = torch.zeros((), dtype=torch.float64)
    for b in range(batch.batch_size):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b]]
        r = int(batch["response_mask"][b].sum())
        if r == 0:
            continue
        ids = torch.cat([prompt, batch["response_ids"][b, :r]]).unsqueeze(0)
        out = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + r - 1]
        if critic:
            values = out[:, 0]
            outs["values"][b, :r] = values.detach()
            loss = loss + 0.5 * ((values - batch["returns"][b, :r].double()) ** 2).sum() / n
        else:
            logp = torch.log_softmax(out / batch.meta.temperature, -1)
            lp = logp.gather(-1, batch["response_ids"][b, :r].unsqueeze(-1)).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
            outs["log_probs"][b, :r], outs["entropy"][b, :r] = lp.detach(), ent.detach()
            pg = -(lp * batch["advantages"][b, :r].double()).sum() / n
            loss = loss + pg - 0.01 * ent.sum() / n
    loss.backward()
    grads = {name: prm.grad.detach().clone() for name, prm in model.named_parameters() if prm.grad is not None}
    return {**outs, "loss": float(loss.detach()), "grads": grads}


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference(arch: str) -> dict[str, Any]:
    """:func:`_reference`, computed once per arch."""
    if arch not in _REFERENCE:
        _REFERENCE[arch] = _reference(arch)
    return _REFERENCE[arch]


ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_log_probs_and_entropy_match_float64_reference(runs: Any, arch: str) -> None:
    ref = reference(arch)
    got = runs[BASE][0][arch]
    assert_close(got["log_probs"], ref["log_probs"], dtype="float32", quantity="log_probs", what=f"{arch} log_probs")
    assert_close(got["entropy"], ref["entropy"], dtype="float32", quantity="entropy", what=f"{arch} entropy")


def test_bfloat16_reference_engine_matches_float64_reference(runs: Any) -> None:
    ref = reference("qwen2")
    assert_close(runs[BASE][0]["bf16"], ref["log_probs"].float(), dtype="bfloat16", quantity="log_probs")


def test_local_attention_spec_matches_float64_reference(runs: Any) -> None:
    ref, got = reference("qwen2"), runs[BASE][0]["local_attention"]
    assert_close(got["log_probs"], ref["log_probs"], dtype="float32", quantity="log_probs")
    assert_close(got["entropy"], ref["entropy"], dtype="float32", quantity="entropy")


def test_critic_values_match_float64_reference(runs: Any) -> None:
    ref = reference("critic")
    assert_close(runs[BASE][0]["critic"]["values"], ref["values"], dtype="float32", quantity="values")


@pytest.mark.parametrize(("layout", "arch"), PAIRS, ids=[f"{_id(a)}-{n}" for a, n in PAIRS])
def test_parallel_layouts_match_tp1(runs: Any, layout: tuple[int, int, int], arch: str) -> None:
    base = runs[BASE][0][arch]
    fields = ("values",) if arch == "critic" else ("log_probs", "entropy")
    for rank, res in enumerate(runs[layout]):
        got = res[arch]
        for f in fields:
            assert_close(got[f], base[f], dtype="float32", quantity=f, what=f"{arch} {f} rank {rank} {layout}")
        assert got["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6)
        for name, g in base["grads"].items():
            assert_close(got["grads"][name], g, dtype="float32", quantity="grad", what=f"{arch} grad {name} {layout}")
        if arch != "critic":
            assert got["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)
            # micro_batch_size=2: 5 samples -> 3 micro-batches; dp=2 -> shards of 3 and 2 -> 2 each
            assert got["num_micro_batches"] == (3 if layout[2] == 1 else 2)
            # Adam's first step is ~lr * sign(grad): compare the updates by relative L2 error.
            initial = load_file(str(_path(arch) / "model.safetensors"))
            for name, w in base["after"].items():
                assert_close(got["after"][name] - initial[name], w - initial[name], dtype="float32",
                             quantity="grad", what=f"{arch} {name} update")


@pytest.mark.parametrize("arch", [*ARCHS, "critic"])
def test_gradients_match_float64_transformers(runs: Any, arch: str) -> None:
    ref = reference(arch)
    loss, grads = ref["loss"], ref["grads"]
    got = runs[BASE][0][arch]
    assert got["loss"] == pytest.approx(loss, rel=1e-4, abs=5e-5)
    assert set(got["grads"]) in (set(grads), set(grads) - {"lm_head.weight"})
    for name, g in got["grads"].items():
        assert_close(g, grads[name], dtype="float32", quantity="grad", what=f"{arch} grad {name}")
    if arch != "critic":
        ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        assert got["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        assert not got["skipped"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_export_weights_gives_back_the_transformers_weights(runs: Any, layout: tuple[int, int, int]) -> None:
    for arch in RUNS[layout]:
        if arch in NOT_ACTORS:
            continue
        hf = load_file(str(_path(arch) / "model.safetensors"))
        for rank, res in enumerate(runs[layout]):
            exported = res[arch]["export"]
            assert set(exported) == set(hf) - {"lm_head.weight"} or set(exported) == set(hf)
            for name, t in exported.items():
                assert torch.equal(t, hf[name]), f"{arch} {name} differs after export (rank {rank}, {layout})"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_checkpoint_round_trip_is_exact(runs: Any, layout: tuple[int, int, int]) -> None:
    res = runs[layout][0][RUNS[layout][0]]
    before, after = res["ckpt_lp"]
    assert torch.equal(before, after)
    assert res["ckpt_step"] == 1
    original, restored = res["ckpt_after2"]
    for name, t in original.items():
        assert torch.equal(t, restored[name]), f"{name} differs after a step from the restored checkpoint"


@pytest.mark.parametrize("saved_at", list(CROSS_LOADS), ids=_id)
def test_checkpoint_saved_at_another_layout_loads_at_tp1(runs: Any, saved_at: tuple[int, int, int]) -> None:
    arch = CROSS_LOADS[saved_at]
    saver = runs[saved_at][0][arch]
    loaded = runs[BASE][0][f"loaded:{arch}"]
    assert loaded["step"] == 2
    # log-probs after the first step, at the saving layout and restored at TP=1
    assert_close(loaded["log_probs"], saver["ckpt_lp"][0], dtype="float32", quantity="log_probs")
    first = saver["after"]
    for name, w in saver["ckpt_after2"][0].items():
        assert_close(loaded["after2"][name] - first[name], w - first[name], dtype="float32",
                     quantity="grad", what=f"{arch} {name} second update")


def test_update_changed_the_weights(runs: Any) -> None:
    res = runs[BASE][0]["llama"]
    hf = load_file(str(_path("llama") / "model.safetensors"))
    moved = max(float((res["after"][n] - hf[n]).abs().max()) for n in hf)
    assert moved > 1e-3



def test_bad_inputs_and_configs_are_rejected_with_clear_errors(runs: Any) -> None:
    errors = runs[BASE][0]["errors"]
    assert errors["nan"].startswith("NonFiniteError") and "advantages" in errors["nan"]
    assert errors["vocab"].startswith("BatchValidationError") and "response_ids" in errors["vocab"]
    assert errors["values_on_actor"].startswith("ConfigError") and "critic" in errors["values_on_actor"]
    assert errors["missing"].startswith("BatchValidationError") and "response_mask" in errors["missing"]
    assert errors["world"].startswith("ConfigError") and "world size is 1" in errors["world"]
    assert errors["option"].startswith("ConfigError") and "bogus" in errors["option"]
    assert errors["gc"].startswith("ConfigError") and "gradient_checkpointing" in errors["gc"]
    assert errors["fp16"].startswith("ConfigError") and "dtype='float16'" in errors["fp16"]
    assert errors["unchanged"] == "yes"


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_copied(runs: Any) -> None:
    loads = runs[BASE][0]["errors"]["checkpoint"]
    for case in ("shape", "dtype", "missing"):
        assert loads[case].startswith("CheckpointError: checkpoint ") and "-refused-" + case in loads[case], loads[case]
    assert ("model tensor 'decoder.final_layernorm.weight' is saved with shape (1,) dtype float32, this engine "
            "expects shape (128,) dtype float32") in loads["shape"]  # (1,) would broadcast into (128,)
    assert ("'decoder.layers.0.mlp.linear_fc2.weight' is saved with shape (128, 128) dtype float64, this engine "
            "expects shape (128, 128) dtype float32") in loads["dtype"]
    assert "missing 1 model tensors ('decoder.layers.1.self_attention.linear_qkv.weight')" in loads["missing"]
    assert loads["unchanged"], "a refused load changed the engine's weights, Adam moments or step"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims apply only without CUDA")
def test_cpu_shims_are_active_without_cuda(runs: Any) -> None:
    assert runs[BASE][0]["errors"]["shims"] == "yes"


ROLLOUT_LAYOUTS = [lay for lay, names in RUNS.items() if "rollout" in names]


@pytest.mark.parametrize("layout", ROLLOUT_LAYOUTS, ids=_id)
def test_rollout_schema_seeding_and_log_probs(runs: Any, layout: tuple[int, int, int]) -> None:
    res = runs[layout][0]["rollout"]
    first = res["first"]
    ids, mask, lp = first["response_ids"], first["response_mask"], first["rollout_log_probs"]
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool and lp.dtype == torch.float32
    assert ids.shape[0] == 6 and first["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert first["sample_index"].tolist() == [0, 1, 0, 1, 0, 1]
    assert bool(mask[:, 0].all())
    assert bool((ids[~mask] == 0).all()) and bool((lp[~mask] == 0).all())
    # a response is truncated exactly when it has no EOS (id 1) and fills max_new_tokens
    eos = ((ids == 1) & mask).any(1)
    assert first["truncated"].tolist() == (~eos & (mask.sum(1) == 6)).tolist()
    assert torch.equal(res["again_ids"], ids)
    # prompts in reverse order: samples follow their (group id, sample index), not the batch position
    reordered = res["reordered_ids"].view(3, 2, -1).flip(0).reshape(6, -1)
    width = min(reordered.shape[1], ids.shape[1])
    assert torch.equal(reordered[:, :width], ids[:, :width])
    assert res["temperature"] == pytest.approx(0.8)
    assert_close(lp, res["train_lp"], dtype="float32", quantity="log_probs", what="rollout vs training log-probs")
    # after one update and a weight sync the rollout engine serves the new weights
    assert res["synced_version"] == 1
    assert_close(res["synced_rollout_lp"], res["synced_train_lp"], dtype="float32", quantity="log_probs",
                 what="log-probs after weight sync")
    for rank_res in runs[layout][1:]:
        assert torch.equal(rank_res["rollout"]["first"]["response_ids"], ids), "TP ranks sampled differently"


@pytest.mark.parametrize("layout", ROLLOUT_LAYOUTS, ids=_id)
def test_rollout_kv_cache_samples_what_recomputing_samples(runs: Any, layout: tuple[int, int, int]) -> None:
    res = runs[layout][0]["rollout"]
    cached, plain = res["first"], res["recompute"]
    assert torch.equal(cached["response_ids"], plain["response_ids"])
    assert torch.equal(cached["response_mask"], plain["response_mask"])
    assert_close(cached["rollout_log_probs"], plain["rollout_log_probs"], dtype="float32", quantity="log_probs",
                 what="KV-cached vs recomputed rollout log-probs")


@pytest.mark.parametrize("layout", ROLLOUT_LAYOUTS, ids=_id)
def test_rollout_static_decode_loop_samples_what_megatron_s_kv_cache_samples(
    runs: Any, layout: tuple[int, int, int]
) -> None:
    res = runs[layout][0]["rollout"]
    cached, static = res["first"], res["static"]
    assert torch.equal(static["response_ids"], cached["response_ids"])
    assert torch.equal(static["response_mask"], cached["response_mask"])
    assert_close(static["rollout_log_probs"], cached["rollout_log_probs"], dtype="float32", quantity="log_probs",
                 what="static decode loop vs Megatron's KV cache")
    assert torch.equal(res["static_again_ids"], static["response_ids"]), "a reused static decoder sampled differently"
    assert torch.equal(res["static_greedy_ids"], res["greedy_ids"])
    assert res["static_windows"] == (34, 38) and res["static_mode"] == "static+windows"
    lengths = res["stopped"]["response_mask"].sum(1)
    assert int(lengths.min()) < int(lengths.max()), f"the stop tokens must end rows at different steps: {lengths}"
    for field in ("response_ids", "response_mask"):
        assert torch.equal(res["static_stopped"][field], res["stopped"][field]), (
            f"{field}: the static loop differs from Megatron's KV cache once rows finish"
        )


@pytest.mark.parametrize("layout", [lay for lay in ROLLOUT_LAYOUTS if lay[0] == 2], ids=_id)
def test_rollout_compiled_decode_step_samples_what_the_eager_step_samples(
    runs: Any, layout: tuple[int, int, int]
) -> None:
    res = runs[layout][0]["rollout"]
    static, compiled = res["static"], res["compiled"]
    assert compiled is not None and compiled["mode"] == "static+compile+windows"
    assert torch.equal(compiled["response_ids"], static["response_ids"])
    assert torch.equal(compiled["response_mask"], static["response_mask"])
    assert_close(compiled["rollout_log_probs"], static["rollout_log_probs"], dtype="float32", quantity="log_probs",
                 what="compiled vs eager static decode step")


def test_rollout_greedy_matches_across_layouts_and_reference(runs: Any) -> None:
    import transformers

    base = runs[BASE][0]["rollout"]
    for layout in ROLLOUT_LAYOUTS:
        assert torch.equal(runs[layout][0]["rollout"]["greedy_ids"], base["greedy_ids"]), _id(layout)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model(TinyModelSpec(arch="qwen3"))), dtype=torch.float64, attn_implementation="eager")
    from verl_conformance.testkit import random_batch

    prompts = random_batch(batch_size=3, max_prompt=6, max_response=1, seed=11)
    for b in range(3):
        ids = prompts["prompt_ids"][b][prompts["prompt_mask"][b]].unsqueeze(0)
        n = int(base["greedy_mask"][b].sum())
        expected = []
        with torch.no_grad():
            for _ in range(n):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                expected.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert base["greedy_ids"][b, :n].tolist() == expected


@pytest.mark.parametrize(("options", "message"), [
    ({"rollout_cuda_graphs": True, "rollout_static_cache": False}, "rollout_cuda_graphs needs rollout_static_cache=True"),
    ({"rollout_compile": True, "rollout_static_cache": False}, "rollout_compile compiles the static decode step"),
    ({"rollout_compile": True, "attention": "local"}, "rollout_compile compiles the static decode step"),
    ({"rollout_static_cache": True, "attention": "local"}, "needs attention='sdpa'"),
    ({"rollout_static_cache": True, "rollout_compile": "yes"}, "'megatron.rollout_compile': expected true or false, got 'yes'"),
])
def test_unsupported_rollout_options_are_rejected(options: dict[str, Any], message: str) -> None:
    from verl_core import ConfigError
    from verl_megatron.options import MegatronOptions

    with pytest.raises(ConfigError, match=message):
        MegatronOptions(**options)
