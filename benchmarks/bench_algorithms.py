"""Time the shared RL algorithms at batch 4096 x 1024 response tokens on CPU.

Each advantage estimator and loss of ``verl_core.algorithms`` is timed (median per call) against a
straightforward loop implementation measured in the same run (per group for the group
estimators and the losses, per time step for the recursive estimators), and, with
``--verl PYTHON`` (the python of a separate environment holding verl 0.9.1), against verl's
``verl.trainer.ppo.core_algos`` served by a subprocess on the same inputs; its outputs are
compared with ours (largest absolute difference over response tokens). The columns are measured
interleaved, call by call, so that all of them see the same machine load.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_algorithms.py [--verl /tmp/verlref/bin/python]

Losses are timed forward + backward, token-mean aggregation, on-policy-ish random log-probs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

B, T, GROUP = 4096, 1024, 16


def make_inputs(batch: int, width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random RL inputs; both processes build identical tensors from the seed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    scores = (torch.rand(batch, generator=g) > 0.5).float()

    def tok(scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(batch, width, generator=g) * scale).where(mask, 0.0)

    rewards = tok(0.01)
    rewards[torch.arange(batch), lengths - 1] += scores
    old = -(tok().abs()) - 0.05
    return {
        "mask": mask,
        "scores": scores,
        "group_ids": torch.arange(batch) // GROUP,
        "token_rewards": rewards.where(mask, 0.0),
        "values": tok(),
        "old_values": tok(),
        "returns": tok(),
        "baseline_scores": torch.rand(batch, generator=g),
        "old_log_probs": old.where(mask, 0.0),
        "log_probs": (old + tok(0.1)).where(mask, 0.0),
        "ref_log_probs": (old + tok(0.1)).where(mask, 0.0),
        "advantages": tok(),
    }


# ----------------------------------------------------------------------------- verl worker
def verl_worker(batch: int, width: int) -> None:
    """Serve timed calls of verl 0.9.1's core_algos on the inputs (see :class:`VerlProcess`)."""
    from types import SimpleNamespace

    import numpy as np
    from verl.trainer.ppo import core_algos as ca
    from verl.workers.config import ActorConfig

    x = make_inputs(batch, width)
    m = x["mask"].float()
    idx = x["group_ids"].numpy().astype(object)
    r = x["token_rewards"]
    actor = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                        clip_ratio_low=0.2, clip_ratio_high=0.28, rollout_n=1)

    def loss(fn: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            lp = x["log_probs"].clone().requires_grad_(True)
            out, _ = fn(old_log_prob=x["old_log_probs"], log_prob=lp, advantages=x["advantages"],
                        response_mask=m, loss_agg_mode="token-mean", config=actor)
            out.backward()
            return lp.grad
        return run

    def value() -> Any:
        v = x["values"].clone().requires_grad_(True)
        out, _ = ca.compute_value_loss(v, x["returns"], x["old_values"], m, 0.5, "token-mean")
        out.backward()
        return v.grad

    def k3() -> Any:
        lp = x["log_probs"].clone().requires_grad_(True)
        ca.agg_loss(ca.kl_penalty(lp, x["ref_log_probs"], "low_var_kl"), m, "token-mean").backward()
        return lp.grad

    cases: dict[str, Callable[[], Any]] = {
        "gae": lambda: ca.compute_gae_advantage_return(r, x["values"], m, 0.99, 0.95)[0],
        "grpo": lambda: ca.compute_grpo_outcome_advantage(r.clone(), m, idx)[0],
        "grpo(verl vectorized)": lambda: ca.compute_grpo_vectorized_outcome_advantage(r, m, idx)[0],
        "dr_grpo": lambda: ca.compute_grpo_outcome_advantage(r.clone(), m, idx, norm_adv_by_std_in_grpo=False)[0],
        "rloo": lambda: ca.compute_rloo_outcome_advantage(r.clone(), m, idx)[0],
        "rloo(verl vectorized)": lambda: ca.compute_rloo_vectorized_outcome_advantage(
            r, m, np.asarray(x["group_ids"].numpy()))[0],
        "reinforce_pp": lambda: ca.compute_reinforce_plus_plus_outcome_advantage(
            r, m, config=SimpleNamespace(gamma=0.99))[0],
        "reinforce_pp_baseline": lambda: ca.compute_reinforce_plus_plus_baseline_outcome_advantage(r.clone(), m, idx)[0],
        "remax": lambda: ca.compute_remax_outcome_advantage(r, x["baseline_scores"], m)[0],
        "ppo loss": loss(ca.compute_policy_loss_vanilla),
        "gspo loss": loss(ca.compute_policy_loss_gspo),
        "cispo loss": loss(ca.compute_policy_loss_cispo),
        "value loss": value,
        "k3 kl loss": k3,
    }
    # serve timing requests one call at a time, so that the two processes alternate and see the
    # same machine load: "NAME" -> one timed call (ms); "DUMP PATH" -> outputs of every case
    print("READY " + json.dumps(sorted(cases)), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd.startswith("DUMP "):
            torch.save({k: fn().detach() for k, fn in cases.items()}, cmd[5:])
            print("DONE", flush=True)
        elif cmd in cases:
            t0 = time.perf_counter()
            cases[cmd]()
            print(f"{(time.perf_counter() - t0) * 1e3:.6f}", flush=True)
        else:
            return


class VerlProcess:
    """verl's core_algos in a subprocess of another python, timed one call at a time."""

    def __init__(self, python: str, batch: int, width: int, threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        cmd = [python, os.path.abspath(__file__), "--verl-worker", "-", "--batch", str(batch),
               "--width", str(width), "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"the verl worker did not start: {line}{err[-3000:]}")
        self.cases: set[str] = set(json.loads(line[6:]))

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def time(self, name: str) -> float:
        return float(self.ask(name))

    def outputs(self, path: str) -> dict[str, torch.Tensor]:
        self.ask("DUMP " + path)
        out: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
        return out

    def close(self) -> None:
        self.ask("QUIT")
        self.proc.wait(timeout=30)


# ----------------------------------------------------------------------------- loop baselines
def loop_group_stats(scores: torch.Tensor, gids: torch.Tensor, kind: str) -> torch.Tensor:
    out = torch.empty_like(scores)
    for gid in torch.unique(gids).tolist():
        rows = (gids == gid).nonzero().squeeze(1)
        s = scores[rows]
        n = s.numel()
        if kind == "grpo":
            mean, std = (s.mean(), s.std()) if n > 1 else (s.new_zeros(()), s.new_ones(()))
            out[rows] = (s - mean) / (std + 1e-6)
        elif kind == "dr_grpo":
            out[rows] = s - (s.mean() if n > 1 else 0.0)
        elif kind == "rloo":
            out[rows] = (n * s - s.sum()) / (n - 1) if n > 1 else s
        else:  # baseline
            out[rows] = s - (s.mean() if n > 1 else 0.0)
    return out


def loop_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = x[mask]
    return ((x - vals.mean()) * torch.rsqrt(vals.var() + 1e-8)).where(mask, 0.0)


def loop_discounted(r: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out


def loop_gae(r: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    adv = torch.zeros_like(r)
    last = torch.zeros(r.shape[0])
    nv = torch.zeros(r.shape[0])
    m = mask.float()
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nv - v[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        nv = v[:, t] * m[:, t]
        adv[:, t] = last
    return loop_whiten(adv, mask)


def loop_loss(x: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """Per-group loop: each group's token-mean share, summed (forward + backward)."""
    leaf_name = "values" if kind == "value" else "log_probs"
    leaf = x[leaf_name].clone().requires_grad_(True)
    n_tok = int(x["mask"].sum())
    total = leaf.new_zeros(())
    gids = x["group_ids"]
    for gid in torch.unique(gids).tolist():
        rows = (gids == gid).nonzero().squeeze(1)
        m = x["mask"][rows]
        if kind == "value":
            v, ov, ret = leaf[rows], x["old_values"][rows], x["returns"][rows]
            vc = ov + (v - ov).clamp(-0.5, 0.5)
            per = 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2)
        elif kind == "k3":
            d = (x["ref_log_probs"][rows] - leaf[rows]).clamp(-20, 20)
            per = (d.exp() - d - 1).clamp(-10, 10)
        else:
            lp, old, a = leaf[rows], x["old_log_probs"][rows], x["advantages"][rows]
            if kind == "gspo":
                seq = ((lp - old) * m).sum(1) / m.sum(1).clamp_min(1)
                ratio = (lp - lp.detach() + seq.detach()[:, None]).clamp(max=10).exp()
            else:
                ratio = (lp - old).clamp(-20, 20).exp()
            clipped = ratio.clamp(0.8, 1.28)
            if kind == "cispo":
                per = -clipped.detach() * a * lp
            else:
                per = torch.maximum(-a * ratio, -a * clipped)
                if kind == "ppo":
                    per = torch.where(a < 0, torch.minimum(per, -a * 3.0), per)
        total = total + (per * m).sum() / n_tok
    total.backward()
    assert leaf.grad is not None
    return leaf.grad


# ----------------------------------------------------------------------------- ours
def ours(x: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    from verl_core import GlobalBatchStats, TensorBatch
    from verl_core.algorithms import (
        ActorLossConfig,
        CriticLossConfig,
        GAEConfig,
        GRPOConfig,
        PolicyLossConfig,
        ReinforcePPConfig,
        actor_loss,
        aggregate,
        critic_loss,
        gae,
        grpo,
        kl_estimate,
        reinforce_pp,
        reinforce_pp_baseline,
        remax,
        rloo,
    )

    batch = TensorBatch({
        "response_mask": x["mask"], "group_ids": x["group_ids"], "token_rewards": x["token_rewards"],
        "values": x["values"], "baseline_scores": x["baseline_scores"],
    })
    mask = x["mask"]
    stats = GlobalBatchStats.of(batch)
    pol = PolicyLossConfig(clip_low=0.2, clip_high=0.28)

    def loss(name: str) -> Callable[[], torch.Tensor]:
        cfg = ActorLossConfig(policy_loss=name, policy=pol)

        def run() -> torch.Tensor:
            lp = x["log_probs"].clone().requires_grad_(True)
            actor_loss(cfg, stats, log_probs=lp, old_log_probs=x["old_log_probs"],
                       advantages=x["advantages"], mask=mask).loss.backward()
            assert lp.grad is not None
            return lp.grad
        return run

    def value() -> torch.Tensor:
        v = x["values"].clone().requires_grad_(True)
        critic_loss(CriticLossConfig(clip_range_value=0.5), stats, values=v, old_values=x["old_values"],
                    returns=x["returns"], mask=mask).loss.backward()
        assert v.grad is not None
        return v.grad

    def k3() -> torch.Tensor:
        lp = x["log_probs"].clone().requires_grad_(True)
        aggregate(kl_estimate(lp, x["ref_log_probs"], "k3"), mask, "token-mean", stats).backward()
        assert lp.grad is not None
        return lp.grad

    return {
        "gae": lambda: gae(batch, GAEConfig(0.99, 0.95))["advantages"],
        "grpo": lambda: grpo(batch)["advantages"],
        "dr_grpo": lambda: grpo(batch, GRPOConfig(norm_by_std=False))["advantages"],
        "rloo": lambda: rloo(batch)["advantages"],
        "reinforce_pp": lambda: reinforce_pp(batch, ReinforcePPConfig(gamma=0.99))["advantages"],
        "reinforce_pp_baseline": lambda: reinforce_pp_baseline(batch)["advantages"],
        "remax": lambda: remax(batch)["advantages"],
        "ppo loss": loss("ppo"),
        "gspo loss": loss("gspo"),
        "cispo loss": loss("cispo"),
        "value loss": value,
        "k3 kl loss": k3,
    }


def loops(x: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    mask, r, gids = x["mask"], x["token_rewards"], x["group_ids"]
    total = r.sum(-1)

    def outcome(kind: str, whiten: bool = False) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = loop_group_stats(total, gids, kind)[:, None].expand_as(r).where(mask, 0.0)
            return loop_whiten(out, mask) if whiten else out
        return run

    return {
        "gae": lambda: loop_gae(r, x["values"], mask, 0.99, 0.95),
        "grpo": outcome("grpo"),
        "dr_grpo": outcome("dr_grpo"),
        "rloo": outcome("rloo"),
        "reinforce_pp": lambda: loop_whiten(loop_discounted(r, 0.99), mask),
        "reinforce_pp_baseline": outcome("baseline", whiten=True),
        "remax": lambda: (loop_discounted(r, 1.0) - x["baseline_scores"][:, None]).where(mask, 0.0),
        "ppo loss": lambda: loop_loss(x, "ppo"),
        "gspo loss": lambda: loop_loss(x, "gspo"),
        "cispo loss": lambda: loop_loss(x, "cispo"),
        "value loss": lambda: loop_loss(x, "value"),
        "k3 kl loss": lambda: loop_loss(x, "k3"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--verl", metavar="PYTHON", help="python of an environment with verl 0.9.1 installed")
    p.add_argument("--reps", type=int, default=5, help="timed calls per case (median reported)")
    p.add_argument("--batch", type=int, default=B)
    p.add_argument("--width", type=int, default=T)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: steadiest on a shared machine)")
    p.add_argument("--verl-worker", metavar="-", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.verl_worker:
        verl_worker(args.batch, args.width)
        return

    verl = VerlProcess(args.verl, args.batch, args.width, args.threads) if args.verl else None
    x = make_inputs(args.batch, args.width)
    mask = x["mask"]
    mine, loop = ours(x), loops(x)
    verl_out: dict[str, torch.Tensor] = {}
    if verl is not None:
        with tempfile.TemporaryDirectory() as tmp:
            verl_out = verl.outputs(os.path.join(tmp, "verl.pt"))
    rows = []
    for name, fn in mine.items():
        o = fn()  # warm-up and the output to compare
        t0 = time.perf_counter()
        lo = loop[name]()  # the loop needs no warm-up: its first call is timed too
        loop_first = (time.perf_counter() - t0) * 1e3
        vkeys = [k for k in (name, f"{name.split()[0]}(verl vectorized)") if verl and k in verl.cases]
        for k in vkeys:
            assert verl is not None
            verl.time(k)  # warm-up
        times: dict[str, list[float]] = {"ours": [], "loop": [loop_first], **{k: [] for k in vkeys}}
        for rep in range(args.reps):  # interleave, so every column sees the same load
            t0 = time.perf_counter()
            fn()
            times["ours"].append((time.perf_counter() - t0) * 1e3)
            for k in vkeys:
                assert verl is not None
                times[k].append(verl.time(k))
            # the loop baselines are slow: at most 3 calls, and one when a call takes over a second
            if rep < 2 and times["loop"][0] < 1000:
                t0 = time.perf_counter()
                loop[name]()
                times["loop"].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        row: dict[str, Any] = {"name": name, "ours": med["ours"], "loop": med["loop"],
                               "loop_diff": float((o - lo).where(mask, 0.0).abs().max())}
        if name in med:
            row["verl"] = med[name]
            row["verl_diff"] = float((o - verl_out[name]).where(mask, 0.0).abs().max())
        vec = f"{name.split()[0]}(verl vectorized)"
        if vec in med:
            row["verl_vec"] = med[vec]
        rows.append(row)
    if verl is not None:
        verl.close()

    print(f"torch {torch.__version__}; batch {args.batch} x {args.width} response tokens, groups of {GROUP}, "
          f"{args.threads} thread(s), median of {args.reps} calls (ms; loop: of <= 3); "
          "losses are forward + backward")
    head = f"{'algorithm':<22} {'ours':>9} {'loop':>9} {'loop/ours':>9}"
    if any("verl" in r for r in rows):
        head += f" {'verl':>9} {'verl/ours':>9} {'verl vec':>9} {'max|ours-verl|':>15}"
    head += f" {'max|ours-loop|':>15}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r['name']:<22} {r['ours']:>9.1f} {r['loop']:>9.1f} {r['loop'] / r['ours']:>9.1f}"
        if any("verl" in r for r in rows):
            v = r.get("verl")
            vv = r.get("verl_vec")
            line += f" {v:>9.1f} {v / r['ours']:>9.1f}" if v is not None else f" {'-':>9} {'-':>9}"
            line += f" {vv:>9.1f}" if vv is not None else f" {'-':>9}"
            line += f" {r['verl_diff']:>15.2e}" if "verl_diff" in r else f" {'-':>15}"
        line += f" {r['loop_diff']:>15.2e}"
        print(line)
    if os.environ.get("BENCH_JSON"):
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
