"""The episode loop: multi-turn rollouts, token in, token out.

:class:`AgentLoop` runs a batch of episodes, one per sample, each with its own
:class:`~verl_core.kernel.environment.Environment`:

1. Each turn, the rollout engine samples the next turn of every active episode from the exact
   token ids of the episode so far (the initial prompt, then every sampled and appended token),
   left-padded into one prompt batch: earlier turns are never re-tokenized. ``max_new_tokens`` is
   the largest remaining budget of the active episodes (capped by the engine's
   ``max_response_len``); each episode's turn is then cut to its own remaining budget. A turn
   ends at EOS or a stop id (``SamplingParams.stop_token_ids``: pass the template's end-of-turn
   ids there); the token that ends it is part of it. A turn the engine's ``max_response_len`` cut
   inside the episode's budget continues in the next call.
2. The environments of every episode whose turn ended are stepped concurrently (one daemon thread
   each, all under ``EpisodeLimits.step_timeout_s``) with the turn's text and ids.
3. The observation's tokens (:class:`~verl_core.agent.render.ObservationRenderer`: the delta of the
   new messages through the chat template, or text as it is) are appended, and the next turn
   starts.

An episode ends when its environment says ``done`` (``termination="done"``), at ``max_turns``
completed turns or when the token budget ``max_total_tokens`` is spent (``truncated`` True), when
its context would exceed the engine's ``max_prompt_len`` (``truncated`` True), or at an
environment failure (``termination="error"``): a factory or step that raises, a step that returns
something other than a :class:`~verl_core.kernel.environment.StepResult`, a step that does not
return within the timeout, or an observation that cannot be rendered. A failure ends only its own
episode, with one message saying what happened; the run goes on. A turn cut by the budget is not
handed to the environment, and an observation that does not fit the budget (with room for at
least one more model token) or comes after the last allowed turn is not appended.

Several ``run`` calls may be under way at once, from different threads (an asynchronous trainer
producing the samples of two steps): each call's thread runs its own episodes, and their turns
share the loop's ``generate`` calls, one call for the next turn of every episode of every call that
asks for one, whose sampling parameters agree but for the seed (and ``max_new_tokens``). A shared
call waits for the calls busy between two of their calls (they ask within moments), and for a call
stepping its environments only about half as long as the last ``generate`` took, so a slow tool
holds up no other call's turns. ``max_active`` caps the
episodes running at once across every call: as one ends, the next waiting episode (of the same call,
or of the next call in arrival order) starts, so the engine's batch stays full while the longest
episodes of a step finish. An episode's random stream does not depend on the episodes it shares a
call with (see ``AgentLoop.run``'s ``params``), so its tokens are those it samples alone wherever the
engine's per-sample seeding is exact (float32).

The rollout engine re-runs the whole prefix each turn unless it declares
``RolloutCapabilities.prefix_continuation`` (it then reuses what it cached); the result is the same.

When the engine's weights are updated while episodes run (asynchronous training), each call's
output carries its weight version. By default an episode continues on the new weights and each turn
records its versions (:attr:`TurnInfo.weight_versions`). With ``max_restarts`` n >= 1, an episode
whose call returns another version than the first call of its attempt is abandoned instead: what it
sampled is discarded (counted in :attr:`EpisodeInfo.restarted_tokens`), a fresh environment is
built from the factory, and the episode starts again from its initial prompt like a new one (the
same random streams), so its tokens come from one version. After n restarts it continues across
further updates, its turns tagged.

The output is one :class:`~verl_core.kernel.batch.TensorBatch` in the canonical layout:
``prompt_ids``/``prompt_mask`` the initial prompt (left-padded), ``response_ids``/``response_mask``
every token after it (model turns and observations, right-padded), ``loss_mask`` True exactly on
the tokens the model sampled, ``turn_ids`` the turn of each token (an observation belongs to the
turn it answers), ``rollout_log_probs`` on the model's tokens (0 elsewhere), ``truncated``, the
prompt's ``group_ids``, ``sample_index`` and extras, plus two extras: :data:`EPISODE_KEY`, an
:class:`EpisodeInfo` per episode, and :data:`~verl_core.kernel.schema.TURNS_EXTRA`, per episode a
list whose item k is the :class:`TurnInfo` of turn k (the ``turn_ids`` value k).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypedDict, cast

import torch

from verl_core.agent._deadline import Outcome, run_with_deadline
from verl_core.agent.render import ObservationRenderer, prompts_from_ids
from verl_core.enginekit.sampling import sample_seed
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.environment import Environment, EnvironmentFactory, StepResult, check_messages
from verl_core.kernel.errors import (
    BatchValidationError,
    ConfigError,
    check_int,
    check_number,
    describe,
)
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.schema import FIELDS, TURNS_EXTRA
from verl_core.kernel.tokenizer import ChatMessage, Tokenizer

__all__ = ["EPISODE_KEY", "AgentLoop", "EpisodeInfo", "EpisodeLimits", "Termination", "TurnInfo", "environment_seconds",
           "episode_metrics"]

EPISODE_KEY: Final = "episode"
"""The extras key of the per-episode :class:`EpisodeInfo`."""

Termination = Literal["done", "max_turns", "max_total_tokens", "context_limit", "error"]
"""Why an episode ended: the environment said done, a limit (``truncated`` True), or a failure."""


class TurnInfo(TypedDict):
    """One model turn and the environment's answer (JSON values).

    Attributes:
        model_tokens: Tokens the model sampled in the turn.
        observation_tokens: Tokens of the observation appended after it (0 when none was).
        reward: The environment step's reward (None: none given, or the step did not run).
        done: The environment ended the episode at this turn.
        metrics: The step's metrics (e.g. ``tool_calls``).
        weight_versions: The weight versions of the ``generate`` calls that sampled the turn,
            ascending and distinct: one, unless a turn cut by the engine's ``max_response_len``
            continued in a call after a weight update (asynchronous training with
            ``partial_rollouts = "continue"``, or an episode past ``AgentLoop``'s ``max_restarts``).
            The token's turn (``turn_ids``) maps each model token to its turn's versions.
    """

    model_tokens: int
    observation_tokens: int
    reward: float | None
    done: bool
    metrics: dict[str, float]
    weight_versions: list[int]


class EpisodeInfo(TypedDict):
    """What happened in one episode (JSON values, so batches holding it can be saved).

    Attributes:
        turns: Model turns sampled (a turn cut by the budget included).
        termination: Why the episode ended (:data:`Termination`).
        message: What ended it, in words, for every termination but ``done`` (else None).
        rewards: The reward of each model turn (None where the environment gave none or was not
            stepped), as in :class:`TurnInfo`.
        model_tokens: Tokens the model sampled (``loss_mask`` True).
        observation_tokens: Tokens appended from observations.
        tool_calls: Sum of the steps' ``tool_calls`` metric.
        tool_errors: Sum of the steps' ``tool_errors`` metric.
        tool_timeouts: Sum of the steps' ``tool_timeouts`` metric.
        env_errors: Environment failures (a raising factory or step, a wrong return type, an
            observation that cannot be rendered): 0 or 1.
        env_timeouts: Steps that did not return within the timeout: 0 or 1.
        env_seconds: This episode's share of the wall-clock seconds the loop spent building and
            stepping environments (with the tools' environment: running the tool calls): each
            time the loop waits on the environments of several episodes at once, the seconds are
            divided evenly among them, so the shares of a batch add up to the loop's time in
            environments (:func:`environment_seconds`). Abandoned attempts (``restarts``) included.
        restarts: Times the episode was abandoned at a weight update and started again from its
            first turn (``AgentLoop``'s ``max_restarts``); the other fields but ``env_seconds``
            describe the last attempt only.
        restarted_tokens: Tokens the model sampled in the abandoned attempts (discarded).
        metrics: Every metric the steps reported, summed.
        messages: The conversation: the prompt's messages when given, then each model turn (role
            ``assistant``, decoded without special tokens) and each appended observation (its
            messages, or role ``observation`` for text).
    """

    turns: int
    termination: Termination
    message: str | None
    rewards: list[float | None]
    model_tokens: int
    observation_tokens: int
    tool_calls: float
    tool_errors: float
    tool_timeouts: float
    env_errors: int
    env_timeouts: int
    env_seconds: float
    restarts: int
    restarted_tokens: int
    metrics: dict[str, float]
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits of every episode; checked when built.

    Attributes:
        max_turns: Model turns per episode (>= 1).
        max_total_tokens: Tokens after the initial prompt, model turns and observations together
            (>= 1); the response width of the output batch is at most this.
        step_timeout_s: Wall-clock seconds the environment steps of one turn may take together
            (they run concurrently); a step still running then ends its episode with an error
            (its thread is abandoned). None = no limit. Also bounds building the environments.
    """

    max_turns: int = 8
    max_total_tokens: int = 1024
    step_timeout_s: float | None = 60.0

    def __post_init__(self) -> None:
        check_int(self.max_turns, "EpisodeLimits.max_turns", low=1)
        check_int(self.max_total_tokens, "EpisodeLimits.max_total_tokens", low=1)
        if self.step_timeout_s is not None:
            check_number(self.step_timeout_s, "EpisodeLimits.step_timeout_s", low=0, low_open=True, hint=" or None")


@dataclass
class _Episode:
    """One episode's state while the loop runs."""

    index: int
    prompt: list[int]
    group_id: int
    sample_index: int
    messages: list[dict[str, Any]]
    first_messages: tuple[dict[str, Any], ...] = ()  # the prompt's messages, to start an attempt again
    env: Environment | None = None
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turn_start: int | None = None  # where the turn being sampled starts in ``tokens``
    turn_versions: list[int] = field(default_factory=list)  # weight versions of the turn's generate calls
    turns: int = 0
    calls: int = 0  # generate calls that sampled for this episode
    steps: int = 0
    turn_infos: list[TurnInfo] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    termination: Termination | None = None
    message: str | None = None
    truncated: bool = False
    env_errors: int = 0
    env_timeouts: int = 0
    env_seconds: float = 0.0  # share of the loop's wall-clock seconds in environments
    version: int | None = None  # the weight version of the attempt's first generate call
    restarts: int = 0
    restarted_tokens: int = 0

    def end(self, why: Termination, message: str | None = None, *, truncated: bool = False) -> None:
        self.termination, self.message, self.truncated = why, message, truncated

    def fail(self, message: str, *, timeout: bool = False) -> None:
        self.end("error", message)
        self.env_timeouts += timeout
        self.env_errors += not timeout

    def append(self, ids: Sequence[int], *, sampled: bool, turn: int, log_probs: Sequence[float] | None = None) -> None:
        self.tokens.extend(ids)
        self.sampled.extend([sampled] * len(ids))
        self.turn_of.extend([turn] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    def restarted(self, discarded: int) -> _Episode:
        """This episode started again from its initial prompt, as a new one (no environment yet): the
        tokens it sampled, and ``discarded`` more from the call that saw the new version, are dropped."""
        return _Episode(
            index=self.index, prompt=self.prompt, group_id=self.group_id, sample_index=self.sample_index,
            messages=[dict(m) for m in self.first_messages], first_messages=self.first_messages,
            env_seconds=self.env_seconds, restarts=self.restarts + 1,
            restarted_tokens=self.restarted_tokens + sum(self.sampled) + discarded,
        )

    def info(self) -> EpisodeInfo:
        assert self.termination is not None
        model = sum(self.sampled)
        return EpisodeInfo(
            turns=self.turns, termination=self.termination, message=self.message,
            rewards=[t["reward"] for t in self.turn_infos],
            model_tokens=model, observation_tokens=len(self.tokens) - model,
            tool_calls=self.metrics.get("tool_calls", 0.0), tool_errors=self.metrics.get("tool_errors", 0.0),
            tool_timeouts=self.metrics.get("tool_timeouts", 0.0), env_errors=self.env_errors,
            env_timeouts=self.env_timeouts, env_seconds=self.env_seconds, restarts=self.restarts,
            restarted_tokens=self.restarted_tokens, metrics=dict(self.metrics), messages=list(self.messages),
        )


@dataclass(eq=False)  # compared by identity
class _Request:
    """A call's episodes to sample a turn of, waiting for a shared generate call."""

    active: list[_Episode]
    params: SamplingParams
    out: TensorBatch | None = None
    error: BaseException | None = None


@dataclass(eq=False)  # compared by identity
class _Run:
    """One ``run`` call's episodes while its thread runs them."""

    rows: TensorBatch
    environments: EnvironmentFactory | Sequence[Environment]
    params: SamplingParams  # the turn's: n=1, the stop ids (EOS included)
    episodes: list[_Episode]
    waiting: list[int]  # indices of the episodes not started yet (``max_active``), in order
    meta: Any = None  # the meta of the last generate call that sampled for this run
    request: _Request | None = None  # waiting for a generate call
    state: Literal["busy", "environments", "idle"] = "busy"  # what its thread does between generate calls
    since: float = 0.0  # when it entered its environments (time.monotonic())

    def started(self) -> list[_Episode]:
        """The episodes started and not ended."""
        waiting = set(self.waiting)
        return [e for e in self.episodes if e.termination is None and e.index not in waiting]


class AgentLoop:
    """Runs batches of multi-turn episodes with a rollout engine (see the module docstring).

    Args:
        engine: The rollout engine that samples every turn.
        limits: Turn, token and time limits of each episode.
        tokenizer: Renders observations (default: the engine's). With a chat template
            (:class:`~verl_core.kernel.tokenizer.ChatTokenizer`) message observations are rendered
            as deltas; without one they and text observations are encoded as text.
        max_restarts: What an episode does when the engine's weights change under it (a call
            returns another ``meta.weight_version`` than the first call of the episode's attempt).
            0 (default): it continues on the new weights, each turn tagged with its versions.
            n >= 1: it is abandoned and started again from its initial prompt, with a fresh
            environment from the factory, at most n times; after that it continues, tagged.
        max_active: Most episodes running at once, over every ``run`` call under way (0 = no
            limit). Episodes start in order as others end; each starts with its environment built.

    Raises:
        ConfigError: an argument of the wrong type, or a negative ``max_restarts`` or ``max_active``.
    """

    def __init__(self, engine: RolloutEngine, limits: EpisodeLimits | None = None, *,
                 tokenizer: Tokenizer | None = None, max_restarts: int = 0, max_active: int = 0) -> None:
        if not callable(getattr(engine, "generate", None)):
            raise ConfigError(f"AgentLoop needs a RolloutEngine, got {describe(engine)}")
        if limits is not None and not isinstance(limits, EpisodeLimits):
            raise ConfigError(f"AgentLoop limits must be an EpisodeLimits, got {describe(limits)}")
        self._engine = engine
        self._limits = limits if limits is not None else EpisodeLimits()
        self._tok = tokenizer if tokenizer is not None else engine.tokenizer
        self._max_restarts = check_int(max_restarts, "AgentLoop max_restarts", low=0)
        self._max_active = check_int(max_active, "AgentLoop max_active", low=0)
        self._cond = threading.Condition()  # guards _runs, their waiting/request/state, and _calling
        self._runs: list[_Run] = []  # the calls under way, in arrival order
        self._calling = False  # a thread is in a shared generate call
        self._last_call_s = 0.0  # how long the last generate call took

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine that samples every turn."""
        return self._engine

    @property
    def limits(self) -> EpisodeLimits:
        """The limits of every episode."""
        return self._limits

    def run(
        self,
        prompts: TensorBatch,
        environments: EnvironmentFactory | Sequence[Environment],
        params: SamplingParams,
        *,
        prompt_messages: Sequence[Sequence[ChatMessage]] | None = None,
    ) -> TensorBatch:
        """Run one episode per sample until each ends.

        Safe to call from several threads at once: the calls' episodes share ``generate`` calls
        (see the module docstring) and each call returns its own episodes' batch.

        Args:
            prompts: Left-padded ``prompt_ids``/``prompt_mask`` (each sample's rendered conversation
                so far, e.g. from :func:`~verl_core.agent.render.render_prompts`), ``group_ids``, and
                the dataset columns as extras. They are repeated ``params.n`` times like
                ``RolloutEngine.generate`` does, unless ``params.n`` is 1 and they already carry
                ``sample_index`` (prompts repeated by the caller).
            environments: A factory called with each sample's row (its extras by key) to build a
                fresh environment (again for each restart), or a list of one environment per
                sample after the repetition (only with ``max_restarts`` 0).
            params: Sampling parameters. ``stop_token_ids`` (plus EOS) end a turn: include the
                chat template's end-of-turn ids. ``max_new_tokens`` is ignored (the budget is
                ``EpisodeLimits.max_total_tokens``); with a seed, every episode's every turn has
                its own random stream, fixed by (seed, group id, sample index, generate call): the
                engine is called with seed 0 and each row's group id carries the hash of the four.
            prompt_messages: The messages each prompt was rendered from (one list per row of
                ``prompts``), to begin each episode's recorded conversation.

        Returns:
            The episodes' batch (see the module docstring). Its ``meta.weight_version`` is the oldest
            weight version any of its turns was sampled from (an update between turns is recorded,
            not hidden behind the last turn's version; the turns of abandoned attempts do not count).

        Raises:
            ConfigError: arguments of the wrong type, as many environments or message lists as
                samples not given, or a list of environments with ``max_restarts`` >= 1.
            BatchValidationError: prompts without ``prompt_ids``, ``prompt_mask`` or ``group_ids``.
        """
        run = self._submit(prompts, environments, params, prompt_messages)
        with self._cond:
            self._runs.append(run)
        try:
            self._drive(run)
        finally:
            with self._cond:
                self._runs.remove(run)
                self._cond.notify_all()
        meta = run.meta
        if meta is not None:  # the oldest version of a kept turn (every call's, without restarts)
            kept = [v for e in run.episodes for t in e.turn_infos for v in t["weight_versions"]]
            meta = dataclasses.replace(meta, weight_version=min(kept, default=meta.weight_version))
        return self._output(run.rows, run.episodes, run.params, meta)

    # ------------------------------------------------------------------ the steps of a run
    def _submit(self, prompts: TensorBatch, environments: EnvironmentFactory | Sequence[Environment],
                params: SamplingParams, prompt_messages: Sequence[Sequence[ChatMessage]] | None) -> _Run:
        """A checked call's episodes, none started."""
        if not isinstance(prompts, TensorBatch):
            raise ConfigError(f"AgentLoop.run() prompts must be a TensorBatch, got {describe(prompts)}")
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"AgentLoop.run() params must be a SamplingParams, got {describe(params)}")
        prompts.require("prompt_ids", "prompt_mask", "group_ids", where="AgentLoop.run()")
        repeat = 1 if params.n == 1 and "sample_index" in prompts else params.n
        if prompt_messages is not None and len(prompt_messages) != prompts.batch_size:
            raise ConfigError(f"AgentLoop.run(): {len(prompt_messages)} prompt message lists for "
                              f"{prompts.batch_size} prompts; give one list per prompt")
        if self._max_restarts and isinstance(environments, (list, tuple)):
            raise ConfigError(
                f"AgentLoop(max_restarts={self._max_restarts}) builds a fresh environment for each restarted "
                "episode, which a list of environments cannot give; pass a factory (row -> Environment), or "
                "max_restarts=0")
        if not isinstance(environments, (list, tuple)) and not callable(environments):
            raise ConfigError(f"AgentLoop.run() environments must be a factory (row -> Environment) or a list "
                              f"of environments, got {describe(environments)}")
        checked = [check_messages(m, f"prompt_messages[{i}]") for i, m in enumerate(prompt_messages or ())]
        rows = prompts.repeat_interleave(repeat) if repeat > 1 or "sample_index" not in prompts else prompts
        if isinstance(environments, (list, tuple)) and len(environments) != rows.batch_size:
            raise ConfigError(
                f"AgentLoop.run(): {len(environments)} environments for {rows.batch_size} episodes (prompts "
                "times n); give one per episode, or a factory that builds one from a sample's row"
            )
        episodes = [
            _Episode(
                index=i, prompt=rows["prompt_ids"][i][rows["prompt_mask"][i]].tolist(),
                group_id=int(rows["group_ids"][i]), sample_index=int(rows["sample_index"][i]),
                messages=[dict(m) for m in checked[i // repeat]] if checked else [],
                first_messages=checked[i // repeat] if checked else (),
            )
            for i in range(rows.batch_size)
        ]
        stops = tuple(dict.fromkeys((*params.stop_token_ids, self._tok.eos_token_id)))
        turn = dataclasses.replace(params, n=1, stop_token_ids=stops)
        return _Run(rows=rows, environments=environments, params=turn, episodes=episodes,
                    waiting=list(range(len(episodes))))

    def _drive(self, run: _Run) -> None:
        """Run turns of ``run``'s episodes until each ended."""
        renderer = ObservationRenderer(self._tok)
        stops = set(run.params.stop_token_ids)
        while True:
            self._start(run)
            active = self._within_context(run.started())
            if not active:
                if not run.waiting:
                    return
                with self._cond:  # every started episode ended; the rest wait for room
                    run.state = "idle"
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._room(run) > 0)
                    run.state = "busy"
                continue
            out = self._sample(run, active)
            run.meta = out.meta
            ended, restarted = self._take_turn(active, out, stops)
            with self._away(run):
                self._step(ended, renderer)
                if restarted:  # abandoned at a weight update: fresh episodes, with fresh environments
                    for e in restarted:
                        run.episodes[e.index] = e
                    self._make_environments(restarted, run.rows, run.environments)

    def _room(self, run: _Run) -> int:
        """Episodes ``run`` may start now (under ``self._cond``): none while an earlier call still has
        episodes waiting, else what ``max_active`` leaves (every waiting one without a limit)."""
        earlier = self._runs[:self._runs.index(run)]
        if any(r.waiting for r in earlier):
            return 0
        if not self._max_active:
            return len(run.waiting)
        return self._max_active - sum(len(r.started()) for r in self._runs)

    def _start(self, run: _Run) -> None:
        """Start ``run``'s waiting episodes, in order, as far as there is room."""
        with self._cond:
            take = run.waiting[:max(0, self._room(run))]
            run.waiting = run.waiting[len(take):]
            self._cond.notify_all()  # a later call may start its own once this one waits no more
        if take:
            with self._away(run):
                self._make_environments([run.episodes[i] for i in take], run.rows, run.environments)

    @contextlib.contextmanager
    def _away(self, run: _Run) -> Iterator[None]:
        """``run`` is in its environments: shared generate calls do not wait for it."""
        with self._cond:
            run.state, run.since = "environments", time.monotonic()
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                run.state = "busy"
                self._cond.notify_all()  # episodes may have ended: room for others

    def _wait_for_others(self) -> float | None:
        """How long a request waits before the next shared generate call (under ``self._cond``;
        None: make it now). It waits while a call is in flight, for every call under way that is
        busy between calls (it asks next, within moments), and for one in its environments until it
        has been there half as long as the last generate call took: a wait that short costs less
        than the call it saves, and environments that take longer (a slow tool, one that waits for
        the trainer) hold up no one else's turn."""
        if self._calling:
            return 10.0
        longest = 0.0
        now = time.monotonic()
        for r in self._runs:
            if r.request is not None or r.state == "idle":
                continue
            if r.state == "busy":
                return 10.0
            longest = max(longest, self._last_call_s / 2 - (now - r.since))
        return longest if longest > 0 else None

    def _sample(self, run: _Run, active: list[_Episode]) -> TensorBatch:
        """``active``'s next turn, sampled in one generate call with the requests of every other call
        whose parameters agree but for the seed; the call is made once no call under way is between
        calls (each has a request in, or is in its environments, or waits for room)."""
        mine = _Request(active, run.params)
        with self._cond:
            run.request = mine
            self._cond.notify_all()
            while mine.out is None and mine.error is None:
                wait = self._wait_for_others()
                if wait is not None:
                    self._cond.wait(wait)
                    continue
                first = next(r.request for r in self._runs if r.request is not None)
                key = _merge_key(first.params)
                group = [r for r in self._runs if r.request is not None and _merge_key(r.request.params) == key]
                requests = [r.request for r in group if r.request is not None]
                for r in group:
                    r.request = None
                    r.state = "busy"  # its thread takes the output next
                self._calling = True
                self._cond.release()
                started = time.monotonic()
                try:
                    outs = self._sample_turn([(q.active, q.params) for q in requests])
                    for q, out in zip(requests, outs, strict=True):
                        q.out = out
                except BaseException as err:  # every call in the generate call fails with it
                    for q in requests:
                        q.error = err
                finally:
                    self._cond.acquire()
                    self._last_call_s = time.monotonic() - started
                    self._calling = False
                    self._cond.notify_all()
            run.request = None
            run.state = "busy"
        if mine.error is not None:
            raise mine.error
        assert mine.out is not None
        return mine.out

    def _make_environments(self, episodes: list[_Episode], rows: TensorBatch,
                           environments: EnvironmentFactory | Sequence[Environment]) -> None:
        if isinstance(environments, (list, tuple)):
            built: list[Outcome] = [Outcome(value=environments[e.index], finished=True) for e in episodes]
        else:
            extras = rows.extras
            factory = cast(EnvironmentFactory, environments)  # checked when the call was submitted
            jobs = [functools.partial(factory, {k: v[e.index] for k, v in extras.items()}) for e in episodes]
            started = time.perf_counter()
            built = run_with_deadline(jobs, self._limits.step_timeout_s)
            _share(episodes, time.perf_counter() - started)
        what = f"the environment factory {getattr(environments, '__name__', type(environments).__name__)}"
        for e, out in zip(episodes, built, strict=True):
            if not out.finished:
                e.fail(f"episode {e.index}: {what} did not return within {self._limits.step_timeout_s:g} s",
                       timeout=True)
            elif out.error is not None:
                e.fail(f"episode {e.index}: {what} raised {type(out.error).__name__}: {out.error}")
            elif not callable(getattr(out.value, "step", None)):
                e.fail(f"episode {e.index}: the environment is {describe(out.value)}, which has no "
                       "step(text, token_ids) method; expected an Environment")
            else:
                e.env = out.value

    def _close_turn(self, e: _Episode) -> tuple[str, list[int]]:
        """End the turn being sampled: record it as an assistant message; its text and ids."""
        start = e.turn_start or 0
        text = self._tok.decode(e.tokens[start:], skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        e.turn_infos.append(TurnInfo(model_tokens=len(e.tokens) - start, observation_tokens=0, reward=None,
                                     done=False, metrics={}, weight_versions=sorted(set(e.turn_versions))))
        e.turn_start = None
        e.turn_versions = []
        e.turns += 1
        return text, e.tokens[start:]

    def _within_context(self, episodes: list[_Episode]) -> list[_Episode]:
        """The episodes still running; those whose ids no longer fit the engine's prompt end truncated."""
        max_prompt = self._engine.spec.max_prompt_len
        active = []
        for e in episodes:
            if e.termination is not None:
                continue
            if len(e.prompt) + len(e.tokens) <= max_prompt:
                active.append(e)
                continue
            if e.turn_start is not None:
                self._close_turn(e)
            e.end("context_limit", f"episode {e.index}: its {len(e.prompt) + len(e.tokens)} tokens exceed the rollout "
                  f"engine's max_prompt_len={max_prompt}, so no further turn can be sampled; raise max_prompt_len "
                  "to continue longer episodes", truncated=True)
        return active

    def _sample_turn(self, calls: list[tuple[list[_Episode], SamplingParams]]) -> list[TensorBatch]:
        """Sample the next tokens of every active episode of ``calls`` (each a call's episodes and turn
        parameters, which agree but for the seed) from its exact ids so far, in one generate call;
        each call's part of the output."""
        limit = self._limits.max_total_tokens
        everyone = [e for active, _ in calls for e in active]
        max_new = min(max(limit - len(e.tokens) for e in everyone), self._engine.spec.max_response_len)
        # Each (seed, group, sample, call) gets its own stream: the engine seeds a row by (seed, group
        # id, sample index), so with the engine's seed fixed at 0 the row's group id carries the hash
        # of all four, and episodes of calls with other seeds can share the generate call.
        streams = []
        for active, params in calls:
            for e in active:
                stream = sample_seed(e.calls, e.group_id, e.sample_index)
                streams.append(stream if params.seed is None else sample_seed(params.seed, stream, 0))
                e.calls += 1
        batch = prompts_from_ids([e.prompt + e.tokens for e in everyone], self._tok.pad_token_id, group_ids=streams)
        first = calls[0][1]
        turn = dataclasses.replace(first, max_new_tokens=max_new, seed=None if first.seed is None else 0)
        out = self._engine.generate(batch, turn)
        parts, start = [], 0
        for active, _ in calls:
            parts.append(out.index(slice(start, start + len(active))) if len(calls) > 1 else out)
            start += len(active)
        return parts

    def _take_turn(self, active: list[_Episode], out: TensorBatch,
                   stops: set[int]) -> tuple[list[_Episode], list[_Episode]]:
        """Append each episode's sampled tokens; the episodes whose turn ended at a stop token, and the
        fresh episodes that replace those abandoned because the call's weight version is not their first's."""
        limit = self._limits.max_total_tokens
        ended, restarted = [], []
        masks, ids_all, lps_all = out["response_mask"], out["response_ids"], out["rollout_log_probs"]
        version = out.meta.weight_version
        for r, e in enumerate(active):
            mask = masks[r]
            ids = ids_all[r][mask].tolist()
            if e.version is None:
                e.version = version
            elif version != e.version and e.restarts < self._max_restarts:
                restarted.append(e.restarted(len(ids)))
                continue
            if not ids:  # a response holds at least one token: the loop would ask again forever
                raise BatchValidationError(
                    f"AgentLoop: {type(self._engine).__name__}.generate returned an empty response (no token "
                    f"under response_mask) for episode {e.index}, so the episode cannot advance; a response "
                    "holds at least one sampled token, and a turn that ends at a stop id or EOS keeps it "
                    "(docs/backend-rollout-engine.md)")
            e.turn_versions.append(version)
            lps = lps_all[r][mask].tolist()
            room = limit - len(e.tokens)
            cut = len(ids) > room
            ids, lps = ids[:room], lps[:room]
            if e.turn_start is None:
                e.turn_start = len(e.tokens)
            e.append(ids, sampled=True, turn=e.turns, log_probs=lps)
            if not cut and ids and ids[-1] in stops:
                ended.append(e)
            elif len(e.tokens) >= limit:
                self._close_turn(e)
                e.end("max_total_tokens", f"episode {e.index}: the token budget max_total_tokens={limit} ran out "
                      f"during turn {e.turns - 1}", truncated=True)
            # else the engine's max_response_len cut the turn inside the budget: it continues next call
        return ended, restarted

    def _step(self, ended: list[_Episode], renderer: ObservationRenderer) -> None:
        """Step the environments of the episodes whose turn ended, concurrently, and append what they say."""
        limits = self._limits
        turns = [self._close_turn(e) for e in ended]
        jobs = [functools.partial(_call_step, e.env, text, ids) for e, (text, ids) in zip(ended, turns, strict=True)]
        started = time.perf_counter()
        outs = run_with_deadline(jobs, limits.step_timeout_s)
        _share(ended, time.perf_counter() - started)
        for e, out in zip(ended, outs, strict=True):
            where = f"episode {e.index}: {type(e.env).__name__}.step (turn {e.turns - 1})"
            if not out.finished:
                e.fail(f"{where} did not return within step_timeout_s={limits.step_timeout_s:g} s; the episode was "
                       "ended and the step's thread abandoned", timeout=True)
                continue
            if out.error is not None:
                e.fail(f"{where} raised {type(out.error).__name__}: {out.error}")
                continue
            result = out.value
            if not isinstance(result, StepResult):
                e.fail(f"{where} returned {describe(result)}; expected a StepResult(observation=..., reward=..., "
                       "done=...)")
                continue
            info = e.turn_infos[-1]
            info["reward"] = None if result.reward is None else float(result.reward)
            info["done"] = result.done
            info["metrics"] = {k: float(v) for k, v in result.metrics.items()}
            for k, v in info["metrics"].items():
                e.metrics[k] = e.metrics.get(k, 0.0) + v
            if result.done:
                e.end("done")
                continue
            if e.turns >= limits.max_turns:
                e.end("max_turns", f"episode {e.index}: the environment did not end the episode within "
                      f"max_turns={limits.max_turns} turns", truncated=True)
                continue
            try:
                obs = renderer.tokens(result.observation, after=e.tokens[-1])
            except Exception as err:  # a user's chat template may raise anything
                e.fail(f"{where}: its observation cannot be rendered: {type(err).__name__}: {err}")
                continue
            room = limits.max_total_tokens - len(e.tokens)
            if len(obs) >= room:
                e.end("max_total_tokens", f"episode {e.index}: the observation of turn {e.turns - 1} ({len(obs)} "
                      f"tokens) leaves no room for another turn within max_total_tokens={limits.max_total_tokens}",
                      truncated=True)
                continue
            e.append(obs, sampled=False, turn=e.turns - 1)
            info["observation_tokens"] = len(obs)
            if isinstance(result.observation, str):
                if result.observation:
                    e.messages.append({"role": "observation", "content": result.observation})
            else:
                e.messages.extend(dict(m) for m in result.observation)

    def _output(self, rows: TensorBatch, episodes: list[_Episode], params: SamplingParams,
                meta: Any) -> TensorBatch:
        """The canonical batch of the finished episodes."""
        pad = self._tok.pad_token_id if meta is None else meta.pad_token_id
        if meta is None:  # no turn was sampled (every environment failed to build, or no episodes)
            meta = dataclasses.replace(rows.meta, temperature=params.temperature, top_p=params.top_p,
                                       top_k=params.top_k, pad_token_id=pad,
                                       weight_version=self._engine.weight_version)
        n, width = len(episodes), max((len(e.tokens) for e in episodes), default=0)
        ids = torch.full((n, width), pad, dtype=torch.int64)
        mask = torch.zeros((n, width), dtype=torch.bool)
        loss = torch.zeros((n, width), dtype=torch.bool)
        turn_ids = torch.zeros((n, width), dtype=torch.int64)
        log_probs = torch.zeros((n, width), dtype=torch.float32)
        for i, e in enumerate(episodes):
            k = len(e.tokens)
            ids[i, :k] = torch.tensor(e.tokens, dtype=torch.int64)
            mask[i, :k] = True
            loss[i, :k] = torch.tensor(e.sampled, dtype=torch.bool)
            turn_ids[i, :k] = torch.tensor(e.turn_of, dtype=torch.int64)
            log_probs[i, :k] = torch.tensor(e.log_probs, dtype=torch.float32)
        truncated = torch.tensor([e.truncated for e in episodes], dtype=torch.bool)
        base = rows.drop(*[name for name, f in FIELDS.items() if "response" in f.dims or name == "truncated"])
        return base.update(
            response_ids=ids, response_mask=mask, loss_mask=loss, turn_ids=turn_ids, rollout_log_probs=log_probs,
            truncated=truncated, meta=meta,
            extras={EPISODE_KEY: [e.info() for e in episodes], TURNS_EXTRA: [list(e.turn_infos) for e in episodes]},
        )


def _merge_key(params: SamplingParams) -> SamplingParams:
    """What turns of different calls must agree on to share a generate call (not the seed, which each
    row's stream carries, nor the length, the longest budget's)."""
    return dataclasses.replace(params, seed=None if params.seed is None else 0, max_new_tokens=1)


def _call_step(env: Environment | None, text: str, ids: list[int]) -> StepResult:
    assert env is not None  # only episodes with an environment sample turns
    return env.step(text, ids)


def _share(episodes: Sequence[_Episode], seconds: float) -> None:
    """Divide ``seconds`` the loop waited on the environments of ``episodes`` evenly among them."""
    for e in episodes:
        e.env_seconds += seconds / len(episodes)


def environment_seconds(batch: TensorBatch) -> float:
    """The wall-clock seconds the episode loop spent building and stepping the environments of ``batch``'s
    episodes (with the tools' environment: running their tool calls): the sum of their
    :attr:`EpisodeInfo.env_seconds`. The rest of the loop's time is sampling the turns (and rendering).

    Raises:
        ConfigError: the batch has no :data:`EPISODE_KEY` extras (it did not come from an AgentLoop).
    """
    if not isinstance(batch, TensorBatch) or EPISODE_KEY not in batch.extras:
        raise ConfigError(f"environment_seconds() needs a batch from AgentLoop.run() (extras {EPISODE_KEY!r}), got "
                          f"{describe(batch)}")
    return float(sum(float(i.get("env_seconds", 0.0)) for i in batch.extras[EPISODE_KEY]))


def episode_metrics(batch: TensorBatch) -> dict[str, float]:
    """Means over a batch's episodes of what :class:`EpisodeInfo` counts, and the share of each termination.

    Keys: ``agent/turns``, ``agent/model_tokens``, ``agent/observation_tokens``,
    ``agent/tool_calls``, ``agent/tool_errors``, ``agent/tool_timeouts``, ``agent/env_errors``,
    ``agent/env_timeouts``, ``agent/env_seconds``, ``agent/mixed_versions`` (the share of episodes
    whose turns were sampled by more than one weight version: asynchronous training with
    ``partial_rollouts = "continue"``), ``agent/restarted_episodes`` (the share of episodes
    restarted at least once at a weight update: ``partial_rollouts = "restart"``),
    ``agent/restarted_tokens`` (the mean tokens an episode sampled in abandoned attempts: with
    ``agent/model_tokens``, the share of the sampling discarded) and ``agent/termination/<why>``
    for every :data:`Termination`.

    Raises:
        ConfigError: the batch has no :data:`EPISODE_KEY` extras (it did not come from an AgentLoop).
    """
    if not isinstance(batch, TensorBatch) or EPISODE_KEY not in batch.extras:
        raise ConfigError(f"episode_metrics() needs a batch from AgentLoop.run() (extras {EPISODE_KEY!r}), got "
                          f"{describe(batch)}")
    infos: Sequence[Mapping[str, Any]] = batch.extras[EPISODE_KEY]
    n = max(len(infos), 1)
    out: dict[str, float] = {}
    for key in ("turns", "model_tokens", "observation_tokens", "tool_calls", "tool_errors", "tool_timeouts",
                "env_errors", "env_timeouts"):
        out[f"agent/{key}"] = sum(float(i[key]) for i in infos) / n
    out["agent/env_seconds"] = environment_seconds(batch) / n
    turns: Sequence[Sequence[Mapping[str, Any]]] = batch.extras.get(TURNS_EXTRA, [])
    out["agent/mixed_versions"] = sum(
        len({v for t in episode for v in t.get("weight_versions", ())}) > 1 for episode in turns) / n
    out["agent/restarted_episodes"] = sum(int(i.get("restarts", 0)) > 0 for i in infos) / n
    out["agent/restarted_tokens"] = sum(float(i.get("restarted_tokens", 0)) for i in infos) / n
    for why in ("done", "max_turns", "max_total_tokens", "context_limit", "error"):
        out[f"agent/termination/{why}"] = sum(i["termination"] == why for i in infos) / n
    return out


