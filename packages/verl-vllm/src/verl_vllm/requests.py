"""The vLLM rollout engine's requests: vLLM sampling parameters, one request per prompt or per
seeded sample, and the response fields of vLLM's completions."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from verl_core import SamplingParams, TensorBatch, VerlError
from verl_core.enginekit.rollout_base import Responses
from verl_vllm._import import import_vllm

import_vllm()

from vllm import SamplingParams as VllmSamplingParams  # noqa: E402  (after the import check)
from vllm.inputs import TokensPrompt  # noqa: E402

__all__ = ["build_requests", "prompt_token_lists", "responses", "sample_seed", "vllm_params"]


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """The 63-bit seed of one sample's random stream, fixed by (seed, group id, sample index).

    Each sample is its own vLLM request with this seed, so a sample does not depend on the other
    samples of the batch or their order.
    """
    digest = hashlib.blake2b(f"{seed}:{group_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def vllm_params(params: SamplingParams, *, n: int, seed: int | None, eos_token_id: int) -> Any:
    """vLLM's sampling parameters for ``n`` samples of one request (greedy: temperature 0).

    A response stops on ``eos_token_id`` (the tokenizer's EOS) and ``params.stop_token_ids`` only.
    vLLM itself would also stop on every EOS id the folder lists (``generation_config.json``'s
    ``eos_token_id`` list, or ``config.json``'s where the folder has no generation config), even
    with ``generation_config="vllm"``: it adds them to each request's stop ids unless the request
    sets ``ignore_eos``. So the request sets ``ignore_eos`` and names the tokenizer's EOS as a stop
    id itself, which ends the response on the same token, kept in it, as vLLM's EOS does.
    """
    common: dict[str, Any] = {
        "n": n,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": sorted({eos_token_id, *params.stop_token_ids}),
        "ignore_eos": True,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "seed": seed,
    }
    if params.greedy:
        return VllmSamplingParams(temperature=0.0, **common)
    return VllmSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, **common
    )


def prompt_token_lists(rows: TensorBatch) -> list[list[int]]:
    """Each row's prompt token ids without its left padding (the rows were validated by ``generate``)."""
    lengths = rows["prompt_mask"].sum(1).tolist()
    ids = rows["prompt_ids"].cpu()
    width = ids.shape[1]
    # Left padding: the real tokens are the last `length` columns (check() proved contiguity).
    return [ids[i, width - int(n) :].tolist() for i, n in enumerate(lengths)]


def build_requests(rows: TensorBatch, params: SamplingParams, seeds: Sequence[int],
                   eos_token_id: int) -> tuple[list[Any], list[Any]]:
    """The vLLM prompts and their sampling parameters for the rows of a generate call.

    One request per sample when seeded (seeded by ``seeds``, one per row) or greedy; otherwise one
    request per prompt (the first of each run of ``n`` adjacent rows) with ``n`` samples. Every
    request stops on ``eos_token_id`` (the tokenizer's EOS) and ``params.stop_token_ids`` only (see
    :func:`vllm_params`).
    """
    # vLLM refuses n > 1 for greedy requests, and a seeded sample needs its own request.
    if seeds or params.greedy:
        row_seeds: Sequence[int | None] = seeds if seeds else [None] * rows.batch_size
        lists = prompt_token_lists(rows)
        return ([TokensPrompt(prompt_token_ids=ids) for ids in lists],
                [vllm_params(params, n=1, seed=seed, eos_token_id=eos_token_id) for seed in row_seeds])
    firsts = prompt_token_lists(rows.index(torch.arange(0, rows.batch_size, params.n)))
    return ([TokensPrompt(prompt_token_ids=ids) for ids in firsts],
            [vllm_params(params, n=params.n, seed=None, eos_token_id=eos_token_id) for _ in firsts])


def responses(completions: list[Any], *, pad: int) -> Responses:
    """The response fields of vLLM's completions (one per sample, in order), on the host.

    Raises:
        VerlError: a completion does not carry one log-prob per token.
    """
    rows = len(completions)
    width = max((len(c.token_ids) for c in completions), default=0)
    response_ids = torch.full((rows, width), pad, dtype=torch.int64)
    response_mask = torch.zeros((rows, width), dtype=torch.bool)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    truncated = torch.zeros(rows, dtype=torch.bool)
    for r, c in enumerate(completions):
        toks = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(toks):
            raise VerlError(
                f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for "
                f"{len(toks)} tokens of sample {r}; expected one per token"
            )
        k = len(toks)
        if k:
            response_ids[r, :k] = torch.tensor(toks, dtype=torch.int64)
            response_mask[r, :k] = True
            log_probs[r, :k] = torch.tensor(
                [float(entry[tok].logprob) for entry, tok in zip(c.logprobs, toks, strict=True)],
                dtype=torch.float32,
            )
        truncated[r] = c.finish_reason == "length"
    return response_ids, response_mask, log_probs, truncated
