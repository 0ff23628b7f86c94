"""The hf rollout engine's static-cache decode and its weight-update fast path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hf_helpers import actor_spec, model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import (
    ConfigError,
    EngineSpec,
    SamplingParams,
    StaleWeightsError,
    StreamWeightSync,
    TensorBatch,
    WeightChunk,
    WeightMessage,
    WeightSyncError,
)
from verl_core.enginekit.sampling import TokenSampler
from verl_hf.rollout import HFRolloutEngine, sample_seed
from verl_hf.rollout_decode import HFStaticDecoder
from verl_hf.training import HFTrainingEngine


def engine(arch: str = "llama", tied: bool = False, **options: Any) -> HFRolloutEngine:
    spec = EngineSpec(model_path=model_path(arch, tied), role="rollout", max_prompt_len=32, max_response_len=32,
                      options=options)
    return HFRolloutEngine(spec)


def prompts(batch_size: int, seed: int) -> TensorBatch:
    b = random_batch(batch_size=batch_size, max_prompt=8, max_response=1, seed=seed)
    return b.select("prompt_ids", "prompt_mask", "group_ids")


PARAMS = [
    SamplingParams(n=2, max_new_tokens=10, seed=1),
    SamplingParams(n=2, max_new_tokens=8, seed=2, temperature=0.7, top_k=20, top_p=0.9,
                   stop_token_ids=tuple(range(4, 14))),
    SamplingParams(max_new_tokens=9, greedy=True, temperature=1.3),
]


@pytest.mark.parametrize(("arch", "tied", "attn"), [("llama", False, "sdpa"), ("qwen3", True, "eager")])
def test_static_cache_gives_the_dynamic_samples(arch: str, tied: bool, attn: str) -> None:
    dynamic = engine(arch, tied, attn_implementation=attn)
    static = engine(arch, tied, attn_implementation=attn, rollout_cache="static")
    assert (dynamic.decode_mode, static.decode_mode) == ("dynamic", "static")
    p = prompts(4, seed=5)
    for params in PARAMS:
        a, b = dynamic.generate(p, params), static.generate(p, params)
        for field in ("response_ids", "response_mask", "truncated", "group_ids", "sample_index"):
            assert torch.equal(a[field], b[field]), f"{field} differs between the dynamic and static caches"
        assert_close(b["rollout_log_probs"], a["rollout_log_probs"], dtype="float32", quantity="log_probs")
    stops = SamplingParams(max_new_tokens=6, seed=0, stop_token_ids=tuple(range(dynamic.tokenizer.vocab_size)))
    one = static.generate(p, stops)
    assert one.response_len == 1 and bool(one["response_mask"].all()) and not bool(one["truncated"].any())


def test_static_rollout_log_probs_equal_the_trainer_s() -> None:
    path = model_path("qwen2", True)
    rollout = engine("qwen2", True, rollout_cache="static")
    out = rollout.generate(prompts(3, seed=4), PARAMS[1])
    lp = HFTrainingEngine(actor_spec(path)).forward(out, ["log_probs"])
    assert_close(out["rollout_log_probs"], lp["log_probs"], dtype="float32", quantity="log_probs")


def test_a_static_step_only_updates_tensors_in_place() -> None:
    """What a CUDA graph replay needs: every input and output of a step lives in the same tensors."""
    e = engine(rollout_cache="static")
    chunk = prompts(3, seed=2).repeat_interleave(1)
    seeds = [sample_seed(0, g, 0) for g in chunk["group_ids"].tolist()]
    params = SamplingParams(max_new_tokens=6, seed=0)
    sampler = TokenSampler(params, e.tokenizer.pad_token_id, torch.tensor([e.tokenizer.eos_token_id]),
                       e._uniforms(seeds, params))
    with torch.no_grad():
        rows, width = chunk["prompt_ids"].shape
        decoder = HFStaticDecoder(e.model, rows, width, sampler, 6, eager_attention=False, device=e.model.device)
        decoder.start(chunk, sampler.uniforms)
        before = {k: (v, v.data_ptr(), v.clone()) for k, v in vars(decoder).items() if isinstance(v, torch.Tensor)}
        decoder.step()
    after = {k: v for k, v in vars(decoder).items() if isinstance(v, torch.Tensor)}
    assert after.keys() == before.keys()
    for k, (obj, ptr, _) in before.items():
        assert after[k] is obj and after[k].data_ptr() == ptr, f"step replaced tensor {k}"
    changed = {k for k, (_, _, old) in before.items() if not torch.equal(after[k], old)}
    assert {"tok", "pos", "slot", "t", "out_tok", "out_mask", "out_lp"} <= changed


@pytest.mark.parametrize("check_every", [3, 8])
def test_checking_for_the_end_every_few_steps_gives_the_same_responses(check_every: int) -> None:
    """The GPU loop asks whether all rows finished only every few steps; extra steps are trimmed."""
    dynamic = engine()
    p = prompts(4, seed=6)
    stops = tuple(range(4, 40))
    params = SamplingParams(max_new_tokens=13, seed=4, stop_token_ids=stops)
    want = dynamic.generate(p, params)
    assert 1 < want.response_len < 13, "rows should finish early, at different steps"
    chunk = p.repeat_interleave(1).trim()
    seeds = [sample_seed(4, g, 0) for g in chunk["group_ids"].tolist()]
    stop_ids = torch.tensor(sorted({dynamic.tokenizer.eos_token_id, *stops}))
    sampler = TokenSampler(params, dynamic.tokenizer.pad_token_id, stop_ids, dynamic._uniforms(seeds, params))
    with torch.no_grad():
        rows, width = chunk["prompt_ids"].shape
        decoder = HFStaticDecoder(dynamic.model, rows, width, sampler, 13, eager_attention=False,
                                 device=dynamic.model.device)
        decoder.start(chunk, sampler.uniforms)
        decoder.run(check_every=check_every)
    ids, mask, lps, truncated = decoder.result()
    assert torch.equal(ids, want["response_ids"]) and torch.equal(mask, want["response_mask"])
    assert torch.equal(truncated, want["truncated"])
    assert_close(lps, want["rollout_log_probs"], dtype="float32", quantity="log_probs")


def test_the_static_decoder_is_reused_while_shapes_and_sampling_repeat() -> None:
    dynamic, static = engine(), engine(rollout_cache="static")
    params = SamplingParams(n=2, max_new_tokens=7, seed=3, top_k=30)
    outs = []
    for seed in (1, 2):  # same shapes (batch 3, prompt width 8), other prompts and seeds
        p = prompts(3, seed=seed)
        assert p.prompt_len == 8
        seeded = dataclasses.replace(params, seed=seed)
        got = static.generate(p, seeded)
        want = dynamic.generate(p, seeded)
        assert torch.equal(got["response_ids"], want["response_ids"])
        assert_close(got["rollout_log_probs"], want["rollout_log_probs"], dtype="float32", quantity="log_probs")
        outs.append((got, static._decoders.current))
    first, second = outs
    assert first[1] is not None and first[1] is second[1], "the second call reuses the decoder"
    again = dynamic.generate(prompts(3, seed=1), dataclasses.replace(params, seed=1))
    assert torch.equal(first[0]["response_ids"], again["response_ids"]), "a reused buffer overwrote an output"
    static.generate(prompts(2, seed=1), params)
    assert static._decoders.current is not None and static._decoders.current is not second[1]
    # Another sampling configuration builds a new decoder too, with the same samples as the dynamic cache.
    greedy = SamplingParams(max_new_tokens=5, greedy=True)
    assert torch.equal(static.generate(prompts(3, seed=1), greedy)["response_ids"],
                       dynamic.generate(prompts(3, seed=1), greedy)["response_ids"])


def test_uniform_table_equals_one_draw_per_step() -> None:
    e = engine()
    seeds = [sample_seed(3, g, s) for g, s in [(0, 0), (0, 1), (5, 0)]]
    table = e._uniforms(seeds, SamplingParams(max_new_tokens=7, seed=3))
    assert table is not None and table.shape == (3, 7)
    for row, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        steps = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for _ in range(7)])
        assert torch.equal(table[row], steps)


def test_decode_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="needs a static KV cache"):
        engine(rollout_cache="dynamic", rollout_cuda_graphs=True)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        engine(rollout_cuda_graphs=True)  # auto picks the static cache for it; graphs need CUDA
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        engine(rollout_cache="static", rollout_cuda_graphs=True)
    with pytest.raises(ConfigError, match="rollout_cache': 'paged' is not valid; choices: 'auto', 'dynamic', 'static'"):
        engine(rollout_cache="paged")


def test_auto_decode_mode_is_the_fast_path_on_cuda_only() -> None:
    from verl_hf.config import HFOptions

    cpu = HFOptions().resolve_rollout(torch.device("cpu"))
    assert (cpu.rollout_cache, cpu.rollout_cuda_graphs, cpu.rollout_compile) == ("dynamic", False, False)
    cuda = HFOptions().resolve_rollout(torch.device("cuda"))
    assert (cuda.rollout_cache, cuda.rollout_cuda_graphs, cuda.rollout_compile) == ("static", True, True)
    sliding = HFOptions().resolve_rollout(torch.device("cuda"), static_ok=False)
    assert (sliding.rollout_cache, sliding.rollout_cuda_graphs, sliding.rollout_compile) == ("dynamic", False, False)
    chosen = HFOptions(rollout_compile=False).resolve_rollout(torch.device("cuda"))
    assert (chosen.rollout_cache, chosen.rollout_cuda_graphs, chosen.rollout_compile) == ("static", True, False)
    assert engine().decode_mode == "dynamic"  # type: ignore[attr-defined]  # CPU default


def test_update_weights_copies_into_the_live_parameters() -> None:
    path = model_path("llama", True)
    rollout = engine("llama", True, rollout_cache="static")
    actor = HFTrainingEngine(actor_spec(path))
    with torch.no_grad():
        for p in actor.model.parameters():
            p.mul_(1.01)
    ptrs = {n: p.data_ptr() for n, p in rollout.model.named_parameters()}
    StreamWeightSync(bucket_bytes=20_000).sync(actor, rollout, version=4)
    assert rollout.weight_version == 4
    assert {n: p.data_ptr() for n, p in rollout.model.named_parameters()} == ptrs
    sent = dict(actor.model.named_parameters())
    for name, p in rollout.model.named_parameters():
        assert torch.equal(p, sent[name]), name
    out = rollout.generate(prompts(2, seed=1), SamplingParams(max_new_tokens=4, seed=0))
    lp = actor.forward(out, ["log_probs"])
    assert_close(out["rollout_log_probs"], lp["log_probs"], dtype="float32", quantity="log_probs")

    def poisoned() -> list[WeightMessage]:
        msgs = list(actor.export_weights(bucket_bytes=20_000))
        last = msgs[-2]
        assert isinstance(last, WeightChunk)
        name, t = last.tensors[-1]
        msgs[-2] = WeightChunk((*last.tensors[:-1], (name, t.clone().fill_(float("nan")))))
        return msgs

    with pytest.raises(WeightSyncError, match="NaN/inf"):
        rollout.update_weights(poisoned())
    with pytest.raises(StaleWeightsError):
        rollout.generate(prompts(1, seed=1), SamplingParams(max_new_tokens=2))
    StreamWeightSync().sync(actor, rollout, version=5)
    assert rollout.generate(prompts(1, seed=1), SamplingParams(max_new_tokens=2)).meta.weight_version == 5


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_decode_attention_equals_transformers_sdpa(groups: int) -> None:
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from verl_hf.modeling import grouped_decode_sdpa

    g = torch.Generator().manual_seed(groups)
    b, kv, slots, dim = 3, 2, 11, 16
    heads = kv * groups
    module: Any = SimpleNamespace(num_key_value_groups=groups, is_causal=True)
    key, value = torch.randn(b, kv, slots, dim, generator=g), torch.randn(b, kv, slots, dim, generator=g)
    mask = torch.rand(b, 1, 1, slots, generator=g) > 0.3
    mask[..., 0] = True
    for q_len in (1, 4):  # a decode step (grouped path) and a prefill (transformers' own path)
        query = torch.randn(b, q_len, heads, dim, generator=g).transpose(1, 2)
        m = mask.expand(b, 1, q_len, slots)
        got, _ = grouped_decode_sdpa(module, query, key, value, m, scaling=0.3)
        want, _ = sdpa_attention_forward(module, query, key, value, m, scaling=0.3)
        assert got.shape == want.shape == (b, q_len, heads, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_compiled_decode_step_samples_what_the_eager_one_samples() -> None:
    eager = engine("llama", rollout_cache="static")
    compiled = engine("llama", rollout_cache="static", rollout_compile=True)
    assert compiled.decode_mode == "static+compile"
    p = prompts(3, seed=7)
    for params in PARAMS[:2]:
        a, b = eager.generate(p, params), compiled.generate(p, params)
        for field in ("response_ids", "response_mask", "truncated"):
            assert torch.equal(a[field], b[field]), f"{field} differs with a compiled decode step"
        assert_close(b["rollout_log_probs"], a["rollout_log_probs"], dtype="float32", quantity="log_probs")
    assert compiled._compiled is not None
    # The first decode of each shape compiled the step: timed once per shape, reported and logged.
    seconds = compiled.compile_seconds
    assert len(seconds) == 1 and all(t > 0 for t in seconds.values())
    (rows, width), = seconds
    assert rows == 3 * PARAMS[0].n and width % 32 == 0
    compiled.generate(p, PARAMS[0])
    assert compiled.compile_seconds == seconds  # the same shape again: nothing compiles
    assert eager.compile_seconds == {}
    with pytest.raises(ConfigError, match="rollout_compile"):
        engine("llama", rollout_cache="dynamic", rollout_compile=True)


def test_prompts_of_other_widths_share_one_static_decoder() -> None:
    dynamic, static = engine(), engine(rollout_cache="static")
    params = SamplingParams(n=2, max_new_tokens=6, seed=5)
    decoders = []
    for max_prompt in (3, 8, 13):  # trimmed widths differ; all round up to one static width
        p = random_batch(batch_size=3, max_prompt=max_prompt, max_response=1, seed=max_prompt).select(
            "prompt_ids", "prompt_mask", "group_ids")
        got, want = static.generate(p, params), dynamic.generate(p, params)
        assert torch.equal(got["response_ids"], want["response_ids"])
        assert torch.equal(got["prompt_ids"], p.repeat_interleave(2)["prompt_ids"]), "the output keeps its prompts"
        assert_close(got["rollout_log_probs"], want["rollout_log_probs"], dtype="float32", quantity="log_probs")
        assert static._decoders.current is not None
        decoders.append(static._decoders.current)
    assert decoders[0] is decoders[1] is decoders[2]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_the_prefill_hands_the_frozen_output_head_a_contiguous_input(cache: str) -> None:
    """The prefill's last-position slice of the hidden states is strided; against a weight that does
    not require grad torch's matmul would read the head once per row (a batched product), so the
    engine loads its model with a hook that makes the head's input contiguous (verl_hf.modeling.contiguous_head_input)."""
    eng = engine("llama", rollout_cache=cache)
    head = eng._model.get_output_embeddings()
    assert not head.weight.requires_grad
    seen: list[tuple[tuple[int, ...], bool]] = []
    head.register_forward_pre_hook(lambda m, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    eng.generate(prompts(3, seed=2), PARAMS[0])
    rows = 3 * PARAMS[0].n
    assert seen and seen[0][0][0] == rows, seen[:1]
    assert all(ok for _, ok in seen), [s for s in seen if not s[1]]
    # what the hook undoes: transformers' slice of the prefill's hidden states is not contiguous
    hidden = torch.zeros(rows, 8, head.in_features)
    assert not hidden[:, -1:, :].is_contiguous()


def test_a_decode_step_that_fails_to_compile_decodes_uncompiled_after_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose decode step inductor cannot compile still decodes (the model itself runs the
    steps), says so once, and names the error in decode_mode. The sampling compiles with aot_eager."""
    import warnings

    import torch._dynamo.exc as dynamo_exc

    from verl_core.enginekit import sampling

    real = torch.compile

    def cannot_compile(*args: Any, **kwargs: Any) -> Any:
        raise dynamo_exc.TorchDynamoException("no lowering for this operator")

    def compile_(fn: Any, **kwargs: Any) -> Any:
        return cannot_compile if isinstance(fn, torch.nn.Module) else real(fn, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_)
    sampling.compiled_sampling_step.cache_clear()
    try:
        eager = engine("llama", rollout_cache="static")
        compiled = engine("llama", rollout_cache="static", rollout_compile=True)
        p = prompts(3, seed=7)
        with pytest.warns(RuntimeWarning, match="hf rollout decode step: torch.compile failed .*no lowering"):
            got = compiled.generate(p, PARAMS[0])
        want = eager.generate(p, PARAMS[0])
        for field in ("response_ids", "response_mask", "truncated"):
            assert torch.equal(got[field], want[field]), field
        assert ("the decode step runs uncompiled after torch.compile failed: TorchDynamoException: no lowering"
                in compiled.decode_mode), compiled.decode_mode
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            compiled.generate(p, PARAMS[0])  # no second warning
    finally:
        sampling.compiled_sampling_step.cache_clear()


def test_a_compiled_step_compiles_a_few_times_however_many_shapes_it_meets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-turn episode's turns (other rows, longer prompts) and evaluation batches bring new
    shapes: the compiled decode step specialises to the first, compiles one graph with symbolic
    sizes when the rows change and once more when the prompt width does, and every later shape
    reuses it, sampling what the eager step samples; ``compile_seconds`` names the shapes that
    compiled. The backend is aot_eager (dynamo and AOT autograd trace as under inductor, without
    its code generation, which takes minutes on a CPU)."""
    import functools

    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    def build(**options: Any) -> HFRolloutEngine:
        return HFRolloutEngine(EngineSpec(model_path=model_path("llama"), role="rollout", max_prompt_len=200,
                                          max_response_len=8, options={"rollout_cache": "static", **options}))

    eager, compiled = build(), build(rollout_compile=True)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    params = SamplingParams(max_new_tokens=6, seed=4)
    shapes = [(4, 8), (6, 8), (6, 40), (5, 72), (7, 104), (3, 136)]  # rows, prompt tokens
    graphs = []
    for i, (rows, width) in enumerate(shapes):
        batch = random_batch(batch_size=rows, max_prompt=width, max_response=1, seed=i)
        batch = batch.select("prompt_ids", "prompt_mask", "group_ids")
        got, want = compiled.generate(batch, params), eager.generate(batch, params)
        for field in ("response_ids", "response_mask", "truncated"):
            assert torch.equal(got[field], want[field]), f"{field} differs at {rows} rows x {width} tokens"
        assert_close(got["rollout_log_probs"], want["rollout_log_probs"], dtype="float32", quantity="log_probs")
        graphs.append(int(dynamo_utils.counters["stats"]["unique_graphs"]))
    # the step and its sampling at the first shape, both again at new rows, the step at a new width
    assert graphs[:3] == [2, 4, 5], graphs
    assert graphs[3:] == [graphs[2]] * 3, f"later shapes compiled again: {graphs}"
    assert sorted(compiled.compile_seconds) == [(4, 32), (6, 32), (6, 64)]
