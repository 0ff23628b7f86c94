"""A data-parallel rank of the conformance suite, run under torchrun by the invariance checks.

Usage: ``python -m torch.distributed.run --nproc_per_node N multirank.py BACKEND MODEL_PATH SPEC_JSON
[MODEL_PATH ...]`` where SPEC_JSON holds ``parallel`` (tp, pp, dp; their product is N) and other
EngineSpec fields. For each model folder in turn (MODEL_PATH, then the ones after SPEC_JSON: one
launch serves several folders), each rank builds the backend's actor (or, with ``"role": "critic"``,
its critic: values and the value loss) through the registry, takes
its :func:`~verl_core.dp_shard` of the suite's batch (the whole batch when dp = 1), runs forward,
one forward_backward with the global batch counts and one optimizer step, exports the weights, runs
one more update on the batch with every response emptied (no loss token), exports the weights again,
runs an update on the batch's first row alone (under dp=2 one rank's share has 0 rows) and closes the
engine; it writes the list of those results, one per folder in order. With
``"role": "rollout"`` in SPEC_JSON each rank builds the rollout engine on MODEL_PATH instead and
writes what it generates for :func:`rollout_cases`. With ``"checkpoint": FOLDER`` each rank runs
:func:`checkpoint_round_trip` on MODEL_PATH instead.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_core import ParallelSizes

__all__ = ["CHECKPOINT_SEEDS", "checkpoint_round_trip", "dp_batch", "main", "rollout_cases", "rollout_generations"]


CHECKPOINT_SEEDS: tuple[int, ...] = (62, 66)
"""Batches (:func:`dp_batch` seeds) of the two updates :func:`checkpoint_round_trip` compares after the load."""


def dp_batch(seed: int = 70) -> Any:
    """The global batch of the data-parallel check (the single-process baseline uses the same)."""
    from verl_conformance.testkit import random_batch

    b = random_batch(batch_size=6, max_prompt=8, max_response=8, seed=seed, empty_responses=1, with_rl_fields=True)
    return b.select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "truncated",
                    "old_log_probs", "advantages", "returns")


def rollout_cases() -> dict[str, Any]:
    """Sampling parameters of the rollout parallelism check, by label: greedy, and seeded at T=1."""
    from verl_core import SamplingParams

    return {"greedy": SamplingParams(greedy=True, max_new_tokens=6),
            "seeded": SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=17)}


def rollout_generations(engine: Any) -> dict[str, dict[str, Any]]:
    """What ``engine`` generates for each of :func:`rollout_cases` on the check's prompts."""
    from verl_conformance.testkit import random_batch

    prompts = random_batch(batch_size=4, max_prompt=8, seed=71).select("prompt_ids", "prompt_mask", "group_ids")
    out = {}
    for label, params in rollout_cases().items():
        b = engine.generate(prompts, params)
        out[label] = {k: b[k] for k in ("response_ids", "response_mask", "rollout_log_probs")}
    return out


def main(argv: list[str]) -> None:
    """Run one rank (see the module docstring)."""
    from verl_conformance.testkit import write_rank_result
    from verl_core import EngineSpec, ParallelSizes

    backend, model_path, extra = argv[0], argv[1], json.loads(argv[2])
    rank = int(os.environ["RANK"])
    parallel = ParallelSizes(**extra.pop("parallel"))
    folder = extra.pop("checkpoint", None)
    if folder is not None:
        write_rank_result(checkpoint_round_trip(backend, model_path, parallel, rank, extra, folder))
        return
    role = extra.pop("role", "actor")
    if role == "rollout":
        from verl_core import get_rollout_engine

        rollout = get_rollout_engine(backend, EngineSpec(model_path=model_path, role="rollout", max_prompt_len=12,
                                                         max_response_len=12, parallel=parallel, **extra))
        write_rank_result(rollout_generations(rollout))
        rollout.close()
        return
    write_rank_result([_update(backend, path, parallel, rank, extra, role) for path in [model_path, *argv[3:]]])


