"""Write the math example's arithmetic word problems: ``train.jsonl``, ``eval.jsonl`` and ``sft_tool.jsonl``.

Each line of ``train.jsonl`` and ``eval.jsonl`` is ``{"question": "...", "answer": "12"}``: a one-
or two-step problem about whole numbers (addition, subtraction, multiplication, exact division),
and its answer as the text of an integer. The files are deterministic for a seed, and no question
of the evaluation set is in the training set. Every character is one the character-level tokenizer
of ``make_model.py`` knows (letters, digits, spaces and ``.,?``).

``sft_tool.jsonl`` holds the training problems as conversations that use the Python tool
(``verl_core.agent.sandbox:python_tool``), for the SFT warm start of ``sft_tool.toml``::

    {"messages": [{"role": "user", "content": "Max has 4 coins. Max gets 18 more. ..."},
                  {"role": "assistant", "content": "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(4+18)\"}}</tool_call>"},
                  {"role": "tool", "content": "22\n"},
                  {"role": "assistant", "content": "22"}]}

The call is in the Hermes format the episode loop parses (``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``), its program prints the answer, the tool's message is what the tool returns
for it (what the program printed, with its newline), and the last turn states the answer.

Usage: ``python examples/math/make_data.py [--out DIR] [--train 400] [--eval 100] [--seed 0]``
(``--out`` defaults to this file's folder, where the shipped files are).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Zoe", "Leo", "Ivy", "Omar", "Nina")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "stamps", "cards", "shells")

Problem = tuple[str, int, str]
"""A question, its answer, and the Python expression that computes the answer."""


def _add(r: random.Random, name: str, item: str) -> Problem:
    a, b = r.randint(2, 60), r.randint(2, 60)
    return f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?", a + b, f"{a}+{b}"


def _subtract(r: random.Random, name: str, item: str) -> Problem:
    friend = r.choice([n for n in NAMES if n != name])
    a = r.randint(10, 90)
    b = r.randint(1, a - 1)
    return (f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?",
            a - b, f"{a}-{b}")


def _multiply(r: random.Random, name: str, item: str) -> Problem:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return (f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy in total?",
            a * b, f"{a}*{b}")


def _divide(r: random.Random, name: str, item: str) -> Problem:
    each, friends = r.randint(2, 12), r.randint(2, 9)
    return (
        f"{name} shares {each * friends} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?", each, f"{each * friends}//{friends}",
    )


def _two_steps(r: random.Random, name: str, item: str) -> Problem:
    a, b = r.randint(5, 50), r.randint(5, 50)
    c = r.randint(1, a + b - 1)
    return (
        f"{name} has {a} {item}, buys {b} more and then gives away {c}. "
        f"How many {item} does {name} have at the end?", a + b - c, f"{a}+{b}-{c}",
    )


KINDS: tuple[Callable[[random.Random, str, str], Problem], ...] = (_add, _subtract, _multiply, _divide, _two_steps)


def _problems(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems, the kinds in turn."""
    r = random.Random(seed)
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < n:
        kind = KINDS[len(out) % len(KINDS)]
        problem = kind(r, r.choice(NAMES), r.choice(ITEMS))
        if problem[0] not in seen:
            seen.add(problem[0])
            out.append(problem)
    return out


def _row(problem: Problem) -> dict[str, str]:
    question, answer, _ = problem
    return {"question": question, "answer": str(answer)}


def problems(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` distinct problems as ``{"question", "answer"}`` rows, the kinds in turn."""
    return [_row(p) for p in _problems(n, seed)]


def tool_call(code: str) -> str:
    """The assistant's call of the ``python`` tool running ``code``, in the Hermes format."""
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def tool_conversation(problem: Problem) -> dict[str, list[dict[str, str]]]:
    """``problem`` solved with the Python tool: the question, the call, the tool's output, the answer."""
    question, answer, expression = problem
    return {"messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": tool_call(f"print({expression})")},
        {"role": "tool", "content": f"{answer}\n"},  # what python_tool returns: the printed line
        {"role": "assistant", "content": str(answer)},
    ]}


def write(out: Path, n_train: int, n_eval: int, seed: int) -> None:
    """Write ``train.jsonl`` (the first ``n_train`` problems), ``eval.jsonl`` (the next ``n_eval``) and
    ``sft_tool.jsonl`` (the training problems as conversations with the Python tool)."""
    every = _problems(n_train + n_eval, seed)
    rows = [_row(p) for p in every]
    out.mkdir(parents=True, exist_ok=True)
    files = (("train", rows[:n_train]), ("eval", rows[n_train:]),
             ("sft_tool", [tool_conversation(p) for p in every[:n_train]]))
    for name, part in files:
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output folder")
    p.add_argument("--train", type=int, default=400, help="training problems")
    p.add_argument("--eval", type=int, default=100, help="held-out problems")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.out, args.train, args.eval, args.seed)
    print(f"wrote {args.train} training and {args.eval} evaluation problems, and {args.train} tool conversations, "
          f"to {args.out}")


if __name__ == "__main__":
    main()
