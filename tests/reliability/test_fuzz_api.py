"""Hypothesis-generated calls to verl-core's public API: any types, any values, any names.

Each call may only succeed or raise a ``VerlError`` whose message names the argument or field
that was wrong: never a TypeError/AttributeError from deep inside, never an object that holds a
value it should have refused. An independent oracle in this file says which inputs are valid.

Also: an oversized generate request is refused with its estimate, and two ranks that see
different free memory refuse it together (``memory_worker.py`` under torchrun).

Generated inputs (explicit ``max_examples``; about 25 s on one core):
    SamplingParams kwargs          1500
    temperatures vs. log-probs      300
    EngineSpec kwargs (nested)     1200
    TensorBatch constructions      1200
    TensorBatch ops                1200
    registry calls                  600
    total                          6000
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_conformance.testkit import launch_torchrun, random_batch
from verl_core import (
    FIELDS,
    MIN_TEMPERATURE,
    BatchMeta,
    BatchValidationError,
    ConfigError,
    EngineSpec,
    NonFiniteError,
    OptimConfig,
    ParallelSizes,
    RequestTooLargeError,
    SamplingParams,
    TensorBatch,
    UnknownNameError,
    VerlError,
    available_backends,
    get_backend,
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
    parse_options,
)
from verl_core.enginekit.memory import check_generate_memory
from verl_core.enginekit.sampling import TokenSampler
from verl_core.kernel.algorithm import ComponentKind
from verl_core.kernel.registry import Registry
from verl_core.kernel.rollout import MAX_NEW_TOKENS, MAX_SAMPLES_PER_PROMPT

HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


# ----------------------------------------------------------------------------- the oracle's vocabulary
def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False


def int_in(low: int | None = None, high: int | None = None) -> Callable[[object], bool]:
    return lambda v: is_int(v) and (low is None or v >= low) and (high is None or v <= high)  # type: ignore[operator]


def num_in(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False) -> Callable[[object], bool]:
    def ok(v: object) -> bool:
        if not is_num(v):
            return False
        x = float(v)  # type: ignore[arg-type]
        return (x > low if low_open else x >= low) and (high is None or (x < high if high_open else x <= high))
    return ok


def one_of(*allowed: str) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and v in allowed


def typed(err: BaseException, *names: str) -> None:
    """The error is a VerlError whose message names one of ``names``."""
    assert isinstance(err, VerlError), f"{type(err).__name__}: {err}"
    msg = str(err)
    assert any(n in msg for n in names), f"the message names none of {names}: {msg}"


def outcome(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as e:  # judged by the caller: only a VerlError is allowed
        return None, e


# ----------------------------------------------------------------------------- value strategies
BIG = st.one_of(st.integers(10**13, 10**40), st.integers(-(10**40), -(10**13)), st.just(10**400))
EDGES = st.sampled_from([0, 1, -1, 2, 65536, 65537, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                         2**63 - 1, 2**63, 2**64 - 1, 2**64])
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([1e-40, 9.9e-5, 1e-4, 0.5, 1.0, 1.5, 1e300, -0.0]))
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.binary(max_size=3), st.just(object()),
                 st.just(torch.tensor(2)), st.just(np.int64(3)), st.just(np.float64(0.5)),
                 st.lists(st.integers(-2, 3), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
ANY = st.one_of(st.integers(-3, 10), EDGES, BIG, FLOATS, JUNK)
SMALL_OR_HUGE = st.one_of(st.integers(-3, 9), BIG, st.booleans(), FLOATS, st.text(max_size=2), st.none())


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] = ANY, percent_bad: int = 15) -> st.SearchStrategy[Any]:
    """``good`` most of the time, ``bad`` in ``percent_bad`` percent of the draws (so valid calls are common too)."""
    # hypothesis favours small integers, so the rare branch is the top of the range
    return st.integers(0, 99).flatmap(lambda i: bad if i >= 100 - percent_bad else good)


# ----------------------------------------------------------------------------- SamplingParams
SAMPLING_RULES: dict[str, Callable[[object], bool]] = {
    "temperature": num_in(MIN_TEMPERATURE),
    "top_p": num_in(0, 1, low_open=True),
    "top_k": int_in(0, 2**31 - 1),
    "max_new_tokens": int_in(1, MAX_NEW_TOKENS),
    "n": int_in(1, MAX_SAMPLES_PER_PROMPT),
    "stop_token_ids": lambda v: isinstance(v, (tuple, list)) and all(int_in(0, 2**63 - 1)(t) for t in v),
    "seed": lambda v: v is None or int_in(0, 2**64 - 1)(v),
    "greedy": lambda v: isinstance(v, bool),
}
SAMPLING_VALUES = {  # valid values, and in 15% of the draws edges, wrong types and junk
    "temperature": mostly(st.floats(MIN_TEMPERATURE, 10), st.one_of(st.floats(0, MIN_TEMPERATURE, exclude_max=True), FLOATS, ANY)),
    "top_p": mostly(st.floats(0, 1, exclude_min=True), st.one_of(st.floats(-1, 0), st.floats(1, 2, exclude_min=True), ANY)),
    "top_k": mostly(st.integers(0, 100), st.one_of(st.integers(-2, -1), st.integers(2**31 - 2, 2**31), ANY)),
    "max_new_tokens": mostly(st.integers(1, 4096), st.one_of(st.integers(-1, 0), st.integers(2**20 - 1, 2**20 + 1), ANY)),
    "n": mostly(st.integers(1, 64), st.one_of(st.integers(-1, 0), st.integers(65535, 65537), st.just(10**9), ANY)),
    "stop_token_ids": mostly(st.lists(mostly(st.integers(0, 2**63 - 1), st.one_of(st.integers(-2, -1), st.just(2**63), FLOATS,
                                                                                 st.booleans(), st.text(max_size=1))),
                                      max_size=3).map(tuple)),
    "seed": mostly(st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.one_of(st.integers(-5, -1), st.just(2**64), ANY)),
    "greedy": mostly(st.booleans()),
}


@given(kwargs=st.fixed_dictionaries({}, optional=SAMPLING_VALUES))
@settings(max_examples=1500, deadline=None, suppress_health_check=HEALTH)
def test_sampling_params_take_any_kwargs(kwargs: dict[str, Any], tally: Counter[str]) -> None:
    bad = [f for f, v in kwargs.items() if not SAMPLING_RULES[f](v)]
    params, err = outcome(lambda: SamplingParams(**kwargs))
    if not bad:
        assert err is None, f"{kwargs} is valid but was refused: {err!r}"
        for f, v in kwargs.items():
            assert getattr(params, f) == (tuple(v) if f == "stop_token_ids" else v)
        return
    tally["fuzz/api sampling params"] += 1
    assert err is not None, f"{kwargs} was accepted, but {bad} are invalid"
    assert isinstance(err, ConfigError)
    typed(err, *[f"SamplingParams.{f}" for f in bad])
    assert "got" in str(err), str(err)


@given(temperature=st.one_of(st.floats(MIN_TEMPERATURE, 1e6), st.floats(1e6, 1e300), st.floats(0, MIN_TEMPERATURE)),
       scale=st.sampled_from([1.0, 30.0, 1e3, 1e4]), greedy=st.booleans(), seed=st.integers(0, 2**32))
@settings(max_examples=300, deadline=None, suppress_health_check=HEALTH)
def test_an_accepted_temperature_never_gives_nan_log_probs(
    temperature: float, scale: float, greedy: bool, seed: int, tally: Counter[str]
) -> None:
    """Below the floor: refused. At or above it: finite log-probs for logits up to 1e4 in magnitude."""
    if temperature < MIN_TEMPERATURE:
        tally["fuzz/api sampling params"] += 1
        with pytest.raises(ConfigError, match="temperature"):
            SamplingParams(temperature=temperature)
        return
    params = SamplingParams(temperature=temperature, greedy=greedy, top_k=3, top_p=0.9)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.rand(3, 50, generator=g) * 2 - 1) * scale
    uniforms = None if greedy else torch.rand(3, 1, generator=g, dtype=torch.float64)
    tok, lp, _ = TokenSampler(params, 0, torch.tensor([1]), uniforms).step(logits, 0, torch.ones(3, dtype=torch.bool))
    assert bool(torch.isfinite(lp).all()), (temperature, scale, lp)
    assert bool((lp <= 0).all()) and bool(((tok >= 0) & (tok < 50)).all())


# ----------------------------------------------------------------------------- EngineSpec
def parses_as_device(v: object) -> bool:
    if isinstance(v, torch.device):
        return True
    if not isinstance(v, str) or not v:
        return False
    try:
        torch.device(v)
    except RuntimeError:
        return False
    return True


PARALLEL_RULES = {k: int_in(1) for k in ("tp", "pp", "dp")}
OPTIM_RULES: dict[str, Callable[[object], bool]] = {
    "lr": num_in(0, low_open=True),
    "weight_decay": num_in(0),
    "betas": lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(num_in(0, 1, high_open=True)(b) for b in v),
    "eps": num_in(0, low_open=True),
    "warmup_steps": int_in(0),
    "total_steps": int_in(0),
    "schedule": one_of("constant", "cosine"),
    "min_lr_ratio": num_in(0, 1),
    "grad_clip": num_in(0),
}
SPEC_RULES: dict[str, Callable[[object], bool]] = {
    "model_path": lambda v: (isinstance(v, str) and bool(v)) or (isinstance(v, Path) and str(v) != ""),
    "role": one_of("actor", "reference", "critic", "rollout", "reward"),
    "dtype": one_of("float32", "bfloat16", "float16"),
    "device": parses_as_device,
    "seed": int_in(0, 2**32 - 1),
    "max_prompt_len": int_in(1),
    "max_response_len": int_in(1),
    "parallel": lambda v: isinstance(v, ParallelSizes),
    "optim": lambda v: isinstance(v, OptimConfig),
    "micro_batch_tokens": lambda v: v is None or int_in(1)(v),
    "micro_batch_size": lambda v: v is None or int_in(1)(v),
    "gradient_checkpointing": lambda v: isinstance(v, bool),
    "options": lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
}
PARALLEL_VALUES = {k: mostly(st.integers(1, 4), st.one_of(st.integers(-1, 0), SMALL_OR_HUGE)) for k in PARALLEL_RULES}
OPTIM_VALUES = {
    "lr": mostly(st.floats(1e-6, 1), st.one_of(st.floats(-1, 0), ANY)),
    "weight_decay": mostly(st.floats(0, 1), st.one_of(st.floats(-1, 0, exclude_max=True), ANY)),
    "betas": mostly(st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)),
                    st.one_of(st.tuples(st.floats(-0.1, 1.1), st.floats(-0.1, 1.1)), st.lists(st.floats(0, 0.9), max_size=3), ANY)),
    "eps": mostly(st.floats(1e-12, 1), st.one_of(st.floats(-1, 0), ANY)),
    "warmup_steps": mostly(st.integers(0, 5), st.one_of(st.integers(-2, -1), ANY)),
    "total_steps": mostly(st.integers(0, 5), st.one_of(st.integers(-2, -1), ANY)),
    "schedule": mostly(st.sampled_from(["constant", "cosine"]), st.one_of(st.just("linear"), ANY)),
    "min_lr_ratio": mostly(st.floats(0, 1), st.one_of(st.floats(-1, 0, exclude_max=True), st.floats(1, 2, exclude_min=True), ANY)),
    "grad_clip": mostly(st.floats(0, 2), st.one_of(st.floats(-1, 0, exclude_max=True), ANY)),
}
SPEC_VALUES = {
    "dtype": mostly(st.sampled_from(["float32", "bfloat16", "float16"]), st.one_of(st.just("fp8"), ANY)),
    "device": mostly(st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:1", "meta", torch.device("cpu")]),
                     st.one_of(st.sampled_from(["gpu", "cuda:-1", "", "cuda:x"]), st.text(max_size=6), ANY)),
    "seed": mostly(st.integers(0, 2**32 - 1), st.one_of(st.integers(-2, -1), st.just(2**32), ANY)),
    "max_prompt_len": mostly(st.integers(1, 4096), st.one_of(st.integers(-1, 0), ANY)),
    "max_response_len": mostly(st.integers(1, 4096), st.one_of(st.integers(-1, 0), ANY)),
    "micro_batch_tokens": mostly(st.one_of(st.none(), st.integers(1, 4096)), st.one_of(st.integers(-1, 0), ANY)),
    "micro_batch_size": mostly(st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.integers(-1, 0), ANY)),
    "gradient_checkpointing": mostly(st.booleans()),
    "options": mostly(st.dictionaries(st.text(max_size=3), ANY, max_size=2),
                      st.one_of(st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2), ANY)),
}


def build_part(cls: type, rules: dict[str, Callable[[object], bool]], kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)`` checked against ``rules``; the object, or None when it was (rightly) refused."""
    bad = [f for f, v in kwargs.items() if not rules[f](v)]
    obj, err = outcome(lambda: cls(**kwargs))
    if bad:
        assert err is not None, f"{cls.__name__}({kwargs}) was accepted, but {bad} are invalid"
        typed(err, *[f"{cls.__name__}.{f}" for f in bad])
        assert isinstance(err, ConfigError)
        return None
    assert err is None, f"{cls.__name__}({kwargs}) is valid but was refused: {err!r}"
    return obj


