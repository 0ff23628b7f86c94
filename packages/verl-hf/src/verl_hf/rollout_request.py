"""The hf rollout engine's request handling: what a generate call must satisfy, the per-sample
seeds of its rows, and the assembly of the response fields from the decoded chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verl_core.enginekit.memory import check_generate_memory
from verl_core.enginekit.sampling import sample_seed
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import BatchValidationError, ConfigError
from verl_core.kernel.rollout import SamplingParams

__all__ = ["concat_responses", "row_seeds", "validate_request"]

Decoded = tuple[Tensor, Tensor, Tensor, Tensor]
"""One decoded chunk: response ids, mask, log-probs [rows, steps] and truncated [rows]."""


def validate_request(prompts: TensorBatch, params: SamplingParams, *, spec: EngineSpec, vocab_size: int,
                     device: torch.device, rows_at_once: int | None, where: str) -> None:
    """Refuse a generate request the engine cannot serve, before anything is allocated.

    Raises:
        BatchValidationError: a missing or malformed field, or a prompt longer than ``max_prompt_len``.
        ConfigError: ``max_new_tokens`` above ``max_response_len``, or a stop id outside the vocabulary.
        RequestTooLargeError: the request cannot fit in memory.
    """
    prompts.require("prompt_ids", "prompt_mask", "group_ids", where=where)
    prompts.check(where=where, vocab_size=vocab_size)
    if prompts.batch_size:
        longest = int(prompts["prompt_mask"].sum(1).max())
        if longest > spec.max_prompt_len:
            raise BatchValidationError(
                f"{where}: longest prompt has {longest} tokens, more than max_prompt_len="
                f"{spec.max_prompt_len}; raise it in the EngineSpec or shorten the prompts"
            )
    if params.max_new_tokens > spec.max_response_len:
        raise ConfigError(
            f"{where}: max_new_tokens={params.max_new_tokens} exceeds the engine's max_response_len="
            f"{spec.max_response_len}; lower it or raise max_response_len"
        )
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise ConfigError(f"{where}: stop token id {t} is outside the vocabulary [0, {vocab_size})")
    check_generate_memory(prompts, params, device=device, vocab_size=vocab_size, rows_at_once=rows_at_once,
                          where=where)


def row_seeds(rows: TensorBatch, params: SamplingParams) -> list[int]:
    """Each row's sampling seed from (call seed, group id, sample index); a random call seed when unset."""
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    groups = rows["group_ids"].tolist()
    indices = rows["sample_index"].tolist()
    return [sample_seed(seed, g, s) for g, s in zip(groups, indices)]


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
