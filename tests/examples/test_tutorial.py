"""The tutorial's examples run and assert their outcomes; the docs page shows their exact code.

Each example runs in a fresh process, as a user would run it (step 2 also under
``torchrun --nproc_per_node 2`` with gloo, where it must sample what it sampled at TP=1).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tutorial"
PAGE = ROOT / "docs" / "tutorial.md"
STEPS = sorted(p.name for p in EXAMPLES.glob("0*.py"))
# what an in-process vLLM leaves in os.environ must not reach the children
_STRIP = ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STRIP}
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _run(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_there_are_six_steps() -> None:
    assert STEPS == [
        "01_install_check.py", "02_bring_your_own_model.py", "03_mixed_backends.py",
        "04_hybrid_pipeline.py", "05_dynamic_batches.py", "06_swap_rollout.py",
    ]


def test_01_install_check() -> None:
    out = _run(str(EXAMPLES / "01_install_check.py"))
    assert "verl-core" in out and "megatron" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_02_bring_your_own_model_tp2_samples_like_tp1(tmp_path: Path) -> None:
    script = str(EXAMPLES / "02_bring_your_own_model.py")
    tp1 = tmp_path / "tp1.json"
    out = _run(script, "--out", str(tp1))
    assert tp1.is_file() and "greedy ids and log-probs agree" in out
    out = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), script, "--tp", "2", "--expect", str(tp1))
    assert out.count("tp=2 samples equal the expected ones") == 2  # both ranks


@pytest.mark.slow
@pytest.mark.parametrize("step", ["03_mixed_backends.py", "04_hybrid_pipeline.py", "05_dynamic_batches.py"])
def test_single_process_steps(step: str) -> None:
    _run(str(EXAMPLES / step))


@pytest.mark.slow
def test_06_swap_rollout() -> None:
    out = _run(str(EXAMPLES / "06_swap_rollout.py"))
    assert "hf and megatron runs are identical" in out


_BLOCK = re.compile(r"<!-- file: (examples/tutorial/\S+) -->\n```python\n(.*?)```\n", re.S)


def test_docs_page_shows_the_real_code_of_every_step() -> None:
    shown = {path: code for path, code in _BLOCK.findall(PAGE.read_text(encoding="utf-8"))}
    assert sorted(shown) == [f"examples/tutorial/{s}" for s in STEPS]
    for path, code in shown.items():
        assert code == (ROOT / path).read_text(encoding="utf-8"), (
            f"docs/tutorial.md shows an outdated copy of {path}; paste the file's current code into the page"
        )