@given(data=st.data(), kwargs=st.fixed_dictionaries({}, optional=SPEC_VALUES),
       model_path=mostly(st.sampled_from(["model", Path("/m")]), st.one_of(st.just(""), ANY), 10),
       role=mostly(st.sampled_from(["actor", "rollout", "reward", "critic", "reference"]), st.one_of(st.just("trainer"), ANY), 10))
@settings(max_examples=1200, deadline=None, suppress_health_check=HEALTH)
def test_engine_spec_takes_any_kwargs(
    data: st.DataObject, kwargs: dict[str, Any], model_path: Any, role: Any, tally: Counter[str]
) -> None:
    kwargs = {"model_path": model_path, "role": role, **kwargs}
    for name, cls, rules, values in (("parallel", ParallelSizes, PARALLEL_RULES, PARALLEL_VALUES),
                                     ("optim", OptimConfig, OPTIM_RULES, OPTIM_VALUES)):
        how = data.draw(st.sampled_from(["default", "default", "built", "built", "junk"]), label=name)
        if how == "junk":
            kwargs[name] = data.draw(ANY, label=name)
        elif how == "built":
            part = build_part(cls, rules, data.draw(st.fixed_dictionaries({}, optional=values), label=f"{name} kwargs"))
            if part is None:
                tally["fuzz/api engine spec"] += 1
                return
            kwargs[name] = part
    bad = [f for f, v in kwargs.items() if not SPEC_RULES[f](v)]
    spec, err = outcome(lambda: EngineSpec(**kwargs))
    if not bad:
        assert err is None, f"{kwargs} is valid but was refused: {err!r}"
        assert isinstance(spec.model_path, str) and isinstance(spec.device, str)
        return
    tally["fuzz/api engine spec"] += 1
    assert err is not None, f"{kwargs} was accepted, but {bad} are invalid"
    assert isinstance(err, ConfigError)
    typed(err, *[f"EngineSpec.{f}" for f in bad])


