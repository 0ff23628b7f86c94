"""RayExecutor: each role's engine runs in a Ray worker group placed by a placement group.

A worker group is ``n`` Ray actors (:class:`~verl_core.trainer.executor.worker.EngineWorker`), one per
rank, on the bundles of one placement group (``ray.num_cpus_per_worker`` CPUs and
``ray.num_gpus_per_worker`` GPUs each). Before any engine is built, the group sets up the
torch.distributed rendezvous the way torchrun does (``MASTER_ADDR``/``MASTER_PORT`` on rank 0's
node, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so a training engine's
ranks run SPMD exactly as under torchrun: Megatron TP/PP and data parallelism work unchanged.

Calls are SPMD: every rank of a training role gets the call, each with its data-parallel share of
the batch (``dp_rank = (rank // tp) % dp``, Megatron's default rank order), put into the object
store once per share; results come from each data-parallel group's first rank. Rollout and reward
roles run ``dp`` independent replicas, each generating or scoring its share. Calls to one group
are submitted under a lock, so every rank sees them in the same order (collectives never cross).

The controller may call from several threads at once (asynchronous training's rollout producer
calls the rollout and reward groups while the trainer's thread calls the training groups); Ray's
calls are thread-safe, and each group's lock orders what reaches it. A weight export, which is a
sequence of calls (open on rank 0, drain on the other ranks, pull message by message, finish),
holds its groups for the whole sequence (:meth:`WorkerGroup.exclusive`), so no other thread's
call lands between its parts.

Weight sync: with ``placement = "split"`` the rollout replicas pull the actor's canonical weight
stream (:mod:`verl_core.kernel.weights`) from actor rank 0 through the object store, one bucket at a time
(the other actor ranks run their side of the export's collectives); with ``"colocated"`` each
process syncs its own actor into its own rollout replica by the registry's path for the pair.

A worker that dies makes the call raise :class:`~verl_core.trainer.executor.WorkerFailedError` naming the
role and the rank; the group is then unusable, and the run resumes from its last checkpoint. The
exception is a rollout group of its own (``split``): up to ``ray.max_rollout_restarts`` times in a
run, :class:`RayRolloutEngine` replaces it with fresh workers built from the same spec on a fresh
placement group, gives them the weights the old ones served, and retries the call (see
:class:`RayRolloutEngine`). A training engine's state (weights, optimizer, random state) lives only
in its workers and its checkpoints, so a dead training worker always fails the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, TypeVar, final

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import (
    RewardCapabilities,
    RolloutCapabilities,
    TrainingCapabilities,
)
from verl_core.kernel.engine import EngineSpec, Role
from verl_core.kernel.errors import ConfigError, VerlError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.kernel.training import (
    DEFAULT_BUCKET_BYTES,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TrainingEngine,
)
from verl_core.kernel.weights import (
    StreamWeightSync,
    SyncReport,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSync,
)
from verl_core.trainer.executor.base import Executor, WorkerFailedError
from verl_core.trainer.executor.config import RayConfig
from verl_core.trainer.executor.wire import register_batch_serializer
from verl_core.trainer.executor.worker import EngineKind, EngineWorker

__all__ = ["RayExecutor", "RayRewardEngine", "RayRolloutEngine", "RayTrainingEngine", "RayWeightSync", "WorkerGroup"]

log = logging.getLogger(__name__)

_SYNC_BUCKET_BYTES = 64 * 1024 * 1024
_T = TypeVar("_T")
_LOG_PROBS: frozenset[ModelOutput] = frozenset({"log_probs"})


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "executor 'ray' needs Ray, which is not installed: pip install 'verl-core[ray]' "
            "(or set the config key executor = \"local\")"
        ) from None
    return ray


def _death_errors(ray: Any) -> tuple[type[BaseException], ...]:
    ex = ray.exceptions
    names = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "OwnerDiedError", "LocalRayletDiedError")
    return tuple(getattr(ex, n) for n in names if hasattr(ex, n))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class WorkerGroup:
    """``world`` EngineWorkers on the bundles of one placement group, set up for torch.distributed.

    Args:
        name: Group name (used in errors).
        world: Number of workers (ranks).
        num_cpus: CPUs of each worker's bundle.
        num_gpus: GPUs of each worker's bundle.
        strategy: Placement-group strategy.
        timeout_s: Seconds to wait for the resources.

    Raises:
        ConfigError: the cluster cannot provide the bundles within ``timeout_s``.
    """

    def __init__(
        self, name: str, world: int, *, num_cpus: float, num_gpus: float, strategy: str, timeout_s: float
    ) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.name = name
        self.world = world
        self.roles: dict[str, EngineKind] = {}
        self.failure: WorkerFailedError | None = None
        # orders submissions; re-entrant so a sequence of calls can hold it throughout (exclusive())
        self._lock = threading.RLock()
        bundle: dict[str, float] = {}
        if num_cpus:
            bundle["CPU"] = num_cpus
        if num_gpus:
            bundle["GPU"] = num_gpus
        if not bundle:
            raise ConfigError(
                "config keys 'ray.num_cpus_per_worker' and 'ray.num_gpus_per_worker' are both 0; a worker "
                "needs at least one resource to be placed"
            )
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy=strategy,
                                  name=f"verl-{name}-{uuid.uuid4().hex[:8]}")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise ConfigError(
                f"Ray could not place worker group {name!r}: it needs {world} bundle(s) of {bundle} "
                f"({strategy}), but after {timeout_s:.0f}s the cluster has {ray.available_resources()} free "
                f"of {ray.cluster_resources()}. Lower ray.num_cpus_per_worker / ray.num_gpus_per_worker or "
                "ray.parallel, use placement = \"colocated\", or add nodes"
            )
        remote_cls = ray.remote(EngineWorker)
        self.workers: list[Any] = [
            remote_cls.options(
                num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(name, i, world)
            for i in range(world)
        ]
        self.info: list[dict[str, Any]] = [{"pid": None} for _ in range(world)]
        try:
            self._rendezvous()
        except BaseException:
            self.shutdown()  # give the bundles back: the group never became usable
            raise

    def _rendezvous(self) -> None:
        """Tell every rank the torch.distributed environment, as torchrun would set it."""
        self.info = self.run("<group>", "describe", [()] * self.world)
        master_ip = self.info[0]["ip"]
        port = self.run("<group>", "free_port", [()], ranks=[0])[0]
        nodes: dict[str, int] = {}
        envs = []
        for rank, info in enumerate(self.info):
            local = nodes.get(info["node_id"], 0)
            nodes[info["node_id"]] = local + 1
            envs.append({
                "MASTER_ADDR": str(master_ip), "MASTER_PORT": str(port), "RANK": str(rank),
                "WORLD_SIZE": str(self.world),
                # Ray gives each worker only its own GPUs, so its device index is 0 among them
                "LOCAL_RANK": "0" if info["gpus"] else str(local),
            })
        for env, info in zip(envs, self.info):
            env["LOCAL_WORLD_SIZE"] = str(nodes[info["node_id"]])
        self.run("<group>", "set_env", [(env,) for env in envs])

    def pids(self) -> list[int]:
        """Process id of each rank's worker."""
        return [int(i["pid"]) for i in self.info]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the group for a sequence of calls made by this thread: calls from other threads
        are submitted before the sequence starts or after it ends, never between its parts.

        A weight export is such a sequence: a call that reached rank 0 between its messages while
        the other ranks run the export's collectives would pair with the wrong collectives and hang.
        """
        with self._lock:
            yield

    def run(
        self,
        role: str,
        method: str,
        args: Sequence[tuple[Any, ...]],
        *,
        ranks: Sequence[int] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call worker ``method`` on ``ranks`` (default: all) with per-rank ``args``; results by position.

        Raises:
            WorkerFailedError: a worker died (or had died earlier), naming the role and the rank.
            Exception: the exception a worker raised, re-raised as itself with a note naming where.
        """
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        if self.failure is not None:
            raise WorkerFailedError(
                f"{self.failure} (the group has been unusable since; close it and resume)",
                role=self.failure.role, rank=self.failure.rank, method=method,
            )
        with self._lock:  # one submission order for every rank: collectives never cross
            refs = [getattr(self.workers[r], method).remote(*a, **(kwargs or {})) for r, a in zip(ranks, args)]
        return self.gather(role, method, refs, ranks)

    def gather(self, role: str, method: str, refs: list[Any], ranks: Sequence[int]) -> list[Any]:
        """Wait for ``refs`` (one per rank of ``ranks``); the first failure raises at once."""
        ray = self._ray
        pending = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deaths = _death_errors(ray)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except deaths as e:
                    raise self._failed(role, ranks[i], method, e) from e
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause
                    if isinstance(cause, Exception):
                        cause.add_note(f"raised in Ray worker rank {ranks[i]} of role {role!r} "
                                       f"(group {self.name!r}, pid {self.info[ranks[i]]['pid']}) during {method}")
                        raise cause from e
                    raise VerlError(f"role {role!r} rank {ranks[i]} failed during {method}: {_first_line(e)}") from e
        return results

    def _failed(self, role: str, rank: int, method: str, err: BaseException) -> WorkerFailedError:
        pid = self.info[rank].get("pid") if rank < len(self.info) else None
        self.failure = WorkerFailedError(
            f"worker rank {rank} of role {role!r} (Ray worker group {self.name!r}, pid {pid}) died during "
            f"{method}: {_first_line(err)}. The step failed and was not recorded; checkpoints already "
            "written are kept. Find the cause in the worker's log (often memory), then resume with "
            "`verl train CONFIG --resume` (a fresh Ray cluster is fine)",
            role=role, rank=rank, method=method,
        )
        return self.failure

    def release(self, role: str) -> None:
        """Close ``role``'s engines (best effort when the group failed)."""
        if self.roles.pop(role, None) is None:
            return
        if self.failure is None:
            with contextlib.suppress(WorkerFailedError):
                self.run(role, "close_role", [(role,)] * self.world)

    def shutdown(self) -> None:
        """Kill every worker and remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(w)
        self.workers = []
        with contextlib.suppress(Exception):  # the cluster is gone already
            remove_placement_group(self.pg)


class _Placed:
    """A role's place: its group, its ranks' data-parallel index, and the first rank of each."""

    def __init__(self, group: WorkerGroup, role: str, spec: EngineSpec, *, replicas: bool) -> None:
        self.group = group
        self.role = role
        world = group.world
        self.replicas = replicas
        if replicas:  # independent replicas: each rank is its own data-parallel index
            self.dp = world
            self.dp_rank = list(range(world))
        else:
            p = spec.parallel
            self.dp = p.dp
            self.dp_rank = [(r // p.tp) % p.dp for r in range(world)]
        self.leaders = [self.dp_rank.index(d) for d in range(self.dp)]

    def run(self, method: str, args: Sequence[tuple[Any, ...]], *, ranks: Sequence[int] | None = None) -> list[Any]:
        return self.group.run(self.role, method, args, ranks=ranks)

    def all(self, method: str, *args: Any) -> list[Any]:
        """``method(role, *args)`` on every rank."""
        return self.run(method, [(self.role, *args)] * self.group.world)

    def call_all(self, name: str, *args: Any) -> list[Any]:
        """The engine's ``name(*args)`` on every rank."""
        return self.all("call", name, *args)

    def sharded(
        self, method: str, batch: TensorBatch, *, pre: tuple[Any, ...] = (), post: tuple[Any, ...] = ()
    ) -> list[Any]:
        """``method(role, *pre, share, *post)`` on the ranks with their data-parallel share.

        Each share is put into the object store once (ranks of one data-parallel group read the
        same copy). Returns the result of each data-parallel group's first rank, in share order;
        replicas with an empty share are left out.
        """
        ray = self.group._ray
        shares = batch.chunk(self.dp) if self.dp > 1 else [batch]
        if self.replicas:
            busy = [r for r in range(self.dp) if shares[r].batch_size] or [0]
            refs = [ray.put(shares[r]) for r in busy]
            return self.run(method, [(self.role, *pre, ref, *post) for ref in refs], ranks=busy)
        refs = [ray.put(s) for s in shares]
        results = self.run(method, [(self.role, *pre, refs[self.dp_rank[r]], *post) for r in range(self.group.world)])
        return [results[r] for r in self.leaders]

    def release(self) -> None:
        self.group.release(self.role)


