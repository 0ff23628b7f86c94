"""TensorBatch crosses processes as tensors plus JSON extras and meta, and is validated on arrival."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_conformance.testkit import random_batch
from verl_core import BatchMeta, BatchValidationError, TensorBatch
from verl_core.trainer.executor import WIRE_FORMAT, from_wire, to_wire


def assert_same(a: TensorBatch, b: TensorBatch) -> None:
    assert a.batch_size == b.batch_size
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    assert dict(a.extras) == dict(b.extras)
    assert a.meta == b.meta


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 6), prompt=st.integers(1, 5), response=st.integers(1, 5), seed=st.integers(0, 10_000),
    rl=st.booleans(), answers=st.lists(st.text(max_size=4) | st.integers() | st.none(), min_size=6, max_size=6),
    temperature=st.floats(0.1, 2.0), step=st.integers(0, 1000),
)
def test_round_trip_keeps_every_field_extra_and_meta(
    size: int, prompt: int, response: int, seed: int, rl: bool, answers: list[Any], temperature: float, step: int
) -> None:
    b = random_batch(batch_size=max(size, 1), max_prompt=prompt, max_response=response, seed=seed,
                     with_rl_fields=rl, temperature=temperature)
    b = b.index(slice(0, size)).update(extras={"answer": answers[:size], "meta": [{"k": [i]} for i in range(size)]})
    b = b.with_meta(step=step, weight_version=seed)
    wire = to_wire(b)
    assert wire["format"] == WIRE_FORMAT
    # only plain data travels: arrays, strings, ints
    assert all(type(f["data"]).__module__ == "numpy" for f in wire["fields"].values())
    assert all(isinstance(v, str) for v in wire["extras"].values())
    assert_same(from_wire(wire), b)


def test_arbitrary_objects_in_extras_are_refused_naming_the_extra() -> None:
    b = random_batch(batch_size=2).update(extras={"handle": [object(), object()]})
    with pytest.raises(BatchValidationError, match="extra 'handle' cannot cross a process boundary"):
        to_wire(b)


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda w: {**w, "format": "pickle"}, "not a verl.TensorBatch.wire/1 batch"),
    (lambda w: {**w, "fields": {**w["fields"], "prompt_ids": {"dtype": "object", "data": None}}}, "no known dtype"),
    (lambda w: {**w, "fields": {**w["fields"], "prompt_ids": {**w["fields"]["prompt_ids"], "dtype": "float32"}}},
     "declared float32 but its array holds torch.int64"),
    (lambda w: {**w, "fields": {**w["fields"], "prompt_mask": {"dtype": "bool", "data": w["fields"]["prompt_mask"]["data"][:1]}}},
     "dim 'batch'"),
    (lambda w: {**w, "meta": '{"evil": 1}'}, "keys BatchMeta does not know"),
    (lambda w: {**w, "fields": {**w["fields"], "values_x": w["fields"]["prompt_ids"]}}, "unknown field 'values_x'"),
])
def test_received_batches_are_validated(corrupt: Any, message: str) -> None:
    wire = to_wire(random_batch(batch_size=3))
    with pytest.raises(BatchValidationError, match=message):
        from_wire(corrupt(wire))


def test_through_the_object_store(ray_cluster: Any) -> None:
    from verl_core.trainer.executor import register_batch_serializer

    register_batch_serializer()
    b = random_batch(batch_size=4, with_rl_fields=True).update(extras={"answer": ["1", "2", "3", "4"]})
    b = b.with_meta(**{**dataclasses.asdict(BatchMeta()), "step": 3})
    assert_same(ray_cluster.get(ray_cluster.put(b)), b)

    # the receiver rebuilds through the validating constructor: a batch assembled without
    # validation (a float field holding int64) is rejected on arrival, not passed on
    bad = TensorBatch._trusted({**{k: b[k] for k in b}, "advantages": torch.zeros(4, b.response_len, dtype=torch.int64)},
                               {}, b.meta, 4)
    with pytest.raises(Exception, match="expected dtype torch.float32") as info:
        ray_cluster.get(ray_cluster.put(bad))
    chain: list[BaseException] = []
    e: BaseException | None = info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, BatchValidationError) for x in chain) or "BatchValidationError" in str(info.value)