# ----------------------------------------------------------------------------- TensorBatch construction
DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32, torch.float64, torch.float16,
          torch.bfloat16, torch.complex64)
DIM_OF = {"batch": 0, "prompt": 1, "response": 2}


@dataclass
class Drawn:
    """A generated constructor call and what the oracle expects of it."""

    tensors: Any
    extras: Any
    meta: Any
    batch_size: Any
    culprits: list[str]  # strings one of which the error must contain; empty = valid


def draw_tensor(data: st.DataObject, spec_dims: tuple[str, ...] | None, dtype: torch.dtype | None,
                sizes: tuple[int, int, int]) -> torch.Tensor:
    """A tensor for a field: usually its declared rank and dtype at the batch's sizes, sometimes not."""
    if spec_dims is None or data.draw(st.integers(0, 39)) == 39:
        shape = tuple(data.draw(st.lists(st.integers(0, 3), max_size=3)))
    else:
        shape = tuple(data.draw(st.integers(0, 4)) if data.draw(st.integers(0, 39)) == 39 else sizes[DIM_OF[d]]
                      for d in spec_dims)
    if dtype is None or data.draw(st.integers(0, 39)) == 39:
        dtype = data.draw(st.sampled_from(DTYPES))
    if dtype == torch.bool:
        return torch.full(shape, data.draw(st.booleans()), dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        fill = data.draw(st.sampled_from([0.0, 1.0, -2.5, math.nan, math.inf, -math.inf]))
        t = torch.zeros(shape, dtype=dtype)
        if t.numel() and data.draw(st.booleans()):
            t.view(-1)[data.draw(st.integers(0, t.numel() - 1))] = fill
        return t
    return torch.full(shape, data.draw(st.sampled_from([0, 1, 5])), dtype=dtype)


def draw_construction(data: st.DataObject) -> Drawn:
    sizes = (data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)))
    names = data.draw(mostly(st.lists(mostly(st.sampled_from(sorted(FIELDS)), st.one_of(st.text(max_size=6), st.integers(0, 3)), 5),
                                      min_size=1, max_size=4, unique_by=lambda x: (type(x), x)), st.just([]), 10))
    tensors: dict[Any, Any] = {}
    culprits: list[str] = []
    dims_seen: dict[str, dict[int, list[str]]] = {}
    for name in names:
        spec = FIELDS.get(name) if isinstance(name, str) else None
        if data.draw(st.integers(0, 39)) == 39:
            value: Any = data.draw(ANY, label="not a tensor")
        else:
            value = draw_tensor(data, spec.dims if spec else None, spec.dtype if spec else None, sizes)
        tensors[name] = value
        if not isinstance(name, str):
            culprits.append("field names must be strings")
        elif spec is None or not isinstance(value, torch.Tensor) or value.dim() != len(spec.dims) \
                or value.dtype != spec.dtype:
            culprits.append(repr(name))
        else:
            for dim, size in zip(spec.dims, value.shape, strict=True):
                dims_seen.setdefault(dim, {}).setdefault(size, []).append(repr(name))
    field_size: int | None = None
    for dim, by_size in dims_seen.items():
        if len(by_size) > 1:
            culprits.extend(n for ns in by_size.values() for n in ns)
        elif dim == "batch":
            field_size = next(iter(by_size))
    whole = data.draw(mostly(st.just("dict"), st.just("junk"), 5), label="tensors")
    tensors_arg: Any = tensors if whole == "dict" else data.draw(st.one_of(st.lists(st.integers(), max_size=2),
                                                                        st.text(max_size=3), st.none(), st.integers()))
    if whole != "dict":
        culprits.append("TensorBatch tensors")
    meta = data.draw(mostly(st.sampled_from([None, BatchMeta(), BatchMeta(temperature=0.5)]), percent_bad=5), label="meta")
    if meta is not None and not isinstance(meta, BatchMeta):
        culprits.append("TensorBatch meta")
    batch_size = data.draw(mostly(st.sampled_from([None, None, sizes[0]]), st.one_of(st.integers(-1, 4), ANY), 10),
                           label="batch_size")
    bs_ok = batch_size is None or int_in(0)(batch_size)
    if not bs_ok:
        culprits.append("batch_size")
    per_sample = st.lists(st.integers(), min_size=sizes[0], max_size=sizes[0])
    extras = data.draw(mostly(
        st.one_of(st.none(), st.dictionaries(mostly(st.text(max_size=3), st.integers(0, 2), 5),
                                             mostly(per_sample, st.one_of(st.lists(st.integers(), max_size=4), ANY), 10),
                                             max_size=2)),
        st.one_of(st.text(max_size=2), st.lists(st.integers(), max_size=2)), 5,
    ), label="extras")
    if not culprits:  # the size checks below only run for otherwise valid calls
        expected = field_size if field_size is not None else batch_size
        if extras is not None and not isinstance(extras, Mapping):
            culprits.append("extras")
        else:
            for key, values in (extras or {}).items():
                if not isinstance(key, str):
                    culprits.append("extras keys")
                    break
                if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                    culprits.append(f"extra {key!r}")
                    break
                if expected is not None and len(values) != expected:
                    culprits.append(f"extra {key!r}")
                    break
                expected = len(values)
        if not culprits:
            if expected is None:
                culprits.append("batch_size=")
            elif batch_size is not None and batch_size != expected:
                culprits.append("batch_size")
    return Drawn(tensors_arg, extras, meta, batch_size, culprits)


