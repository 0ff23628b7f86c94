"""The hf rollout engine's assembly of the response fields from the chunks it decoded."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verl_core.enginekit.rollout_base import Responses

__all__ = ["concat_responses"]

Decoded = Responses
"""One decoded chunk: response ids, mask, log-probs [rows, steps] and truncated [rows]."""


def concat_responses(parts: Sequence[Decoded], pad: int, device: torch.device | str) -> Decoded:
    """The decoded chunks stacked into one batch on ``device``, right-padded to the widest chunk."""
    width = max(int(p[0].shape[1]) for p in parts)

    def cat(i: int, fill: float | int | bool) -> Tensor:
        padded = []
        for p in parts:
            t = p[i]
            missing = width - t.shape[1]
            if missing:
                t = torch.cat([t, torch.full((t.shape[0], missing), fill, dtype=t.dtype, device=t.device)], 1)
            padded.append(t)
        return torch.cat(padded, 0).to(device)

    return cat(0, pad), cat(1, False), cat(2, 0.0), torch.cat([p[3] for p in parts]).to(device)
