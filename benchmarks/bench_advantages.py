"""Time every advantage estimator of ``verl_core.algorithms`` against verl 0.9.1, on CPU.

For each estimator (GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax) the
table gives our median time per call, the baseline's, their ratio (> 1: ours is faster) and the
largest difference of the advantages over response tokens. The baseline is, in this order of
preference:

1. verl 0.9.1 imported in this process (run this script with the python of an environment that
   has both verl and this project's packages), the fastest of verl's variants for each estimator
   (its loop and its ``*_vectorized`` versions);
2. verl 0.9.1 in a subprocess (``--verl PYTHON``, the python of a separate environment holding
   verl; see ``bench_algorithms.py``), same inputs, calls alternating with ours;
3. without verl: the straightforward loop implementations of ``bench_algorithms.py``.

The header names the baseline used. Calls alternate (ours, baseline, ours, ...) so both see the
same machine load; ``--cpu-time`` times the calling thread's CPU time instead of wall time, which
a loaded machine disturbs less. Inputs come from ``bench_algorithms.make_inputs`` (right-padded
bool mask, groups of 16, rewards 0 after each response); verl gets its float mask ready made, as
its trainer hands it over, while ours reads the bool mask of the canonical layout.

The table ends with the lowest ratio; ``--min-ratio R`` makes the script exit with status 1 when
an estimator is slower than ``R`` times the baseline (``--min-ratio 1`` checks that every
estimator is at least as fast as verl's fastest variant).

A second table (verl imported in this process only; ``--no-scores`` leaves it out) times the work
a trainer step does from the reward stage's sequence scores to the advantages, for GRPO,
Dr. GRPO and RLOO without KL in the reward. Ours is ``Algorithm.from_name(name)
.compute_advantages(batch)`` on a batch of ``scores``, the bool ``response_mask`` and
``group_ids`` (the trainer's call; the outcome estimators take the scores directly). verl's is
its token reward tensor built the fastest vectorised way (zeros, then the scores scattered at
each response's last index, with the index and the float mask ready made), then its
``*_vectorized`` estimator. That is the form most favourable to verl: its reward managers
(``verl/workers/reward_manager/naive.py``, ``dapo.py``, ``batch.py``) write
``reward_tensor[i, valid_response_length - 1] = reward`` in a Python loop over the samples. The
column "ours, built" is our previous step: ``compute_token_rewards`` (the scores placed on the
last token) then the estimator, which sums the rows back up.

Usage::

    OMP_NUM_THREADS=1 /tmp/verlref/bin/python benchmarks/bench_advantages.py      # verl in-process
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantages.py --verl /tmp/verlref/bin/python
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

# only the built-in estimators are timed: plugins installed in the interpreter's environment (whose
# sources this run's PYTHONPATH may not hold) are not loaded
os.environ.setdefault("VERL_DISABLE_PLUGIN_AUTOLOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_algorithms as ba  # the shared inputs, verl worker and loop baselines

ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax")
FROM_SCORES = ("grpo", "dr_grpo", "rloo")  # the presets whose step starts from the scores


def verl_in_process(x: dict[str, torch.Tensor]) -> dict[str, dict[str, Callable[[], torch.Tensor]]] | None:
    """verl's variants of each estimator, or None when verl cannot be imported here."""
    try:
        from types import SimpleNamespace

        from verl.trainer.ppo import core_algos as ca
    except ImportError:
        return None
    m = x["mask"].float()  # verl's masks are float
    r = x["token_rewards"]
    idx = x["group_ids"].numpy()
    obj = idx.astype(object)
    return {
        "gae": {"gae": lambda: ca.compute_gae_advantage_return(r, x["values"], m, 0.99, 0.95)[0]},
        "grpo": {
            "grpo": lambda: ca.compute_grpo_outcome_advantage(r, m, obj)[0],
            "grpo_vectorized": lambda: ca.compute_grpo_vectorized_outcome_advantage(r, m, idx)[0],
        },
        "dr_grpo": {
            "grpo(norm=False)": lambda: ca.compute_grpo_outcome_advantage(r, m, obj, norm_adv_by_std_in_grpo=False)[0],
            "grpo_vectorized(norm=False)": lambda: ca.compute_grpo_vectorized_outcome_advantage(
                r, m, idx, norm_adv_by_std_in_grpo=False)[0],
        },
        "rloo": {
            "rloo": lambda: ca.compute_rloo_outcome_advantage(r, m, obj)[0],
            "rloo_vectorized": lambda: ca.compute_rloo_vectorized_outcome_advantage(r, m, idx)[0],
        },
        "reinforce_pp": {"reinforce_plus_plus": lambda: ca.compute_reinforce_plus_plus_outcome_advantage(
            r, m, config=SimpleNamespace(gamma=0.99))[0]},
        "reinforce_pp_baseline": {"reinforce_plus_plus_baseline": lambda: (
            ca.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, obj)[0])},
        "remax": {"remax": lambda: ca.compute_remax_outcome_advantage(r, x["baseline_scores"], m)[0]},
    }