@final
class RayTrainingEngine(TrainingEngine):
    """A training engine running SPMD in a Ray worker group; the controller's handle to it."""

    def __init__(self, place: _Placed, spec: EngineSpec, info: dict[str, Any]) -> None:
        self._place = place
        self._spec = spec
        self._caps: TrainingCapabilities = info["capabilities"]
        self._tokenizer: Tokenizer = info["tokenizer"]
        self._weight_changes = 0

    @property
    def weight_changes(self) -> int:
        """Calls submitted so far that may change the weights (optimizer steps, checkpoint loads).

        Counted before the call is submitted, so a reader holding the group
        (:meth:`WorkerGroup.exclusive`) that sees the count it saw at an export knows the weights
        are still those the export sent.
        """
        return self._weight_changes

    @property
    def spec(self) -> EngineSpec:
        """The spec every rank was built from."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """Rank 0's capabilities."""
        return self._caps

    @property
    def tokenizer(self) -> Tokenizer:
        """Rank 0's tokenizer (a copy in this process)."""
        return self._tokenizer

    @property
    def worker_group(self) -> WorkerGroup:
        """The group the engine runs in."""
        return self._place.group

    def forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS) -> TensorBatch:
        """Every rank computes its share; the outputs are joined into ``batch``."""
        names = tuple(outputs)
        parts: list[TensorBatch] = self._place.sharded("forward", batch, post=(names,))
        joined = TensorBatch.concat(parts) if len(parts) > 1 else parts[0]
        return batch.update({n: joined[n] for n in names})

    def base_forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = _LOG_PROBS) -> TensorBatch:
        """Every rank computes its share with the adapter left out; the outputs are joined into ``batch``."""
        names = tuple(outputs)
        parts: list[TensorBatch] = self._place.sharded("call", batch, pre=("base_forward",), post=(names,))
        joined = TensorBatch.concat(parts) if len(parts) > 1 else parts[0]
        return batch.update({n: joined[n] for n in names})

    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """Every rank computes the gradients of its share under ``max_tokens``; metrics are global (rank 0's)."""
        out: list[Metrics] = self._place.sharded("forward_backward", mini_batch, post=(loss_fn, stats, max_tokens))
        return out[0]

    def optimizer_step(self) -> StepMetrics:
        """Every rank steps (they agree on skipping); rank 0's metrics."""
        self._weight_changes += 1
        out: StepMetrics = self._place.call_all("optimizer_step")[0]
        return out

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Rank 0's weight stream, one bucket at a time through the object store."""
        group = self._place.group
        ray = group._ray
        role = self._place.role
        with group.exclusive():  # no other thread's call between the export's parts
            group.run(role, "export_open", [(role, dtype, bucket_bytes, 1)], ranks=[0])
            drains = [group.workers[r].export_drain.remote(role, dtype, bucket_bytes) for r in range(1, group.world)]
            try:
                index = 0
                while True:
                    [ref] = group.run(role, "export_next", [(role, index)], ranks=[0])[0]
                    msg: WeightMessage = ray.get(ref)
                    index += 1
                    yield msg
                    if isinstance(msg, WeightCommit):
                        break
            finally:
                group.run(role, "export_finish", [(role,)], ranks=[0])
                group.gather(role, "export_weights", drains, list(range(1, group.world)))

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Every rank saves (the engine decides which rank writes what) to ``path``."""
        self._place.call_all("save_checkpoint", os.path.abspath(path))

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Every rank restores from ``path``."""
        self._weight_changes += 1
        self._place.call_all("load_checkpoint", os.path.abspath(path))

    def offload(self) -> None:
        """Every rank offloads."""
        self._place.call_all("offload")

    def onload(self) -> None:
        """Every rank onloads."""
        self._place.call_all("onload")

    def close(self) -> None:
        """Close the engine on every rank (the group goes when its last role closes)."""
        self._place.release()


