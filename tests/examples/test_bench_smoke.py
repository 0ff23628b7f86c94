"""The GPU benchmarks run on a CPU at their tiny size: ``bench_grpo_vs_trl.py`` (the verl side, its
memory plan and peak memory; TRL is not installed here), ``gpu/bench_decode_long.py`` (every
decode path of the hf rollout, its bandwidth bound; responses of different lengths on both rollouts) and ``bench_async.py``'s ragged multi-turn
workload (sync against async). A smoke test of the scripts, not a measurement."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def test_bench_grpo_vs_trl_runs_the_verl_side_at_the_tiny_size(tmp_path: Path) -> None:
    text = _run("benchmarks/bench_grpo_vs_trl.py", "--size", "tiny", "--device", "cpu", "--sides", "verl",
                "--steps", "2", "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--out", str(tmp_path))
    assert "memory plan (float32):" in text and "rollout KV cache" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("verl train  "))
    assert "<- the default config" in row and float(row.split()[-6]) > 0  # the peak memory column
    assert "time/rollout_wake" in text and "(no result: run with --sides verl)" not in text
    assert (tmp_path / "result-verl-default.json").is_file()
    # a preset fills the flags it sets; explicit flags win over it
    again = _run("benchmarks/bench_grpo_vs_trl.py", "--help")
    assert "0.9b-16x8x2048" in again and "14b-8x8x128" in again


def test_bench_decode_long_runs_every_decode_path_at_the_tiny_size(tmp_path: Path) -> None:
    text = _run("benchmarks/gpu/bench_decode_long.py", "--size", "tiny", "--device", "cpu", "--lengths", "8", "40",
                "--prompts", "2", "--n", "2", "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path),
                "--variant", "dynamic={}",
                "--variant", 'windows={"rollout_cache": "static", "rollout_decode_window": 34}',
                "--variant", 'whole-cache={"rollout_cache": "static", "rollout_decode_window": 0}')
    rows = [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        ("dynamic", "dynamic", "8"), ("dynamic", "dynamic", "40"), ("windows", "static+windows", "8"),
        ("windows", "static+windows", "40"), ("whole-cache", "static", "8"), ("whole-cache", "static", "40")]
    for r in rows:
        assert float(r[6].replace(",", "")) > 0 and float(r[7].replace(",", "")) > 0  # tok/s and its bound
    assert (tmp_path / "bench_decode_long.md").read_text().count("| windows |") == 2


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_bench_decode_long_times_responses_of_different_lengths_against_finished_rows_reading_all(
    tmp_path: Path, backend: str
) -> None:
    """``--stop-every``: rows end at different steps; ``--finished-rows-read`` (the baseline) samples the same."""
    rows = []
    for baseline in ([], ["--finished-rows-read"]):
        text = _run("benchmarks/gpu/bench_decode_long.py", "--backend", backend, "--size", "tiny", "--device", "cpu",
                    "--lengths", "40", "--stop-every", "8", "--prompts", "2", "--n", "3", "--calls", "1",
                    "--model-dir", str(tmp_path / "model"),
                    "--variant", 'windows={"rollout_decode_window": 16, "rollout_compile": false}', *baseline)
        rows += [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("| windows ")]
    assert len(rows) == 2 and rows[0][1].strip() == rows[1][1].strip() == "static+windows", rows
    tokens, mean = rows[0][3].strip(), float(rows[0][4])
    assert rows[1][3].strip() == tokens, "the baseline sampled other tokens"
    assert 1 < mean < 40, f"responses must end at different steps before the limit: mean length {mean}"


def test_bench_async_runs_the_ragged_workload_sync_and_async_at_the_tiny_size(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    text = _run("benchmarks/bench_async.py", "--workloads", "ragged", "--steps", "2", "--repeats", "1",
                "--staleness", "1", "--tool-s", "0", "--out", str(runs))
    rows = {" ".join(ln.split()[1:-3]): ln.split()[-3:] for ln in text.splitlines() if ln.startswith("ragged ")}
    assert set(rows) == {"sync", "async k=1", "async k=1 cont"}, text
    for seconds, run, ratio in rows.values():
        assert float(seconds) == float(run) > 0 and float(ratio) > 0
    assert float(rows["sync"][2]) == 1.0
    # the spread measured in the runs: episodes of 1 to 8 turns of up to 8 tokens, 64 tokens at most
    spread = re.search(r"# ragged: response tokens per sample min (\d+), mean ([\d.]+), max (\d+)", text)
    assert spread is not None, text
    low, mean, high = int(spread[1]), float(spread[2]), int(spread[3])
    assert 0 < low <= mean <= high <= 64 and high > 2 * low, spread[0]
    for setting in ("sync", "asynck1", "asynck1cont"):
        steps = [json.loads(ln) for ln in (runs / f"ragged-local-{setting}-0" / "metrics.jsonl").read_text().splitlines()]
        assert len(steps) == 2 and all(m["agent/turns"] > 1 for m in steps), steps
        assert all(m["response/length_min"] <= m["response/length_mean"] <= m["response/length_max"] for m in steps)
    assert json.loads((runs / "ragged-local-asynck1-0" / "config.json").read_text())["async_training"]["mode"] == "async"
    assert json.loads((runs / "ragged-local-asynck1cont-0" / "config.json").read_text())["async_training"] == {
        "mode": "async", "max_staleness": 1, "partial_rollouts": "continue"}


def test_bench_async_counts_every_step_of_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """An asynchronous run's first step also generates the steps released ahead and its last steps
    have no rollout left: a mean that leaves the first step out counts the free steps alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_async", ROOT / "benchmarks" / "bench_async.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_async", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    # three steps at staleness 1: two rollouts in the first, one in the second, none in the third
    async_run = [{"time/step": 60.0}, {"time/step": 30.0}, {"time/step": 6.0}]
    sync_run = [{"time/step": 36.0}, {"time/step": 34.0}, {"time/step": 34.0}]
    assert bench._seconds_per_step(async_run) == pytest.approx(32.0)
    assert bench._seconds_per_step(sync_run) == pytest.approx(104.0 / 3)


def test_bench_reward_inputs_compares_each_path_with_its_baseline() -> None:
    """The script checks that both paths score alike before timing them, and prints both ratios."""
    text = _run("benchmarks/bench_reward_inputs.py", "--rows", "8", "--response", "16", "--repeat", "1")
    ratios = re.findall(r"\| (score|masked tokens: one boolean index) \| [0-9.]+ \| ([0-9.]+)x \|", text)
    assert [name for name, _ in ratios] == ["score", "masked tokens: one boolean index"], text
    assert all(float(r) > 0 for _, r in ratios)
