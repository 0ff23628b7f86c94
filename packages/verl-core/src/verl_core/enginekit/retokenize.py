"""Scoring with a reward model whose tokenizer differs from the policy's.

The policy's samples carry the policy's token ids. :class:`CrossTokenizerReward` wraps any reward
engine and, when the two vocabularies differ, converts each sample through text before scoring:
prompt and response are decoded with the policy's tokenizer (special tokens dropped) and encoded
with the reward model's, a response that ended with the policy's EOS gets the reward model's EOS,
and the scores come back onto the policy's batch. When the vocabularies are the same, ids pass
through untouched (no decode, no cost). The conversion needs only the :class:`Tokenizer` protocol,
so it works between any two backends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from verl_core.enginekit.byo import as_tokenizer
from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.errors import BatchValidationError, ConfigError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.schema import FIELDS
from verl_core.kernel.tokenizer import Tokenizer

__all__ = ["CrossTokenizerReward", "max_token_bytes", "retokenize", "same_vocabulary"]


def _vocab_table(tok: Tokenizer) -> dict[str, int] | None:
    """The token -> id table of a transformers tokenizer behind ``tok`` (None when there is none)."""
    inner = tok.wrapped if isinstance(tok, HFTokenizer) else tok
    get_vocab = getattr(inner, "get_vocab", None)
    if callable(get_vocab):
        table = get_vocab()
        if isinstance(table, dict):
            return {str(k): int(v) for k, v in table.items()}
    return None


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ids mean the same tokens under ``a`` and ``b`` (so ids can pass between them as they are).

    Compares the token tables when both tokenizers expose one (transformers tokenizers do), else the
    text of every single id; EOS and pad ids must match too.
    """
    if a is b:
        return True
    if (a.eos_token_id, a.pad_token_id) != (b.eos_token_id, b.pad_token_id):
        return False
    ta, tb = _vocab_table(a), _vocab_table(b)
    if ta is not None and tb is not None:
        return ta == tb
    if a.vocab_size != b.vocab_size:
        return False
    return all(
        a.decode([i], skip_special_tokens=False) == b.decode([i], skip_special_tokens=False)
        for i in range(a.vocab_size)
    )


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one id of ``tokenizer`` adds to the text :func:`retokenize` decodes, plus one.

    Special tokens (dropped by the decode) add none; the extra byte is for a leading space that some
    tokenizers (SentencePiece) drop when they decode an id alone. A sample of ``n`` ids re-encoded by
    a tokenizer each of whose tokens covers at least one byte of text (byte-level BPE, WordPiece,
    SentencePiece, character tokenizers) is at most ``n * max_token_bytes(tokenizer)`` ids long.
    Decodes every id once.
    """
    return 1 + max((len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)), default=0)


def retokenize(batch: TensorBatch, source: Tokenizer, target: Tokenizer) -> TensorBatch:
    """``batch``'s prompts and responses re-encoded from ``source``'s vocabulary into ``target``'s.

    Per-sample fields without a token dimension (``group_ids``, ``sample_index``, ``truncated``,
    ``scores``, ...), the extras and the meta are kept (the meta's pad id becomes ``target``'s);
    per-token fields (log-probs, values, ...) are dropped, since their positions no longer line up.

    Raises:
        BatchValidationError: a prompt decodes to text that ``target`` encodes to no tokens.
    """
    batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="retokenize")
    prompts = batch["prompt_ids"].cpu().tolist()
    pmask = batch["prompt_mask"].cpu().tolist()
    responses = batch["response_ids"].cpu().tolist()
    rmask = batch["response_mask"].cpu().tolist()
    new_prompts: list[list[int]] = []
    new_responses: list[list[int]] = []
    for i in range(batch.batch_size):
        prompt = [t for t, m in zip(prompts[i], pmask[i], strict=True) if m]
        response = [t for t, m in zip(responses[i], rmask[i], strict=True) if m]
        encoded = target.encode(source.decode(prompt))
        if not encoded:
            raise BatchValidationError(
                f"retokenize: prompt {i} decodes to {source.decode(prompt)!r}, which the target tokenizer "
                "encodes to no tokens; every sample needs a prompt token"
            )
        new_prompts.append(encoded)
        out = target.encode(source.decode(response))
        if response and response[-1] == source.eos_token_id:
            out.append(target.eos_token_id)
        new_responses.append(out)
    pad = target.pad_token_id
    p_width = max((len(p) for p in new_prompts), default=0)
    r_width = max((len(r) for r in new_responses), default=0)
    dev = batch.device
    prompt_ids = torch.full((batch.batch_size, p_width), pad, dtype=torch.int64)
    prompt_mask = torch.zeros((batch.batch_size, p_width), dtype=torch.bool)
    response_ids = torch.full((batch.batch_size, r_width), pad, dtype=torch.int64)
    response_mask = torch.zeros((batch.batch_size, r_width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(new_prompts, new_responses, strict=True)):
        if p:
            prompt_ids[i, p_width - len(p):] = torch.tensor(p, dtype=torch.int64)
            prompt_mask[i, p_width - len(p):] = True
        if r:
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
            response_mask[i, : len(r)] = True
    kept = {
        name: t for name, t in batch.items()
        if name in FIELDS and FIELDS[name].dims == ("batch",)
    }
    kept.update(prompt_ids=prompt_ids.to(dev), prompt_mask=prompt_mask.to(dev),
                response_ids=response_ids.to(dev), response_mask=response_mask.to(dev))
    meta = dataclasses.replace(batch.meta, pad_token_id=pad)
    return TensorBatch(kept, batch.extras, meta, batch_size=batch.batch_size)


class CrossTokenizerReward(RewardEngine):
    """A reward engine that scores the policy's samples even when its own tokenizer differs.

    Args:
        reward: The reward engine (e.g. a transformers sequence-classification model).
        policy_tokenizer: Tokenizer of the samples' ids (the rollout engine's ``tokenizer``).
        reward_tokenizer: Tokenizer of the reward model (default: ``reward.tokenizer``).

    Raises:
        ConfigError: no reward tokenizer is given and the engine has none.
    """

    def __init__(self, reward: RewardEngine, policy_tokenizer: Any, reward_tokenizer: Any = None) -> None:
        if reward_tokenizer is None:
            reward_tokenizer = getattr(reward, "tokenizer", None)
            if reward_tokenizer is None:
                raise ConfigError(
                    f"{type(reward).__name__} has no `tokenizer`; pass reward_tokenizer= to CrossTokenizerReward"
                )
        self._inner = reward
        self._policy = as_tokenizer(policy_tokenizer)
        self._reward_tok = as_tokenizer(reward_tokenizer)
        self._convert = not same_vocabulary(self._policy, self._reward_tok)
        inner_caps = reward.capabilities
        self._caps = RewardCapabilities(
            scores=inner_caps.scores,
            token_scores=inner_caps.token_scores and not self._convert,
            needs_text=inner_caps.needs_text,
            devices=inner_caps.devices,
        )

    @property
    def converts(self) -> bool:
        """True when samples go through text (the vocabularies differ); False when ids pass as they are."""
        return self._convert

    @property
    def inner(self) -> RewardEngine:
        """The wrapped reward engine."""
        return self._inner

    @property
    def tokenizer(self) -> Tokenizer:
        """The policy's tokenizer (the one the samples this engine takes are in)."""
        return self._policy

    @property
    def capabilities(self) -> RewardCapabilities:
        """The inner engine's, without token scores when converting (positions do not line up)."""
        return self._caps

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Return ``batch`` with the reward model's ``scores`` (converted through text if needed).

        Raises:
            ConfigError: the vocabularies differ and the inner engine gives only token scores.
        """
        if not self._convert:
            return self._inner.score(batch)
        scored = self._inner.score(retokenize(batch, self._policy, self._reward_tok))
        if "scores" not in scored:
            raise ConfigError(
                f"{type(self._inner).__name__} returned only token_scores; token-level scores cannot be "
                "carried across different tokenizers. Use a reward engine that gives sequence scores"
            )
        return batch.update(scores=scored["scores"].to(batch.device))

    def close(self) -> None:
        """Close the wrapped engine."""
        self._inner.close()
