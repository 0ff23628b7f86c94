"""Benchmark of the hf backend on CPU: training and generation throughput, micro-batching, overhead.

Prints one table. Ratios compare against a baseline measured in the same run (interleaved
repetitions, median), so a loaded machine shifts both sides alike.

* train tok/s: forward+backward+optimizer step of the engine, real (unpadded) tokens per second;
* gen tok/s: generated tokens per second of the rollout engine (KV cache, sampling);
* token budget vs fixed size: the same ragged mini-batch trained with ``micro_batch_tokens`` against
  ``micro_batch_size`` at the same peak padded tokens per micro-batch (target >= 1.3x);
* engine vs plain loop: the engine's training step against a hand-written transformers loop
  (explicit positions, float32 log-probs, the same PPO loss, AdamW) on the same batch (target >= 0.97x).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hf.py`` (a few minutes); ``--quick``
skips the ~100M-parameter model. On a machine shared with other jobs use one thread: OpenMP
threads that spin-wait for a busy core made small matmuls 40x slower with two threads here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verl_conformance.testkit import TinyModelSpec, build_tiny_model, random_batch
from verl_core import EngineSpec, GlobalBatchStats, OptimConfig, SamplingParams, TensorBatch
from verl_core.algorithms import Algorithm
from verl_hf.modeling import load_model, position_ids
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine

LOSS = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
OPTIM = OptimConfig(lr=1e-6, grad_clip=1.0)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b`` run alternately (after one warm-up each)."""
    a()
    b()
    ta, tb = [], []
    for _ in range(reps):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)


def rl_batch(batch_size: int, prompt: int, response: int, vocab: int, seed: int) -> TensorBatch:
    b = random_batch(batch_size=batch_size, max_prompt=prompt, max_response=response, vocab_size=vocab,
                     seed=seed, with_rl_fields=True)
    return b


def with_old(engine: HFTrainingEngine, batch: TensorBatch) -> TensorBatch:
    return batch.update(old_log_probs=engine.forward(batch)["log_probs"])


def real_tokens(batch: TensorBatch) -> int:
    return int(batch.seq_lengths().sum())


def train_step(engine: HFTrainingEngine, batch: TensorBatch) -> Callable[[], object]:
    stats = GlobalBatchStats.of(batch)

    def step() -> object:
        engine.forward_backward(batch, LOSS, stats)
        return engine.optimizer_step()

    return step


