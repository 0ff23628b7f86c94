"""TensorBatch: ops as properties (hypothesis) and validation errors asserted on their messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import (
    BatchMeta,
    BatchValidationError,
    ConfigError,
    FieldSpec,
    NonFiniteError,
    TensorBatch,
    partition_by_token_budget,
    register_field,
)
from verl_core.trainer.batching.batch_io import load_batch, save_batch


def make_batch(
    sizes: list[tuple[int, int]], *, max_prompt: int | None = None, max_response: int | None = None,
    pad: int = 0, seed: int = 0, extras: bool = True,
) -> TensorBatch:
    """A batch with prompt/response real lengths ``sizes`` (left/right padded)."""
    g = torch.Generator().manual_seed(seed)
    n = len(sizes)
    P = max_prompt if max_prompt is not None else max([p for p, _ in sizes] + [0])
    R = max_response if max_response is not None else max([r for _, r in sizes] + [0])
    p_len = torch.tensor([p for p, _ in sizes], dtype=torch.int64).reshape(n)
    r_len = torch.tensor([r for _, r in sizes], dtype=torch.int64).reshape(n)
    pm = torch.arange(P).unsqueeze(0) >= (P - p_len).unsqueeze(1)
    rm = torch.arange(R).unsqueeze(0) < r_len.unsqueeze(1)
    fields = {
        "prompt_ids": torch.randint(3, 50, (n, P), generator=g).masked_fill(~pm, pad),
        "prompt_mask": pm,
        "response_ids": torch.randint(3, 50, (n, R), generator=g).masked_fill(~rm, pad),
        "response_mask": rm,
        "old_log_probs": torch.randn(n, R, generator=g) * rm,
        "scores": torch.randn(n, generator=g),
        "group_ids": torch.arange(n, dtype=torch.int64) // 2,
    }
    ext = {"answer": [f"a{i}" for i in range(n)]} if extras else None
    return TensorBatch(fields, ext, BatchMeta(pad_token_id=pad))


def assert_same(a: TensorBatch, b: TensorBatch) -> None:
    assert set(a) == set(b)
    assert a.batch_size == b.batch_size
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
    assert a.extras == b.extras
    assert a.meta == b.meta


lengths = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(lengths, st.lists(st.integers(0, 5), max_size=6))
def test_split_then_concat_is_identity(sizes: list[tuple[int, int]], cuts: list[int]) -> None:
    b = make_batch(sizes)
    n = b.batch_size
    parts, left = [], n
    for c in cuts:
        c = min(c, left)
        parts.append(c)
        left -= c
    parts.append(left)
    pieces = b.split(parts)
    assert [p.batch_size for p in pieces] == parts
    assert_same(TensorBatch.concat(pieces), b)


@settings(max_examples=40, deadline=None)
@given(lengths, st.integers(1, 7))
def test_chunk_sizes_differ_by_at_most_one(sizes: list[tuple[int, int]], n: int) -> None:
    b = make_batch(sizes)
    chunks = b.chunk(n)
    got = [c.batch_size for c in chunks]
    assert sum(got) == b.batch_size and max(got) - min(got) <= 1
    assert_same(TensorBatch.concat(chunks), b)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(12, 40))
def test_micro_batches_respect_budget_cover_once_and_restore(sizes: list[tuple[int, int]], budget: int) -> None:
    b = make_batch(sizes)
    mbs = b.micro_batches(max_tokens=budget)
    seen = sorted(mbs.order.tolist())
    assert seen == list(range(b.batch_size)), "every sample exactly once"
    for mb in mbs:
        longest = int(mb.seq_lengths().max())
        assert mb.batch_size * longest <= budget
        assert mb.prompt_len + mb.response_len <= max(b.prompt_len + b.response_len, 0)
    assert_same(mbs.restore(list(mbs)), b)
    assert 0 < mbs.utilisation() <= 1


def test_micro_batch_budget_smaller_than_a_sample_names_the_sample() -> None:
    b = make_batch([(2, 2), (5, 6)])
    with pytest.raises(BatchValidationError, match=r"sample 1 has 11 tokens.*max_tokens=8"):
        b.micro_batches(max_tokens=8)


def test_partition_utilisation_is_high_on_ragged_lengths() -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 4097, (4096,), generator=g).tolist()
    groups = partition_by_token_budget(lens, 16384)
    cost = sum(len(gr) * max(lens[i] for i in gr) for gr in groups)
    assert sum(lens) / cost >= 0.95
    assert all(len(gr) * max(lens[i] for i in gr) <= 16384 for gr in groups)


@settings(max_examples=40, deadline=None)
@given(lengths, st.integers(1, 5))
def test_pad_unpad_round_trip_and_padding_is_inert(sizes: list[tuple[int, int]], divisor: int) -> None:
    b = make_batch(sizes)
    padded, n_pad = b.pad_to_multiple(divisor)
    assert padded.batch_size % divisor == 0 and n_pad < divisor
    if n_pad:
        tail = padded.index(slice(b.batch_size, None))
        assert not bool(tail["response_mask"].any())
        assert not bool(tail["old_log_probs"].any())
    assert_same(padded.unpad(n_pad), b)


@settings(max_examples=40, deadline=None)
@given(lengths, st.integers(1, 4))
def test_repeat_interleave_keeps_groups(sizes: list[tuple[int, int]], n: int) -> None:
    b = make_batch(sizes)
    r = b.repeat_interleave(n)
    assert r.batch_size == b.batch_size * n
    assert torch.equal(r["group_ids"], b["group_ids"].repeat_interleave(n))
    assert torch.equal(r["sample_index"], torch.arange(n).repeat(b.batch_size))
    assert r.extras["answer"] == tuple(a for a in b.extras["answer"] for _ in range(n))
    assert torch.equal(r["prompt_ids"][::n], b["prompt_ids"])


@settings(max_examples=30, deadline=None)
@given(lengths, st.data())
def test_index_any_permutation_and_back(sizes: list[tuple[int, int]], data: st.DataObject) -> None:
    b = make_batch(sizes)
    perm = data.draw(st.permutations(range(b.batch_size)))
    shuffled = b.index(list(perm))
    inverse = torch.argsort(torch.tensor(perm))
    assert_same(shuffled.index(inverse), b)


def test_concat_repads_prompts_left_and_responses_right() -> None:
    a = make_batch([(2, 1)], pad=7)
    b = make_batch([(4, 3)], pad=7, seed=1)
    c = TensorBatch.concat([a, b])
    assert c.prompt_len == 4 and c.response_len == 3
    assert c["prompt_mask"][0].tolist() == [False, False, True, True]
    assert c["prompt_ids"][0, :2].tolist() == [7, 7]
    assert c["response_mask"][0].tolist() == [True, False, False]
    assert c["response_ids"][0, 1:].tolist() == [7, 7]
    assert c["old_log_probs"][0, 1:].tolist() == [0.0, 0.0]
    c.check()


def test_concat_rejects_different_sampling_and_keeps_oldest_step() -> None:
    a = make_batch([(1, 1)]).with_meta(step=3, weight_version=3)
    b = make_batch([(1, 1)]).with_meta(step=5, weight_version=4)
    assert TensorBatch.concat([a, b]).meta.step == 3
    with pytest.raises(BatchValidationError, match="meta.temperature"):
        TensorBatch.concat([a, b.with_meta(temperature=0.5)])
    with pytest.raises(BatchValidationError, match="fields"):
        TensorBatch.concat([a, b.drop("scores")])


def test_trim_removes_only_padding_columns() -> None:
    b = make_batch([(2, 1), (3, 2)], max_prompt=6, max_response=5)
    t = b.trim()
    assert t.prompt_len == 3 and t.response_len == 2
    assert torch.equal(t.seq_lengths(), b.seq_lengths())


def test_save_load_round_trip(tmp_path: Path) -> None:
    b = make_batch([(2, 3), (1, 0)]).with_meta(temperature=0.7, step=4)
    save_batch(b, tmp_path / "b.pt")
    assert_same(load_batch(tmp_path / "b.pt"), b)
    assert [p.name for p in tmp_path.iterdir()] == ["b.pt"], "no temporary file left behind"


def test_load_refuses_arbitrary_pickles(tmp_path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"format": "verl.TensorBatch/1", "x": Evil()}))
    with pytest.raises(BatchValidationError, match="not a readable TensorBatch"):
        load_batch(tmp_path / "evil.pt")


@pytest.mark.parametrize("batch", [
    make_batch([(2, 3), (1, 0), (3, 1)]).with_meta(temperature=0.7, top_p=0.9, top_k=5, weight_version=3, step=4),
    # extras of any picklable value (a replay buffer's spill file keeps what the wire format refuses)
    TensorBatch({"scores": torch.tensor([0.5, -1.0])}, {"obj": [(1, "a"), {"k": [2.0]}], "none": [None, b"x"]}),
    TensorBatch({}, {"answer": ["x", "y", "z"]}),  # extras only
    TensorBatch({}, batch_size=3),  # neither fields nor extras: the batch size alone
    TensorBatch({"prompt_ids": torch.zeros(0, 4, dtype=torch.int64)}),  # no samples
], ids=["rl-fields", "object-extras", "extras-only", "size-only", "empty"])
def test_pickle_round_trips_exactly(batch: TensorBatch) -> None:
    """A spill tier writes batches with pickle: tensors (bit for bit, dtype, shape), extras, meta and size
    come back; so does copy.deepcopy, which pickles alike."""
    import copy
    import pickle

    for back in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch)):
        assert type(back) is TensorBatch and back is not batch
        assert_same(back, batch)
        for k in batch:
            assert back[k].dtype == batch[k].dtype
        assert back.extras == batch.extras and back.meta == batch.meta and back.batch_size == batch.batch_size
        with pytest.raises(AttributeError, match="immutable"):
            back.foo = 1


def test_unpickling_validates_like_the_constructor() -> None:
    """A pickle whose fields disagree is refused when it is read, as the constructor refuses them."""
    batch = make_batch([(1, 1), (2, 2)])
    rebuild, (cls, tensors, extras, meta, size) = batch.__reduce__()
    assert rebuild(cls, tensors, extras, meta, size).batch_size == 2
    with pytest.raises(BatchValidationError, match="field 'scores': dim 'batch' has size 5"):
        rebuild(cls, {**tensors, "scores": torch.zeros(5)}, extras, meta, size)


def test_save_rejects_non_json_extras(tmp_path: Path) -> None:
    b = TensorBatch({"scores": torch.zeros(1)}, {"obj": [object()]})
    with pytest.raises(BatchValidationError, match="extras must be JSON"):
        save_batch(b, tmp_path / "x.pt")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------ validation messages
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_ids": torch.zeros(2, 3)}, r"field 'response_ids': expected dtype torch.int64 .*got torch.float32"),
        ({"response_mask": torch.zeros(2, dtype=torch.bool)}, r"field 'response_mask': expected rank 2 \[batch, response\].*got shape \(2,\)"),
        ({"response_ids": torch.zeros(2, 3, dtype=torch.long), "response_mask": torch.zeros(2, 4, dtype=torch.bool)},
         r"field 'response_mask': dim 'response' has size 4, but field 'response_ids' has 3"),
        ({"response_ids": torch.zeros(2, 3, dtype=torch.long), "scores": torch.zeros(3)},
         r"field 'scores': dim 'batch' has size 3, but field 'response_ids' has 2"),
        ({"rewardz": torch.zeros(2)}, r"unknown field 'rewardz'; known fields: .*register_field"),
        ({"scores": [1.0, 2.0]}, r"field 'scores': expected a torch.Tensor .*got list"),
    ],
)
def test_validation_errors_name_field_expected_and_actual(fields: dict[str, object], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        TensorBatch(fields)  # type: ignore[arg-type]


def test_extras_length_mismatch() -> None:
    with pytest.raises(BatchValidationError, match=r"extra 'answer': expected 2 values \(one per sample\), got 3"):
        TensorBatch({"scores": torch.zeros(2)}, {"answer": ["a", "b", "c"]})


def test_update_validates_new_fields_against_existing() -> None:
    b = make_batch([(1, 2), (2, 2)])
    with pytest.raises(BatchValidationError, match="dim 'response' has size 5"):
        b.update(advantages=torch.zeros(2, 5))
    out = b.update(advantages=torch.zeros(2, 2))
    assert "advantages" in out and "advantages" not in b


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_check_rejects_non_finite_at_boundaries(bad: float) -> None:
    b = make_batch([(1, 2), (2, 2)])
    lp = b["old_log_probs"].clone()
    lp[1, 0] = bad
    b2 = b.update(old_log_probs=lp)  # construction does not scan values...
    with pytest.raises(NonFiniteError, match=r"forward: field 'old_log_probs' holds NaN/inf \(first at sample 1\)"):
        b2.check(where="forward")  # ...the boundary check does


def test_check_rejects_wrong_padding_side_and_out_of_vocab() -> None:
    b = make_batch([(1, 2), (2, 2)], max_prompt=3)
    flipped = b.update(prompt_mask=b["prompt_mask"].flip(1))
    with pytest.raises(BatchValidationError, match="prompt_mask of sample 0 is not left-padded"):
        flipped.check()
    rflip = b.update(response_mask=torch.tensor([[False, True], [True, True]]))
    with pytest.raises(BatchValidationError, match="response_mask of sample 0 is not right-padded"):
        rflip.check()
    with pytest.raises(BatchValidationError, match=r"ids in \[.*expected ids in \[0, 10\)"):
        b.check(vocab_size=10)


def test_immutable_and_meta_validation() -> None:
    b = make_batch([(1, 1)])
    with pytest.raises(AttributeError, match="immutable"):
        b.foo = 1  # type: ignore[attr-defined]
    with pytest.raises(BatchValidationError, match=r"BatchMeta.temperature must be a finite number >= 0.0001"):
        BatchMeta(temperature=0.0)


def test_register_custom_field() -> None:
    spec = FieldSpec("test_bonus", ("batch",), torch.float32, "float", "A test-only field.")
    register_field(spec)
    register_field(spec)  # idempotent
    with pytest.raises(ConfigError, match="already registered"):
        register_field(FieldSpec("test_bonus", ("batch",), torch.float64, "float", "other"))
    assert "test_bonus" in TensorBatch({"test_bonus": torch.ones(2)})


def test_to_device_and_select() -> None:
    b = make_batch([(1, 1), (2, 2)])
    s = b.select("response_ids", "response_mask", extras=False)
    assert set(s) == {"response_ids", "response_mask"} and not s.extras
    assert b.to("cpu")["response_ids"].device.type == "cpu"
    with pytest.raises(BatchValidationError, match="needs field"):
        b.select("values")