@given(data=st.data())
@settings(max_examples=1200, deadline=None, suppress_health_check=HEALTH)
def test_tensor_batch_takes_any_construction(data: st.DataObject, tally: Counter[str]) -> None:
    d = draw_construction(data)
    batch, err = outcome(lambda: TensorBatch(d.tensors, d.extras, d.meta, batch_size=d.batch_size))
    if d.culprits:
        tally["fuzz/api batch construction"] += 1
        assert err is not None, f"accepted, but the oracle expected an error naming one of {d.culprits}"
        assert isinstance(err, BatchValidationError), repr(err)
        typed(err, *d.culprits)
        return
    assert err is None, f"a valid construction was refused: {err!r}"
    # Values are checked at the boundary: NaN/inf, negative ids, padding and empty prompts.
    non_finite = [n for n, t in batch.items() if FIELDS[n].kind == "float" and not bool(torch.isfinite(t).all())]
    _, check_err = outcome(lambda: batch.check(where="fuzz", vocab_size=8))
    if non_finite:
        tally["fuzz/api batch values"] += 1
        assert check_err is not None, f"check() passed a batch with NaN/inf in {non_finite}"
    if check_err is not None:
        assert isinstance(check_err, BatchValidationError), repr(check_err)
        typed(check_err, *batch)
        if isinstance(check_err, NonFiniteError):
            assert any(repr(n) in str(check_err) for n in non_finite), str(check_err)


