"""Write the demo's data files: the 3-digit copy task ("c123=" -> "123") split three ways.

The 1000 numbers 000..999 are shuffled with a fixed seed and split, so no prompt is in two files:

* ``sft.jsonl`` (200 rows, ``prompt`` / ``response``): the supervised warm start (``verl sft``);
* ``train.jsonl`` (600 rows, ``prompt`` / ``answer``): the RL prompts (``verl train``);
* ``eval.jsonl`` (200 rows, ``prompt`` / ``answer``): held out, scored greedily during RL.

The output is the same on every machine; run ``python examples/demo/make_data.py`` to rewrite the
files next to this script (``--out DIR`` writes elsewhere).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = "verl-demo-copy-3"
SIZES = {"eval": 200, "sft": 200, "train": 600}


def splits() -> dict[str, list[str]]:
    """The numbers of each file, in file order."""
    numbers = [f"{i:03d}" for i in range(1000)]
    random.Random(SEED).shuffle(numbers)
    out, start = {}, 0
    for name, size in SIZES.items():
        out[name] = numbers[start:start + size]
        start += size
    return out


def rows(name: str, numbers: list[str]) -> list[dict[str, str]]:
    """The JSON rows of one file: the SFT file has the target response, the RL files the answer."""
    key = "response" if name == "sft" else "answer"
    return [{"prompt": f"c{n}=", key: n} for n in numbers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="folder to write into")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, numbers in splits().items():
        text = "".join(json.dumps(r) + "\n" for r in rows(name, numbers))
        (args.out / f"{name}.jsonl").write_text(text)
        print(f"wrote {args.out / f'{name}.jsonl'} ({len(numbers)} rows)")


if __name__ == "__main__":
    main()
