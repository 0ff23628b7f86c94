"""Shared torchrun launches of the Megatron tests: each layout of engine_checks.py runs once per session.

test_engine.py compares every layout; test_reshard.py reads the resharding results of the TP=2 x
PP=2 launch, so the 4-process checks of both files cost one launch. test_megatron_optimizer.py
reads the TP=2 and DP=2 launches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from verl_conformance.testkit import launch_torchrun

Layout = tuple[int, int, int]
SCRIPT = Path(__file__).with_name("engine_checks.py")


def layout_id(layout: Layout) -> str:
    """``tp{}pp{}dp{}`` of a layout."""
    return "tp{}pp{}dp{}".format(*layout)


@pytest.fixture(scope="session")
def megatron_launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Layout], list[dict[str, Any]]]:
    """``launch(layout)``: every rank's result of engine_checks.py at ``layout`` (launched on first use)."""
    import engine_checks  # fail fast on an import error, before launching

    done: dict[Layout, list[dict[str, Any]]] = {}
    ckpts: dict[Layout, Path] = {}

    def ckpt(layout: Layout) -> Path:
        if layout not in ckpts:
            ckpts[layout] = tmp_path_factory.mktemp(layout_id(layout)) / "ckpt"
        return ckpts[layout]

    def launch(layout: Layout) -> list[dict[str, Any]]:
        if layout in done:
            return done[layout]
        loads = ""
        if layout == engine_checks.BASE:
            for src in [*engine_checks.CROSS_LOADS, engine_checks.BF16_SAVER]:
                launch(src)  # TP=1 restores the checkpoints these layouts save
            loads = ";".join([f"{arch}={ckpt(src)}" for src, arch in engine_checks.CROSS_LOADS.items()]
                             + [f"bf16={ckpt(engine_checks.BF16_SAVER)}-bf16"])
        if layout == engine_checks.MEGATRON_LOADER:
            launch(engine_checks.MEGATRON_SAVER)  # DP=2 restores the checkpoint TP=2's optimizer checks save
            loads = f"megatron={ckpt(engine_checks.MEGATRON_SAVER)}-megatron"
        tp, pp, dp = layout
        t0 = time.perf_counter()
        done[layout] = launch_torchrun(
            SCRIPT, tp * pp * dp,
            [str(tp), str(pp), str(dp), str(ckpt(layout)), ",".join(engine_checks.RUNS[layout]), loads],
            timeout=300, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        )
        print(f"{layout_id(layout)}: {time.perf_counter() - t0:.1f}s")
        return done[layout]

    return launch
