"""The kernel partitioner's packed cost: groups bounded by the sum of their lengths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core import BatchValidationError, TensorBatch
from verl_core.kernel.batch import micro_batch_cost, partition_by_token_budget


def test_cost_of_a_micro_batch_padded_and_packed() -> None:
    assert micro_batch_cost([5, 3, 8]) == 24  # 3 x longest
    assert micro_batch_cost([5, 3, 8], packed=True) == 16  # the real tokens
    assert micro_batch_cost([0, 0], packed=True) == 2 and micro_batch_cost([0, 0]) == 2  # an empty sample counts 1
    assert micro_batch_cost([]) == 0 and micro_batch_cost([], packed=True) == 0


def test_packed_groups_fill_with_short_samples_beside_long_ones() -> None:
    lengths = [60, 40, 60, 40, 60, 40]
    padded = partition_by_token_budget(lengths, 100)
    packed = partition_by_token_budget(lengths, 100, packed=True)
    assert padded == [[0], [2], [4], [1, 3], [5]]  # runs of similar lengths, size x longest <= 100
    assert packed == [[0, 1], [2, 3], [4, 5]]  # first fit, longest first: 60 + 40 each
    assert partition_by_token_budget([], 10, packed=True) == []


def test_packed_sample_over_the_budget_is_the_same_clear_error() -> None:
    with pytest.raises(BatchValidationError, match=r"sample 1 has 11 tokens.*max_tokens=8"):
        partition_by_token_budget([3, 11, 2], 8, packed=True)
    with pytest.raises(BatchValidationError, match="packed must be True or False"):
        partition_by_token_budget([3], 8, packed=1)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 64), min_size=0, max_size=40), st.integers(0, 200))
def test_packed_groups_respect_the_budget_and_cover_every_index_once(lengths: list[int], extra: int) -> None:
    budget = max(lengths, default=0) + 1 + extra
    groups = partition_by_token_budget(lengths, budget, packed=True)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # a permutation
    assert all(g and micro_batch_cost([lengths[i] for i in g], packed=True) <= budget for g in groups)
    assert groups == partition_by_token_budget(list(lengths), budget, packed=True)  # deterministic
    # first fit over the padded partition's order opens at most one group per padded run, so
    # packing never needs more micro-batches than padding
    assert len(groups) <= len(partition_by_token_budget(lengths, budget))


def test_tensor_batch_micro_batches_packed_restore_the_input_order() -> None:
    lengths = [7, 1, 2, 6, 3, 1]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    batch = TensorBatch({
        "prompt_ids": torch.ones(6, 1, dtype=torch.int64), "prompt_mask": torch.ones(6, 1, dtype=torch.bool),
        "response_ids": torch.where(mask, 5, 0), "response_mask": mask, "group_ids": torch.arange(6),
    })
    mbs = batch.micro_batches(max_tokens=10, packed=True)  # sequences of 8, 2, 3, 7, 4, 2 tokens
    assert [mb["group_ids"].tolist() for mb in mbs] == [[0, 1], [3, 2], [4, 5]]
    assert all(int(mb.seq_lengths().sum()) <= 10 for mb in mbs)
    assert len(batch.micro_batches(max_tokens=10)) == 4  # padded: 8 | 7 | 4, 3 | 2, 2 (size x longest)
    assert torch.equal(mbs.restore(list(mbs))["group_ids"], batch["group_ids"])