# ----------------------------------------------------------------------------- TensorBatch ops
def base(seed: int) -> TensorBatch:
    return random_batch(batch_size=4, max_prompt=5, max_response=4, vocab_size=32, seed=seed, with_rl_fields=True,
                        group_size=2)


def index_arg() -> st.SearchStrategy[Any]:
    tensor = st.builds(lambda vals, dt: torch.tensor(vals).to(dt), st.lists(st.integers(-5, 5), max_size=4),
                       st.sampled_from(DTYPES[:-1]))
    part = st.one_of(st.none(), st.integers(-6, 6), BIG, FLOATS, st.text(max_size=1))
    return st.one_of(st.lists(SMALL_OR_HUGE, max_size=4), st.lists(st.integers(-5, 5), max_size=4), tensor,
                     st.builds(slice, part, part, part), st.just(np.array([0, 1])), SMALL_OR_HUGE, JUNK)


def half(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return mostly(good, bad, 50)


NAMES = st.one_of(st.sampled_from(sorted(FIELDS)), st.text(max_size=4), st.integers(0, 2), st.none())
HAS = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages", "group_ids"]  # fields base() has
OPS: dict[str, tuple[st.SearchStrategy[Any], Callable[[TensorBatch, Any], Any], tuple[str, ...]]] = {
    # op: (argument: valid or anything, half and half; the call; what an error may name)
    "index": (half(st.lists(st.integers(-4, 3), max_size=6), index_arg()), lambda b, a: b.index(a),
              ("index()", "index() indices")),
    "split": (half(st.lists(st.integers(0, 4), max_size=3).map(lambda xs: [*xs, 4 - sum(xs)]),
                     st.one_of(st.lists(SMALL_OR_HUGE, max_size=4), ANY)), lambda b, a: b.split(a), ("split()",)),
    "chunk": (half(st.integers(1, 6), SMALL_OR_HUGE), lambda b, a: b.chunk(a), ("chunk(",)),
    "repeat_interleave": (half(st.integers(1, 4), SMALL_OR_HUGE), lambda b, a: b.repeat_interleave(a),
                          ("repeat_interleave(",)),
    "pad_to_multiple": (half(st.integers(1, 6), SMALL_OR_HUGE), lambda b, a: b.pad_to_multiple(a), ("pad_to_multiple(",)),
    "unpad": (half(st.integers(0, 4), SMALL_OR_HUGE), lambda b, a: b.unpad(a), ("unpad(",)),
    "pad_prompts": (half(st.integers(5, 40), SMALL_OR_HUGE), lambda b, a: b.pad_prompts(a), ("pad_prompts(",)),
    "micro_batches": (half(st.one_of(st.fixed_dictionaries({"max_tokens": st.integers(9, 100)}),
                                       st.fixed_dictionaries({"size": st.integers(1, 5)}, optional={"trim": st.booleans()})),
                             st.fixed_dictionaries({}, optional={"max_tokens": SMALL_OR_HUGE, "size": SMALL_OR_HUGE,
                                                                 "trim": ANY})),
                      lambda b, a: b.micro_batches(**a), ("micro_batches()", "max_tokens", "micro-batch budget")),
    "select": (half(st.tuples(st.lists(st.sampled_from(HAS), max_size=3), st.booleans()),
                      st.tuples(st.lists(NAMES, max_size=3), st.one_of(st.lists(NAMES, max_size=2), ANY))),
               lambda b, a: b.select(*a[0], extras=a[1]), ("select()", "extras")),
    "drop": (half(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3), st.lists(NAMES, max_size=3)),
             lambda b, a: b.drop(*a), ("drop()",)),
    "require": (half(st.lists(st.sampled_from(HAS), max_size=3), st.lists(NAMES, max_size=3)),
                lambda b, a: b.require(*a, where="fuzz-require"), ("fuzz-require",)),
    "getitem": (half(st.sampled_from(HAS), NAMES), lambda b, a: b[a], ("is not in this batch",)),
    "update": (half(st.just(("scores", torch.float32, 4, None)),
                      st.tuples(NAMES, st.sampled_from(DTYPES), st.integers(0, 5), st.one_of(st.none(), ANY))),
               lambda b, a: b.update({a[0]: torch.zeros((a[2], b.response_len)[: 1 + (a[2] % 2)], dtype=a[1])}, meta=a[3]),
               ("update()", "field")),
    "with_meta": (half(st.dictionaries(st.sampled_from(["temperature", "top_p"]), st.floats(0.01, 1), max_size=2),
                         st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "step", "pad_token_id", "temp"]),
                                         st.one_of(st.floats(0, 2), ANY), max_size=2)),
                  lambda b, a: b.with_meta(**a), ("BatchMeta.", "with_meta()")),
    "to": (half(st.just("cpu"), st.one_of(st.sampled_from(["cuda", "cuda:7", "gpu", ""]), ANY)), lambda b, a: b.to(a),
           ("to() device",)),
    "concat": (half(st.lists(st.just("same"), max_size=2),
                      st.lists(st.one_of(st.sampled_from(["other_temperature", "fewer_fields"]), ANY), min_size=1, max_size=3)),
               lambda b, a: TensorBatch.concat([b, *[_variant(b, v) for v in a]]), ("concat()",)),
    "check": (half(st.tuples(st.sampled_from([None, 32]), st.just("fuzz-check")),
                     st.tuples(st.one_of(st.none(), st.integers(-1, 64), ANY),
                               st.one_of(st.just("fuzz-check"), st.integers(), st.none(), st.binary(max_size=2)))),
              lambda b, a: b.check(vocab_size=a[0], where=a[1]), ("check()", "fuzz-check")),
    "restore": (half(st.just([2, 2]), st.lists(st.one_of(st.integers(0, 4), ANY), max_size=3)),
                lambda b, a: b.micro_batches(size=2).restore([b.index(list(range(v))) if int_in(0, 4)(v) else v for v in a]),
                ("restore()",)),
}


