"""Bad input at the protocol boundary of real engines never enters the engine.

Every hf and example-backend entry point (``TrainingEngine.forward``, ``forward_backward``,
``RolloutEngine.generate``, hf's ``RewardEngine.score``) gets hypothesis-generated bad batches: NaN/inf, ids outside the
vocabulary, broken padding sides, over-long prompts and responses, missing fields, empty prompts,
and batches assembled without validation (wrong dtypes, ranks, mismatched lengths). Each must be
refused with a typed error before any model code runs (a forward pre-hook on every module counts
calls) and without touching gradients or weights. Malformed weight streams are refused with
WeightSyncError and leave the rollout engine refusing to generate until a complete sync.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from verl_conformance.testkit import TinyModelSpec, build_tiny_model, random_batch
from verl_core import (
    MIN_TEMPERATURE,
    EngineSpec,
    GlobalBatchStats,
    OptimConfig,
    RequestTooLargeError,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    VerlError,
    WeightSyncError,
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
)
from verl_core.algorithms import Algorithm
from verl_core.kernel.weights import TensorInfo, WeightChunk, WeightCommit, WeightManifest

VOCAB = 128
MAX_PROMPT = 8
MAX_RESPONSE = 6
BACKENDS = ["hf", "example"]
FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@dataclass
class Engines:
    name: str
    actor: Any
    rollout: Any
    calls: Counter[str]


def _modules(engine: object) -> Iterator[nn.Module]:
    seen: set[int] = set()
    for value in vars(engine).values():
        if isinstance(value, nn.Module) and id(value) not in seen:
            seen.add(id(value))
            yield value


def _count_calls(engine: object, calls: Counter[str], role: str) -> None:
    mods = list(_modules(engine))
    assert mods, f"found no torch module on the {role} engine to watch"
    for m in mods:
        m.register_forward_pre_hook(lambda *_: calls.update([role]))


@pytest.fixture(scope="module", params=BACKENDS)
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", TinyModelSpec(
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32, intermediate_size=64,
        vocab_size=VOCAB,
    ))
    common = dict(model_path=str(path), max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE)
    actor = get_training_engine(request.param, EngineSpec(role="actor", optim=OptimConfig(lr=1e-2), **common))
    rollout = get_rollout_engine(request.param, EngineSpec(role="rollout", **common))
    calls: Counter[str] = Counter()
    _count_calls(actor, calls, "actor")
    _count_calls(rollout, calls, "rollout")
    return Engines(request.param, actor, rollout, calls)


def valid_batch(seed: int) -> TensorBatch:
    return random_batch(batch_size=4, max_prompt=MAX_PROMPT, max_response=MAX_RESPONSE, vocab_size=VOCAB,
                        seed=seed, with_rl_fields=True, group_size=2)


def _long(batch: TensorBatch, prompt: bool, extra: int) -> TensorBatch:
    """The batch with one prompt (or response) longer than the engine's maximum."""
    name = "prompt" if prompt else "response"
    width = (MAX_PROMPT if prompt else MAX_RESPONSE) + extra
    grow = width - batch[f"{name}_ids"].shape[1]
    out = {}
    for key, t in batch.items():
        if t.dim() == 2 and key.startswith("prompt") == prompt:
            pad = torch.zeros(t.shape[0], grow, dtype=t.dtype)
            if key.endswith("_ids"):
                pad += 5
            if key.endswith("_mask"):
                pad[0] = True
                t = t.clone()
                t[0] = True
            out[key] = torch.cat([pad, t], 1) if prompt else torch.cat([t, pad], 1)
        else:
            out[key] = t
    return TensorBatch(out, batch.extras, batch.meta)


