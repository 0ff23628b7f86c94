"""The math example with the Python tool (examples/math: sft_tool.toml, then config_tool.toml) on a CPU.

A random model never calls a tool. The shipped SFT warm start, shortened to 100 steps at a tiny
model's learning rate, teaches the ``--size tiny`` model of ``make_model.py`` the call's format; two
GRPO steps of multi-turn episodes from the SFT model then call the ``python`` tool: some calls parse
and run in the sandbox (fewer errors than calls), the tool's output comes back as observation
tokens, and the step's seconds in the tool calls (``time/environment``) are recorded. The 0.89B
GPU run of the same configs is ``benchmarks/gpu/run_math_example.sh --tool``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from verl_core.trainer import Trainer, load_config
from verl_core.trainer.sft.trainer import SFTTrainer

ROOT = Path(__file__).resolve().parents[2]
MATH = ROOT / "examples" / "math"
pytestmark = pytest.mark.slow

COMMON = ["model.device=cpu", "model.dtype=float32", "overwrite=true", "logging.sinks=[]", "logging.progress=false"]


def _module(name: str) -> ModuleType:
    """``examples/math/<name>.py`` under a name of its own (the agent demo has a ``make_data`` too)."""
    spec = importlib.util.spec_from_file_location(f"math_example_{name}", MATH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from more; the machine is shared
    yield
    torch.set_num_threads(before)


def test_sft_on_tool_conversations_makes_grpo_episodes_call_the_python_tool(tmp_path: Path) -> None:
    model = _module("make_model").make_model(tmp_path / "model", "tiny")
    sft_config = load_config(MATH / "sft_tool.toml", [
        *COMMON, f"model.path={json.dumps(str(model))}", f"output_dir={json.dumps(str(tmp_path / 'sft'))}",
        "steps=100", "optim.lr=3e-3",
    ])
    assert sft_config.agent.tools == ["verl_core.agent.sandbox:python_tool"]
    with SFTTrainer(sft_config, base_dir=MATH) as sft:  # the dataset path is relative to the config
        sft.train()
        policy = sft.model_dir
    assert policy is not None

    grpo_config = load_config(MATH / "config_tool.toml", [
        *COMMON, f"model.path={json.dumps(str(policy))}", f"output_dir={json.dumps(str(tmp_path / 'grpo'))}",
        "steps=2", "rollout.n=2", "batch.prompts_per_step=4", 'data.eval=""', "checkpoint.final=false",
    ])
    assert grpo_config.agent.tools == ["verl_core.agent.sandbox:python_tool"]
    with Trainer(grpo_config, base_dir=MATH) as trainer:
        history = trainer.train()

    assert len(history) == 2
    calls = sum(m["agent/tool_calls"] for m in history)
    errors = sum(m["agent/tool_errors"] for m in history)
    assert calls > 0, history  # the episodes called the tool
    assert errors < calls, history  # and some calls parsed and their programs ran
    assert all(m["agent/tool_timeouts"] == 0 for m in history)
    assert sum(m["agent/observation_tokens"] for m in history) > 0  # the tool's output was appended
    for m in history:
        # the seconds of the tool calls are recorded, and are part of the rollout's
        assert 0 < m["time/environment"] < m["time/rollout"]
        assert m["agent/env_seconds"] == pytest.approx(m["time/environment"] / m["samples"])
