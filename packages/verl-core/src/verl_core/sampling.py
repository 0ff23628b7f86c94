"""Token sampling shared by rollout engines: per-sample seeds, uniform tables, one decode step.

A sample's random stream is fixed by (seed, group id, sample index) (:func:`sample_seed`), so it
does not depend on the other samples of a batch or their order. Its uniforms are the first draws
of its own generator (:func:`uniform_table`), and a token is the inverse CDF of the top-k /
nucleus-restricted distribution at that uniform (:func:`kept_probs`, :func:`inverse_cdf`).
:class:`TokenSampler` runs one decode step without any host synchronisation, so a whole decode
step can be captured in a CUDA graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import torch
from torch import Tensor

from verl_core.rollout import SamplingParams

__all__ = ["TokenSampler", "inverse_cdf", "kept_probs", "sample_seed", "uniform_table"]

_MASK63: Final = (1 << 63) - 1


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """The 63-bit seed of one sample's random stream: a BLAKE2b hash of (seed, group id, sample index)."""
    digest = hashlib.blake2b(f"{seed}:{group_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def uniform_table(seeds: Sequence[int], steps: int, device: torch.device | str = "cpu") -> Tensor:
    """[len(seeds), steps] float64 uniforms: row r holds the first draws of sample r's own generator.

    The values one draw per decode step would give, drawn once so no step waits for the host.
    """
    draws = [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    return torch.stack(draws).to(device) if draws else torch.zeros(0, steps, dtype=torch.float64, device=device)


def kept_probs(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """softmax(scaled) with the tokens outside the top-k / nucleus set zeroed (not renormalised).

    The nucleus is the smallest prefix (by probability) whose mass reaches ``top_p``; the most
    likely token always stays.
    """
    probs = torch.softmax(scaled, -1)
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        probs = torch.where(scaled >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < top_p * sorted_p.sum(-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids where each row's (unnormalised, vocabulary-order) CDF first exceeds ``uniforms`` x its total."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tok.clamp_max(probs.shape[-1] - 1)


class TokenSampler:
    """One decode step's sampling: token, log-prob and stop flag per row from float32 logits.

    Pure tensor code with no host synchronisation (it runs inside a CUDA graph too): uniforms come
    from a precomputed [rows, steps] table (:func:`uniform_table`; None samples greedily), the step
    index may be a device tensor.

    Args:
        params: The sampling parameters.
        pad: Token id written where a row is no longer alive.
        stops: Stop token ids (1-D, on the logits' device).
        uniforms: The uniform table, or None for greedy decoding.
    """

    def __init__(self, params: SamplingParams, pad: int, stops: Tensor, uniforms: Tensor | None) -> None:
        self.params = params
        self.pad = pad
        self.stops = stops
        self.uniforms = uniforms

    def step(self, logits: Tensor, t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Token (pad where not alive), log-prob (0 where not alive) and "stopped now" of step ``t``."""
        p = self.params
        scaled = logits / p.temperature if p.temperature != 1.0 else logits
        logp = torch.log_softmax(scaled, -1)
        if p.greedy or self.uniforms is None:
            tok = torch.argmax(logits, -1)
        else:
            u = self.uniforms[:, t] if isinstance(t, int) else self.uniforms.index_select(1, t).squeeze(1)
            tok = inverse_cdf(kept_probs(scaled, p.top_k, p.top_p), u)
        tok = torch.where(alive, tok, self.pad)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        # A broadcast compare, not torch.isin: isin may sort (a host sync) for larger stop sets.
        stopped = alive & (tok.unsqueeze(-1) == self.stops).any(-1)
        return tok, torch.where(alive, lp, 0.0), stopped
