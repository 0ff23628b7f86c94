"""Write the tool demo's data: adding two 6-digit numbers, with the calculator tool and without.

    python examples/agent/make_data.py --out examples/agent

* ``sft_tool.jsonl``: conversations where the assistant calls ``add`` with the two numbers of the
  question, reads the result and answers with it (the model learns the call's format and copying);
* ``sft_direct.jsonl``: the same questions answered directly (the baseline without the tool);
* ``train.jsonl``: RL prompts (a user message) with their ``answer``;
* ``eval.jsonl``: held-out prompts, no question of which is in the other files.

Every number is drawn from 500000-999999 by a seeded generator (so every sum has 7 digits), and
the files are the same on every machine.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SIZES = {"sft": 400, "train": 1000, "eval": 200}


def call(a: int, b: int) -> str:
    """The assistant's calculator call, in the chat template's tool-call format."""
    return f"<tool_call>{json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}})}</tool_call>"


def question(a: int, b: int) -> list[dict[str, str]]:
    """The prompt: one user message ``a+b``."""
    return [{"role": "user", "content": f"{a}+{b}"}]


def rows(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The rows of every file."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()

    def pairs(n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while len(out) < n:
            pair = (rng.randrange(500000, 1000000), rng.randrange(500000, 1000000))
            if pair not in seen:
                seen.add(pair)
                out.append(pair)
        return out

    held_out, sft, train = pairs(SIZES["eval"]), pairs(SIZES["sft"]), pairs(SIZES["train"])
    return {
        "sft_tool": [{"messages": [*question(a, b), {"role": "assistant", "content": call(a, b)},
                                   {"role": "tool", "content": str(a + b)},
                                   {"role": "assistant", "content": str(a + b)}]} for a, b in sft],
        "sft_direct": [{"messages": [*question(a, b), {"role": "assistant", "content": str(a + b)}]} for a, b in sft],
        "train": [{"messages": question(a, b), "answer": str(a + b)} for a, b in train],
        "eval": [{"messages": question(a, b), "answer": str(a + b)} for a, b in held_out],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent), help="folder of the files")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in rows().items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"{out / name}.jsonl: {len(data)} rows")


if __name__ == "__main__":
    main()