def from_scores(x: dict[str, torch.Tensor]) -> dict[str, dict[str, Callable[[], torch.Tensor]]] | None:
    """Each of :data:`FROM_SCORES` from the sequence scores: ours, ours building token rewards, verl's."""
    try:
        from verl.trainer.ppo import core_algos as ca
    except ImportError:
        return None
    from verl_core import TensorBatch
    from verl_core.algorithms import Algorithm, compute_token_rewards

    mask, scores = x["mask"], x["scores"]
    batch = TensorBatch({"response_mask": mask, "scores": scores, "group_ids": x["group_ids"]})
    m = mask.float()  # ready made, as in the first table
    last = (mask.sum(-1) - 1).unsqueeze(-1)  # each response's last index, ready made (lengths >= 1)
    placed = scores.unsqueeze(-1)
    idx = x["group_ids"].numpy()

    def verl_rewards() -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=torch.float32).scatter_(1, last, placed)

    def ours(name: str) -> Callable[[], torch.Tensor]:
        algo = Algorithm.from_name(name)
        return lambda: algo.compute_advantages(batch)["advantages"]

    def built(name: str) -> Callable[[], torch.Tensor]:
        algo = Algorithm.from_name(name)
        from verl_core.kernel.registry import get_registry

        est = get_registry().component("advantage", algo.estimator).impl
        return lambda: est(compute_token_rewards(batch, algo.reward)[0], algo.estimator_config)["advantages"]

    verl = {
        "grpo": lambda: ca.compute_grpo_vectorized_outcome_advantage(verl_rewards(), m, idx)[0],
        "dr_grpo": lambda: ca.compute_grpo_vectorized_outcome_advantage(
            verl_rewards(), m, idx, norm_adv_by_std_in_grpo=False)[0],
        "rloo": lambda: ca.compute_rloo_vectorized_outcome_advantage(verl_rewards(), m, idx)[0],
    }
    return {n: {"ours": ours(n), "ours, built": built(n), "verl": verl[n]} for n in FROM_SCORES}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def interleaved(
    fns: dict[str, Callable[[], Any]], reps: int, clock: Callable[[], float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per call of each function, the calls alternating so that all see the same load,
    and the mean minor page faults per call (a fresh ``[batch, response]`` buffer costs about
    4,000 of them when the allocator takes it from the system, about 1.3 ms here)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    faults = dict.fromkeys(fns, 0)
    for _ in range(reps):
        for k, f in fns.items():
            n = _faults()
            t = clock()
            f()
            times[k].append((clock() - t) * 1e3)
            faults[k] += _faults() - n
    return {k: statistics.median(v) for k, v in times.items()}, {k: v / reps for k, v in faults.items()}


def scores_table(x: dict[str, torch.Tensor], args: argparse.Namespace, clock: Callable[[], float]) -> None:
    """Print the second table (see the module docstring)."""
    cases = from_scores(x)
    if cases is None:
        print("\nfrom scores: skipped (needs verl importable in this process)")
        return
    mask = x["mask"]
    print(f"\nfrom the reward stage's scores to advantages (no KL in the reward), median of {args.reps} "
          "interleaved calls")
    print("ours: Algorithm.from_name(name).compute_advantages(batch of scores, bool response_mask, group_ids)")
    print("ours, built: compute_token_rewards + the estimator (the rows summed back up)")
    print("verl: zeros + scatter of the scores at the last index (index and float mask ready made) "
          "+ its *_vectorized estimator")
    head = (f"{'estimator':<10} {'ours':>8} {'ours, built':>11} {'verl':>8} {'verl/ours':>9} "
            f"{'built/ours':>10} {'max|diff|':>10}  page faults per call (ours, built, verl)")
    print(head)
    print("-" * len(head))
    for name in args.only_scores:
        fns = cases[name]
        outs = {k: f() for k, f in fns.items()}  # warm-up and the outputs compared
        med, faults = interleaved(fns, args.reps, clock)
        diff = float((outs["ours"] - outs["verl"]).where(mask, 0.0).abs().max())
        assert torch.equal(outs["ours"], outs["ours, built"]), name
        print(f"{name:<10} {med['ours']:>8.2f} {med['ours, built']:>11.2f} {med['verl']:>8.2f} "
              f"{med['verl'] / med['ours']:>9.2f} {med['ours, built'] / med['ours']:>10.2f} {diff:>10.2e}  "
              + ", ".join(f"{faults[k]:.0f}" for k in ("ours", "ours, built", "verl")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--verl", metavar="PYTHON", help="python of an environment with verl 0.9.1 (subprocess)")
    p.add_argument("--reps", type=int, default=11, help="timed calls per case (median reported)")
    p.add_argument("--batch", type=int, default=ba.B)
    p.add_argument("--width", type=int, default=ba.T)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    p.add_argument("--cpu-time", action="store_true", help="time the thread's CPU time, not wall time")
    p.add_argument("--only", nargs="*", choices=ESTIMATORS, help="estimators to time (default: all)")
    p.add_argument("--min-ratio", type=float, metavar="R",
                   help="exit with status 1 when an estimator's base/ours ratio is below R")
    p.add_argument("--no-scores", action="store_true", help="leave out the second table (from the scores)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    x = ba.make_inputs(args.batch, args.width)
    mask = x["mask"]
    ours = ba.ours(x)
    names = args.only or list(ESTIMATORS)

    local = verl_in_process(x)
    proc: ba.VerlProcess | None = None
    remote_out: dict[str, torch.Tensor] = {}
    if local is not None:
        kind = "verl 0.9.1, imported in this process (fastest of its variants)"
    elif args.verl:
        proc = ba.VerlProcess(args.verl, args.batch, args.width, args.threads)
        with tempfile.TemporaryDirectory() as tmp:
            remote_out = proc.outputs(os.path.join(tmp, "verl.pt"))
        kind = f"verl 0.9.1 in a subprocess ({args.verl}; its wall time per call)"
    else:
        kind = "loop implementations of bench_algorithms.py (verl is not importable; pass --verl PYTHON)"
    loops = ba.loops(x)

    def baselines(name: str) -> dict[str, Callable[[], Any]]:
        if local is not None:
            return local[name]
        if proc is not None:
            keys = [k for k in (name, f"{name}(verl vectorized)") if k in proc.cases]
            if name == "dr_grpo":
                keys = ["dr_grpo"]
            return {k: (lambda k=k: proc.time(k)) for k in keys}
        return {"loop": loops[name]}

    rows = []
    for name in names:
        fn = ours[name]
        out = fn()  # warm-up and the output compared
        base = baselines(name)
        outs = {k: f() for k, f in base.items()}  # warm-up
        times: dict[str, list[float]] = {"ours": [], **{k: [] for k in base}}
        for _ in range(args.reps):  # interleaved, so every column sees the same load
            t = clock()
            fn()
            times["ours"].append((clock() - t) * 1e3)
            for k, f in base.items():
                if proc is not None:
                    times[k].append(f())
                else:
                    t = clock()
                    f()
                    times[k].append((clock() - t) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = min(base, key=lambda k: med[k])
        if proc is not None:
            ref = remote_out.get(name)
        else:
            ref = outs[best] if isinstance(outs[best], torch.Tensor) else None
        diff = float((out - ref).where(mask, 0.0).abs().max()) if ref is not None else float("nan")
        rows.append((name, med["ours"], best, med[best], diff))
    if proc is not None:
        proc.close()

    unit = "thread CPU ms" if args.cpu_time else "wall ms"
    print(f"torch {torch.__version__}; batch {args.batch} x {args.width} response tokens, groups of {ba.GROUP}, "
          f"{args.threads} thread(s), median of {args.reps} interleaved calls ({unit})")
    print(f"baseline: {kind}")
    head = f"{'estimator':<22} {'ours':>9} {'baseline':>9} {'base/ours':>9} {'max|diff|':>10}  baseline variant"
    print(head)
    print("-" * len(head))
    for name, o, best, b, diff in rows:
        print(f"{name:<22} {o:>9.2f} {b:>9.2f} {b / o:>9.2f} {diff:>10.2e}  {best}")
    low_name, low = min(((r[0], r[3] / r[1]) for r in rows), key=lambda r: r[1])
    print(f"lowest base/ours: {low:.2f} ({low_name})")
    args.only_scores = [n for n in FROM_SCORES if n in names]
    if not args.no_scores and args.only_scores:
        scores_table(x, args, clock)
    if args.min_ratio is not None and low < args.min_ratio:
        sys.exit(f"{low_name} is {low:.2f}x the baseline, below --min-ratio {args.min_ratio}")


if __name__ == "__main__":
    main()