def corrupt(batch: TensorBatch, kind: str, data: st.DataObject) -> TensorBatch:
    """``batch`` made invalid in one way (built so that construction alone may not notice)."""
    t: dict[str, torch.Tensor] = dict(batch)

    def pick(*names: str) -> str:
        return data.draw(st.sampled_from([n for n in names if n in t]))

    row = data.draw(st.integers(0, batch.batch_size - 1), label="row")
    if kind == "non_finite":
        name = pick("old_log_probs", "advantages", "ref_log_probs", "rollout_log_probs")
        x = t[name].clone()
        x[row, data.draw(st.integers(0, x.shape[1] - 1))] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return batch.update({name: x})
    if kind in ("out_of_vocab", "negative_id"):
        name = pick("prompt_ids", "response_ids")
        x = t[name].clone()
        x[row, -1 if name == "prompt_ids" else 0] = (
            data.draw(st.integers(VOCAB, 2**40)) if kind == "out_of_vocab" else data.draw(st.integers(-(2**40), -1))
        )
        return batch.update({name: x})
    if kind == "right_padded_prompt":
        x = t["prompt_mask"].clone()
        x[row] = torch.arange(x.shape[1]) < 1  # real token on the left, padding on the right
        x[row, -1] = False
        if bool(x[row].all()) or not bool(x[row].any()):
            x[row, 0], x[row, -1] = True, False
        return batch.update(prompt_mask=x)
    if kind == "left_padded_response":
        x = t["response_mask"].clone()
        x[row] = False
        x[row, -1] = True
        return batch.update(response_mask=x)
    if kind == "empty_prompt":
        x = t["prompt_mask"].clone()
        x[row] = False
        return batch.update(prompt_mask=x)
    if kind == "long_prompt":
        return _long(batch, True, data.draw(st.integers(1, 6)))
    if kind == "long_response":
        return _long(batch, False, data.draw(st.integers(1, 6)))
    if kind == "missing_field":
        return batch.drop(pick("prompt_ids", "prompt_mask", "response_ids", "response_mask"))
    # structurally invalid batches assembled without validation (as a buggy caller could)
    if kind == "unvalidated_dtype":
        name = pick("prompt_ids", "response_ids", "prompt_mask", "advantages")
        t[name] = t[name].to(data.draw(st.sampled_from([torch.int32, torch.float64, torch.float16, torch.uint8])))
    elif kind == "unvalidated_rows":
        name = pick("response_ids", "advantages", "group_ids")
        t[name] = t[name][: batch.batch_size - 1 - row % 2]
    else:  # unvalidated_rank
        name = pick("prompt_ids", "response_mask", "advantages")
        t[name] = t[name].unsqueeze(0)
    return TensorBatch._trusted(t, dict(batch.extras), batch.meta, batch.batch_size)


KINDS = ["non_finite", "out_of_vocab", "negative_id", "right_padded_prompt", "left_padded_response",
         "empty_prompt", "long_prompt", "long_response", "missing_field", "unvalidated_dtype",
         "unvalidated_rows", "unvalidated_rank"]
PROMPT_KINDS = ["out_of_vocab", "negative_id", "right_padded_prompt", "empty_prompt", "long_prompt",
                "unvalidated_dtype", "unvalidated_rank", "missing_field"]


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, m in enumerate(_modules(engine)) for n, p in m.named_parameters()}


def _refused(call: Callable[[], object]) -> BaseException:
    with pytest.raises(VerlError) as info:
        call()
    err = info.value
    assert isinstance(err, ValueError), f"{type(err).__name__} is not a ValueError: {err}"
    return err


@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 30), entry=st.sampled_from(["forward", "forward_backward"]),
       data=st.data())
@FUZZ
def test_training_engine_refuses_bad_batches_before_running(
    engines: Engines, kind: str, seed: int, entry: str, data: st.DataObject, tally: Counter[str]
) -> None:
    actor = engines.actor
    batch = valid_batch(seed)
    bad = corrupt(batch, kind, data)
    if kind == "missing_field" and set(bad) >= {"prompt_ids", "prompt_mask", "response_ids", "response_mask"}:
        return
    before = _weights(actor)
    engines.calls.clear()
    tally[f"fuzz/engine boundary ({kind})"] += 1
    loss = Algorithm.grpo().actor_loss
    if entry == "forward":
        err = _refused(lambda: actor.forward(bad, ("log_probs",)))
    else:
        err = _refused(lambda: actor.forward_backward(bad, loss, GlobalBatchStats.of(batch)))
    assert engines.calls["actor"] == 0, f"{kind}: the model ran before the input was refused ({err})"
    assert all(p.grad is None for m in _modules(actor) for p in m.parameters()), "a refused call left gradients"
    after = _weights(actor)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused call changed the weights"


@given(kind=st.sampled_from(PROMPT_KINDS), seed=st.integers(0, 30), data=st.data())
@FUZZ
def test_rollout_engine_refuses_bad_prompts_before_running(
    engines: Engines, kind: str, seed: int, data: st.DataObject, tally: Counter[str]
) -> None:
    prompts = valid_batch(seed).select("prompt_ids", "prompt_mask", "group_ids")
    if kind == "long_prompt":
        bad = _long(valid_batch(seed), True, data.draw(st.integers(1, 6))).select("prompt_ids", "prompt_mask", "group_ids")
    else:
        bad = corrupt(prompts, kind, data)
    if kind == "missing_field" and set(bad) >= {"prompt_ids", "prompt_mask"}:
        return
    engines.calls.clear()
    tally[f"fuzz/engine boundary (prompts {kind})"] += 1
    err = _refused(lambda: engines.rollout.generate(bad, SamplingParams(max_new_tokens=MAX_RESPONSE, seed=0)))
    assert engines.calls["rollout"] == 0, f"{kind}: the model ran before the prompts were refused ({err})"


