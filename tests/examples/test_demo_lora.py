"""The LoRA variant of the demo's GRPO stage (examples/configs/grpo_lora_demo.toml), from the SFT stage
as shipped: a rank-16 adapter reaches the held-out target, and exports as merged weights and as a
PEFT adapter folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_demo_recipe import METRIC, ROOT, _env, sft_model  # noqa: F401  (sft_model is a fixture)

LORA_CONFIG = "examples/configs/grpo_lora_demo.toml"


@pytest.mark.slow
def test_lora_grpo_reaches_the_target_on_held_out_prompts(sft_model: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "grpo-lora"
    proc = subprocess.run(
        [sys.executable, "-m", "verl_core.cli", "train", LORA_CONFIG, f"output_dir={json.dumps(str(out))}",
         f"model.path={json.dumps(str(sft_model))}", "steps=50", "logging.progress=false", "logging.plot=false"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m[METRIC] for m in steps if METRIC in m]
    assert len(steps) == 50 and len(evals) == 2  # steps 25 and 50
    assert evals[-1] >= 0.9, evals  # 0.995 at step 25 and 1.0 at step 50 for seed 0
    for args, files in (([], {"config.json", "model.safetensors"}),
                        (["--adapter-only"], {"adapter_config.json", "adapter_model.safetensors"})):
        dest = tmp_path / f"export{len(args)}"
        done = subprocess.run([sys.executable, "-m", "verl_core.cli", "export", str(out), str(dest), *args],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert files <= {p.name for p in dest.iterdir()}
