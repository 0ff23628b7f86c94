"""EngineWorker: one rank of a Ray worker group, hosting the engines of the roles placed on it.

The class is plain Python; :mod:`verl_core.trainer.executor.ray_executor` turns it into a Ray actor. Every
method runs inside the worker process. Batches arrive and leave through the wire format of
:mod:`verl_core.trainer.executor.wire` (registered as Ray's TensorBatch serializer in every worker).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError, WeightSyncError
from verl_core.kernel.weights import (
    SyncReport,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
)
from verl_core.trainer.executor.wire import register_batch_serializer

__all__ = ["EngineKind", "EngineWorker"]

EngineKind = Literal["training", "rollout", "reward"]
"""Which protocol a hosted engine implements."""


@dataclass
class _Export:
    """A weight stream being served to ``consumers`` readers, each pulling every message once."""

    stream: Iterator[WeightMessage]
    consumers: int
    serial: int  # this worker's count of streams opened: a reader of an earlier one is refused
    keep: bool = False  # keep every message's ObjectRef for export_kept (else dropped once all took it)
    produced: list[Any] = field(default_factory=list)  # ObjectRef per message (None once all took it)
    taken: list[int] = field(default_factory=list)
    done: bool = False


def _as_version(stream: Iterable[WeightMessage], version: int | None, counted: list[int]) -> Iterator[WeightMessage]:
    """``stream`` up to its commit, with the manifest and the commit stamped ``version`` (None: as they
    are); adds the tensors and bytes sent to ``counted[0]`` and ``counted[1]``, the version to ``counted[2]``."""
    for msg in stream:
        if isinstance(msg, WeightManifest):
            if version is not None:
                msg = WeightManifest(version, msg.tensors, msg.tied_embeddings)
            counted[2] = msg.version
        elif isinstance(msg, WeightChunk):
            counted[0] += len(msg.tensors)
            counted[1] += msg.nbytes
        elif isinstance(msg, WeightCommit):
            yield msg if version is None else WeightCommit(version)
            return
        yield msg


class EngineWorker:
    """One rank of a worker group: builds engines by backend name and runs their calls.

    Args:
        group: Name of the worker group.
        rank: This worker's rank in the group.
        world: Number of workers in the group.
    """

    def __init__(self, group: str, rank: int, world: int) -> None:
        register_batch_serializer()
        self.group = group
        self.rank = rank
        self.world = world
        self.engines: dict[str, Any] = {}
        self._exports: dict[str, _Export] = {}
        self._opened = 0

    # ------------------------------------------------------------------ group setup
    def describe(self) -> dict[str, Any]:
        """Node id, node IP, process id and the GPU ids Ray gave this worker."""
        import ray

        api: Any = ray  # parts of Ray's API are untyped
        return {
            "node_id": api.get_runtime_context().get_node_id(),
            "ip": api.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in api.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A TCP port free on this node (rank 0 hosts the torch.distributed rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port: int = s.getsockname()[1]
            return port

    def set_env(self, env: dict[str, str]) -> None:
        """Set the torch.distributed environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK)."""
        os.environ.update(env)

    # ------------------------------------------------------------------ engines
    def build(self, role: str, kind: EngineKind, backend: str, spec: EngineSpec) -> dict[str, Any]:
        """Build ``role``'s engine through the registry; returns what the controller caches."""
        from verl_core.kernel.registry import (
            get_reward_engine,
            get_rollout_engine,
            get_training_engine,
        )

        if role in self.engines:
            raise ConfigError(f"worker group {self.group!r} rank {self.rank} already hosts role {role!r}")
        engine: Any
        if kind == "training":
            engine = get_training_engine(backend, spec)
        elif kind == "rollout":
            engine = get_rollout_engine(backend, spec)
        else:
            engine = get_reward_engine(backend, spec)
        self.engines[role] = engine
        info: dict[str, Any] = {"pid": os.getpid(), "capabilities": engine.capabilities}
        if kind != "reward" and self.rank == 0:
            info["tokenizer"] = engine.tokenizer
        if kind == "rollout":
            info["weight_dtype"] = engine.weight_dtype
        return info

    def _engine(self, role: str) -> Any:
        try:
            return self.engines[role]
        except KeyError:
            raise ConfigError(
                f"worker group {self.group!r} rank {self.rank} hosts no engine for role {role!r} "
                f"(it hosts: {', '.join(self.engines) or 'none'})"
            ) from None

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of ``role``'s engine and return its result."""
        return getattr(self._engine(role), method)(*args, **kwargs)

    def attr(self, role: str, name: str) -> Any:
        """Read attribute ``name`` of ``role``'s engine."""
        return getattr(self._engine(role), name)

    def forward(self, role: str, batch: TensorBatch, outputs: tuple[str, ...]) -> TensorBatch:
        """The engine's forward, returning only the computed fields (the caller has the rest)."""
        out: TensorBatch = self._engine(role).forward(batch, outputs)
        return out.select(*outputs, extras=False)

    def forward_backward(
        self, role: str, batch: TensorBatch, loss_fn: Any, stats: Any, max_tokens: int | None
    ) -> dict[str, float]:
        """The engine's forward_backward on this rank's share, under the controller's token budget."""
        out: dict[str, float] = self._engine(role).forward_backward(batch, loss_fn, stats, max_tokens=max_tokens)
        return out

    def close_role(self, role: str) -> None:
        """Close and forget ``role``'s engine."""
        engine = self.engines.pop(role, None)
        self._exports.pop(role, None)
        if engine is not None:
            engine.close()

    # ------------------------------------------------------------------ weight streams
    def export_open(
        self, role: str, dtype: torch.dtype | None, bucket_bytes: int, consumers: int, keep: bool = False
    ) -> int:
        """Start serving ``role``'s weight stream to ``consumers`` readers (see :meth:`export_next`);
        with ``keep`` every message stays in the object store for :meth:`export_kept`. Returns the
        stream's serial, which its readers pass to :meth:`export_next`."""
        stream = self._engine(role).export_weights(dtype=dtype, bucket_bytes=bucket_bytes)
        self._opened += 1
        self._exports[role] = _Export(iter(stream), consumers, self._opened, keep)
        return self._opened

    def export_next(self, role: str, index: int, serial: int | None = None) -> list[Any]:
        """Message ``index`` of the open stream, as ``[ObjectRef]``; with ``serial``, only if the open
        stream is that one (a reader of a stream that was abandoned, e.g. after a reader died and
        the sync was sent again, is refused instead of taking a message of the new one).

        Each message is put into the object store as soon as it is produced (a chunk is valid only
        until the next one is requested, so it is copied at once) and dropped here once every
        reader has taken it.
        """
        import ray

        exp = self._exports.get(role)
        if exp is None or (serial is not None and serial != exp.serial):
            raise WeightSyncError(f"no weight stream of role {role!r} is open on rank {self.rank}"
                                  + (f" with serial {serial}" if serial is not None else ""))
        while len(exp.produced) <= index:
            if exp.done:
                raise WeightSyncError(f"weight stream of role {role!r} ended before message {index}")
            msg = next(exp.stream, None)
            if msg is None:
                exp.done = True
                continue
            exp.produced.append(ray.put(msg))
            exp.taken.append(0)
            exp.done = isinstance(msg, WeightCommit)
        ref = exp.produced[index]
        if ref is None:
            raise WeightSyncError(f"message {index} of role {role!r}'s weight stream was already taken by every reader")
        exp.taken[index] += 1
        if exp.taken[index] >= exp.consumers and not exp.keep:
            exp.produced[index] = None
        return [ref]

    def export_kept(self, role: str) -> list[Any]:
        """The ObjectRef of every message of the open stream, opened with ``keep`` and read to its commit.

        The caller holds them (as a borrower) after :meth:`export_finish` drops this worker's own.
        """
        exp = self._exports.get(role)
        if exp is None or not exp.keep or not exp.done or any(ref is None for ref in exp.produced):
            raise WeightSyncError(
                f"role {role!r} on rank {self.rank} has no complete weight stream opened with keep=True to hand over"
            )
        return list(exp.produced)

    def export_finish(self, role: str) -> None:
        """Run the open stream to its end (so peers in collectives finish) and close it."""
        exp = self._exports.pop(role, None)
        if exp is not None and not exp.done:
            for _ in exp.stream:
                pass

    def export_drain(self, role: str, dtype: torch.dtype | None, bucket_bytes: int) -> None:
        """Run ``role``'s export on a non-serving rank (its collectives pair with the serving rank's)."""
        for _ in self._engine(role).export_weights(dtype=dtype, bucket_bytes=bucket_bytes):
            pass

    def update_from(
        self, role: str, source: Any, source_role: str, version: int, serial: int | None = None
    ) -> SyncReport:
        """Pull ``source_role``'s open weight stream (the one of ``serial``, when given) from worker
        ``source`` into ``role``'s engine."""
        import ray

        def pull() -> Iterator[WeightMessage]:
            index = 0
            while True:
                [ref] = ray.get(source.export_next.remote(source_role, index, serial))
                msg: WeightMessage = ray.get(ref)
                index += 1
                yield msg
                if isinstance(msg, WeightCommit):
                    return

        return self._apply(role, pull(), version)

    def update_from_refs(self, role: str, refs: list[Any], version: int | None = None) -> SyncReport:
        """Apply a weight stream whose messages are in the object store (``refs``, in order), stamped
        ``version`` (None: the version its manifest carries)."""
        import ray

        return self._apply(role, (ray.get(r) for r in refs), version)

    def _apply(self, role: str, stream: Iterable[WeightMessage], version: int | None) -> SyncReport:
        import time

        t0 = time.perf_counter()
        counted = [0, 0, 0]
        self._engine(role).update_weights(_as_version(stream, version, counted))
        return SyncReport(counted[2], counted[0], counted[1], time.perf_counter() - t0, {"direct": 0.0})

    def sync_local(
        self, actor_role: str, rollout_role: str, actor_backend: str, rollout_backend: str, version: int
    ) -> SyncReport:
        """Sync this process's actor into its rollout engine (colocated roles), by the registry's path."""
        from verl_core.kernel.registry import get_weight_sync

        sync = get_weight_sync(actor_backend, rollout_backend)
        report: SyncReport = sync.sync(self._engine(actor_role), self._engine(rollout_role), version=version)
        return report

    def pid(self) -> int:
        """This worker's process id."""
        return os.getpid()
