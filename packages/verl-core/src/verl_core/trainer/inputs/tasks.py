"""Built-in tasks: generated prompt sets with rule-based exact-match rewards, needing no download.

* ``copy``: ``"c123="`` -> ``"123"``; ``reverse``: ``"r123="`` -> ``"321"``; ``add``: ``"12+345="`` ->
  ``"357"``. Every answer spans several tokens of a character-level tokenizer and must be followed
  by EOS: :class:`TaskReward` gives 1 only to a response that is exactly the answer and then EOS.
* Prompts are a deterministic function of (seed, step), so a resumed run draws the same prompts,
  and group ids are ``step * prompts_per_step + i``: unique for the whole run.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from verl_core.agent.render import prompts_from_ids
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.tokenizer import Tokenizer

__all__ = ["TASKS", "DigitTask", "RewardMode", "TaskReward", "get_task", "prompt_batch"]

TASKS: Final = ("copy", "reverse", "add")


@dataclass(frozen=True)
class DigitTask:
    """A generated task over decimal numbers.

    Attributes:
        name: ``copy``, ``reverse`` or ``add``.
        digits: Digits of each number (copy/reverse use exactly this many; add draws operands
            of 1 to ``digits`` digits).
    """

    name: str
    digits: int = 3

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ConfigError(f"unknown task {self.name!r}; built-in tasks: {', '.join(TASKS)}")
        if not 1 <= self.digits <= 9:
            raise ConfigError(f"task digits must be in 1..9, got {self.digits}")

    def example(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt, answer) pair drawn with ``rng``."""
        if self.name == "add":
            hi = 10**self.digits - 1
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            return f"{a}+{b}=", str(a + b)
        number = "".join(rng.choice("0123456789") for _ in range(self.digits))
        if self.name == "copy":
            return f"c{number}=", number
        return f"r{number}=", number[::-1]

    def examples(self, n: int, *, seed: int, step: int) -> list[tuple[str, str]]:
        """The ``n`` (prompt, answer) pairs of ``step`` of a run seeded with ``seed`` (deterministic)."""
        rng = random.Random(f"{self.name}/{self.digits}/{seed}/{step}")
        return [self.example(rng) for _ in range(n)]

    def max_answer_len(self) -> int:
        """Characters of the longest answer (EOS not counted)."""
        return self.digits + 1 if self.name == "add" else self.digits

    def max_prompt_len(self) -> int:
        """Characters of the longest prompt."""
        return 2 * self.digits + 2 if self.name == "add" else self.digits + 2

    @staticmethod
    def score(prompt: str, response: str, extras: Mapping[str, Any]) -> float:
        """Exact match of the response text with ``extras["answer"]``: 1.0 or 0.0.

        Usable as the function of :class:`verl_core.FunctionReward` (which does not see EOS);
        :class:`TaskReward` additionally requires the response to end with EOS.
        """
        return 1.0 if response == str(extras["answer"]) else 0.0


def get_task(name: str, digits: int = 3) -> DigitTask:
    """The built-in task ``name``."""
    return DigitTask(name, digits)


RewardMode = Literal["exact", "partial", "token"]
"""``exact``: 1 for the answer then EOS, else 0. ``partial``: the share of positions of
answer-then-EOS that the response matches, over the longer of the two (1 only for an exact match).
``token``: the ``partial`` score plus dense ``token_scores`` (1 / longer length at each matching
position, so they sum to the partial score) for per-token estimators such as ``grpo_token``."""