def _update(backend: str, model_path: str, parallel: ParallelSizes, rank: int, extra: dict[str, Any],
            role: str) -> dict[str, Any]:
    """One rank's forward, update and exported weights of the ``role`` engine (``actor``: log-probs under the
    policy loss; ``critic``: values under the value loss) on ``model_path`` (closed after)."""
    from verl_conformance.harness import SUITE_OPTIM, collect_stream
    from verl_conformance.losses import role_loss, role_output
    from verl_conformance.testkit import emptied
    from verl_core import EngineSpec, GlobalBatchStats, dp_shard, get_training_engine

    spec = EngineSpec(model_path=model_path, role=role, optim=SUITE_OPTIM, max_prompt_len=12,  # type: ignore[arg-type]
                      max_response_len=12, parallel=parallel, **extra)
    engine = get_training_engine(backend, spec)
    loss, output = role_loss(role), role_output(role)
    batch = dp_batch()
    # With only dp > 1 the data-parallel rank is the global rank; otherwise every rank takes it all.
    shard = dp_shard(batch, rank, parallel.dp) if parallel.dp > 1 else batch
    outputs = engine.forward(shard, [output])[output]
    metrics = engine.forward_backward(shard, loss, GlobalBatchStats.of(batch))
    step = engine.optimizer_step()
    weights = collect_stream(engine.export_weights())[1]
    empty = emptied(batch)  # then a step with no loss token, which must change no weight
    engine.forward_backward(dp_shard(empty, rank, parallel.dp) if parallel.dp > 1 else empty, loss,
                            GlobalBatchStats.of(empty))
    engine.optimizer_step()
    after_empty = collect_stream(engine.export_weights())[1]
    one = batch.index(slice(0, 1))  # then a global batch of one row: under dp=2 the second rank's share has 0 rows
    one_metrics = engine.forward_backward(dp_shard(one, rank, parallel.dp) if parallel.dp > 1 else one, loss,
                                          GlobalBatchStats.of(one))
    one_step = engine.optimizer_step()
    engine.close()
    return {"outputs": outputs, "loss": metrics["loss"], "grad_norm": step.grad_norm, "weights": weights,
            "after_empty": after_empty, "one_row": (one_metrics["loss"], one_step.grad_norm)}


def checkpoint_round_trip(backend: str, model_path: str, parallel: ParallelSizes, rank: int, extra: dict[str, Any],
                          folder: str) -> dict[str, Any]:
    """Two updates of the actor under the stateful checks' warmup schedule, ``save_checkpoint(folder)`` on
    every rank, two more updates; then a fresh engine that loads ``folder`` runs the same two. Returns
    ``{"kept": ..., "loaded": ...}``, each the two updates' losses, grad norms and learning rates and
    the weights exported after them."""
    from verl_conformance.checks.stateful import STATE_OPTIM
    from verl_conformance.harness import collect_stream
    from verl_conformance.losses import TOKEN_MEAN_PG
    from verl_core import (
        EngineSpec,
        GlobalBatchStats,
        TrainingEngine,
        dp_shard,
        get_training_engine,
    )

    spec = EngineSpec(model_path=model_path, role="actor", optim=STATE_OPTIM, max_prompt_len=12,
                      max_response_len=12, parallel=parallel, **extra)

    def updates(engine: TrainingEngine, seeds: tuple[int, ...], export: bool = True) -> dict[str, Any]:
        steps = []
        for seed in seeds:
            batch = dp_batch(seed)
            shard = dp_shard(batch, rank, parallel.dp) if parallel.dp > 1 else batch
            loss = engine.forward_backward(shard, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))["loss"]
            step = engine.optimizer_step()
            steps.append({"loss": loss, "grad_norm": step.grad_norm, "lr": step.lr})
        return {"steps": steps, "weights": collect_stream(engine.export_weights())[1] if export else {}}

    engine = get_training_engine(backend, spec)
    updates(engine, (60, 61), export=False)
    engine.save_checkpoint(folder)
    kept = updates(engine, CHECKPOINT_SEEDS)
    engine.close()
    fresh = get_training_engine(backend, spec)
    fresh.load_checkpoint(folder)
    loaded = updates(fresh, CHECKPOINT_SEEDS)
    fresh.close()
    return {"kept": kept, "loaded": loaded}


if __name__ == "__main__":
    # record: torchrun's summary then names the first rank that failed and prints its traceback (the last
    # lines of the output, which a LaunchError keeps), not only the symptom of a rank that outlived it
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)(sys.argv[1:])