def _variant(b: TensorBatch, kind: Any) -> Any:
    if kind == "same":
        return b
    if kind == "other_temperature":
        return b.with_meta(temperature=0.5)
    if kind == "fewer_fields":
        return b.drop("advantages")
    return kind


def snapshot(b: TensorBatch) -> tuple[dict[str, torch.Tensor], Any, BatchMeta]:
    return {k: v.clone() for k, v in b.items()}, b.extras, b.meta


def valid_result(out: Any) -> None:
    """What an op returned is a well-formed batch (or a tensor / list / micro-batches of them)."""
    if out is None:  # require()
        return
    if isinstance(out, tuple):  # pad_to_multiple
        out = out[0]
    parts = list(out) if isinstance(out, (list, Sequence)) or hasattr(out, "batches") else [out]
    for p in parts:
        if isinstance(p, TensorBatch):
            TensorBatch(dict(p), p.extras, p.meta, batch_size=p.batch_size)  # the structure holds
        else:
            assert isinstance(p, torch.Tensor), type(p)


@given(op=st.sampled_from(sorted(OPS)), seed=st.integers(0, 20), data=st.data())
@settings(max_examples=1200, deadline=None, suppress_health_check=HEALTH)
def test_tensor_batch_ops_take_any_arguments(op: str, seed: int, data: st.DataObject, tally: Counter[str]) -> None:
    batch = base(seed)
    before = snapshot(batch)
    strategy, call, names = OPS[op]
    arg = data.draw(strategy, label="argument")
    out, err = outcome(lambda: call(batch, arg))
    if err is None:
        valid_result(out)
    else:
        tally[f"fuzz/api batch op ({op})"] += 1
        typed(err, *names)
        assert isinstance(err, (BatchValidationError, RequestTooLargeError)), repr(err)
    after = snapshot(batch)
    assert before[1] == after[1] and before[2] == after[2], "an op changed its input's extras or meta"
    assert set(before[0]) == set(after[0]) and all(torch.equal(before[0][k], after[0][k]) for k in before[0]), (
        "an op changed its input batch"
    )


