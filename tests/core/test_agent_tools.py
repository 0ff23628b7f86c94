"""Tools from Python functions, the Hermes tool-call parser and the ToolEnvironment."""

from __future__ import annotations

import json
import time
from typing import Literal, Optional

import pytest

from verl_core.agent import (
    HermesToolParser,
    ParsedTurn,
    StepResult,
    Tool,
    ToolCall,
    ToolEnvironment,
    ToolError,
    ToolSchemaError,
    ToolTimeoutError,
    as_tools,
)
from verl_core.kernel.environment import Environment


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    A longer description
    on two lines.

    Args:
        a: The first one.
        b (int): The second one,
            described on two lines.

    Returns:
        The sum.
    """
    return a + b


def shapes(names: list[str], weights: dict[str, float], mode: Literal["fast", "slow"], note: str | None = None,
           limit: Optional[int] = None, flag: bool = False, ratio: float = 1.0) -> str:  # noqa: UP045
    """Every supported type.

    Args:
        names: Names.
        weights: Weights by name.
        mode: How.
        note: A note.
        limit: A limit.
        flag: A flag.
        ratio: A ratio.
    """
    return f"{names} {weights} {mode} {note} {limit} {flag} {ratio}"


def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    if reason == "tool":
        raise ToolError(f"refused: {reason}")
    raise ValueError(f"broken: {reason}")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_schema_from_signature_and_docstring() -> None:
    tool = Tool.from_function(add)
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers. A longer description on two lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first one."},
                    "b": {"type": "integer", "description": "The second one, described on two lines."},
                },
                "required": ["a"],
            },
        },
    }
    props = Tool.from_function(shapes).parameters["properties"]
    assert props["names"]["type"] == "array" and props["names"]["items"] == {"type": "string"}
    assert props["weights"]["additionalProperties"] == {"type": "number"}
    assert props["mode"]["enum"] == ["fast", "slow"] and props["mode"]["type"] == "string"
    assert props["note"]["type"] == ["string", "null"] and props["limit"]["type"] == ["integer", "null"]
    assert props["flag"]["type"] == "boolean" and props["ratio"]["type"] == "number"
    assert Tool.from_function(shapes).parameters["required"] == ["names", "weights", "mode"]
    assert Tool.from_function(add, name="plus").name == "plus"


def no_annotation(x, y: int) -> int:  # type: ignore[no-untyped-def]
    """Doc.

    Args:
        x: X.
        y: Y.
    """
    return y


def bad_type(x: set[int]) -> int:
    """Doc.

    Args:
        x: X.
    """
    return 0


def undocumented(x: int, y: int) -> int:
    """Doc.

    Args:
        x: X.
    """
    return x


def no_doc(x: int) -> int:
    return x


def star(*xs: int) -> int:
    """Doc.

    Args:
        xs: X.
    """
    return 0


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (no_annotation, r"'no_annotation', parameter 'x': has no type annotation"),
        (bad_type, r"'bad_type', parameter 'x' has type set\[int\], which has no JSON schema"),
        (undocumented, r"'undocumented', parameter 'y': is not described in the docstring's 'Args:'"),
        (no_doc, r"'no_doc' has no docstring"),
        (star, r"'star', parameter 'xs': \*args"),
    ],
)
def test_functions_that_cannot_become_tools(fn: object, match: str) -> None:
    with pytest.raises(ToolSchemaError, match=match):
        Tool.from_function(fn)  # type: ignore[arg-type]


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ToolSchemaError, match="share the name"):
        as_tools([add, Tool.from_function(fail, name="add")])


def test_hermes_parser() -> None:
    parser = HermesToolParser()
    text = f"thinking {call('add', a=1)} then {call('add', a=2, b=3)}"
    assert parser.parse(text) == ParsedTurn((ToolCall("add", {"a": 1}), ToolCall("add", {"a": 2, "b": 3})), ())
    assert parser.parse("no call at all").attempted is False
    stringly = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>'
    assert parser.parse(stringly).calls == (ToolCall("add", {"a": 4}),)
    broken = parser.parse("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"x\"")
    assert broken.calls == () and len(broken.errors) == 3 and broken.attempted
    assert "not valid JSON" in broken.errors[0]
    assert "no string 'name'" in broken.errors[1]
    assert "never closed" in broken.errors[2]


def test_tool_environment_runs_calls_and_reports_errors() -> None:
    env = ToolEnvironment([add, fail, slow], timeout_s=5.0)
    assert isinstance(env, Environment)
    assert [s["function"]["name"] for s in env.schemas] == ["add", "fail", "slow"]
    text = (call("add", a=1) + call("fail", reason="tool") + call("fail", reason="bug") + call("nope")
            + call("add", b=1) + call("add", a="x") + "<tool_call>oops</tool_call>")
    result = env.step(text, [])
    assert isinstance(result, StepResult) and not result.done
    contents = [m["content"] for m in result.observation]  # type: ignore[index]
    assert all(m["role"] == "tool" for m in result.observation)  # type: ignore[index]
    assert contents[0].startswith("Error: the tool call is not valid JSON")
    assert contents[1] == "3"
    assert contents[2] == "Error: refused: tool"
    assert contents[3] == "Error: tool 'fail' raised ValueError: broken: bug"
    assert contents[4].startswith("Error: unknown tool 'nope'; available tools: add, fail, slow")
    assert contents[5] == "Error: tool 'add': missing required argument(s) a"
    assert contents[6] == "Error: tool 'add': argument 'a' must be integer, got \"x\""
    assert result.metrics == {"tool_calls": 7.0, "tool_errors": 6.0, "tool_timeouts": 0.0}


def test_a_turn_without_calls_ends_the_episode() -> None:
    class Graded(ToolEnvironment):
        def final_reward(self, text: str) -> float | None:
            return 1.0 if "42" in text else 0.0

    result = Graded([add]).step("the answer is 42", [])
    assert result.done and result.reward == 1.0 and result.observation == ()


def test_a_tool_that_hangs_is_abandoned_with_an_error() -> None:
    env = ToolEnvironment([slow, add], timeout_s=0.3)
    start = time.monotonic()
    result = env.step(call("slow", seconds=30) + call("add", a=1, b=1), [])
    assert time.monotonic() - start < 3.0
    contents = [m["content"] for m in result.observation]  # type: ignore[index]
    assert contents == ["Error: tool 'slow' did not finish within 0.3 s; the call was abandoned", "2"]
    assert result.metrics["tool_timeouts"] == 1.0 and result.metrics["tool_errors"] == 1.0


def test_tool_timeout_errors_count_as_timeouts_and_output_is_cut() -> None:
    def limited() -> str:
        """Gives up."""
        raise ToolTimeoutError("ran out of time")

    def chatty() -> str:
        """Talks a lot."""
        return "x" * 100

    env = ToolEnvironment([limited, chatty], max_output_chars=30, max_calls_per_turn=2)
    result = env.step(call("limited") + call("chatty") + call("chatty"), [])
    contents = [m["content"] for m in result.observation]  # type: ignore[index]
    assert contents[0] == "Error: ran out of time"
    assert contents[1] == "x" * 30 + "\n... [70 more characters cut]"
    assert contents[2].startswith("Error: too many tool calls in one turn (limit 2)")
    assert result.metrics == {"tool_calls": 3.0, "tool_errors": 2.0, "tool_timeouts": 1.0}
