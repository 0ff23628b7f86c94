"""Tools from plain Python functions, a tool-call parser, and an environment that runs the calls.

* :class:`Tool` / :func:`as_tools`: a function's signature and Google docstring become a JSON tool
  schema in the OpenAI/transformers ``tools=`` format,
  ``{"type": "function", "function": {"name", "description", "parameters"}}``.
* :class:`HermesToolParser`: finds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (Hermes/Qwen templates); any :class:`ToolCallParser` can replace it.
* :class:`ToolEnvironment`: an :class:`~verl_core.kernel.environment.Environment` that runs the calls
  of each model turn (each on its own thread, with a timeout), answers with one role ``tool``
  message per call, turns every failure into an error message the model reads, counts calls,
  errors and timeouts, and ends the episode at the first turn without a tool call.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, get_args, get_origin

from verl_core.agent._deadline import run_with_deadline
from verl_core.kernel.environment import Environment, StepResult
from verl_core.kernel.errors import ConfigError, VerlError, check_int, check_number, describe

__all__ = [
    "HermesToolParser",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolError",
    "ToolSchemaError",
    "ToolTimeoutError",
    "as_tools",
]

_SECTIONS: Final = frozenset({
    "args", "arguments", "parameters", "params", "returns", "return", "yields", "yield", "raises",
    "examples", "example", "note", "notes", "attributes", "see also", "warning", "warnings", "todo",
})
_ARG_LINE: Final = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")
_JSON_TYPES: Final[Mapping[type, str]] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolSchemaError(ConfigError):
    """A function cannot become a tool (the message names the function and the parameter)."""


class ToolError(VerlError, RuntimeError):
    """Raised by a tool to report a failure; its message is what the model reads."""


class ToolTimeoutError(ToolError):
    """A tool call did not finish within its time limit (counted as a timeout)."""


# ----------------------------------------------------------------------------- schemas
def _docstring(fn: Callable[..., Any], where: str) -> tuple[str, dict[str, str]]:
    """The description (text before the first section) and the ``Args:`` entries of a Google docstring."""
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ToolSchemaError(f"{where} has no docstring; write a Google-style docstring with a summary "
                              "line and an 'Args:' entry per parameter")
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    base_indent: int | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if indent == 0 and stripped.endswith(":") and stripped[:-1].strip().lower() in _SECTIONS:
            section, current, base_indent = stripped[:-1].strip().lower(), None, None
            continue
        if section is None:
            description.append(line)
        elif section in ("args", "arguments", "parameters", "params") and stripped:
            if base_indent is None:
                base_indent = indent
            m = _ARG_LINE.match(stripped)
            if indent <= base_indent and m:
                current = m.group(1).lstrip("*")
                args[current] = m.group(3).strip()
            elif current is not None:
                args[current] = f"{args[current]} {stripped}".strip()
    text = " ".join(" ".join(description).split())
    if not text:
        raise ToolSchemaError(f"{where} has no description: its docstring must start with a summary line")
    return text, args


def _type_schema(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a parameter's annotation."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is list or origin in (list, Sequence):
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if annotation is dict or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise ToolSchemaError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        return {"type": "object", "additionalProperties": _type_schema(args[1], where)} if args else {"type": "object"}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in (str, int):
            raise ToolSchemaError(f"{where}: a Literal must hold only strings or only integers, got {annotation!r}")
        return {"type": _JSON_TYPES[next(iter(kinds))], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = _type_schema(rest[0], where)
            if isinstance(inner.get("type"), str):
                return {**inner, "type": [inner["type"], "null"]}
            return {"anyOf": [inner, {"type": "null"}]}
    raise ToolSchemaError(
        f"{where} has type {annotation!r}, which has no JSON schema here; use str, int, float, bool, "
        "list[...], dict[str, ...], Literal[...] or one of them | None"
    )


def _schema(fn: Callable[..., Any], name: str) -> tuple[str, dict[str, Any]]:
    """The description and the parameters schema of ``fn`` (``ToolSchemaError`` naming what is missing)."""
    where = f"tool function {name!r}"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ToolSchemaError(f"{where}: cannot read its signature ({e})") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise ToolSchemaError(f"{where}: cannot resolve its type annotations ({type(e).__name__}: {e})") from None
    description, docs = _docstring(fn, where)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in signature.parameters.values():
        pwhere = f"{where}, parameter {p.name!r},"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ToolSchemaError(f"{where}, parameter {p.name!r}: *args, **kwargs and positional-only "
                                  "parameters cannot be passed by name from a JSON call; use named parameters")
        if p.name not in hints:
            raise ToolSchemaError(f"{where}, parameter {p.name!r}: has no type annotation; annotate it "
                                  "(e.g. 'x: int')")
        if not docs.get(p.name):
            raise ToolSchemaError(f"{where}, parameter {p.name!r}: is not described in the docstring's "
                                  f"'Args:' section; add a line '{p.name}: what it is'")
        properties[p.name] = {**_type_schema(hints[p.name], pwhere[:-1]), "description": docs[p.name]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return description, {"type": "object", "properties": properties, "required": required}


@dataclass(frozen=True)
class Tool:
    """A Python function the model can call, with its JSON schema.

    Build it with :meth:`from_function` (or pass functions to :func:`as_tools`).

    Attributes:
        name: Name the model calls it by.
        description: What the tool does (the docstring's text before its first section).
        parameters: JSON schema of the arguments (an ``object`` with ``properties`` and ``required``).
        fn: The function; it is called with the arguments as keywords and returns anything (text
            is passed as is, other values as JSON, else ``str()``).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any] = field(repr=False, compare=False)

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """The tool of ``fn``: its annotations and Google docstring give the schema.

        Every parameter needs a type annotation (str, int, float, bool, ``list[...]``,
        ``dict[str, ...]``, ``Literal[...]``, or one of them ``| None``) and an ``Args:`` entry;
        parameters with a default are optional.

        Args:
            fn: The function.
            name: The tool's name (default ``fn.__name__``).

        Raises:
            ToolSchemaError: one error naming the function and the parameter that has no
                annotation, an unsupported type, or no docstring entry (or the missing docstring).
        """
        if not callable(fn):
            raise ToolSchemaError(f"a tool must be a function, got {describe(fn)}")
        tool_name = name if name is not None else getattr(fn, "__name__", "")
        if not isinstance(tool_name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", tool_name):
            raise ToolSchemaError(f"tool name must be 1-64 letters, digits, '_', '.', '-' (not starting with a "
                                  f"digit), got {describe(tool_name)}; pass name=")
        description, parameters = _schema(fn, tool_name)
        return cls(tool_name, description, parameters, fn)

    @property
    def schema(self) -> dict[str, Any]:
        """The tool in the ``tools=`` format of chat templates and OpenAI-style APIs."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(json.dumps(self.parameters))}}

    def check_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` do not fit the schema (missing, unknown, wrong JSON type), or None."""
        props: Mapping[str, Any] = self.parameters.get("properties", {})
        missing = [n for n in self.parameters.get("required", ()) if n not in arguments]
        if missing:
            return f"missing required argument(s) {', '.join(missing)}"
        unknown = [n for n in arguments if n not in props]
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; the tool takes {', '.join(props) or 'none'}"
        for n, v in arguments.items():
            if not _json_type_ok(v, props[n]):
                return f"argument {n!r} must be {props[n].get('type', 'of the declared type')}, got {json.dumps(v)}"
        return None


def _json_type_ok(value: Any, schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind is None:
        return True
    kinds = [kind] if isinstance(kind, str) else list(kind)
    checks: dict[str, Callable[[Any], bool]] = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    return any(checks[k](value) for k in kinds if k in checks)


def as_tools(tools: Sequence[Tool | Callable[..., Any]]) -> tuple[Tool, ...]:
    """Tools from a list of :class:`Tool` objects and plain functions.

    Raises:
        ToolSchemaError: a function that cannot become a tool, or two tools with the same name.
    """
    if not isinstance(tools, (list, tuple)):
        raise ToolSchemaError(f"tools must be a list or tuple of functions or Tool objects, got {describe(tools)}")
    out = tuple(t if isinstance(t, Tool) else Tool.from_function(t) for t in tools)
    names = [t.name for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolSchemaError(f"two tools share the name(s) {', '.join(dupes)}; pass name= to Tool.from_function")
    return out


# ----------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call.

    Attributes:
        name: The tool's name.
        arguments: Its arguments by name.
    """

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """The tool calls found in a model turn.

    Attributes:
        calls: The calls that parsed, in order.
        errors: One message per call block that did not parse (the model reads them).
    """

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def attempted(self) -> bool:
        """Whether the turn tried to call a tool at all (a parsed call or an unparseable one)."""
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    """Finds the tool calls in a model turn's text, in the format the chat template teaches."""

    def parse(self, text: str) -> ParsedTurn:
        """The calls in ``text`` and a message per call block that did not parse."""
        ...


@dataclass(frozen=True)
class HermesToolParser(ToolCallParser):
    """Tool calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen).

    ``arguments`` may also be a JSON string of an object, or be named ``parameters``.

    Attributes:
        open_tag: Text that opens a call.
        close_tag: Text that closes it.
    """

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        """The calls of ``text``; an unclosed block or a body that is not a call is an error."""
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            if end < 0:
                errors.append(f"a tool call opened with {self.open_tag} was never closed with {self.close_tag}")
                break
            call, error = self._call(text[body_start:end].strip())
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
            pos = end + len(self.close_tag)
        return ParsedTurn(tuple(calls), tuple(errors))

    def _call(self, body: str) -> tuple[ToolCall | None, str]:
        expected = f'expected {self.open_tag}{{"name": "<tool>", "arguments": {{...}}}}{self.close_tag}'
        try:
            obj = json.loads(body)
        except ValueError as e:
            return None, f"the tool call is not valid JSON ({e}); {expected}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, f"the tool call has no string 'name'; {expected}"
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None, f"the arguments of tool call {obj['name']!r} are a string that is not JSON; {expected}"
        if not isinstance(args, dict):
            return None, f"the arguments of tool call {obj['name']!r} must be a JSON object; {expected}"
        return ToolCall(obj["name"], args), ""


# ----------------------------------------------------------------------------- running calls
def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


class ToolEnvironment(Environment):
    """An environment that runs the tool calls of each model turn.

    Each turn's text is parsed by ``parser``. A turn without any tool call ends the episode (its
    reward is :meth:`final_reward`). Otherwise every call runs on its own thread, all of the turn's
    calls together, for at most ``timeout_s`` seconds, and the observation is one role ``tool``
    message per call block (first those that did not parse, then the calls in order): the tool's output (text as is, other values as JSON), or an
    error the model reads, for an unparseable block, an unknown tool, arguments that do not fit
    the schema, a tool that raised (:class:`ToolError`'s message as is, other exceptions with their
    type), or a call still running at the deadline (abandoned: use a process, like
    :mod:`verl_core.agent.sandbox`, for code that can hang). The step's ``metrics`` count
    ``tool_calls`` (call blocks), ``tool_errors`` (failed ones, timeouts included) and
    ``tool_timeouts``.

    Args:
        tools: Functions or :class:`Tool` objects.
        parser: Finds the calls (default :class:`HermesToolParser`).
        timeout_s: Wall-clock limit of one turn's calls, > 0.
        max_output_chars: Longest tool output the model reads; longer ones are cut with a note.
        max_calls_per_turn: Calls run per turn; later ones get an error message.

    Raises:
        ToolSchemaError: a function that cannot become a tool, or duplicate names.
        ConfigError: a limit out of range.
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]],
        *,
        parser: ToolCallParser | None = None,
        timeout_s: float = 30.0,
        max_output_chars: int = 4096,
        max_calls_per_turn: int = 8,
    ) -> None:
        self._tools = {t.name: t for t in as_tools(tools)}
        self._parser: ToolCallParser = parser if parser is not None else HermesToolParser()
        if not callable(getattr(self._parser, "parse", None)):
            raise ConfigError(f"ToolEnvironment parser must have a parse(text) method, got {describe(parser)}")
        self._timeout_s = check_number(timeout_s, "ToolEnvironment timeout_s", low=0, low_open=True)
        self._max_output = check_int(max_output_chars, "ToolEnvironment max_output_chars", low=1)
        self._max_calls = check_int(max_calls_per_turn, "ToolEnvironment max_calls_per_turn", low=1)

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The tools, in the order given."""
        return tuple(self._tools.values())

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for rendering the prompt (``ChatTokenizer.render(tools=...)``)."""
        return [t.schema for t in self._tools.values()]

    def final_reward(self, text: str) -> float | None:
        """Reward of the turn without a tool call that ends the episode (override; default None)."""
        return None

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        """Run the turn's tool calls, or end the episode when it has none."""
        parsed = self._parser.parse(text)
        if not isinstance(parsed, ParsedTurn):
            raise ConfigError(f"{type(self._parser).__name__}.parse must return a ParsedTurn, got {describe(parsed)}")
        if not parsed.attempted:
            return StepResult(observation=(), reward=self.final_reward(text), done=True)
        messages: list[dict[str, Any]] = [
            {"role": "tool", "content": f"Error: {e}"} for e in parsed.errors
        ]
        errors, timeouts = len(parsed.errors), 0
        jobs: list[Callable[[], Any]] = []
        slots: list[tuple[int, ToolCall]] = []
        for i, call in enumerate(parsed.calls):
            tool = self._tools.get(call.name)
            problem = None
            if i >= self._max_calls:
                problem = f"too many tool calls in one turn (limit {self._max_calls}); this one was not run"
            elif tool is None:
                problem = f"unknown tool {call.name!r}; available tools: {', '.join(self._tools) or 'none'}"
            else:
                problem = tool.check_arguments(call.arguments)
                if problem is not None:
                    problem = f"tool {call.name!r}: {problem}"
            if problem is not None or tool is None:
                messages.append({"role": "tool", "name": call.name, "content": f"Error: {problem}"})
                errors += 1
                continue
            slots.append((len(messages), call))
            messages.append({"role": "tool", "name": call.name, "content": ""})
            jobs.append(functools.partial(tool.fn, **call.arguments))
        for (at, call), out in zip(slots, run_with_deadline(jobs, self._timeout_s)):
            if not out.finished:
                content = (f"Error: tool {call.name!r} did not finish within {self._timeout_s:g} s; the call "
                           "was abandoned")
                errors, timeouts = errors + 1, timeouts + 1
            elif isinstance(out.error, ToolError):
                content = f"Error: {out.error}"
                errors += 1
                timeouts += isinstance(out.error, ToolTimeoutError)
            elif out.error is not None:
                content = f"Error: tool {call.name!r} raised {type(out.error).__name__}: {out.error}"
                errors += 1
            else:
                content = _text(out.value)
            messages[at]["content"] = _cut(content, self._max_output)
        metrics = {"tool_calls": float(len(parsed.calls) + len(parsed.errors)), "tool_errors": float(errors),
                   "tool_timeouts": float(timeouts)}
        return StepResult(observation=messages, metrics=metrics)