@given(max_new=st.integers(MAX_RESPONSE + 1, 10_000), stop=st.lists(st.integers(VOCAB, 2**40), min_size=1, max_size=2))
@FUZZ
def test_rollout_engine_refuses_bad_sampling_params(
    engines: Engines, max_new: int, stop: list[int], tally: Counter[str]
) -> None:
    prompts = valid_batch(0).select("prompt_ids", "prompt_mask", "group_ids")
    engines.calls.clear()
    tally["fuzz/engine boundary (sampling params)"] += 1
    _refused(lambda: engines.rollout.generate(prompts, SamplingParams(max_new_tokens=max_new)))
    if engines.name == "hf":  # a stop id outside the vocabulary is harmless; hf refuses it as a likely typo
        tally["fuzz/engine boundary (sampling params)"] += 1
        _refused(lambda: engines.rollout.generate(prompts, SamplingParams(max_new_tokens=2, stop_token_ids=tuple(stop))))
    assert engines.calls["rollout"] == 0


def test_rollout_engine_refuses_a_request_too_large_for_memory(engines: Engines, tally: Counter[str]) -> None:
    """2**18 prompts x n=65536 samples need terabytes: refused with the estimate before the model runs."""
    one = valid_batch(0).select("prompt_ids", "prompt_mask", "group_ids")
    prompts = one.index(torch.arange(2**18) % one.batch_size)  # a few MB of valid prompts
    engines.calls.clear()
    tally["fuzz/engine boundary (oversized request)"] += 1
    with pytest.raises(RequestTooLargeError, match=r"262144 prompts x n=65536 = 17179869184 samples of \d+ prompt \+ 6 new "
                                                    r"tokens.* needs at least .* GiB .* memory is available"):
        engines.rollout.generate(prompts, SamplingParams(n=65536, max_new_tokens=MAX_RESPONSE, seed=0))
    assert engines.calls["rollout"] == 0


@given(
    temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2), st.none()),
    top_p=st.one_of(st.floats(allow_nan=True), st.integers(-2, 2), st.none()),
    top_k=st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=1)),
    max_new_tokens=st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.none()),
    n=st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=1)),
)
@settings(max_examples=300, deadline=None)
def test_sampling_params_accept_only_valid_values(
    temperature: Any, top_p: Any, top_k: Any, max_new_tokens: Any, n: Any, tally: Counter[str]
) -> None:
    def num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    valid = (num(temperature) and math.isfinite(temperature) and temperature >= MIN_TEMPERATURE
             and num(top_p) and 0 < top_p <= 1
             and integer(top_k) and top_k >= 0 and integer(max_new_tokens) and max_new_tokens >= 1
             and integer(n) and n >= 1)
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, n=n)
    if valid:
        SamplingParams(**kwargs)
        return
    tally["fuzz/sampling params"] += 1
    _refused(lambda: SamplingParams(**kwargs))


def test_an_empty_batch_is_handled_or_refused_cleanly(engines: Engines, tally: Counter[str]) -> None:
    empty = valid_batch(0).index([])
    tally["fuzz/engine boundary (empty batch)"] += 3
    for call in (
        lambda: engines.actor.forward(empty, ("log_probs",)),
        lambda: engines.rollout.generate(empty.select("prompt_ids", "prompt_mask", "group_ids"),
                                         SamplingParams(max_new_tokens=2, seed=0)),
    ):
        error: VerlError | None = None
        try:
            out = call()
        except VerlError as e:
            error = e
        if error is not None:
            assert isinstance(error, ValueError), repr(error)
        else:
            assert out.batch_size == 0


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Counter[str]]:
    """The hf reward-model engine on a tiny sequence-classification model, its modules watched."""
    path = build_tiny_model(tmp_path_factory.mktemp("reward") / "tiny", TinyModelSpec(
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32, intermediate_size=64,
        vocab_size=VOCAB, head="reward",
    ))
    engine = get_reward_engine("hf", EngineSpec(model_path=str(path), role="reward", max_prompt_len=MAX_PROMPT,
                                                max_response_len=MAX_RESPONSE))
    calls: Counter[str] = Counter()
    _count_calls(engine, calls, "reward")
    return engine, calls


