"""Greedy exact match of a model folder on the demo's held-out prompts, without training.

    python examples/demo/evaluate.py runs/demo/sft/model-sft

Runs the evaluation that ``verl train examples/configs/grpo_demo.toml`` runs after its steps (one
greedy response per prompt of ``examples/demo/eval.jsonl``, scored by the exact reward of
``reward.py``) on the model folder given, and prints the share of exact answers. ``make demo``
uses it to show where the SFT warm start leaves the policy before RL. Run from the repository root.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from verl_core.trainer import Trainer, load_config

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_demo.toml"
METRIC = "eval/reward/exact_answer_then_eos/mean"


def exact_match(model: str | Path, config: str | Path = CONFIG) -> float:
    """Held-out greedy exact match of ``model`` under the evaluation settings of ``config``."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"model.path={str(model)!r}", f"output_dir={str(Path(tmp) / 'run')!r}",
                     "logging.progress=false", "logging.sinks=[]"]
        run = load_config(config, overrides)
        with Trainer(run, base_dir=Path(config).parent) as trainer:
            return trainer.evaluate()[METRIC]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a transformers model folder, e.g. runs/demo/sft/model-sft")
    args = parser.parse_args()
    print(f"held-out greedy exact match of {args.model}: {exact_match(args.model):.3f}")


if __name__ == "__main__":
    main()