class _ServedWeightsLostError(WorkerFailedError):
    """A replaced rollout group cannot be given the weights its predecessor served."""


@dataclasses.dataclass(frozen=True)
class _Served:
    """The weights a rollout group serves, as a replacement group can be given them again.

    Attributes:
        version: The weight version.
        kept: ObjectRefs of the stream's messages, kept in the object store (None: not kept).
        sync: The sync that sent them from ``source`` (None: they came another way).
        source: The training engine they were exported from.
        changes: ``source.weight_changes`` at the export: while it is unchanged the source still
            holds these weights and can send them again.
    """

    version: int
    kept: list[Any] | None = None
    sync: RayWeightSync | None = None
    source: RayTrainingEngine | None = None
    changes: int = 0


@final
class RayRolloutEngine(RolloutEngine):
    """A rollout engine as ``dp`` replicas in a Ray worker group; prompts are split between them.

    A worker of the group that dies (Ray reports the actor, its process or its node gone) is
    survived up to ``ray.max_rollout_restarts`` times in the run when the group hosts the rollout
    alone (``placement = "split"``): the executor kills what is left of the group, places a fresh
    one from the same spec, and the call that met the death is retried there. Before a call that
    samples (``generate``, ``weight_version``) the fresh replicas get the weights the old ones
    served, at the same version, from

    * the copy kept in the object store, when the executor keeps one (asynchronous training, where
      the actor trains while the rollout samples: it is one copy of the weights in the rollout's
      dtype, held until the next sync replaces it, spilled to disk by Ray when the store is full);
    * else the actor, by the same weight sync, as long as it has not been updated since it sent
      them: always true in a synchronous run, where the rollout samples only between a weight sync
      and the next update (no copy is kept then);
    * nothing, when they are the weights the engine was built with (no sync yet).

    A weight sync to a fresh group sends new weights anyway, so a group replaced while asleep
    (during the update) waits for it. Sampling is seeded per sample, so the retried call returns
    what the interrupted one would have. When none of the above can give the served weights back
    (their copy was not kept and the actor has moved on), the call raises the WorkerFailedError.
    """

    def __init__(
        self, place: _Placed, spec: EngineSpec, info: dict[str, Any], *, backend: str,
        executor: RayExecutor | None = None, keep: bool = False,
    ) -> None:
        self._place = place
        self._spec = spec
        self._backend = backend
        self._executor = executor
        self._keep = keep
        self._caps: RolloutCapabilities = info["capabilities"]
        self._tokenizer: Tokenizer = info["tokenizer"]
        self._dtype: torch.dtype = info["weight_dtype"]
        # held while the group is replaced, given its weights, or sent new ones: a call from
        # another thread never sees a fresh group before it serves the right version
        self._lock = threading.RLock()
        self._served: _Served | None = None  # None: the weights the engine was built with
        self._pending: WorkerFailedError | None = None  # the death that left the served weights to restore

    @property
    def spec(self) -> EngineSpec:
        """The spec every replica was built from."""
        return self._spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        """Replica 0's capabilities."""
        return self._caps

    @property
    def tokenizer(self) -> Tokenizer:
        """Replica 0's tokenizer (a copy in this process)."""
        return self._tokenizer

    @property
    def weight_dtype(self) -> torch.dtype:
        """Dtype the replicas want weight streams in."""
        return self._dtype

    @property
    def worker_group(self) -> WorkerGroup:
        """The group the replicas run in (a fresh one after a replacement)."""
        return self._place.group

    @property
    def weight_version(self) -> int:
        """Replica 0's serving weight version."""
        place = self._place

        def read() -> int:
            out: int = place.run("attr", [(place.role, "weight_version")], ranks=[0])[0]
            return out

        return self._call("weight_version", read, served=True)

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Each replica samples its share of the prompts (per-sample seeding keeps the samples)."""

        def sample() -> TensorBatch:
            parts: list[TensorBatch] = self._place.sharded("call", prompts, pre=("generate",), post=(params,))
            return TensorBatch.concat(parts) if len(parts) > 1 else parts[0]

        return self._call("generate", sample, served=True)

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Replica 0's answer."""
        place = self._place

        def ask() -> bool:
            out: bool = place.run("call", [(place.role, "log_probs_exact", params)], ranks=[0])[0]
            return out

        return self._call("log_probs_exact", ask, served=False)

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Put every message into the object store, then every replica applies the stream."""
        ray = self._place.group._ray
        refs, version = [], 0
        for msg in stream:
            if isinstance(msg, WeightManifest):
                version = msg.version
            refs.append(ray.put(msg))
        self.receive(lambda: (self._place.all("update_from_refs", refs), _Served(version, refs if self._keep else None)))

    def sleep(self) -> None:
        """Every replica sleeps."""
        self._call("sleep", lambda: self._place.call_all("sleep"), served=False)

    def sleep_until_sync(self) -> None:
        """Every replica sleeps, free to drop its weights (a complete sync follows the wake)."""
        self._call("sleep_until_sync", lambda: self._place.call_all("sleep_until_sync"), served=False)

    def wake(self) -> None:
        """Every replica wakes."""
        self._call("wake", lambda: self._place.call_all("wake"), served=False)

    def close(self) -> None:
        """Close every replica."""
        self._place.release()

    # ------------------------------------------------------------------ surviving a dead worker
    def receive(self, send: Callable[[], tuple[_T, _Served]]) -> _T:
        """Run ``send``, which gives every replica a complete weight stream and says what it was.

        A replica that dies meanwhile is replaced (within the restarts left) and the stream sent
        again; what was sent becomes what a later replacement is given. Other threads' calls wait
        until then.
        """
        with self._lock:
            if self._served is not None and self._served.kept is not None:
                self._served = _Served(self._served.version)  # at most one copy in the store: the new one replaces it
            out, served = self._call("update_weights", send, served=False)
            self._served, self._pending = served, None
            return out

    def _call(self, what: str, call: Callable[[], _T], *, served: bool) -> _T:
        """``call()``, surviving the death of a worker of the group; ``served``: it needs the served weights."""
        while True:
            group = self._place.group
            try:
                if served and self._pending is not None:
                    self._restore()
                return call()
            except WorkerFailedError as e:
                self._recover(group, e, what)

    def _recover(self, group: WorkerGroup, err: WorkerFailedError, what: str) -> None:
        """Replace ``group`` after ``err`` (or raise ``err`` when the executor may not)."""
        if err.role != self._place.role or self._executor is None or isinstance(err, _ServedWeightsLostError):
            raise err  # another role's worker died (e.g. the actor while sending weights): not ours to replace
        with self._lock:
            if self._place.group is not group:
                return  # another thread met the same death and replaced the group already
            self._executor.restart_rollout(self._place, self._backend, self._spec, err, what)
            if self._served is not None:
                self._pending = err

    def _restore(self) -> None:
        """Give a replacement group the weights the old one served (see the class docstring)."""
        with self._lock:
            served, death = self._served, self._pending
            if served is None or death is None:
                return
            if served.kept is not None:
                self._place.all("update_from_refs", served.kept, served.version)
            elif served.sync is not None and served.source is not None:
                source = served.source
                with source.worker_group.exclusive():  # no optimizer step starts while we compare and export
                    if source.weight_changes != served.changes:
                        raise self._lost(served, death, "the actor has been updated since it sent them and no copy "
                                         "was kept (a copy is kept only under asynchronous training)")
                    self._served = served.sync.stream(source, self, version=served.version)[1]
            else:
                raise self._lost(served, death, "they were not sent by the actor's weight sync and no copy was kept")
            self._pending = None
            log.info("the fresh rollout worker group serves weight version %d again (%s)", served.version,
                     "from the copy kept in the object store" if served.kept is not None else "sent by the actor")

    def _lost(self, served: _Served, death: WorkerFailedError, why: str) -> WorkerFailedError:
        err = _ServedWeightsLostError(
            f"the {death.role} worker group was replaced after its worker rank {death.rank} died "
            f"({_first_line(death.__cause__ or death)}), but the weights it served (version {served.version}) "
            f"cannot be given to the fresh workers: {why}. The step failed and was not recorded; resume from "
            "the last checkpoint with `verl train CONFIG --resume`",
            role=death.role, rank=death.rank, method=death.method,
        )
        err.__cause__ = death
        return err


@final
class RayRewardEngine(RewardEngine):
    """A reward engine as ``dp`` replicas in a Ray worker group; batches are split between them."""

    def __init__(self, place: _Placed, info: dict[str, Any]) -> None:
        self._place = place
        self._caps: RewardCapabilities = info["capabilities"]

    @property
    def capabilities(self) -> RewardCapabilities:
        """Replica 0's capabilities."""
        return self._caps

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Each replica scores its share."""
        parts: list[TensorBatch] = self._place.sharded("call", batch, pre=("score",))
        return TensorBatch.concat(parts) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        """Close every replica."""
        self._place.release()


@final
class RayWeightSync(WeightSync):
    """Actor -> rollout weight sync between engines placed by a RayExecutor.

    Split groups: the rollout replicas pull actor rank 0's canonical weight stream through the
    object store, one bucket in flight; the sync holds both groups meanwhile
    (:meth:`WorkerGroup.exclusive`), so a call another thread makes to either waits for it to end.
    With ``keep`` the stream's messages stay in the object store until the next sync, so that a
    replacement rollout group can be given them (:class:`RayRolloutEngine`). Colocated: every
    process syncs its own engines by the registry's path for the backend pair. Engines not placed
    by Ray get the canonical stream.

    Args:
        actor_backend: Backend of the actor.
        rollout_backend: Backend of the rollout engine.
        bucket_bytes: Bytes per chunk of the stream (split groups).
        keep: Keep the last stream sent (split groups).
    """

    def __init__(
        self, actor_backend: str, rollout_backend: str, *, bucket_bytes: int = _SYNC_BUCKET_BYTES, keep: bool = False
    ) -> None:
        self.actor_backend = actor_backend
        self.rollout_backend = rollout_backend
        self.bucket_bytes = bucket_bytes
        self.keep = keep

    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Move ``source``'s weights into ``target`` as ``version``."""
        if not isinstance(source, RayTrainingEngine) or not isinstance(target, RayRolloutEngine):
            return StreamWeightSync(self.bucket_bytes).sync(source, target, version=version)
        t0 = time.perf_counter()
        src, dst = source._place, target._place
        if src.group is dst.group:
            reports: list[SyncReport] = src.run(
                "sync_local",
                [(src.role, dst.role, self.actor_backend, self.rollout_backend, version)] * src.group.world,
            )
            return dataclasses.replace(reports[0], seconds=time.perf_counter() - t0)
        report = target.receive(lambda: self.stream(source, target, version=version))
        return dataclasses.replace(report, seconds=time.perf_counter() - t0)

    def stream(self, source: RayTrainingEngine, target: RayRolloutEngine, *, version: int) -> tuple[SyncReport, _Served]:
        """Send ``source``'s weights to ``target``'s split group as ``version``, once; returns the
        report and what ``target`` then serves (:meth:`RayRolloutEngine.receive` calls it)."""
        src, dst = source._place, target._place
        group = src.group
        replicas = dst.group.world
        # the actor's group, then the rollout's (the one order anything takes both in): neither sees
        # another thread's call until every replica has the new version and the export is closed
        with group.exclusive(), dst.group.exclusive():
            changes = source.weight_changes
            serial = group.run(src.role, "export_open",
                               [(src.role, target.weight_dtype, self.bucket_bytes, replicas, self.keep)], ranks=[0])[0]
            drains = [group.workers[r].export_drain.remote(src.role, target.weight_dtype, self.bucket_bytes)
                      for r in range(1, group.world)]
            kept = None
            try:
                reports: list[SyncReport] = dst.run(
                    "update_from", [(dst.role, group.workers[0], src.role, version, serial)] * replicas
                )
                if self.keep:
                    kept = group.run(src.role, "export_kept", [(src.role,)], ranks=[0])[0]
            finally:
                group.run(src.role, "export_finish", [(src.role,)], ranks=[0])
                group.gather(src.role, "export_weights", drains, list(range(1, group.world)))
        return reports[0], _Served(version, kept, self, source, changes)