class TaskReward(RewardEngine):
    """Scores a response against the task's answer followed by EOS, in [0, 1].

    With ``mode="exact"`` the score is 1.0 for exactly the answer then EOS and 0.0 otherwise. With
    ``mode="partial"`` it is the number of positions where the response's tokens equal those of
    answer-then-EOS, divided by the longer length, so only an exact match scores 1.0 and a random
    policy scores about 1/vocab; it gives a learning signal before the first exact match. With
    ``mode="token"`` the batch also gets ``token_scores``: at each matching position 1 / the
    longer length (summing to the partial score). :meth:`exact_match` always reports the strict
    success.

    Args:
        task: The task whose :meth:`DigitTask.score` judges the text.
        tokenizer: Encodes the answers, decodes responses and names EOS.
        mode: ``exact`` or ``partial``.
    """

    def __init__(self, task: DigitTask, tokenizer: Tokenizer, mode: RewardMode = "exact") -> None:
        if mode not in ("exact", "partial", "token"):
            raise ConfigError(f"TaskReward mode must be 'exact', 'partial' or 'token', got {mode!r}")
        self._task = task
        self._tok = tokenizer
        self._mode = mode
        self._caps = RewardCapabilities(needs_text=True)

    @property
    def capabilities(self) -> RewardCapabilities:
        """Sequence scores from text."""
        return self._caps

    def _responses(self, batch: TensorBatch) -> tuple[list[list[int]], tuple[Any, ...]]:
        batch.require("response_ids", "response_mask", where="TaskReward.score")
        if "answer" not in batch.extras:
            raise ConfigError("TaskReward.score needs the per-sample extra 'answer' (set by prompt_batch)")
        ids = batch["response_ids"].cpu().tolist()
        mask = batch["response_mask"].cpu().tolist()
        return [[t for t, m in zip(r, mk) if m] for r, mk in zip(ids, mask)], batch.extras["answer"]

    def exact_match(self, batch: TensorBatch) -> torch.Tensor:
        """1.0 where the response is exactly the answer then EOS, else 0.0 (float32 [batch])."""
        responses, answers = self._responses(batch)
        eos = self._tok.eos_token_id
        out = []
        for toks, answer in zip(responses, answers):
            if not toks or toks[-1] != eos or eos in toks[:-1]:
                out.append(0.0)
            else:
                out.append(self._task.score("", self._tok.decode(toks[:-1]), {"answer": answer}))
        return torch.tensor(out, dtype=torch.float32, device=batch.device)

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Score every sample; the batch needs ``response_ids``, ``response_mask`` and the ``answer`` extra."""
        exact = self.exact_match(batch)
        if self._mode == "exact":
            return batch.update(scores=exact)
        responses, answers = self._responses(batch)
        eos = self._tok.eos_token_id
        out = []
        dense = torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
        for i, (toks, answer) in enumerate(zip(responses, answers)):
            target = [*self._tok.encode(str(answer)), eos]
            longer = max(len(toks), len(target))
            hits = [t for t, (a, b) in enumerate(zip(toks, target)) if a == b]
            out.append(len(hits) / longer)
            if hits:
                dense[i, hits] = 1.0 / longer
        scores = torch.tensor(out, dtype=torch.float32, device=batch.device)
        scores = torch.where(exact > 0, exact, scores.clamp(max=0.99))
        if self._mode == "token":
            return batch.update(scores=scores, token_scores=dense.to(batch.device))
        return batch.update(scores=scores)


def prompt_batch(
    prompts: Sequence[str],
    tokenizer: Tokenizer,
    *,
    group_ids: Sequence[int],
    extras: Mapping[str, Sequence[Any]] | None = None,
    meta: BatchMeta | None = None,
) -> TensorBatch:
    """Encode prompt texts into a left-padded TensorBatch with ``group_ids`` and extras.

    The texts are encoded as they are (no chat template); the batch is
    :func:`~verl_core.agent.render.prompts_from_ids`'s, the one builder of prompt batches
    (:func:`~verl_core.agent.render.render_prompts` takes conversations as well as texts).

    Raises:
        ConfigError: a prompt that encodes to no tokens, or not as many group ids as prompts.
    """
    encoded = [tokenizer.encode(p) for p in prompts]
    return prompts_from_ids(encoded, tokenizer.pad_token_id, group_ids=group_ids, extras=extras, meta=meta)
