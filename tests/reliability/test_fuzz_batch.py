"""Hypothesis-generated bad input to TensorBatch: construction, value checks, every op, meta and load.

Each bad input must end in a BatchValidationError (a VerlError and a ValueError, so existing
``except ValueError`` code keeps working) whose message names what was wrong; never a bare
assert, a TypeError/IndexError from deep inside torch, or a batch that half-applied the change.
"""

from __future__ import annotations

import io
import math
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_conformance.testkit import random_batch
from verl_core import (
    MIN_TEMPERATURE,
    BatchMeta,
    BatchValidationError,
    NonFiniteError,
    TensorBatch,
    VerlError,
)
from verl_core.kernel.schema import FIELDS
from verl_core.trainer.batching.batch_io import load_batch, save_batch

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool, torch.complex64)
VOCAB = 64


def base(seed: int, size: int = 4) -> TensorBatch:
    return random_batch(batch_size=size, max_prompt=6, max_response=5, vocab_size=VOCAB, seed=seed,
                        with_rl_fields=True, group_size=2 if size % 2 == 0 else 1)


def typed(err: BaseException) -> None:
    """The error is one of the SDK's typed errors, compatible with ``except ValueError``."""
    assert isinstance(err, VerlError) and isinstance(err, ValueError), repr(err)
    assert str(err), "an error must say what was wrong"


