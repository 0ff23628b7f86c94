"""A tiny RL run for tests that compare whole runs: its config, running it through `verl train`, and its metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# seed 2 of this tiny setting gives reward variance, so a gradient, in every step
TINY_RUN = """
seed = 2
[task]
name = "copy"
digits = 1
[model]
hidden_size = 32
intermediate_size = 64
num_heads = 1
num_kv_heads = 1
[rollout]
n = 8
max_new_tokens = 3
[batch]
prompts_per_step = 8
[optim]
lr = 1e-2
[logging]
progress = false
plot = false
"""
CLOCK = ("time/", "throughput/")  # what differs from run to run however the numbers agree


def write(tmp_path: Path, name: str, text: str) -> Path:
    """``text`` written to ``tmp_path / name``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(text)
    return path


def cli_run(tmp_path: Path, name: str, text: str, *overrides: str) -> list[dict[str, Any]]:
    """Run ``verl train`` on the config ``text`` (output in ``tmp_path / name``); returns every step's metrics."""
    from verl_core.cli import main

    out = tmp_path / name
    assert main(["train", str(write(tmp_path, f"{name}.toml", text)), f"output_dir={json.dumps(str(out))}",
                 *overrides]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def comparable(m: dict[str, Any], clock: tuple[str, ...] = CLOCK) -> dict[str, Any]:
    """A step's metrics without the ones that measure time."""
    return {k: v for k, v in m.items() if not k.startswith(clock) and not k.endswith("_per_s")}
