"""Random, correctly padded TensorBatches for tests."""

from __future__ import annotations

import torch

from verl_core import BatchMeta, TensorBatch

__all__ = ["random_batch"]


def random_batch(
    *,
    batch_size: int = 4,
    max_prompt: int = 8,
    max_response: int = 8,
    vocab_size: int = 128,
    seed: int = 0,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    first_id: int = 4,
    group_size: int = 1,
    empty_responses: int = 0,
    temperature: float = 1.0,
    with_rl_fields: bool = False,
) -> TensorBatch:
    """A batch with ragged prompts (left-padded) and responses (right-padded).

    Args:
        batch_size: Samples.
        max_prompt: Padded prompt width; real prompt lengths are drawn in [1, max_prompt].
        max_response: Padded response width; real lengths in [1, max_response] (the longest is
            always present so the width is used).
        vocab_size: Ids are drawn in [first_id, vocab_size) (special ids are avoided).
        seed: Seed of the draws.
        pad_token_id: Fills padding positions of id fields.
        eos_token_id: Ends responses that are shorter than ``max_response``.
        first_id: Smallest ordinary token id.
        group_size: Consecutive samples share a group id.
        empty_responses: The last this-many samples get an empty response.
        temperature: Stored in meta.
        with_rl_fields: Also fill old/ref/rollout log-probs, values, scores, advantages, returns.
    """
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, max_prompt + 1, (batch_size,), generator=g)
    r_len = torch.randint(1, max_response + 1, (batch_size,), generator=g)
    if batch_size:
        p_len[0] = max_prompt
        r_len[0] = max_response
    if empty_responses:
        r_len[batch_size - empty_responses :] = 0
    pos_p = torch.arange(max_prompt)
    prompt_mask = pos_p.unsqueeze(0) >= (max_prompt - p_len).unsqueeze(1)
    prompt_ids = torch.randint(first_id, vocab_size, (batch_size, max_prompt), generator=g)
    prompt_ids = prompt_ids.masked_fill(~prompt_mask, pad_token_id)
    pos_r = torch.arange(max_response)
    response_mask = pos_r.unsqueeze(0) < r_len.unsqueeze(1)
    response_ids = torch.randint(first_id, vocab_size, (batch_size, max_response), generator=g)
    ends = (r_len > 0) & (r_len < max_response)
    rows = ends.nonzero().squeeze(1)
    response_ids[rows, r_len[rows] - 1] = eos_token_id
    response_ids = response_ids.masked_fill(~response_mask, pad_token_id)
    fields: dict[str, torch.Tensor] = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "group_ids": torch.arange(batch_size) // max(group_size, 1),
        "truncated": r_len == max_response,
    }
    if with_rl_fields:
        m = response_mask.float()
        def tok(scale: float, shift: float = 0.0) -> torch.Tensor:
            return (torch.randn(batch_size, max_response, generator=g) * scale + shift) * m
        fields.update(
            old_log_probs=tok(0.5, -2.0),
            ref_log_probs=tok(0.5, -2.0),
            rollout_log_probs=tok(0.5, -2.0),
            values=tok(1.0),
            old_values=tok(1.0),
            advantages=tok(1.0),
            returns=tok(1.0),
            scores=torch.rand(batch_size, generator=g),
        )
    meta = BatchMeta(temperature=temperature, pad_token_id=pad_token_id)
    return TensorBatch(fields, meta=meta)


def emptied(batch: TensorBatch) -> TensorBatch:
    """``batch`` with every response empty: ``response_mask`` all False, ``response_ids`` the pad id,
    every other per-token field (log-probs, advantages, returns, values) 0 and ``truncated`` False.
    Its :class:`~verl_core.GlobalBatchStats` count no loss token."""
    shape = batch["response_ids"].shape
    fields: dict[str, torch.Tensor] = {
        name: torch.zeros_like(t) for name, t in batch.items()
        if t.is_floating_point() and t.shape == shape
    }
    fields["response_mask"] = torch.zeros_like(batch["response_mask"])
    fields["response_ids"] = torch.full_like(batch["response_ids"], batch.meta.pad_token_id)
    if "truncated" in batch:
        fields["truncated"] = torch.zeros_like(batch["truncated"])
    return batch.update(fields)