def tensor_like(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.ones(shape, dtype=dtype)


@given(data=st.data(), seed=st.integers(0, 50))
@FUZZ
def test_a_bad_field_is_rejected_at_construction(data: st.DataObject, seed: int, tally: Counter[str]) -> None:
    batch = base(seed)
    tensors = dict(batch)
    name = data.draw(st.sampled_from(sorted(tensors)), label="field")
    spec = FIELDS[name]
    kind = data.draw(st.sampled_from(["dtype", "rank", "not_a_tensor", "unknown_key", "length"]), label="kind")
    t = tensors[name]
    if kind == "dtype":
        dtype = data.draw(st.sampled_from([d for d in DTYPES if d != spec.dtype]))
        tensors[name] = t.to(dtype) if dtype != torch.complex64 else t.to(torch.float32).to(dtype)
    elif kind == "rank":
        rank = data.draw(st.sampled_from([r for r in range(5) if r != len(spec.dims)]))
        tensors[name] = tensor_like(data.draw, tuple([2] * rank), spec.dtype)
    elif kind == "not_a_tensor":
        tensors[name] = data.draw(st.one_of(
            st.integers(), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
            st.lists(st.integers(-3, 3), max_size=4), st.just(t.tolist()), st.just(t.numpy()),
        ))
    elif kind == "unknown_key":
        name = data.draw(st.text(min_size=1, max_size=12).filter(lambda s: s not in FIELDS), label="unknown")
        tensors[name] = t
    else:  # one dim of this field disagrees with the other fields
        dim = data.draw(st.integers(0, t.dim() - 1))
        shape = list(t.shape)
        shape[dim] = data.draw(st.sampled_from([n for n in range(0, 9) if n != shape[dim]]))
        tensors[name] = tensor_like(data.draw, tuple(shape), spec.dtype)
    tally[f"fuzz/batch construction ({kind})"] += 1
    with pytest.raises(BatchValidationError) as info:
        TensorBatch(tensors, batch.extras, batch.meta)
    typed(info.value)
    assert repr(name) in str(info.value) or name in str(info.value), str(info.value)


@given(seed=st.integers(0, 50), data=st.data())
@FUZZ
def test_bad_extras_are_rejected(seed: int, data: st.DataObject, tally: Counter[str]) -> None:
    batch = base(seed)
    bad = data.draw(st.one_of(
        st.lists(st.integers(), max_size=8).filter(lambda v: len(v) != batch.batch_size),
        st.text(max_size=6), st.integers(), st.none(), st.binary(max_size=4),
    ))
    tally["fuzz/batch extras"] += 1
    with pytest.raises(BatchValidationError) as info:
        TensorBatch(dict(batch), {"answer": bad}, batch.meta)
    typed(info.value)
    with pytest.raises(BatchValidationError):
        batch.update(extras={"answer": bad})


@given(seed=st.integers(0, 50), data=st.data())
@FUZZ
def test_check_rejects_every_bad_value(seed: int, data: st.DataObject, tally: Counter[str]) -> None:
    batch = base(seed)
    kind = data.draw(st.sampled_from(["non_finite", "out_of_vocab", "negative_id", "prompt_padding",
                                      "response_padding", "negative_group"]), label="kind")
    rows = batch.batch_size
    row = data.draw(st.integers(0, rows - 1), label="row")
    expected_error: type[BatchValidationError] = BatchValidationError
    if kind == "non_finite":
        name = data.draw(st.sampled_from(sorted(k for k in batch if FIELDS[k].kind == "float")))
        t = batch[name].clone()
        col = data.draw(st.integers(0, t.shape[1] - 1)) if t.dim() == 2 else None
        value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        if col is None:
            t[row] = value
        else:
            t[row, col] = value  # masked positions too: NaN anywhere is invalid
        expected_error = NonFiniteError
    elif kind in ("out_of_vocab", "negative_id"):
        name = data.draw(st.sampled_from(["prompt_ids", "response_ids"]))
        t = batch[name].clone()
        col = data.draw(st.integers(0, t.shape[1] - 1))
        t[row, col] = data.draw(st.integers(VOCAB, 2**40) if kind == "out_of_vocab" else st.integers(-(2**40), -1))
    elif kind == "prompt_padding":
        name = "prompt_mask"
        t = batch[name].clone()
        lengths = t.sum(1)
        cand = [r for r in range(rows) if lengths[r] >= 2]
        if not cand:
            return
        row = data.draw(st.sampled_from(cand))
        t[row, -1] = False  # a hole on the right of a left-padded prompt
    elif kind == "response_padding":
        name = "response_mask"
        t = batch[name].clone()
        lengths = t.sum(1)
        cand = [r for r in range(rows) if lengths[r] >= 2]
        if not cand:
            return
        row = data.draw(st.sampled_from(cand))
        t[row, 0] = False  # a hole on the left of a right-padded response
    else:
        name = "group_ids"
        t = batch[name].clone()
        t[row] = data.draw(st.integers(-(2**40), -1))
    bad = batch.update({name: t})  # structure is fine: only the value pass can catch it
    tally[f"fuzz/batch check ({kind})"] += 1
    with pytest.raises(expected_error) as info:
        bad.check(where="fuzz", vocab_size=VOCAB)
    typed(info.value)
    assert name in str(info.value) and "fuzz" in str(info.value)


OPS: dict[str, Any] = {
    "index_out_of_range": lambda b, n: b.index([0, b.batch_size + n]),
    "index_negative": lambda b, n: b.index([-(b.batch_size + 1 + n)]),
    "index_2d": lambda b, n: b.index(torch.zeros(2, 2, dtype=torch.int64)),
    "split_wrong_sum": lambda b, n: b.split([b.batch_size + n + 1]),
    "split_negative": lambda b, n: b.split([-n - 1, b.batch_size + n + 1]),
    "chunk_zero": lambda b, n: b.chunk(-n),
    "repeat_zero": lambda b, n: b.repeat_interleave(-n),
    "micro_tokens_too_small": lambda b, n: b.micro_batches(max_tokens=1 + n % 2),
    "micro_tokens_nonpositive": lambda b, n: b.micro_batches(max_tokens=-n),
    "micro_size_zero": lambda b, n: b.micro_batches(size=-n),
    "micro_both": lambda b, n: b.micro_batches(size=1, max_tokens=100 + n),
    "micro_none": lambda b, n: b.micro_batches(),
    "pad_divisor": lambda b, n: b.pad_to_multiple(-n),
    "unpad_too_many": lambda b, n: b.unpad(b.batch_size + n + 1),
    "unpad_negative": lambda b, n: b.unpad(-n - 1),
    "select_missing": lambda b, n: b.select("prompt_ids", "log_probs"),
    "select_extras_missing": lambda b, n: b.select("prompt_ids", extras=["nope"]),
    "require_missing": lambda b, n: b.require("values", "log_probs", where="fuzz"),
    "update_wrong_rows": lambda b, n: b.update(scores=torch.zeros(b.batch_size + n + 1)),
    "update_wrong_dtype": lambda b, n: b.update(scores=torch.zeros(b.batch_size, dtype=torch.float64)),
    "concat_none": lambda b, n: TensorBatch.concat([]),
    "concat_fields": lambda b, n: TensorBatch.concat([b, b.drop("scores")]),
    "concat_extras": lambda b, n: TensorBatch.concat([b, b.update(extras={"x": list(range(b.batch_size))})]),
    "concat_temperature": lambda b, n: TensorBatch.concat([b, b.with_meta(temperature=0.5 + n)]),
    "concat_pad_id": lambda b, n: TensorBatch.concat([b, b.with_meta(pad_token_id=n + 1)]),
    "with_meta_bad_temperature": lambda b, n: b.with_meta(temperature=-float(n)),
    "with_meta_unknown_key": lambda b, n: b.with_meta(temprature=1.0),
    "with_meta_wrong_type": lambda b, n: b.with_meta(top_k="5"),
    "restore_wrong_sizes": lambda b, n: b.micro_batches(size=1).restore([b]),
}


@given(op=st.sampled_from(sorted(OPS)), seed=st.integers(0, 50), n=st.integers(0, 3))
@settings(max_examples=250, deadline=None)
def test_every_op_rejects_bad_arguments(op: str, seed: int, n: int, tally: Counter[str]) -> None:
    batch = base(seed)
    before = {k: v.clone() for k, v in batch.items()}
    tally[f"fuzz/batch op ({op})"] += 1
    with pytest.raises(BatchValidationError) as info:
        OPS[op](batch, n)
    typed(info.value)
    # nothing half-applied: the input batch is untouched
    assert set(batch) == set(before) and all(torch.equal(batch[k], before[k]) for k in before)


@given(
    temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.none()),
    top_p=st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.text(max_size=2)),
    top_k=st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=2), st.none()),
    pad_token_id=st.one_of(st.integers(-5, 5), st.floats(), st.none()),
    step=st.one_of(st.integers(-3, 3), st.text(max_size=2)),
)
@settings(max_examples=300, deadline=None)
def test_batch_meta_accepts_only_valid_values(
    temperature: Any, top_p: Any, top_k: Any, pad_token_id: Any, step: Any, tally: Counter[str]
) -> None:
    def is_num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    valid = (
        is_num(temperature) and math.isfinite(temperature) and temperature >= MIN_TEMPERATURE
        and is_num(top_p) and 0 < top_p <= 1
        and is_int(top_k) and top_k >= 0
        and is_int(pad_token_id) and pad_token_id >= 0
        and is_int(step) and step >= 0
    )
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, pad_token_id=pad_token_id, step=step)
    if valid:
        BatchMeta(**kwargs)
        return
    tally["fuzz/batch meta"] += 1
    with pytest.raises(BatchValidationError) as info:
        BatchMeta(**kwargs)
    typed(info.value)


