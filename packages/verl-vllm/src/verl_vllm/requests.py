"""The vLLM rollout engine's requests: prompt checks, vLLM sampling parameters, one request per
prompt or per seeded sample, and the response fields assembled from vLLM's completions."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from verl_core import BatchValidationError, EngineSpec, SamplingParams, TensorBatch, VerlError
from verl_core.enginekit.sampling import expand_prompts
from verl_vllm._import import import_vllm

import_vllm()

from vllm import SamplingParams as VllmSamplingParams  # noqa: E402  (after the import check)
from vllm.inputs import TokensPrompt  # noqa: E402

__all__ = ["assemble", "build_requests", "prompt_token_lists", "sample_seed", "vllm_params"]

WHERE = "VllmRolloutEngine.generate"


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """The 63-bit seed of one sample's random stream, fixed by (seed, group id, sample index).

    Each sample is its own vLLM request with this seed, so a sample does not depend on the other
    samples of the batch or their order.
    """
    digest = hashlib.blake2b(f"{seed}:{group_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def vllm_params(params: SamplingParams, *, n: int, seed: int | None) -> Any:
    """vLLM's sampling parameters for ``n`` samples of one request (greedy: temperature 0)."""
    common: dict[str, Any] = {
        "n": n,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "seed": seed,
    }
    if params.greedy:
        return VllmSamplingParams(temperature=0.0, **common)
    return VllmSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, **common
    )


def prompt_token_lists(prompts: TensorBatch, spec: EngineSpec, vocab_size: int) -> list[list[int]]:
    """Each prompt's token ids without its left padding, after checking the batch.

    Raises:
        BatchValidationError: the batch is malformed, or a prompt is empty or longer than
            ``spec.max_prompt_len``.
    """
    prompts.require("prompt_ids", "prompt_mask", "group_ids", where=WHERE)
    prompts.check(where=WHERE, vocab_size=vocab_size)
    lengths = prompts["prompt_mask"].sum(1)
    if prompts.batch_size and int(lengths.min()) == 0:
        row = int((lengths == 0).nonzero()[0])
        raise BatchValidationError(
            f"{WHERE}: prompt of sample {row} is empty (prompt_mask all False); vLLM needs at "
            "least one prompt token"
        )
    if prompts.batch_size and int(lengths.max()) > spec.max_prompt_len:
        row = int(lengths.argmax())
        raise BatchValidationError(
            f"{WHERE}: prompt of sample {row} has {int(lengths[row])} tokens, more than "
            f"EngineSpec.max_prompt_len={spec.max_prompt_len}; shorten it or raise the limit"
        )
    ids = prompts["prompt_ids"].cpu()
    width = ids.shape[1]
    # Left padding: the real tokens are the last `length` columns (check() proved contiguity).
    return [ids[i, width - int(lengths[i]) :].tolist() for i in range(prompts.batch_size)]


def build_requests(token_lists: list[list[int]], group_ids: list[int],
                   params: SamplingParams) -> tuple[list[Any], list[Any]]:
    """The vLLM prompts and their sampling parameters: one request per prompt with ``n`` samples,
    or one per sample when seeded (each seeded by :func:`sample_seed`) or greedy."""
    n = params.n
    requests: list[Any] = []
    sampling: list[Any] = []
    # vLLM refuses n > 1 for greedy requests, and a seeded sample needs its own request.
    one_per_sample = params.seed is not None or params.greedy
    for ids, gid in zip(token_lists, group_ids, strict=True):
        if not one_per_sample:
            requests.append(TokensPrompt(prompt_token_ids=ids))
            sampling.append(vllm_params(params, n=n, seed=None))
            continue
        for j in range(n):
            seed = None if params.seed is None else sample_seed(params.seed, group_id=gid, sample_index=j)
            requests.append(TokensPrompt(prompt_token_ids=ids))
            sampling.append(vllm_params(params, n=1, seed=seed))
    return requests, sampling


def assemble(prompts: TensorBatch, params: SamplingParams, completions: list[Any], *, pad: int,
             weight_version: int) -> TensorBatch:
    """The expanded prompts with the response fields of vLLM's completions (one per sample, in order).

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
    base, meta = expand_prompts(prompts, params, pad_token_id=pad, weight_version=weight_version)
    device = prompts.device
    fields: dict[str, Tensor] = {
        "response_ids": response_ids,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
        "truncated": truncated,
    }
    return base.update({k: v.to(device) for k, v in fields.items()}, meta=meta)
