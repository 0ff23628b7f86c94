"""The ``[agent]`` section: multi-turn episodes with tools or an environment, and the user code it names.

:class:`AgentConfig` is the section (checked when the config loads: shapes and ranges, nothing
imported). :meth:`AgentSetup.resolve` imports what it names, before any engine is built: the
environment factory (``agent.environment``) and the tools (``agent.tools``), each a
``"module:attr"`` or ``"path/to/file.py:attr"`` spec, and turns every problem into one
:class:`~verl_core.kernel.errors.ConfigError` naming the dotted key.

A ``agent.tools`` entry names

* a plain function: its annotations and Google docstring become the tool's schema
  (:meth:`~verl_core.agent.tools.Tool.from_function`);
* a :class:`~verl_core.agent.tools.Tool` object, used as it is;
* a factory: a function whose return annotation is ``Tool``, called once with no arguments, e.g.
  ``"verl_core.agent.sandbox:python_tool"`` (the sandboxed Python tool with its default limits).

:func:`episode_keywords` gives reward functions what a multi-turn batch adds to their keywords.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

from verl_core.agent.loop import EPISODE_KEY, EpisodeLimits
from verl_core.agent.render import ObservationRenderer, chat_tokenizer
from verl_core.agent.tools import Tool, ToolEnvironment, ToolSchemaError, as_tools
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.convert import Check, Ge, Gt
from verl_core.kernel.environment import Environment, EnvironmentFactory
from verl_core.kernel.errors import ConfigError, describe
from verl_core.kernel.schema import TURNS_EXTRA
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.trainer.inputs.usercode import import_object, split_spec

__all__ = [
    "EPISODE_EXTRAS",
    "MESSAGES_KEYWORD",
    "PROMPT_MESSAGES",
    "AgentConfig",
    "AgentSetup",
    "episode_keywords",
    "is_episode_batch",
    "resolve_tools",
]

PROMPT_MESSAGES: Final = "prompt_messages"
"""Extras key of the chat messages each prompt was rendered from (multi-turn runs; the episode
loop starts each episode's recorded conversation with them and takes the key off the batch)."""

MESSAGES_KEYWORD: Final = "messages"
"""The keyword that gives reward functions of a multi-turn run each episode's whole conversation."""

EPISODE_EXTRAS: Final = (EPISODE_KEY, TURNS_EXTRA, PROMPT_MESSAGES)
"""Extras of a multi-turn batch that are not dataset columns (reward functions do not get them as columns)."""


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Multi-turn episodes: the ``[agent]`` section (off while neither ``environment`` nor ``tools`` is set).

    Attributes:
        environment: An environment factory, ``"module:attr"`` or ``"path/to/file.py:attr"``:
            called with each sample's dataset row (a mapping of its columns) to build that
            episode's :class:`~verl_core.kernel.environment.Environment`. Empty = a
            :class:`~verl_core.agent.tools.ToolEnvironment` over ``tools``.
        tools: Tools, each ``"module:attr"`` or ``"path/to/file.py:attr"`` naming a plain
            function, a :class:`~verl_core.agent.tools.Tool`, or a zero-argument factory annotated
            ``-> Tool`` (e.g. ``"verl_core.agent.sandbox:python_tool"``). Their schemas are
            rendered into chat prompts (the template's ``tools``); without ``environment`` a
            :class:`~verl_core.agent.tools.ToolEnvironment` runs the model's calls, and the first
            turn without a call ends the episode.
        max_turns: Model turns per episode (>= 1).
        max_total_tokens: Tokens after the prompt per episode, model turns and observations
            together (>= 1); the only bound on one turn's length: ``rollout.max_new_tokens`` is
            the size of one ``generate`` call (the rollout engine's ``max_response_len``), and a
            turn it cuts before EOS or a stop token continues in the next call.
        tool_timeout_s: Wall-clock seconds the tool calls of one turn may take (> 0); a call still
            running then is abandoned and the model reads an error.
        step_timeout_s: Wall-clock seconds one environment step may take (> 0, and above
            ``tool_timeout_s`` when the tools' environment is used); a step still running then
            ends its episode with an error.
        concurrency: Most episodes run at once (each steps its environment on a thread of its
            own); as one ends the next starts, of the same step or (asynchronous training producing
            steps side by side) of the next. 0 = no limit: every episode of a step at once.
        stop_tokens: Tokens that end a model turn besides EOS, each one token of the vocabulary
            (e.g. ``"<|im_end|>"``). Empty = the chat template's end-of-turn token (the first
            token the template puts after an assistant message), or EOS alone without a template.
    """

    environment: str = ""
    tools: list[str] = dataclasses.field(default_factory=list)
    max_turns: Annotated[int, Ge(1)] = 8
    max_total_tokens: Annotated[int, Ge(1)] = 1024
    tool_timeout_s: Annotated[float, Gt(0)] = 30.0
    step_timeout_s: Annotated[float, Gt(0)] = 60.0
    concurrency: Annotated[int, Check(lambda v: v >= 0, ">= 0 (0 = every episode of a step at once)")] = 0
    stop_tokens: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.environment:
            split_spec(self.environment, "config key 'agent.environment'")
        for i, spec in enumerate(self.tools):
            split_spec(spec, f"config key 'agent.tools[{i}]'")
        for i, token in enumerate(self.stop_tokens):
            if not isinstance(token, str) or not token:
                raise ConfigError(f"config key 'agent.stop_tokens[{i}]' must be a non-empty token, got {token!r}")
        if not self.enabled:
            changed = [f.name for f in dataclasses.fields(self) if f.name not in ("environment", "tools")
                       and getattr(self, f.name) != (f.default_factory() if callable(f.default_factory) else f.default)]
            if changed:
                raise ConfigError(
                    f"config key 'agent.{changed[0]}' is set but neither 'agent.environment' nor 'agent.tools' is: "
                    "set one of them to run multi-turn episodes, or remove the [agent] section"
                )

    @property
    def enabled(self) -> bool:
        """Whether the run's rollouts are multi-turn episodes."""
        return bool(self.environment or self.tools)

    def limits(self) -> EpisodeLimits:
        """The episode loop's limits of this section."""
        return EpisodeLimits(max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                             step_timeout_s=self.step_timeout_s)


class _ToolEnvironments:
    """The environment factory of ``agent.tools`` alone: a fresh :class:`ToolEnvironment` per episode."""

    __name__ = "ToolEnvironment"

    def __init__(self, tools: Sequence[Tool], timeout_s: float) -> None:
        self.tools = tuple(tools)
        self.timeout_s = timeout_s

    def __call__(self, row: Mapping[str, Any]) -> Environment:
        return ToolEnvironment(self.tools, timeout_s=self.timeout_s)


def _returns_tool(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is annotated to return a :class:`Tool` (a tool factory)."""
    try:
        return typing.get_type_hints(fn).get("return") is Tool
    except Exception:  # unresolvable annotations: not a factory; its schema is checked next
        return False


def _tool(spec: str, index: int, base_dir: Path | None) -> Tool:
    key = f"config key 'agent.tools[{index}]' = {spec!r}"
    obj = import_object(spec, what=f"config key 'agent.tools[{index}]': tool", base_dir=base_dir)
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise ConfigError(f"{key} is {describe(obj)}; expected a function, a Tool, or a factory annotated -> Tool")
    if _returns_tool(obj):
        try:
            made = obj()
        except Exception as e:
            raise ConfigError(f"{key}: calling the tool factory with no arguments raised {type(e).__name__}: {e}") from e
        if not isinstance(made, Tool):
            raise ConfigError(f"{key}: the tool factory returned {describe(made)}; expected a Tool")
        return made
    try:
        return Tool.from_function(obj)
    except ToolSchemaError as e:
        raise ConfigError(f"{key} cannot become a tool: {e}") from e


def _factory(spec: str, base_dir: Path | None) -> EnvironmentFactory:
    key = f"config key 'agent.environment' = {spec!r}"
    obj = import_object(spec, what="config key 'agent.environment': environment factory", base_dir=base_dir)
    if not callable(obj):
        raise ConfigError(f"{key} is {describe(obj)}; expected an environment factory, a callable taking a "
                          "sample's row (a mapping of its dataset columns) and returning an Environment")
    try:
        inspect.signature(obj).bind({})
    except TypeError as e:
        raise ConfigError(f"{key} cannot be called with one argument, the sample's row ({e}); expected "
                          "factory(row) -> Environment") from e
    except ValueError:  # a builtin or C callable without a signature: it is called as is
        pass
    return typing.cast(EnvironmentFactory, obj)


def resolve_tools(config: AgentConfig, *, base_dir: Path | None = None) -> tuple[Tool, ...]:
    """The tools ``agent.tools`` names, imported (see the module docstring for what an entry may name).

    Raises:
        ConfigError: naming the ``agent.tools[i]`` key: a spec that does not import or has no such
            attribute, a function whose schema cannot be built, a factory that fails or returns
            no Tool; or two tools of one name.
    """
    tools = tuple(_tool(spec, i, base_dir) for i, spec in enumerate(config.tools))
    try:
        as_tools(list(tools))
    except ToolSchemaError as e:
        raise ConfigError(f"config key 'agent.tools': {e}") from e
    return tools


@dataclasses.dataclass(frozen=True)
class AgentSetup:
    """What ``[agent]`` names, imported and checked: the environments, tools and limits of the episodes.

    Attributes:
        config: The section.
        factory: Builds each episode's environment from its row.
        tools: The tools (empty when none are given).
    """

    config: AgentConfig
    factory: EnvironmentFactory
    tools: tuple[Tool, ...]

    @classmethod
    def resolve(cls, config: AgentConfig, *, base_dir: Path | None = None) -> AgentSetup:
        """Import the environment factory and the tools of ``config``.

        Args:
            config: An enabled ``[agent]`` section.
            base_dir: The config file's folder (relative file specs are looked up there first).

        Raises:
            ConfigError: naming the key: a spec that does not import or has no such attribute; an
                environment factory that is not callable with one argument; a tool whose schema
                cannot be built (the function and parameter are named), a factory that fails or
                returns no Tool, or two tools of one name; ``agent.step_timeout_s`` not above
                ``agent.tool_timeout_s`` when the tools' environment runs the calls.
        """
        if not config.enabled:
            raise ConfigError("AgentSetup.resolve() needs 'agent.environment' or 'agent.tools' to be set")
        tools = resolve_tools(config, base_dir=base_dir)
        if config.environment:
            factory = _factory(config.environment, base_dir)
        else:
            if config.step_timeout_s <= config.tool_timeout_s:
                raise ConfigError(
                    f"config key 'agent.step_timeout_s' = {config.step_timeout_s:g} must be above 'agent.tool_timeout_s' "
                    f"= {config.tool_timeout_s:g}: the step that runs the tool calls would time out before them"
                )
            factory = _ToolEnvironments(tools, config.tool_timeout_s)
        return cls(config, factory, tools)

    @property
    def schemas(self) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas for the chat template's ``tools`` (None without tools)."""
        return [t.schema for t in self.tools] or None

    def stop_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The ids that end a model turn besides EOS (see :attr:`AgentConfig.stop_tokens`).

        Raises:
            ConfigError: an ``agent.stop_tokens`` entry that is not exactly one token.
        """
        out: list[int] = []
        for i, token in enumerate(self.config.stop_tokens):
            ids = tokenizer.encode(token)
            if len(ids) != 1:
                raise ConfigError(
                    f"config key 'agent.stop_tokens[{i}]' = {token!r} encodes to {len(ids)} tokens {ids}; each stop "
                    "token must be one token of the vocabulary (e.g. the template's end-of-turn token)"
                )
            out.extend(ids)
        if not self.config.stop_tokens and chat_tokenizer(tokenizer) is not None:
            out.extend(ObservationRenderer(tokenizer).tail[:1])
        return tuple(dict.fromkeys(out))


def _final_turn_ids(batch: TensorBatch) -> list[list[int]]:
    """Per sample, the ids the model sampled in its last turn."""
    loss, turns, ids = batch.loss_mask.cpu(), batch["turn_ids"].cpu(), batch["response_ids"].cpu()
    out: list[list[int]] = []
    for r in range(batch.batch_size):
        mask = loss[r]
        if not bool(mask.any()):
            out.append([])
            continue
        last = turns[r][mask].max()
        out.append(ids[r][mask & (turns[r] == last)].tolist())
    return out


def is_episode_batch(batch: TensorBatch) -> bool:
    """Whether ``batch`` came from the episode loop (its ``episode`` extras and ``turn_ids``), not a
    single-turn rollout (whose dataset may have a column named ``episode``)."""
    return EPISODE_KEY in batch.extras and "turn_ids" in batch


def episode_keywords(batch: TensorBatch) -> dict[str, list[Any]] | None:
    """What reward functions get for a batch of episodes (None for a single-turn batch).

    ``completions``: the text of each episode's final model turn (its last ``assistant``
    message; ``""`` when the episode has none), ``completion_ids``: that turn's sampled ids, and
    ``messages``: the whole conversation (the prompt's messages, every model turn and every
    observation, tool results included).
    """
    if not is_episode_batch(batch):
        return None
    infos: Sequence[Mapping[str, Any]] = batch.extras[EPISODE_KEY]
    messages = [[dict(m) for m in info["messages"]] for info in infos]
    completions = [next((m["content"] for m in reversed(conv) if m.get("role") == "assistant"), "") for conv in messages]
    ids = _final_turn_ids(batch)
    return {"completions": completions, "completion_ids": ids, MESSAGES_KEYWORD: messages}

