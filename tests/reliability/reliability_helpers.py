"""Shared pieces of the reliability tests: the session tally and tiny trainer configs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Final

from verl_core.trainer.config import RunConfig, load_config

TALLY: Final[Counter[str]] = Counter()
"""fuzz/<area>: bad inputs tried; fault/<kind>: faults injected; kill/<where>: SIGKILL points survived."""

# A tiny run: copy one digit, 2 prompts x 2 samples, one-layer model, fixed micro-batch budget (so
# the partition never depends on free memory) and a replay buffer that spills every batch to disk.
TINY: Final = (
    "task.name=copy", "task.digits=1", "task.reward=partial",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1",
    "model.num_layers=1", "rollout.n=2", "rollout.max_new_tokens=3", "batch.prompts_per_step=2",
    "batch.micro_batch_tokens=64", "batch.buffer_memory_bytes=1", "optim.lr=1e-2",
    "logging.progress=false", "logging.plot=false",
)


def tiny_config(out: Path, *extra: str, model: Path | None = None) -> RunConfig:
    """A tiny run writing to ``out`` (using the model folder ``model`` when given)."""
    overrides = [*TINY, f"output_dir={json.dumps(str(out))}"]
    if model is not None:
        overrides.append(f"model.path={json.dumps(str(model))}")
    return load_config(None, [*overrides, *extra])


def comparable(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics without the wall-clock ones (timings and throughput differ from run to run)."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))} for m in history]