@final
class RayExecutor(Executor):
    """Places each role's engine in a Ray worker group (see the module docstring).

    Args:
        config: Placement and resources (the ``[ray]`` config section).
        device: Device of the engines (``model.device``): CUDA devices reserve GPUs per worker
            unless ``config.num_gpus_per_worker`` says otherwise.
        rollout_during_update: The rollout samples while the actor trains (asynchronous training).
            A rollout group replaced then cannot be sent the weights it served by the actor, which
            has moved on, so the weight sync keeps the last weights it sent in the object store
            (one copy, in the rollout's dtype) while ``config.max_rollout_restarts`` > 0.

    Raises:
        ConfigError: Ray is not installed.
    """

    def __init__(
        self, config: RayConfig | None = None, *, device: str = "cpu", rollout_during_update: bool = False
    ) -> None:
        self.config = config or RayConfig()
        ray = import_ray()
        self._ray = ray
        self._owns_cluster = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": False}
            if self.config.address:
                kwargs["address"] = self.config.address
            else:
                if self.config.num_cpus:
                    kwargs["num_cpus"] = self.config.num_cpus
                if self.config.object_store_memory:
                    kwargs["object_store_memory"] = self.config.object_store_memory
            ray.init(**kwargs)
            self._owns_cluster = True
        register_batch_serializer()
        gpus = self.config.num_gpus_per_worker
        self._gpus = float(gpus) if gpus is not None else (1.0 if device.startswith("cuda") else 0.0)
        self._groups: dict[str, WorkerGroup] = {}
        self._keep = rollout_during_update and self.config.max_rollout_restarts > 0
        self.rollout_restarts = 0
        """Rollout worker groups replaced so far (see :meth:`restart_rollout`)."""

    @property
    def name(self) -> str:
        """``ray``."""
        return "ray"

    def worker_group(self, role: str) -> WorkerGroup:
        """The worker group hosting ``role``."""
        for group in self._groups.values():
            if role in group.roles:
                return group
        raise ConfigError(f"no worker group hosts role {role!r}; placed roles: {self.placed_roles()}")

    def placed_roles(self) -> list[str]:
        """Every role placed so far."""
        return [r for g in self._groups.values() for r in g.roles]

    def worker_pids(self, role: str) -> list[int]:
        """Process id of each rank of ``role``'s group."""
        return self.worker_group(role).pids()

    def _group(self, role: str, world: int, *, fixed: bool) -> WorkerGroup:
        name = "colocated" if self.config.placement == "colocated" else role
        group = self._groups.get(name)
        if group is not None and group.workers:
            if fixed and group.world != world:
                raise ConfigError(
                    f"placement 'colocated' puts every role in one group of {group.world} workers, but role "
                    f"{role!r} needs {world} ranks (config key 'ray.parallel.{role}'); give the roles the same "
                    "world size or set ray.placement = \"split\""
                )
            return group
        return self._new_group(name, world)

    def _new_group(self, name: str, world: int) -> WorkerGroup:
        cfg = self.config
        group = WorkerGroup(name, world, num_cpus=cfg.num_cpus_per_worker, num_gpus=self._gpus,
                            strategy=cfg.strategy, timeout_s=cfg.placement_timeout_s)
        self._groups[name] = group
        return group

    def _place(self, role: Role, kind: EngineKind, backend: str, spec: EngineSpec) -> tuple[_Placed, EngineSpec, dict[str, Any]]:
        if os.path.exists(spec.model_path):
            spec = dataclasses.replace(spec, model_path=os.path.abspath(spec.model_path))
        configured = self.config.parallel_of(role)
        if kind == "training":
            if configured is not None:
                spec = dataclasses.replace(spec, parallel=configured)
            group = self._group(role, spec.parallel.world_size, fixed=True)
        else:
            replicas = configured.dp if configured is not None else 1
            spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, dp=1))
            group = self._group(role, replicas, fixed=configured is not None)
        if role in group.roles:
            raise ConfigError(f"role {role!r} is already placed in worker group {group.name!r}")
        try:
            infos = group.run(role, "build", [(role, kind, backend, spec)] * group.world)
        except BaseException:
            if not group.roles:  # a group made for this role alone: give its resources back
                group.shutdown()
                self._groups.pop(group.name, None)
            raise
        group.roles[role] = kind
        place = _Placed(group, role, spec, replicas=kind != "training")
        return place, spec, infos[0]

    def training_engine(self, role: Role, backend: str, spec: EngineSpec) -> TrainingEngine:
        """Place ``role``'s training engine: ``tp * pp * dp`` SPMD ranks (``ray.parallel.<role>``)."""
        place, spec, info = self._place(role, "training", backend, spec)
        return RayTrainingEngine(place, spec, info)

    def rollout_engine(self, backend: str, spec: EngineSpec) -> RolloutEngine:
        """Place the rollout engine: ``ray.parallel.rollout.dp`` replicas (or one per colocated rank)."""
        place, spec, info = self._place("rollout", "rollout", backend, spec)
        return RayRolloutEngine(place, spec, info, backend=backend, executor=self, keep=self._keep)

    def reward_engine(self, backend: str, spec: EngineSpec) -> RewardEngine:
        """Place a reward-model engine as replicas."""
        place, _, info = self._place("reward", "reward", backend, spec)
        return RayRewardEngine(place, info)

    def weight_sync(self, actor_backend: str, rollout_backend: str) -> WeightSync:
        """A :class:`RayWeightSync` for the pair (keeping the last weights sent when a replaced
        rollout group could not get them from the actor)."""
        return RayWeightSync(actor_backend, rollout_backend, keep=self._keep)

    def restart_rollout(
        self, place: _Placed, backend: str, spec: EngineSpec, err: WorkerFailedError, call: str
    ) -> None:
        """Replace the rollout's worker group, after ``err`` (a worker's death) during ``call``.

        Kills what is left of the group, removes its placement group, then places a fresh group
        of as many workers with the same resources and builds the engine from ``spec`` on each.
        Logs one warning and counts in :attr:`rollout_restarts` (the metric ``ray/rollout_restarts``).

        Raises:
            WorkerFailedError: ``err`` (with a note saying why), when the group also hosts other
                roles (``placement = "colocated"``) or ``ray.max_rollout_restarts`` replacements
                were made already.
            ConfigError: the cluster cannot place the fresh group within ``ray.placement_timeout_s``.
        """
        old, role = place.group, place.role
        limit = self.config.max_rollout_restarts
        others = sorted(r for r in old.roles if r != role)
        if others:
            err.add_note(f"the {role} worker is not replaced: its processes also host {', '.join(others)} "
                         "(ray.placement = \"colocated\"), whose state only a checkpoint restores")
            raise err
        if self.rollout_restarts >= limit:
            if limit:
                err.add_note(f"the {role} worker group was replaced {limit} time(s) already in this run, the "
                             "limit ray.max_rollout_restarts")
            raise err
        self.rollout_restarts += 1
        pid = old.info[err.rank].get("pid") if err.rank < len(old.info) else None
        log.warning("Ray %s worker rank %d (pid %s) died during %s: %s; replacing the %s worker group (restart %d "
                    "of %d, ray.max_rollout_restarts)", role, err.rank, pid, call, _first_line(err.__cause__ or err),
                    role, self.rollout_restarts, limit)
        kind = old.roles.pop(role)
        old.shutdown()  # gives its bundles back for the fresh group
        group: WorkerGroup | None = None
        try:
            group = self._new_group(old.name, old.world)
            group.run(role, "build", [(role, kind, backend, spec)] * group.world)
        except BaseException as e:
            if group is not None:
                group.shutdown()
            e.add_note(f"raised while replacing the {role} worker group after its worker rank {err.rank} died "
                       f"during {call} ({_first_line(err.__cause__ or err)})")
            raise
        group.roles[role] = kind
        place.group = group

    def metrics(self) -> dict[str, float]:
        """``ray/rollout_restarts``: rollout worker groups replaced so far in this process."""
        return {"ray/rollout_restarts": self.rollout_restarts}

    def close(self) -> None:
        """Kill every worker, remove the placement groups, and stop a cluster this executor started."""
        for group in self._groups.values():
            group.shutdown()
        self._groups.clear()
        if self._owns_cluster and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_cluster = False