class _Boom:
    """Unpickling this runs code: a batch file must never be able to do that."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path("/tmp/verl-reliability-pwned"),))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@given(seed=st.integers(0, 20), data=st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_load_rejects_corrupt_truncated_and_malicious_files(
    seed: int, data: st.DataObject, tmp_path: Path, tally: Counter[str]
) -> None:
    batch = base(seed)
    good = tmp_path / f"good-{seed}.pt"
    save_batch(batch, good)
    raw = good.read_bytes()
    kind = data.draw(st.sampled_from(["truncated", "bit_flip", "random_bytes", "pickle", "wrong_payload",
                                      "empty"]), label="kind")
    if kind == "truncated":
        blob = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "bit_flip":
        pos = data.draw(st.integers(0, 200))  # the zip header and the pickled index
        blob = raw[:pos] + bytes([raw[pos] ^ 0xFF]) + raw[pos + 1:]
    elif kind == "random_bytes":
        blob = data.draw(st.binary(min_size=0, max_size=256))
    elif kind == "pickle":
        buf = io.BytesIO()
        torch.save({"format": "verl.TensorBatch/1", "tensors": {}, "evil": _Boom()}, buf)
        blob = buf.getvalue() if data.draw(st.booleans()) else pickle.dumps(_Boom())
    elif kind == "wrong_payload":
        buf = io.BytesIO()
        torch.save(data.draw(st.sampled_from([[1, 2], {"format": "other"}, torch.zeros(3),
                                              {"format": "verl.TensorBatch/1", "meta": "{}"}])), buf)
        blob = buf.getvalue()
    else:
        blob = b""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(blob)
    pwned = Path("/tmp/verl-reliability-pwned")
    pwned.unlink(missing_ok=True)
    tally[f"fuzz/batch load ({kind})"] += 1
    error: BatchValidationError | None = None
    try:
        loaded = load_batch(bad)
    except BatchValidationError as e:
        error = e
    if error is not None:
        typed(error)
        assert "bad.pt" in str(error)
    else:
        # a flipped bit in a tensor's bytes may still load: then it is a valid batch, never garbage types
        assert kind == "bit_flip", kind
        loaded.check(where="reload")
    assert not pwned.exists(), "loading a batch file ran code"
