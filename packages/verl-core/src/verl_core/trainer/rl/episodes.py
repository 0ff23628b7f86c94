"""Multi-turn rollouts of an RL run (``[agent]``): the episode loop in place of one ``generate`` call.

:class:`EpisodeRollout` runs :class:`~verl_core.agent.loop.AgentLoop` on a step's prompts (and on
evaluation prompts): the prompts are repeated ``rollout.n`` times and run at most
``agent.concurrency`` episodes at a time, into one batch in the canonical layout, with ``loss_mask`` (the tokens the model sampled) and ``turn_ids``.
One loop serves every call, so calls under way at once (an asynchronous run's steps produced side by
side, an evaluation) share its ``generate`` calls, and ``agent.concurrency`` bounds them together: as
an episode ends, the next one starts, of the same step or of the next.
The rest of the step reads it like a single-turn batch: losses, KL, aggregation and counts read
``TensorBatch.loss_mask``, forwards run over the whole response (observations included).

:class:`EpisodeRewards` is the reward of such a batch: the run's reward (the reward functions,
a reward model, or nothing) plus, per episode, the sum of the environment's per-turn rewards
(``StepResult.reward``; a turn without one counts 0), reported as ``reward/environment``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from verl_core.agent.loop import EPISODE_KEY, AgentLoop
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.errors import RewardError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.trainer.inputs.agent import PROMPT_MESSAGES, AgentSetup, is_episode_batch

if TYPE_CHECKING:
    from verl_core.trainer.rl.engines import RLEngines

__all__ = ["ENVIRONMENT_TERM", "EpisodeRewards", "EpisodeRollout"]

ENVIRONMENT_TERM = "environment"
"""Name of the environment's reward term in extras and metrics (``reward/environment/mean``)."""


class EpisodeRollout:
    """Runs a prompt batch as multi-turn episodes with the run's rollout engine.

    Args:
        setup: The ``[agent]`` section's environments, tools and limits.
        engines: The run's engines; the rollout engine is read at call time (one replaced after
            setup is the one used).
        max_restarts: Times an episode whose turns would span a weight update is sampled again from
            its first turn (``AgentLoop``'s ``max_restarts``; 0 = it continues on the new weights).
    """

    def __init__(self, setup: AgentSetup, engines: RLEngines, *, max_restarts: int = 0) -> None:
        self.setup = setup
        self.engines = engines
        self.max_restarts = max_restarts
        self._stops: tuple[Tokenizer, tuple[int, ...]] | None = None
        self._loop: AgentLoop | None = None
        self._guard = threading.Lock()  # guards _loop

    def loop(self, engine: RolloutEngine) -> AgentLoop:
        """The episode loop of ``engine``: one for every call, so calls under way at once (the
        asynchronous producer's steps, an evaluation) share its generate calls and ``agent.concurrency``."""
        with self._guard:
            if self._loop is None or self._loop.engine is not engine:  # a replaced engine gets a loop of its own
                self._loop = AgentLoop(engine, self.setup.config.limits(), tokenizer=engine.tokenizer,
                                       max_restarts=self.max_restarts, max_active=self.setup.config.concurrency)
            return self._loop

    def stop_token_ids(self, engine: RolloutEngine) -> tuple[int, ...]:
        """The ids that end a turn besides EOS, for ``engine``'s tokenizer (computed once per tokenizer)."""
        tok = engine.tokenizer
        if self._stops is None or self._stops[0] is not tok:
            self._stops = (tok, self.setup.stop_token_ids(tok))
        return self._stops[1]

    def run(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """The episodes of ``prompts``, ``params.n`` per prompt, in prompt order (a prompt's samples together).

        Args:
            prompts: Left-padded prompts with ``group_ids`` and the dataset columns as extras; the
                extra :data:`~verl_core.trainer.inputs.agent.PROMPT_MESSAGES` (the messages each
                prompt was rendered from), when there, begins each episode's conversation.
            params: The step's sampling parameters; ``agent.stop_tokens`` (or the template's
                end-of-turn token) are added to its stop ids.

        Returns:
            One batch of every episode (see :mod:`verl_core.agent.loop`).
        """
        engine = self.engines.rollout
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.stop_token_ids(engine))))
        turn = dataclasses.replace(params, n=1, stop_token_ids=stops)
        messages: Sequence[Any] | None = prompts.extras.get(PROMPT_MESSAGES)
        if messages is not None:
            prompts = prompts.select(*prompts, extras=[k for k in prompts.extras if k != PROMPT_MESSAGES])
        rows = prompts.repeat_interleave(params.n)  # sample_index 0..n-1: the loop takes them as they are
        row_messages = None if messages is None else [m for m in messages for _ in range(params.n)]
        return self.loop(engine).run(rows, self.setup.factory, turn, prompt_messages=row_messages)


class EpisodeRewards(RewardEngine):
    """The reward of a batch of episodes: the run's reward plus the environment's per-turn rewards, summed.

    The score of an episode is the inner engine's score (0 without one) plus the sum of its
    turns' ``StepResult.reward`` (None counts 0). The environment's sum is also recorded as the
    extra ``reward/environment`` (metric ``reward/environment/mean``).

    Args:
        inner: The run's reward engine (reward functions, a reward model), or None when the
            environment's rewards are the whole reward.
    """

    def __init__(self, inner: RewardEngine | None) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> RewardCapabilities:
        """The inner engine's (sequence scores when there is none)."""
        return self.inner.capabilities if self.inner is not None else RewardCapabilities()

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Score ``batch`` with the inner engine and add each episode's environment rewards.

        Raises:
            RewardError: the batch holds no episodes (it did not come from the episode loop).
        """
        if not is_episode_batch(batch):
            raise RewardError(
                f"the reward of a multi-turn run scores batches of episodes (extras {EPISODE_KEY!r} and turn_ids, "
                "from the episode loop); this batch has none"
            )
        env = [float(sum(r for r in info["rewards"] if r is not None)) for info in batch.extras[EPISODE_KEY]]
        out = self.inner.score(batch) if self.inner is not None else batch
        extra = torch.tensor(env, dtype=torch.float32, device=batch.device)
        base = out["scores"] if "scores" in out else torch.zeros_like(extra)
        return out.update(scores=base.float() + extra, extras={f"reward/{ENVIRONMENT_TERM}": env})

    def close(self) -> None:
        """Close the inner engine."""
        if self.inner is not None:
            self.inner.close()