def test_an_oversized_generate_request_is_refused_with_its_estimate() -> None:
    prompts = base(0).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(n=MAX_SAMPLES_PER_PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    with pytest.raises(RequestTooLargeError, match=r"4 prompts x n=65536 = 262144 samples of 5 prompt \+ 1048576 new "
                                                    r"tokens \+ logits of 262144 rows x 32000 tokens needs at least "
                                                    r"3\.39e\+03 GiB .* of cpu memory is available"):
        check_generate_memory(prompts, params, device="cpu", vocab_size=32000, where="fuzz")
    need = 64 * (5 * 9 + 1024 * 13) + 16 * 10_000 * 8  # 64 rows of prompt + response slots, logits of 16 rows
    with pytest.raises(RequestTooLargeError, match=rf"needs at least .* \({need} bytes\), but only .* \(1048576 bytes\)"):
        check_generate_memory(prompts, SamplingParams(n=16, max_new_tokens=1024), device="cpu", vocab_size=10_000,
                              rows_at_once=16, available=2**20)
    assert check_generate_memory(prompts, SamplingParams(n=2, max_new_tokens=8), device="cpu") == 4 * 2 * (5 * 9 + 8 * 13)
    with pytest.raises(ConfigError, match=r"SamplingParams.n must be an integer in \[1, 65536\], got 1000000000"):
        SamplingParams(n=10**9)  # refused before anything is allocated


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_that_generate_together_refuse_together(tally: Counter[str]) -> None:
    """With ``group=``, ranks that see different free memory take the smallest, so all refuse alike."""
    ranks = launch_torchrun(Path(__file__).parent / "memory_worker.py", 2, timeout=120)
    tally["fuzz/api oversized request (2 ranks)"] += 1
    assert ranks[0]["alone"].startswith("a 2 GiB request needs at least 2 GiB") and ranks[1]["alone"] == "fits"
    for r in ranks:
        assert "but only 1 GiB" in r["together"], r


# ----------------------------------------------------------------------------- registry
INSTALLED = set(available_backends())
KINDS: tuple[ComponentKind, ...] = ("advantage", "policy_loss", "kl", "aggregation", "value_loss")
UNINSTALLED = st.text(min_size=1, max_size=8).filter(lambda s: s not in INSTALLED)
BACKEND_NAMES = st.one_of(st.sampled_from(sorted(INSTALLED) or ["hf"]), UNINSTALLED, st.just(""), JUNK, st.integers())
SPECS = st.one_of(st.builds(lambda r: EngineSpec(model_path="unused", role=r),
                            st.sampled_from(["actor", "reference", "critic", "rollout", "reward"])),
                  st.dictionaries(st.just("role"), st.just("actor")), ANY)
BUILDERS = {"rollout": (get_rollout_engine, ("rollout",)), "training": (get_training_engine, ("actor", "reference", "critic")),
            "reward": (get_reward_engine, ("reward",))}


@given(call=st.sampled_from(["backend", "build", "weight_sync", "component", "parse_options", "register"]), data=st.data())
@settings(max_examples=600, deadline=None, suppress_health_check=HEALTH)
def test_registry_takes_any_names_and_specs(call: str, data: st.DataObject, tally: Counter[str]) -> None:
    if call == "backend":
        name = data.draw(BACKEND_NAMES)
        out, err = outcome(lambda: get_backend(name))
        if isinstance(name, str) and name in INSTALLED:
            assert err is None and out.spec.name == name
            return
        tally["fuzz/api registry"] += 1
        assert err is not None
        typed(err, "backend name", f"unknown verl backend {name!r}")
    elif call == "build":
        which = data.draw(st.sampled_from(sorted(BUILDERS)))
        builder, roles = BUILDERS[which]
        name = data.draw(st.one_of(UNINSTALLED, st.just(""), JUNK))  # never builds a real engine
        spec = data.draw(SPECS)
        tally["fuzz/api registry"] += 1
        _, err = outcome(lambda: builder(name, spec))
        assert err is not None, f"{which}({name!r}, {spec!r}) built something"
        if not isinstance(spec, EngineSpec):
            typed(err, "spec must be an EngineSpec")
        elif spec.role not in roles:
            typed(err, "needs role")
        else:
            typed(err, "backend name", f"unknown verl backend {name!r}")
    elif call == "weight_sync":
        source, target = data.draw(st.one_of(UNINSTALLED, JUNK)), data.draw(st.one_of(UNINSTALLED, JUNK))
        out, err = outcome(lambda: get_weight_sync(source, target))
        if all(isinstance(x, str) and x for x in (source, target)):
            assert err is None and hasattr(out, "sync")  # the canonical stream serves any pair
            return
        tally["fuzz/api registry"] += 1
        typed(err or AssertionError("accepted"), "weight sync source", "weight sync target")
    elif call == "component":
        registry = Registry(autoload=False)
        kind = data.draw(st.one_of(st.sampled_from(KINDS), st.text(max_size=6), JUNK))
        known = sorted(registry.components(kind)) if kind in KINDS else []
        name = data.draw(st.one_of(st.sampled_from(known or ["x"]), st.text(max_size=6), JUNK))
        out, err = outcome(lambda: registry.component(kind, name))
        if kind in KINDS and isinstance(name, str) and name in known:
            assert err is None and out.name == name
            return
        tally["fuzz/api registry"] += 1
        typed(err or AssertionError("accepted"), "component kind", f"{kind} name", f"unknown {kind} {name!r}")
    elif call == "parse_options":
        options = data.draw(st.one_of(
            st.fixed_dictionaries({}, optional={"lr": st.one_of(st.floats(-1, 1), ANY), "eps": st.one_of(st.floats(0, 1), ANY)}),
            st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), st.integers(), max_size=2), ANY))
        out, err = outcome(lambda: parse_options(OptimConfig, options, where="fuzz options"))
        if isinstance(options, Mapping) and all(isinstance(k, str) and k in OPTIM_RULES and OPTIM_RULES[k](v)
                                                for k, v in options.items()):
            assert err is None and isinstance(out, OptimConfig)
            return
        tally["fuzz/api registry"] += 1
        assert isinstance(err, ConfigError), repr(err)
        typed(err, "fuzz options", "OptimConfig.")
    else:
        registry = Registry(autoload=False)
        name = data.draw(st.one_of(st.text(min_size=1, max_size=6), st.just(""), JUNK))
        _, err = outcome(lambda: registry.register(object(), name))
        if isinstance(name, str) and name:
            assert err is None
            return
        tally["fuzz/api registry"] += 1
        typed(err or AssertionError("accepted"), "plugin name")


def test_unknown_names_are_refused_with_the_installed_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown verl backend 'hff'; installed: "):
        get_backend("hff")
    with pytest.raises(UnknownNameError, match=r"unknown algorithm component kind 'loss' \(str\); kinds: advantage"):
        Registry(autoload=False).component("loss", "ppo")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"spec must be an EngineSpec, got \{'role': 'rollout'\} \(dict\)"):
        get_rollout_engine("hf", {"role": "rollout"})  # type: ignore[arg-type]