def throughput(path: str, label: str, batch: TensorBatch, gen_prompts: int, gen_tokens: int,
               reps: int) -> list[tuple[str, str, str]]:
    engine = HFTrainingEngine(EngineSpec(model_path=path, role="actor", optim=OPTIM,
                                         max_prompt_len=1024, max_response_len=1024))
    batch = with_old(engine, batch)
    step = train_step(engine, batch)
    step()
    secs = statistics.median(timed(step) for _ in range(reps))
    rows = [(f"{label}: train tok/s", f"{real_tokens(batch) / secs:,.0f}", f"{secs:.3f} s/step")]
    rollout = HFRolloutEngine(EngineSpec(model_path=path, role="rollout", max_response_len=gen_tokens))
    prompts = random_batch(batch_size=gen_prompts, max_prompt=16, max_response=1, seed=1,
                           vocab_size=128).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(max_new_tokens=gen_tokens, seed=0, temperature=1.0)
    rollout.generate(prompts, params)
    gen_secs = []
    produced = 0
    for _ in range(max(1, reps // 2)):
        t0 = time.perf_counter()
        out = rollout.generate(prompts, params)
        gen_secs.append(time.perf_counter() - t0)
        produced = int(out["response_mask"].sum())
    g = statistics.median(gen_secs)
    rows.append((f"{label}: gen tok/s", f"{produced / g:,.0f}", f"{gen_prompts} x {gen_tokens} tokens"))
    return rows


def ragged_batch(vocab: int) -> TensorBatch:
    """A mini-batch with a few long and many short sequences (as RL responses are)."""
    g = torch.Generator().manual_seed(0)
    parts = []
    for i, (p, r) in enumerate([(32, 480)] * 2 + [(32, 96)] * 6 + [(16, 32)] * 24):
        b = random_batch(batch_size=1, max_prompt=p, max_response=r, vocab_size=vocab, seed=i,
                         with_rl_fields=True)
        parts.append(b)
    batch = TensorBatch.concat(parts)
    perm = torch.randperm(batch.batch_size, generator=g)
    return batch.index(perm)


def budget_vs_size(path: str, reps: int) -> list[tuple[str, str, str]]:
    batch = ragged_batch(128)
    size = 4
    budget = size * int(batch.seq_lengths().max())  # the same peak padded tokens per micro-batch
    spec = dict(model_path=path, role="actor", optim=OPTIM, max_prompt_len=1024, max_response_len=1024)
    by_size = HFTrainingEngine(EngineSpec(**spec, micro_batch_size=size))  # type: ignore[arg-type]
    by_budget = HFTrainingEngine(EngineSpec(**spec, micro_batch_tokens=budget))  # type: ignore[arg-type]
    batch = with_old(by_size, batch)
    t_size, t_budget = interleaved(train_step(by_size, batch), train_step(by_budget, batch), reps)
    n = real_tokens(batch)
    util_size = batch.micro_batches(size=size).utilisation()
    util_budget = batch.micro_batches(max_tokens=budget).utilisation()
    return [
        (f"fixed size {size}: train tok/s", f"{n / t_size:,.0f}", f"utilisation {util_size:.2f}"),
        (f"budget {budget} tok: train tok/s", f"{n / t_budget:,.0f}", f"utilisation {util_budget:.2f}"),
        ("token budget / fixed size", f"{t_size / t_budget:.2f}x", "target >= 1.3x"),
    ]


def plain_loop(path: str, batch: TensorBatch) -> Callable[[], object]:
    """The same step written directly against transformers (no validation, no micro-batching)."""
    model = load_model(path, "causal_lm", dtype=torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=OPTIM.lr, betas=OPTIM.betas,
                            eps=OPTIM.eps, weight_decay=OPTIM.weight_decay)
    stats = GlobalBatchStats.of(batch)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    pos = position_ids(mask)
    r = batch.response_len

    def step() -> object:
        model.train()
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False,
                    logits_to_keep=r + 1)
        logp = torch.log_softmax(out.logits[:, :r].float(), -1)
        lp = logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
        lp = torch.where(batch["response_mask"], lp, 0.0)
        loss = LOSS(batch.update(log_probs=lp), stats).loss
        loss.backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norm

    return step


def engine_vs_plain(path: str, reps: int) -> list[tuple[str, str, str]]:
    engine = HFTrainingEngine(EngineSpec(model_path=path, role="actor", optim=OPTIM,
                                         max_prompt_len=1024, max_response_len=1024))
    batch = with_old(engine, rl_batch(16, 64, 128, 128, seed=3))
    # The two sides differ by a few percent at most: more repetitions to see past machine noise.
    t_plain, t_engine = interleaved(plain_loop(path, batch), train_step(engine, batch), max(reps, 7))
    n = real_tokens(batch)
    return [
        ("plain transformers loop: train tok/s", f"{n / t_plain:,.0f}", ""),
        ("engine step: train tok/s", f"{n / t_engine:,.0f}", ""),
        ("engine / plain loop", f"{t_plain / t_engine:.3f}x", "target >= 0.97x"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the ~100M-parameter model")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        tiny = str(build_tiny_model(Path(tmp) / "tiny", TinyModelSpec(arch="llama")))
        small_spec = TinyModelSpec(arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                   head_dim=32, intermediate_size=688, vocab_size=512, max_position=1024)
        small = str(build_tiny_model(Path(tmp) / "small", small_spec))
        rows += throughput(tiny, "tiny (0.2M)", rl_batch(16, 32, 64, 128, seed=0), 16, 64, args.reps)
        rows += budget_vs_size(small, args.reps)
        rows += engine_vs_plain(small, args.reps)
        if not args.quick:
            big_spec = TinyModelSpec(arch="llama", tied=True, hidden_size=768, num_layers=12, num_heads=12,
                                     num_kv_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000,
                                     max_position=2048, init_std=0.02)
            big = str(build_tiny_model(Path(tmp) / "big", big_spec))
            n_params = sum(p.numel() for p in load_model(big, "causal_lm", dtype=torch.float32).parameters())
            rows += throughput(big, f"llama {n_params / 1e6:.0f}M", rl_batch(4, 64, 64, 32000, seed=0), 4, 32, 2)
    width = max(len(r[0]) for r in rows)
    print(f"hf backend on CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'measurement'.ljust(width)}  {'value':>12}  note")
    print("-" * (width + 40))
    for name, value, note in rows:
        print(f"{name.ljust(width)}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
