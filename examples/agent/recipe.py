"""The whole tool demo for some seeds, with and without the tool, timed: model, SFT, GRPO, held-out success.

    python examples/agent/recipe.py --seeds 0 1 2 --out runs/agent

For each seed and variant: build the tiny model (``model.py``, initialised with the seed), SFT
(``configs/agent_sft.toml``: tool conversations, or direct answers), GRPO
(``configs/agent_grpo.toml``: multi-turn episodes with the calculator, or one turn without it),
then the held-out greedy success after each stage (``evaluate.py``). Prints one line per run and
the machine's load (``uptime``). Run from the repository root.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import evaluate
import model as demo_model

from verl_core.trainer import Trainer, load_config
from verl_core.trainer.sft.trainer import SFTTrainer

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIG = ROOT / "examples" / "configs" / "agent_sft.toml"
GRPO_CONFIG = evaluate.CONFIG
SFT_DATA = {"tool": "examples/agent/sft_tool.jsonl", "direct": "examples/agent/sft_direct.jsonl"}


def run(seed: int, variant: evaluate.Variant, out: Path, *, sft_steps: int | None = None,
        grpo_steps: int | None = None) -> dict[str, Any]:
    """One seed of one variant: the held-out success after SFT (``sft``) and after GRPO (``grpo``), the
    mean tool calls per held-out episode, the training reward of the first and last GRPO step, and the
    wall-clock seconds of each stage and of the whole run and its CPU seconds (``cpu_s``)."""
    folder = out / f"{variant}-{seed}"
    common = [f"seed={seed}", "overwrite=true", "logging.sinks=[]", "logging.progress=false"]
    started, cpu = time.perf_counter(), time.process_time()
    path = demo_model.build(folder / "model", seed=seed)
    sft = load_config(SFT_CONFIG, [*common, f"model.path={str(path)!r}", f"output_dir={str(folder / 'sft')!r}",
                                   f"data.train={SFT_DATA[variant]!r}",
                                   *(["agent.tools=[]"] if variant == "direct" else []),
                                   *([f"steps={sft_steps}"] if sft_steps else [])])
    with SFTTrainer(sft) as trainer:
        trainer.train()
        sft_model = trainer.model_dir
    assert sft_model is not None  # train() exported the final weights
    sft_s = time.perf_counter() - started
    after_sft = evaluate.success(sft_model, variant)
    t = time.perf_counter()
    grpo = load_config(GRPO_CONFIG, [*common, *evaluate.overrides(variant), f"model.path={str(sft_model)!r}",
                                     f"output_dir={str(folder / 'grpo')!r}", "checkpoint.final=false",
                                     *([f"steps={grpo_steps}"] if grpo_steps else [])])
    with Trainer(grpo, base_dir=ROOT) as trainer:
        history = trainer.train()
    grpo_s = time.perf_counter() - t
    final = history[-1]
    return {"sft": after_sft["success"], "grpo": final[evaluate.METRIC], "tool_calls": final["eval/agent/tool_calls"],
            "train_reward": [history[0]["reward/mean"], final["reward/mean"]], "sft_s": sft_s, "grpo_s": grpo_s,
            "total_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=["tool", "direct"], choices=["tool", "direct"])
    parser.add_argument("--out", default="runs/agent")
    parser.add_argument("--sft-steps", type=int, help="override the SFT config's steps")
    parser.add_argument("--grpo-steps", type=int, help="override the GRPO config's steps")
    args = parser.parse_args()
    os.chdir(ROOT)
    for seed in args.seeds:
        for variant in args.variants:
            r = run(seed, variant, Path(args.out), sft_steps=args.sft_steps, grpo_steps=args.grpo_steps)
            first, last = r["train_reward"]
            print(f"seed {seed} {variant:6s}: held-out greedy success after SFT {r['sft']:.3f}, after GRPO "
                  f"{r['grpo']:.3f} ({r['tool_calls']:.2f} tool calls/episode; GRPO training reward {first:.2f} -> "
                  f"{last:.2f}); SFT {r['sft_s']:.0f}s (model build and export included), GRPO {r['grpo_s']:.0f}s "
                  f"(held-out evaluations included), total {r['total_s']:.0f}s wall, {r['cpu_s']:.0f}s CPU",
                  flush=True)
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
