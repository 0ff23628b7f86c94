"""Held-out greedy success of tool-demo models: one greedy episode per question of ``eval.jsonl``.

    python examples/agent/evaluate.py --tool runs/agent/grpo/model --direct runs/agent/grpo-direct/model

A model given with ``--tool`` is evaluated as it was trained: the calculator listed in the prompt
and run when called; one given with ``--direct`` answers in one turn without it. Success is the
exact reward (``calculator.py:exact_answer``): the final turn is exactly the sum. Run from the
repository root.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Literal

from verl_core.trainer import Trainer, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "agent_grpo.toml"
METRIC = "eval/reward/exact_answer/mean"
Variant = Literal["tool", "direct"]

DIRECT = ["agent.tools=[]", "agent.environment='examples/agent/calculator.py:answer_only'"]
"""Overrides of the baseline: no tool in the prompt, one turn per episode."""


def overrides(variant: Variant) -> list[str]:
    """The config overrides of ``variant`` (none for the tool)."""
    return [] if variant == "tool" else list(DIRECT)


def success(model: str | Path, variant: Variant) -> dict[str, float]:
    """Held-out greedy success of ``model`` (``success``) and its mean tool calls per episode (``tool_calls``)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = load_config(CONFIG, [*overrides(variant), f"model.path={str(model)!r}",
                                   f"output_dir={str(Path(tmp) / 'run')!r}", "logging.sinks=[]"])
        with Trainer(run, base_dir=ROOT) as trainer:
            out = trainer.evaluate()
    return {"success": out[METRIC], "tool_calls": out["eval/agent/tool_calls"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", help="a model trained with the calculator")
    parser.add_argument("--direct", help="a model trained to answer directly")
    args = parser.parse_args()
    for variant, model in (("tool", args.tool), ("direct", args.direct)):
        if model:
            got = success(model, variant)  # type: ignore[arg-type]
            print(f"{variant:6s} {model}: held-out greedy success {got['success']:.3f} "
                  f"({got['tool_calls']:.2f} tool calls per episode)")


if __name__ == "__main__":
    main()
