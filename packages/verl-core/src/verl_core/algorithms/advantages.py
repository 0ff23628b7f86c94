"""Advantage estimators: GAE, GRPO (and Dr. GRPO), RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax.

Each estimator is a function ``(batch, config) -> batch`` of the *global* batch (the whitening
estimators need all of it) that adds ``advantages`` and ``returns`` (float32 ``[batch, response]``,
0 where ``batch.loss_mask`` is False; a multi-turn batch is estimated over its loss tokens, see
:mod:`verl_core.algorithms.loss_tokens`). Everything is vectorised: groups (from ``group_ids``) are
found with ``torch.unique`` (no sort when the ids are sorted) and reduced with ``index_add``, or
along rows when they are runs of equal size (``_groups``); discounted sums over time use blocked
matrix products, with no Python loop over samples, groups or tokens.

Speed (these functions are memory-bound on CPU): the response lengths come from summing the
right-padded mask as int64 words (``_lengths``), float masks are written from the lengths
(converting a bool mask is a slow copy), a sample's total reward reads its row once up to its
length (blocked sums, ``_prefix_sums``), reward-to-go sums run over short blocks
(``_suffix_sums``), fresh ``[batch, response]`` buffers are kept few (each costs page faults),
and the outcome estimators whiten per-sequence values in ``[batch]`` space.
``benchmarks/bench_advantages.py`` times them against verl 0.9.1.

Rewards: the outcome estimators (GRPO, RLOO, REINFORCE++-baseline) use each sample's total reward
:func:`outcome_rewards` (as verl's ``token_level_rewards.sum(-1)``); the per-token estimators (GAE,
REINFORCE++, ReMax) use ``token_rewards``. When the batch has no ``token_rewards`` they are derived
from ``scores`` / ``token_scores`` without a KL penalty (:func:`~verl_core.algorithms.kl.compute_token_rewards`).

Conventions of verl 0.9.1 ``core_algos`` that are kept: GRPO's epsilon 1e-6 with the unbiased std
(``torch.std``), a group of one has mean 0 and std 1 (its advantage is the raw score); RLOO's group
of one keeps the raw score (as verl's ``rloo``; its ``rloo_vectorized`` gives 0); GAE and
REINFORCE++ (both kinds) whiten over the batch's response tokens with the unbiased variance and
``rsqrt(var + 1e-8)``. Where this differs, deliberately:

* masked positions of ``advantages`` and ``returns`` are 0 (verl's GAE leaves whitened non-zero
  values at padding, and ``values`` at padding in its returns);
* the response mask must be right-padded (the canonical layout, checked by ``TensorBatch.check``);
  a multi-turn batch (observation tokens inside the response, ``loss_mask`` False) runs on its
  loss tokens, observation tokens skipped as verl's loops skip them (:mod:`verl_core.algorithms.loss_tokens`);
* whitening a batch with a single response token gives 0 and with none gives all zeros (verl raises);
  masked means divide by the exact count (verl adds 1e-8);
* group statistics, and the mean and variance of whitening, are accumulated in float64 (verl:
  float32), then rounded to float32;
* rewards after a row's response length are never read (verl sums ``token_level_rewards`` over the
  whole row, so it needs them to be 0 there).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import mask_weights
from verl_core.algorithms.config import (
    GAEConfig,
    GRPOConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    ReMaxConfig,
    RLOOConfig,
)
from verl_core.algorithms.kl import compute_token_rewards
from verl_core.algorithms.loss_tokens import LossTokenLayout, over_loss_tokens
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import BatchValidationError

__all__ = [
    "discounted_cumsum",
    "gae",
    "group_index",
    "grpo",
    "masked_whiten",
    "outcome_rewards",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "token_rewards",
]

_BLOCK = 64
_SUM_BLOCK = 64
_SUFFIX_BLOCK = 32
_WHITEN_EPS = 1e-8


# ----------------------------------------------------------------------------- helpers
def group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Dense group index of each sample and the size of each group.

    Returns:
        ``(inverse, counts)``: ``inverse[b]`` in ``[0, G)`` numbers the group of sample ``b``;
        ``counts[g]`` is the size of group ``g`` (int64).
    """
    groups = _groups(group_ids)
    return groups.inverse, groups.counts


