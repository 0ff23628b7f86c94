"""The hf rollout's attention over cache windows: a static decode step reads the slots written so
far (rounded up to a window), the prefill the prompt's slots, never the whole preallocated cache.

On CUDA this is the default (``HFOptions.rollout_decode_window`` resolves to 256) and each window
is a CUDA graph; here the same decoder runs its windows eagerly (the option set explicitly), with
the same attention function, and must sample what the full-cache and the dynamic-cache paths sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hf_helpers import model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import ConfigError, EngineSpec, SamplingParams, TensorBatch
from verl_core.enginekit.sampling import GraphCaptures
from verl_hf.config import DEFAULT_DECODE_WINDOW, HFOptions
from verl_hf.modeling import GROUPED_SDPA, grouped_decode_sdpa
from verl_hf.rollout import HFRolloutEngine
from verl_hf.rollout_decode import decode_mode


def engine(arch: str = "llama", tied: bool = False, **options: Any) -> HFRolloutEngine:
    spec = EngineSpec(model_path=model_path(arch, tied), role="rollout", max_prompt_len=32, max_response_len=64,
                      options=options)
    return HFRolloutEngine(spec)


def prompts(batch_size: int, seed: int) -> TensorBatch:
    return random_batch(batch_size=batch_size, max_prompt=8, max_response=1, seed=seed).select(
        "prompt_ids", "prompt_mask", "group_ids")


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("q_len", [1, 5])
def test_attention_over_a_window_equals_attention_over_the_whole_cache(groups: int, q_len: int) -> None:
    """A mask narrower than the cache reads its first slots only; the rest (garbage here) is never read."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(groups * 10 + q_len)
    b, kv, slots, window, dim = 3, 2, 40, 13, 16
    module: Any = SimpleNamespace(num_key_value_groups=groups, is_causal=True)
    key, value = torch.randn(b, kv, slots, dim, generator=g), torch.randn(b, kv, slots, dim, generator=g)
    query = torch.randn(b, q_len, kv * groups, dim, generator=g).transpose(1, 2)
    mask = torch.rand(b, 1, q_len, window, generator=g) > 0.3
    mask[..., 0] = True
    full = torch.zeros(b, 1, q_len, slots, dtype=torch.bool)
    full[..., :window] = mask
    got, _ = grouped_decode_sdpa(module, query, key, value, mask, scaling=0.3)
    want, _ = grouped_decode_sdpa(module, query, key, value, full, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    poisoned_k, poisoned_v = key.clone(), value.clone()
    poisoned_k[:, :, window:] = float("nan")
    poisoned_v[:, :, window:] = float("nan")
    again, _ = grouped_decode_sdpa(module, query, poisoned_k, poisoned_v, mask, scaling=0.3)
    assert torch.equal(again, got), "slots past the window were read"


class Spy:
    """(query length, mask width, cache length) of every call of the rollout's attention, and the
    masks of its one-token calls, once installed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.step_masks: list[torch.Tensor] = []

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
                 *args: Any, **kwargs: Any) -> Any:
        self.calls.append((query.shape[2], -1 if mask is None else mask.shape[-1], key.shape[2]))
        if query.shape[2] == 1 and mask is not None:
            self.step_masks.append(mask.clone())
        return grouped_decode_sdpa(module, query, key, value, mask, *args, **kwargs)

    def install(self) -> None:
        """Take the grouped attention's place (after the engines are built: building one registers it)."""
        from transformers import AttentionInterface

        AttentionInterface.register(GROUPED_SDPA, self)


@pytest.fixture
def spy() -> Iterator[Spy]:
    from transformers import AttentionInterface

    try:
        yield Spy()
    finally:
        AttentionInterface.register(GROUPED_SDPA, grouped_decode_sdpa)


PARAMS = [
    SamplingParams(n=2, max_new_tokens=60, seed=3),
    SamplingParams(n=2, max_new_tokens=50, seed=4, temperature=0.7, top_k=20, top_p=0.9,
                   stop_token_ids=tuple(range(4, 9))),
    SamplingParams(max_new_tokens=60, greedy=True),
]


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen3", True)])
def test_windowed_decode_samples_what_the_whole_cache_and_the_dynamic_cache_sample(
    arch: str, tied: bool, spy: Spy
) -> None:
    dynamic = engine(arch, tied)
    whole = engine(arch, tied, rollout_cache="static", rollout_decode_window=0)
    windowed = engine(arch, tied, rollout_cache="static", rollout_decode_window=36)
    assert (dynamic.decode_mode, whole.decode_mode, windowed.decode_mode) == ("dynamic", "static", "static+windows")
    assert windowed.model.config._attn_implementation == GROUPED_SDPA
    spy.install()
    p = prompts(3, seed=8)
    for params in PARAMS:
        a, b = dynamic.generate(p, params), whole.generate(p, params)
        spy.calls.clear()
        c = windowed.generate(p, params)
        for field in ("response_ids", "response_mask", "truncated"):
            assert torch.equal(a[field], c[field]), f"{field}: windowed decode differs from the dynamic cache"
            assert torch.equal(b[field], c[field]), f"{field}: windowed decode differs from the whole static cache"
        assert_close(c["rollout_log_probs"], b["rollout_log_probs"], dtype="float32", quantity="log_probs",
                     what="windowed vs whole-cache static decode")
        decoder = windowed._decoders.current
        assert decoder is not None and decoder.width == 32
        length = 32 + params.max_new_tokens
        assert decoder.windows == (36, 72, length) if length > 80 else decoder.windows == (36, length)
        layers = windowed.model.config.num_hidden_layers
        prefill = spy.calls[:layers]
        assert {call for call in prefill} == {(32, 32, length)}, "the prefill reads the prompt's slots only"
        steps = [w for q, w, _ in spy.calls[layers:] if q == 1]
        assert len(steps) == layers * (c.response_len - 1) or params.stop_token_ids
        # step k (k tokens drawn) reads 32 + k slots, at the smallest window holding them
        for k, w in enumerate(steps[::layers], start=1):
            assert w == next(x for x in decoder.windows if x >= 32 + k)


def test_a_finished_row_attends_only_the_slot_its_step_writes(spy: Spy) -> None:
    """Once a row drew a stop token, each later decode step's mask attends one slot of it, the one
    the step writes (the fused kernel then reads one block of that row's cache, not all it wrote);
    live rows attend their real slots so far, and the samples stay the dynamic cache's."""
    dynamic = engine()
    windowed = engine(rollout_cache="static", rollout_decode_window=36)
    spy.install()
    vocab = windowed.tokenizer.vocab_size
    params = SamplingParams(n=4, max_new_tokens=40, seed=6, stop_token_ids=tuple(range(4, 4 + vocab // 12)))
    p = prompts(3, seed=2)
    want = dynamic.generate(p, params)
    spy.step_masks.clear()
    got = windowed.generate(p, params)
    for field in ("response_ids", "response_mask", "truncated"):
        assert torch.equal(got[field], want[field]), f"{field}: the windowed decode differs from the dynamic cache"
    lengths = got["response_mask"].sum(1)
    assert int(lengths.min()) < int(lengths.max()) - 2, f"the responses must end at different steps: {lengths}"
    real = got["prompt_mask"].sum(1)
    layers = windowed.model.config.num_hidden_layers
    steps = spy.step_masks[::layers]
    assert len(steps) == got.response_len - 1
    width, mixed = 32, 0
    for k, mask in enumerate(steps, start=1):  # step k feeds token k - 1 and writes slot width + k - 1
        attended = mask[:, 0, 0]
        done = lengths <= k
        mixed += int(done.any() and not done.all())
        for row in range(attended.shape[0]):
            if done[row]:
                assert attended[row].nonzero().flatten().tolist() == [width + k - 1], (row, k)
            else:
                assert int(attended[row].sum()) == int(real[row]) + k, (row, k)
    assert mixed > 0, "no step had finished and live rows together"


def test_window_options_are_resolved_per_device_and_validated() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert HFOptions().resolve_rollout(cuda).rollout_decode_window == DEFAULT_DECODE_WINDOW == 256
    assert HFOptions().resolve_rollout(cpu).rollout_decode_window == 0
    assert HFOptions().resolve_rollout(cuda, static_ok=False).rollout_decode_window == 0
    assert HFOptions(attn_implementation="eager").resolve_rollout(cuda).rollout_decode_window == 0
    assert HFOptions(rollout_decode_window=0).resolve_rollout(cuda).rollout_decode_window == 0
    explicit = HFOptions(rollout_decode_window=64).resolve_rollout(cpu)
    assert (explicit.rollout_cache, explicit.rollout_decode_window) == ("static", 64)
    with pytest.raises(ConfigError, match="rollout_decode_window .* set rollout_cache='static'"):
        HFOptions(rollout_cache="dynamic", rollout_decode_window=64)
    with pytest.raises(ConfigError, match="rollout_decode_window needs attn_implementation='sdpa'"):
        HFOptions(attn_implementation="eager", rollout_decode_window=64)
    with pytest.raises(ConfigError, match="rollout_decode_window"):
        HFOptions(rollout_decode_window=-1)
    # on CPU the default keeps transformers' own sdpa: a CPU engine decodes like a user's model object
    assert engine(rollout_cache="static").model.config._attn_implementation == "sdpa"


def test_the_fused_decode_kernel_option_is_validated_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    import verl_core.enginekit.decode_attention as decode_attention

    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    # unset: on exactly where it can run, never an error
    monkeypatch.setattr(decode_attention, "fused_decode_kernel", lambda: object())
    assert HFOptions().fused_decode(cuda, bf16) and HFOptions().fused_decode(cuda, torch.float16)
    assert not HFOptions().fused_decode(cpu, bf16) and not HFOptions().fused_decode(cuda, torch.float32)
    assert not HFOptions(attn_implementation="eager").fused_decode(cuda, bf16)
    assert not HFOptions(rollout_decode_kernel=False).fused_decode(cuda, bf16)
    monkeypatch.setattr(decode_attention, "fused_decode_kernel", lambda: None)
    assert not HFOptions().fused_decode(cuda, bf16)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="rollout_decode_kernel=True needs a CUDA device .* runs on cpu in bfloat16"):
        HFOptions(rollout_decode_kernel=True).fused_decode(cpu, bf16)
    with pytest.raises(ConfigError, match="rollout_decode_kernel=True needs a CUDA device .* in float32"):
        HFOptions(rollout_decode_kernel=True).fused_decode(cuda, torch.float32)
    with pytest.raises(ConfigError, match="rollout_decode_kernel replaces sdpa's decode-step attention"):
        HFOptions(attn_implementation="eager", rollout_decode_kernel=True)
    monkeypatch.setattr(decode_attention, "fused_decode_kernel", lambda: None)
    with pytest.raises(ConfigError, match="needs Triton, which is not installed"):
        HFOptions(rollout_decode_kernel=True).fused_decode(cuda, bf16)
    monkeypatch.setattr(decode_attention, "fused_decode_kernel", lambda: object())
    assert HFOptions(rollout_decode_kernel=True).fused_decode(cuda, bf16)
    # an engine that runs no kernel says so in its decode mode; one that does says that
    e = engine(rollout_cache="static", rollout_decode_window=36)
    assert e.decode_mode == "static+windows" and e.model.config._attn_implementation == GROUPED_SDPA
    assert e._options.rollout_decode_kernel is False  # resolved: the CPU engine runs no kernel
    assert decode_mode(dataclasses.replace(e._options, rollout_decode_kernel=True)) == "static+windows+fused-attention"
    with pytest.raises(ConfigError, match="rollout_decode_kernel=True needs a CUDA device"):
        engine(rollout_decode_kernel=True)


def test_a_shape_whose_capture_fails_decodes_eagerly_while_others_replay() -> None:
    """The engine's decode with a capture that fails for one window of one shape (CPU: injected)."""
    e = engine(rollout_cache="static", rollout_decode_window=36)
    want = engine(rollout_cache="static", rollout_decode_window=36)
    windows_tried: list[int] = []

    class Replay:
        def __init__(self, step: Any) -> None:
            self.step = step

        def replay(self) -> None:
            self.step()

    def capture(step: Any, pool: Any) -> Replay:
        window = e._decoders.current.window  # type: ignore[union-attr]
        windows_tried.append(window)
        if window == 72:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return Replay(step)

    e._graphs = GraphCaptures("hf rollout", capture=capture)
    # graphs on, as on CUDA (the option check refuses them on a CPU device at construction)
    e._options = HFOptions(rollout_cache="static", rollout_cuda_graphs=True, rollout_decode_window=36,
                           rollout_compile=False)
    p, params = prompts(2, seed=1), SamplingParams(n=2, max_new_tokens=60, seed=7)
    with pytest.warns(RuntimeWarning, match="tries again"):
        first = e.generate(p, params)
    with pytest.warns(RuntimeWarning, match="decodes eagerly from now on"):
        second = e.generate(p, params)
    third = e.generate(p, params)
    reference = want.generate(p, params)
    for out in (first, second, third):
        assert torch.equal(out["response_ids"], reference["response_ids"])
        assert torch.equal(out["rollout_log_probs"], reference["rollout_log_probs"])
    assert windows_tried == [36, 72, 92, 72]
    assert e.graph_captures.metrics() == {"graph_captures": 2.0, "graph_capture_failures": 2.0,
                                          "graph_eager_shapes": 1.0}
    assert "1 shape(s) decode eagerly after failed CUDA graph captures" in e.decode_mode
    assert "operation not permitted" in e.decode_mode


def test_a_compiled_windowed_step_compiles_once_below_the_whole_cache_and_once_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """However many windows a decode has, the compiled step is compiled twice: once with the window's
    width dynamic (every window below the whole cache) and once for the whole cache; its sampling,
    the same shape at every window, once. The compiler
    backend is aot_eager here (dynamo and AOT autograd trace as under inductor, without its code
    generation, which takes minutes on a CPU); the samples are the eager windowed decode's."""
    import functools

    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    eager = engine(rollout_cache="static", rollout_decode_window=8)
    compiled = engine(rollout_cache="static", rollout_decode_window=8, rollout_compile=True)
    assert compiled.decode_mode == "static+compile+windows"
    p, params = prompts(2, seed=3), SamplingParams(n=2, max_new_tokens=64, seed=5)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    got, want = compiled.generate(p, params), eager.generate(p, params)
    decoder = compiled._decoders.current
    assert decoder is not None and len(decoder.windows) >= 5, decoder.windows if decoder else None
    assert got.response_len == 64, "every window must be reached"
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2 + 1  # the model's step twice, the sampling once
    for field in ("response_ids", "response_mask", "truncated"):
        assert torch.equal(got[field], want[field]), (
            f"{field}: the compiled windowed step differs from the eager one"
        )
    assert_close(
        got["rollout_log_probs"],
        want["rollout_log_probs"],
        dtype="float32",
        quantity="log_probs",
        what="compiled vs eager windowed decode",
    )