@given(kind=st.sampled_from([k for k in KINDS if k != "non_finite"]), seed=st.integers(0, 30), data=st.data())
@FUZZ
def test_reward_engine_refuses_bad_batches_before_running(
    reward: tuple[Any, Counter[str]], kind: str, seed: int, data: st.DataObject, tally: Counter[str]
) -> None:
    engine, calls = reward
    batch = valid_batch(seed).select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids")
    bad = corrupt(batch, kind, data)
    if kind == "missing_field" and set(bad) >= {"prompt_ids", "prompt_mask", "response_ids", "response_mask"}:
        return
    calls.clear()
    tally[f"fuzz/engine boundary (reward {kind})"] += 1
    err = _refused(lambda: engine.score(bad))
    assert calls["reward"] == 0, f"{kind}: the reward model ran before the input was refused ({err})"


def _stream(engines: Engines) -> list[Any]:
    """A valid weight stream from the actor, materialised (chunks copied: they are valid only briefly)."""
    out: list[Any] = []
    for msg in engines.actor.export_weights():
        if isinstance(msg, WeightChunk):
            msg = WeightChunk(tuple((n, t.clone()) for n, t in msg.tensors))
        out.append(msg)
    return out


STREAM_FAULTS = ["drop_chunk", "drop_commit", "drop_manifest", "commit_version", "rename", "reshape", "dtype",
                 "non_finite", "unknown_tensor", "duplicate", "junk_message", "after_commit", "manifest_shape"]


@given(fault=st.sampled_from(STREAM_FAULTS), data=st.data())
@FUZZ
def test_rollout_engine_refuses_bad_weight_streams_and_serves_nothing_stale(
    engines: Engines, fault: str, data: st.DataObject, tally: Counter[str]
) -> None:
    good = _stream(engines)
    manifest, chunks, commit = good[0], good[1:-1], good[-1]
    i = data.draw(st.integers(0, len(chunks) - 1), label="chunk")
    names = [n for n, _ in chunks[i].tensors]
    j = data.draw(st.integers(0, len(names) - 1), label="tensor")

    def with_tensor(fn: Callable[[torch.Tensor], torch.Tensor], name: str | None = None) -> Any:
        pairs = list(chunks[i].tensors)
        pairs[j] = (name or pairs[j][0], fn(pairs[j][1]))
        return WeightChunk(tuple(pairs))

    bad: list[Any]
    if fault == "drop_chunk":
        bad = [manifest, *chunks[:i], *chunks[i + 1:], commit]
    elif fault == "drop_commit":
        bad = [manifest, *chunks]
    elif fault == "drop_manifest":
        bad = [*chunks, commit]
    elif fault == "commit_version":
        bad = [manifest, *chunks, WeightCommit(manifest.version + data.draw(st.integers(1, 5)))]
    elif fault in ("rename", "reshape", "dtype", "non_finite"):
        change: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "rename": lambda t: t,
            "reshape": lambda t: t.reshape(-1)[:-1] if t.numel() > 1 else t.reshape(1, 1, 1),
            "dtype": lambda t: t.to(torch.float64),
            "non_finite": lambda t: t.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("nan")).reshape(t.shape),
        }
        chunk = with_tensor(change[fault], names[j] + ".renamed" if fault == "rename" else None)
        bad = [manifest, *chunks[:i], chunk, *chunks[i + 1:], commit]
    elif fault == "unknown_tensor":
        bad = [manifest, *chunks, WeightChunk((("model.rogue.weight", torch.zeros(2)),)), commit]
    elif fault == "duplicate":
        bad = [manifest, *chunks, chunks[i], commit]
    elif fault == "junk_message":
        bad = [manifest, *chunks[:i], data.draw(st.sampled_from([None, 3, "chunk", {"a": 1}])), *chunks[i:], commit]
    elif fault == "after_commit":
        bad = [manifest, *chunks, commit, chunks[i]]
    else:  # a manifest that does not match the receiving model
        tensors = dict(manifest.tensors)
        info = tensors[names[j]]
        tensors[names[j]] = TensorInfo((*info.shape, 2), info.dtype)
        bad = [WeightManifest(manifest.version, tensors, manifest.tied_embeddings), *chunks, commit]
    rollout = engines.rollout
    prompts = valid_batch(0).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(max_new_tokens=2, seed=0)
    tally[f"fuzz/weight stream ({fault})"] += 1
    with pytest.raises(VerlError) as info:
        rollout.update_weights(iter(bad))
    assert isinstance(info.value, (WeightSyncError, ValueError)), repr(info.value)
    # half-applied weights never serve: generation refuses until a complete sync succeeds
    with pytest.raises(StaleWeightsError):
        rollout.generate(prompts, params)
    rollout.update_weights(iter(_stream(engines)))
    assert rollout.generate(prompts, params).batch_size == prompts.batch_size