class _Groups(NamedTuple):
    """The groups of a batch's samples (:func:`_groups`).

    Per-sample values are laid out by :meth:`rows` (``[groups, n]`` when the groups are runs of
    ``n`` consecutive samples, else ``[batch]``); :meth:`size` and :meth:`sum` broadcast against
    that layout, so one formula serves both.
    """

    inverse: Tensor  # dense group index of each sample
    counts: Tensor  # size of each group
    run: int  # n when the groups are runs of n consecutive samples, else 0

    def rows(self, values: Tensor) -> Tensor:
        """``values`` (``[batch]``) as ``[groups, n]`` for runs (a view), else as they are."""
        return values.view(-1, self.run) if self.run else values

    def size(self) -> Tensor:
        """The group size of each sample (float64; one 0-dim value for runs)."""
        if self.run:
            return torch.tensor(float(self.run), dtype=torch.float64, device=self.inverse.device)
        return self.counts.to(torch.float64)[self.inverse]

    def sum(self, values: Tensor) -> Tensor:
        """The sum over each sample's group of ``values`` laid out by :meth:`rows`."""
        if self.run:  # one row per group: a reduction along rows instead of an index_add
            return values.sum(-1, keepdim=True)
        total = torch.zeros(len(self.counts), dtype=values.dtype, device=values.device)
        return total.index_add_(0, self.inverse, values)[self.inverse]


def _groups(group_ids: Tensor) -> _Groups:
    """The groups of ``group_ids``; sorted ids (a trainer numbers groups in order) need no sort."""
    if group_ids.numel() > 1 and bool((group_ids[1:] >= group_ids[:-1]).all()):
        _, inverse, counts = torch.unique_consecutive(group_ids, return_inverse=True, return_counts=True)
        run = int(counts[0]) if bool((counts == counts[0]).all()) else 0
        return _Groups(inverse, counts, run)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return _Groups(inverse, counts, 0)


# at most this many int64 mask words are summed together: each byte of their sum counts the words
# whose byte at that place is True, at most 255, so no byte carries into the next
_MAX_WORDS = 255


def _lengths(mask: Tensor) -> Tensor:
    """Response lengths (int64 ``[batch]``) of a right-padded bool mask.

    The mask's bytes are read 8 at a time as int64 words and summed per row (a vectorised
    integer reduction, where a sum over a bool mask is a slow non-vectorised one); each byte of
    that sum counts the True bytes at one place of the words, so the sum of its 8 bytes is the
    row's count of True. Masks whose rows are not a whole number of words (or that are not
    contiguous) are searched per row instead: the negation of a right-padded row is sorted, so
    its length is where the first 1 stands.
    """
    B, T = mask.shape
    dev = mask.device
    if B == 0 or T == 0:
        return torch.zeros(B, dtype=torch.int64, device=dev)
    if T % 8 or not mask.is_contiguous() or mask.storage_offset() % 8:
        pad = (~mask).view(torch.uint8)
        one = torch.ones(B, 1, dtype=torch.uint8, device=dev)
        return torch.searchsorted(pad, one).squeeze(1)
    W = T // 8
    chunks = next(n for n in range(-(-W // _MAX_WORDS), W + 1) if W % n == 0)  # no byte carries
    sums = mask.view(torch.int64).view(B, chunks, W // chunks).sum(-1)
    return sums.view(torch.uint8).view(B, chunks * 8).sum(-1)


def _mask_from_lengths(lengths: Tensor, width: int, out: Tensor | None = None) -> Tensor:
    """A float32 ``[batch, width]`` tensor (new, or ``out``): 1 before each row's length, 0 after.

    Written by one comparison against the lengths: several times faster on CPU than converting
    the bool mask (a ``uint8 -> float32`` copy is not vectorised), and exact for any mask that
    is right-padded.
    """
    if out is None:
        out = torch.empty(lengths.shape[0], width, dtype=torch.float32, device=lengths.device)
    return torch.lt(_columns(width, lengths.device), lengths.to(torch.float32).unsqueeze(-1), out=out)


@functools.lru_cache(maxsize=32)
def _columns(width: int, device: torch.device) -> Tensor:
    """``arange(width)`` as float32 (read-only, shared)."""
    return torch.arange(width, dtype=torch.float32, device=device)


def _weights(batch: TensorBatch, lengths: Tensor | None = None) -> Tensor:
    """A fresh float32 0/1 copy of the (right-padded) response mask (callers may overwrite it)."""
    mask = batch["response_mask"]
    return _mask_from_lengths(_lengths(mask) if lengths is None else lengths, mask.shape[-1])


@functools.lru_cache(maxsize=32)
def _leading_ones(block: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[block + 1, block]``: row ``i`` holds ``i`` ones, then zeros (read-only, shared)."""
    i = torch.arange(block + 1, device=device)
    return (torch.arange(block, device=device) < i.unsqueeze(-1)).to(dtype)


def _prefix_sums(x: Tensor, lengths: Tensor) -> Tensor:
    """``sum_{t < lengths[b]} x[b, t]`` per row, never reading what lies after a row's length.

    One pass over ``x``: blocks of ``_SUM_BLOCK`` columns are summed whole (a fast inner
    reduction) and the sums of the blocks before the one each row ends in are read from their
    running sum (prefix sums never see a later block); that end block is gathered
    (``batch x _SUM_BLOCK`` values) and summed up to the row's end; columns past the last whole
    block are summed under a mask. Masking the product ``x * mask`` instead costs three more
    passes over ``[batch, response]`` (write, read, refill). Values after a row's length may
    hold anything finite.
    """
    B, T = x.shape
    K = _SUM_BLOCK
    nb = T // K
    whole = nb * K
    dev = x.device
    if B == 0 or T == 0:
        return torch.zeros(B, dtype=x.dtype, device=dev)
    if not nb:
        keep = torch.arange(T, device=dev) < lengths.unsqueeze(-1)
        return torch.where(keep, x, 0.0).sum(-1)
    x = x.contiguous()
    block_sums = x[:, :whole].reshape(B, nb, K).sum(-1)
    # the block each row ends in: the last one for a row that reaches the last whole block's end
    end = torch.div(lengths, K, rounding_mode="floor").clamp_(max=nb - 1)
    # the blocks before it, read from a running sum that never includes a later block (whose sum
    # may overflow to inf, which a 0/1 product would turn into NaN)
    before = torch.nn.functional.pad(block_sums, (1, 0)).cumsum_(-1).gather(1, end.unsqueeze(-1)).squeeze(1)
    rest = (lengths.clamp(max=whole) if whole < T else lengths) - end * K  # values of the end block, 0..K
    if whole == T:  # the end blocks are rows of the [batch * blocks, K] view
        ends = x.view(B * nb, K).index_select(0, end.add_(torch.arange(0, B * nb, nb, device=dev)))
    else:  # windows of K values starting at each end block
        ends = x.view(-1).unfold(0, K, 1).index_select(0, end.mul_(K).add_(torch.arange(0, B * T, T, device=dev)))
    total = ends.mul_(_leading_ones(K, x.dtype, dev).index_select(0, rest)).sum(-1).add_(before)
    if whole < T:
        tail = x[:, whole:]
        keep = whole + torch.arange(T - whole, device=dev) < lengths.unsqueeze(-1)
        total = total + torch.where(keep, tail, 0.0).sum(-1)
    return total


def _outcome(batch: TensorBatch) -> tuple[Tensor, Tensor]:
    """:func:`outcome_rewards` and the response lengths."""
    batch.require("response_mask", where="an outcome advantage estimator")
    mask = batch["response_mask"]
    lengths = _lengths(mask)
    if "token_rewards" in batch:
        total = _prefix_sums(batch["token_rewards"], lengths).double()
        if "scores" in batch:
            total = torch.where(lengths > 0, total, batch["scores"].double())
        return total, lengths
    if "scores" not in batch and "token_scores" not in batch:
        raise BatchValidationError(
            "an outcome advantage estimator needs 'token_rewards', 'scores' or 'token_scores'; "
            f"the batch has only: {', '.join(batch) or 'none'}"
        )
    if "token_scores" not in batch:
        # what summing the row of token rewards holding only the score gives: 0 + s (+0 for -0)
        # for a response, the score as it is for an empty one (see the branch above)
        scores = batch["scores"].double()
        return torch.where(lengths > 0, scores + 0.0, scores), lengths
    total = torch.zeros(batch.batch_size, dtype=torch.float64, device=mask.device)
    if "scores" in batch:
        total = total + batch["scores"].double()
    total = total + _prefix_sums(batch["token_scores"], lengths).double()
    return total, lengths


def outcome_rewards(batch: TensorBatch) -> Tensor:
    """Total reward of each sample (float64 ``[batch]``).

    ``sum_t token_rewards`` when the batch has ``token_rewards`` (an empty response, which has no
    token to hold a reward, gets its ``scores`` when present); otherwise ``scores`` plus the sum of
    ``token_scores`` (either may be absent, not both). The sums run over the loss tokens.
    """
    layout = LossTokenLayout.of(batch)
    return _outcome(batch if layout is None else layout.compact(batch))[0]


def token_rewards(batch: TensorBatch, weights: Tensor | None = None) -> Tensor:
    """``token_rewards`` of the batch, 0 where masked (derived from scores when absent); a new tensor.

    ``weights`` (the 0/1 float mask of a single-turn batch) saves converting the mask; a
    multi-turn batch takes none and gets 0 at its observation tokens.
    """
    layout = LossTokenLayout.of(batch) if weights is None else None
    if layout is not None:
        return layout.expand(token_rewards(layout.compact(batch)))
    if "token_rewards" not in batch:
        batch, _ = compute_token_rewards(batch)
    return batch["token_rewards"] * (_weights(batch) if weights is None else weights)


def _suffix_sums(x: Tensor) -> Tensor:
    """A new tensor ``y[..., t] = sum_{k >= t} x[..., k]``.

    A cumulative sum runs one dependent addition per element; over short blocks of
    ``_SUFFIX_BLOCK`` columns the processor overlaps the chains of neighbouring blocks, which is
    about twice as fast on CPU as one sum along the whole row (and needs no flipped copies). The
    suffix sum at ``t`` in block ``j`` is ``x_t - (inclusive prefix of t within block j)`` plus
    the suffix sum of the blocks from ``j`` on. Where ``x`` is 0 from some column on (a masked,
    right-padded row) the result is exactly 0 there: a block's running sum over zeros stays
    equal to its total.
    """
    lead, T = x.shape[:-1], x.shape[-1]
    K = _SUFFIX_BLOCK
    if T <= K or T % K or x.numel() == 0:
        return x.flip(-1).cumsum(-1).flip(-1)
    rows = x.reshape(-1, T // K, K)
    local = rows.cumsum(-1)
    from_block = local[..., -1].flip(-1).cumsum(-1).flip(-1)  # sum of the blocks from j on
    return torch.sub(rows, local, out=local).add_(from_block.unsqueeze(-1)).reshape(*lead, T)


def discounted_cumsum(x: Tensor, gamma: float, *, block: int = _BLOCK) -> Tensor:
    """Reverse discounted sum along the last dim: ``y[..., t] = sum_{k >= t} gamma**(k - t) x[..., k]``.

    Computed without a loop over time: blocks of ``block`` steps are reduced by a matrix product
    with the ``[block, block]`` matrix of discounts, and the blocks are chained by a second
    product over block start values. ``gamma`` must lie in [0, 1] (powers only shrink, so
    nothing overflows; discounts below the dtype's range round to 0).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discounted_cumsum needs gamma in [0, 1], got {gamma}")
    if x.shape[-1] == 0 or gamma == 0.0:
        return x.clone()
    if gamma == 1.0:
        return _suffix_sums(x)
    lead, T = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    flat = x.reshape(rows, T)
    L = min(block, T)
    nb = -(-T // L)
    if nb * L != T:
        flat = torch.nn.functional.pad(flat, (0, nb * L - T))
    blocks = flat.view(rows, nb, L)
    log_g = math.log(gamma)

    def powers(n: int, scale: int) -> Tensor:
        i = torch.arange(n, dtype=torch.float64)
        e = (i[:, None] - i[None, :]) * scale  # e[k, t] = (k - t) * scale
        m = torch.where(e >= 0, torch.exp(e.clamp_min(0) * log_g), torch.zeros((), dtype=torch.float64))
        return m.to(device=x.device, dtype=x.dtype)

    local = blocks @ powers(L, 1)  # within-block returns
    if nb > 1:
        starts = local[:, :, 0] @ powers(nb, L)  # true return at each block start
        tail = torch.exp((L - torch.arange(L, dtype=torch.float64)) * log_g).to(device=x.device, dtype=x.dtype)
        # block j also receives the discounted return from the start of block j + 1
        local[:, :-1, :].addcmul_(starts[:, 1:, None], tail)
    return local.reshape(rows, nb * L)[:, :T].contiguous().reshape(*lead, T)


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """``(v - mean) * rsqrt(var + 1e-8)`` over the masked positions (unbiased var), 0 elsewhere.

    ``mask`` is bool or 0/1 of the values' dtype (masked values must be finite). With one masked
    position the result is 0 there; with none, all zeros (verl raises in both). The mean and
    the variance are accumulated in float64 (see :func:`_whiten_`).
    """
    w = mask_weights(mask, values.dtype)
    n = round(float(w.reshape(-1, w.shape[-1]).sum(-1).double().sum())) if w.numel() else 0
    return _whiten_(values * w, w, n)


def _whiten_(values: Tensor, w: Tensor, n: int) -> Tensor:
    """:func:`masked_whiten` in place, for ``values`` already 0 where ``w`` is 0; ``n`` = count of w.

    Two passes, both accumulated in float64 from per-row float32 partial sums: the mean, then
    the sum of squares of the centred values (a per-row norm, read-only). A single float32 dot
    product over millions of tokens is off by ~1e-4 relative; this is within ~1e-8.
    """
    if n == 0:
        return values.zero_()
    mean = float(values.reshape(-1, values.shape[-1]).sum(-1).double().sum()) / n
    centered = values.sub_(mean).mul_(w)
    if n == 1:
        return centered  # 0 at the one position
    rows = centered.reshape(-1, centered.shape[-1])
    var = float(torch.linalg.vector_norm(rows, dim=-1).double().square().sum()) / (n - 1)
    return centered.mul_(1.0 / math.sqrt(var + _WHITEN_EPS))


def _whiten_per_sequence(per_seq: Tensor, lengths: Tensor) -> Tensor:
    """:func:`masked_whiten` of ``per_seq[b]`` broadcast over each row's ``lengths[b]`` tokens.

    The token statistics of a per-sequence value are length-weighted sequence statistics, so the
    mean and variance are computed over ``[batch]`` in float64 instead of ``[batch, response]``.
    """
    n = int(lengths.sum())
    if n <= 1:  # as masked_whiten: 0 at the one position, all zeros with none
        return torch.zeros_like(per_seq)
    v, k = per_seq.double(), lengths.double()
    mean = (v * k).sum() / n
    var = ((v - mean).square() * k).sum() / (n - 1)
    return ((v - mean) * torch.rsqrt(var + _WHITEN_EPS)).to(per_seq.dtype)


def _broadcast(per_seq: Tensor, lengths: Tensor, width: int) -> Tensor:
    """A new float32 ``[batch, width]``: ``per_seq[b]`` before each row's length, 0 after."""
    return _mask_from_lengths(lengths, width).mul_(per_seq.to(torch.float32).unsqueeze(-1))


def _finish(batch: TensorBatch, advantages: Tensor, returns: Tensor) -> TensorBatch:
    return batch.update(advantages=advantages.to(torch.float32), returns=returns.to(torch.float32))


# ----------------------------------------------------------------------------- estimators
@over_loss_tokens
@torch.no_grad()
def gae(batch: TensorBatch, config: GAEConfig | None = None) -> TensorBatch:
    """Generalised advantage estimation (Schulman et al. 2016) with a critic's ``values``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` = 0 after the last response token (the end
    is terminal, no bootstrap), ``A_t = sum_k (gamma * lam)**k delta_{t+k}``, ``returns = A + V``
    (before whitening), ``advantages`` = masked whitening of ``A`` over the batch (``whiten``).
    Needs ``response_mask``, ``values`` and rewards.
    """
    config = config or GAEConfig()
    batch.require("response_mask", "values", where="GAE")
    lengths = _lengths(batch["response_mask"])
    w = _weights(batch, lengths)
    v = batch["values"] * w
    # delta_t = r_t + gamma V_{t+1} - V_t; with right padding and V = 0 at masked positions the
    # next value of the last token is 0 and delta is 0 at masked positions
    delta = token_rewards(batch, w).sub_(v)
    delta[:, :-1].add_(v[:, 1:], alpha=config.gamma)
    # suffix sums of a right-padded masked delta are already 0 at masked positions
    adv = discounted_cumsum(delta, config.gamma * config.lam)
    returns = v.add_(adv)
    if config.whiten:
        adv = _whiten_(adv, w, int(lengths.sum()))
    return _finish(batch, adv, returns)


@over_loss_tokens
@torch.no_grad()
def grpo(batch: TensorBatch, config: GRPOConfig | None = None) -> TensorBatch:
    """GRPO: ``(R - mean_group) / (std_group + eps)`` (or ``R - mean_group`` for Dr. GRPO).

    ``R`` is :func:`outcome_rewards`; ``std`` is the unbiased std of the group. A group of one has
    mean 0 and std 1 (its advantage is ``R / (1 + eps)``, verl's convention); a group of identical
    rewards gets 0. The scalar is broadcast over the response tokens; ``returns`` = ``advantages``.
    Needs ``response_mask``, ``group_ids`` and rewards.
    """
    config = config or GRPOConfig()
    batch.require("response_mask", "group_ids", where="GRPO")
    scores, lengths = _outcome(batch)
    groups = _groups(batch["group_ids"])
    x, n = groups.rows(scores), groups.size()
    single = n == 1
    centered = x - torch.where(single, 0.0, groups.sum(x) / n)
    if config.norm_by_std:
        var = groups.sum(centered.square()) / (n - 1).clamp_min(1)
        centered = centered / (torch.where(single, 1.0, var.sqrt()) + config.epsilon)
    adv = _broadcast(centered.reshape(-1), lengths, batch["response_mask"].shape[-1])
    return _finish(batch, adv, adv)


@over_loss_tokens
@torch.no_grad()
def rloo(batch: TensorBatch, config: RLOOConfig | None = None) -> TensorBatch:
    """RLOO: ``R_i - mean_{j != i} R_j`` over the other samples of the group.

    A group of one keeps its raw reward (verl's ``rloo``). ``returns`` = ``advantages``. Needs
    ``response_mask``, ``group_ids`` and rewards.
    """
    batch.require("response_mask", "group_ids", where="RLOO")
    scores, lengths = _outcome(batch)
    groups = _groups(batch["group_ids"])
    x, n = groups.rows(scores), groups.size()
    adv = torch.where(n > 1, (n * x - groups.sum(x)) / (n - 1).clamp_min(1), x)
    out = _broadcast(adv.reshape(-1), lengths, batch["response_mask"].shape[-1])
    return _finish(batch, out, out)


@over_loss_tokens
@torch.no_grad()
def reinforce_pp(batch: TensorBatch, config: ReinforcePPConfig | None = None) -> TensorBatch:
    """REINFORCE++: discounted returns ``G_t = sum_k gamma**k r_{t+k}``, whitened over the batch.

    ``returns`` = ``G`` (unwhitened). Needs ``response_mask`` and rewards.
    """
    config = config or ReinforcePPConfig()
    batch.require("response_mask", where="REINFORCE++")
    lengths = _lengths(batch["response_mask"])
    w = _weights(batch, lengths)
    returns = discounted_cumsum(token_rewards(batch, w), config.gamma)  # 0 after the response
    adv = _whiten_(returns.clone(), w, int(lengths.sum())) if config.whiten else returns
    return _finish(batch, adv, returns)


@over_loss_tokens
@torch.no_grad()
def reinforce_pp_baseline(
    batch: TensorBatch, config: ReinforcePPBaselineConfig | None = None
) -> TensorBatch:
    """REINFORCE++ with baseline: ``R - mean_group``, broadcast over tokens, whitened over the batch.

    A group of one has baseline 0. ``returns`` = ``advantages`` (as verl). Needs ``response_mask``,
    ``group_ids`` and rewards.
    """
    config = config or ReinforcePPBaselineConfig()
    batch.require("response_mask", "group_ids", where="REINFORCE++ with baseline")
    scores, lengths = _outcome(batch)
    groups = _groups(batch["group_ids"])
    x, n = groups.rows(scores), groups.size()
    per_seq = (x - torch.where(n == 1, 0.0, groups.sum(x) / n)).reshape(-1).to(torch.float32)
    if config.whiten:
        per_seq = _whiten_per_sequence(per_seq, lengths)
    adv = _broadcast(per_seq, lengths, batch["response_mask"].shape[-1])
    return _finish(batch, adv, adv)


@over_loss_tokens
@torch.no_grad()
def remax(batch: TensorBatch, config: ReMaxConfig | None = None) -> TensorBatch:
    """ReMax: reward-to-go ``G_t = sum_{k >= t} r_k`` minus the greedy response's score.

    ``advantages = G_t - baseline_scores``, ``returns = G_t``. Needs ``response_mask``,
    ``baseline_scores`` and rewards.
    """
    batch.require("response_mask", "baseline_scores", where="ReMax")
    if "token_rewards" not in batch:
        batch, _ = compute_token_rewards(batch)
    mask = batch["response_mask"]
    lengths = _lengths(mask)
    # one [batch, response] buffer holds the masked rewards, then the mask again, then the
    # advantages: a fresh buffer costs page faults on CPU, a rewrite of the mask much less
    buf = _mask_from_lengths(lengths, mask.shape[-1])
    returns = _suffix_sums(torch.mul(batch["token_rewards"], buf, out=buf))  # 0 after the response
    w = _mask_from_lengths(lengths, mask.shape[-1], out=buf)
    adv = torch.addcmul(returns, batch["baseline_scores"].unsqueeze(-1), w, value=-1.0, out=w)
    return _finish(batch, adv, returns)
