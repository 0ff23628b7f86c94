"""Direct weight sync: Megatron training layout -> colocated Megatron rollout layout, slice by slice.

The canonical path (:class:`verl_core.StreamWeightSync`) gathers every full tensor (TP all-gather,
PP broadcast) on every rank, converts it to transformers naming and lets the rollout engine cut
its shard back out. When the training engine (TP x PP, DP replicas) and the rollout engine (TP,
replicas) run on the same ranks, each rank only needs the slices of its rollout shard, and most
of them already sit on some rank in the training layout. :class:`MegatronDirectSync` moves
exactly those:

* :func:`plan_reshard` (pure bookkeeping, identical on every rank) intersects, for every Megatron
  tensor, each rank's rollout shard with the training shards of the stage that owns the tensor,
  and picks for every piece one training rank that holds it (the destination itself when it
  can: a local copy, no communication);
* pieces are packed into buckets so that on every rank the bytes it sends plus the bytes it
  receives in one bucket stay within ``bucket_bytes`` (a tensor whose pieces exceed that is
  split by rows of its full shape; only a single row larger than a bucket travels alone);
* :func:`run_reshard` executes one bucket at a time: one ``all_to_all_single`` of a flat send
  buffer and a flat receive buffer in the rollout's dtype, then copies into the rollout
  parameters in place. Peak extra memory per rank is therefore one bucket on top of its own
  training shards and its own rollout shard.

The values are copied, never recomputed, so the rollout parameters are bitwise those the
canonical stream produces (including a cast to the rollout's dtype, done by the same rounding).

Colocated switching: with the actor option ``during_rollout="offload"`` (or
``MegatronDirectSync(during_rollout="offload")``) the sync first moves the actor's optimizer
state and pending gradients to CPU memory; the actor's next training call moves them back.
Both switch times are reported in the actor's next ``forward_backward`` metrics
(``switch_to_rollout_s``, ``switch_to_training_s``) and the first in the sync's
:class:`~verl_core.SyncReport` details.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import (
    RolloutEngine,
    StreamWeightSync,
    SyncReport,
    TrainingEngine,
    WeightSync,
    WeightSyncError,
)
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_megatron.convert import StateDictAdapter

if TYPE_CHECKING:
    from verl_megatron.rollout import MegatronRolloutEngine
    from verl_megatron.training import MegatronTrainingEngine

__all__ = [
    "Bucket",
    "Layout",
    "MegatronDirectSync",
    "RankPlace",
    "ReshardPlan",
    "ReshardStats",
    "Transfer",
    "plan_reshard",
    "run_reshard",
    "shard_boxes",
]

Range = tuple[int, int]
"""Half-open index range ``[lo, hi)`` along one dimension."""
Box = tuple[Range, ...]
"""One range per dimension of a tensor."""


@dataclass(frozen=True)
class RankPlace:
    """Where one global rank sits in the training and in the rollout layout."""

    train_tp_rank: int
    train_pp_rank: int
    rollout_tp_rank: int


@dataclass(frozen=True)
class Layout:
    """A training layout (TP x PP, DP replicas) and a rollout layout (TP, replicas) on the same ranks.

    Attributes:
        train_tp: Training tensor-parallel size.
        train_pp: Training pipeline-parallel size.
        rollout_tp: Rollout tensor-parallel size (the rollout has pp = 1).
        places: Each global rank's place, indexed by global rank.
    """

    train_tp: int
    train_pp: int
    rollout_tp: int
    places: tuple[RankPlace, ...]

    def __post_init__(self) -> None:
        world = len(self.places)
        if world % (self.train_tp * self.train_pp) or world % self.rollout_tp:
            raise WeightSyncError(
                f"{world} ranks do not hold whole training (tp={self.train_tp} x pp={self.train_pp}) "
                f"and rollout (tp={self.rollout_tp}) groups"
            )
        for rank, p in enumerate(self.places):
            if not (0 <= p.train_tp_rank < self.train_tp and 0 <= p.train_pp_rank < self.train_pp
                    and 0 <= p.rollout_tp_rank < self.rollout_tp):
                raise WeightSyncError(f"rank {rank} has an impossible place {p} in {self}")

    @property
    def world_size(self) -> int:
        """Ranks the layouts span."""
        return len(self.places)


@dataclass(frozen=True)
class Transfer:
    """One box of one Megatron tensor, from a training shard on ``src`` to a rollout shard on ``dst``.

    Attributes:
        name: Megatron global tensor name.
        src: Global rank whose training shard holds the box.
        dst: Global rank whose rollout shard receives it.
        src_box: The box in the source's training shard (shard-local coordinates).
        dst_box: The box in the destination's rollout shard.
    """

    name: str
    src: int
    dst: int
    src_box: Box
    dst_box: Box

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(hi - lo for lo, hi in self.src_box)

    @property
    def remote(self) -> bool:
        """True when the box crosses ranks (a local copy otherwise)."""
        return self.src != self.dst


@dataclass(frozen=True)
class Bucket:
    """Transfers executed together by one collective."""

    transfers: tuple[Transfer, ...]

    @property
    def remote(self) -> bool:
        """Whether any rank sends or receives in this bucket."""
        return any(t.remote for t in self.transfers)

    def traffic(self, rank: int, element_size: int) -> int:
        """Bytes ``rank`` sends plus bytes it receives in this bucket (its buffer size)."""
        return element_size * sum(t.numel for t in self.transfers if t.remote and rank in (t.src, t.dst))


@dataclass(frozen=True)
class ReshardPlan:
    """Every transfer of one resharding, in buckets.

    Attributes:
        layout: The two layouts.
        buckets: The buckets, in execution order.
        element_size: Bytes per element of the rollout's dtype.
        bucket_bytes: The per-rank bound each bucket was packed to.
    """

    layout: Layout
    buckets: tuple[Bucket, ...]
    element_size: int
    bucket_bytes: int

    def peak_buffer_bytes(self, rank: int) -> int:
        """Largest send + receive buffer ``rank`` allocates in any bucket."""
        return max((b.traffic(rank, self.element_size) for b in self.buckets), default=0)

    def received_bytes(self, rank: int, *, remote_only: bool = False) -> int:
        """Bytes written into ``rank``'s rollout shard (from other ranks only, if ``remote_only``)."""
        return self.element_size * sum(
            t.numel for b in self.buckets for t in b.transfers
            if t.dst == rank and (t.remote or not remote_only)
        )


def shard_boxes(adapter: StateDictAdapter, name: str, tp: int, tp_rank: int) -> list[tuple[Box, tuple[int, ...]]]:
    """The contiguous pieces of TP rank ``tp_rank``'s shard of Megatron tensor ``name``.

    Returns:
        ``(box in the full tensor, offset of that box in the shard)`` per piece: one piece for
        row-, column-split and replicated tensors, two for ``linear_fc1`` (its gate and up slices).
    """
    shape = adapter.megatron_shape(name)
    full: Box = tuple((0, s) for s in shape)
    zero = (0,) * len(shape)
    part = adapter.partition(name)
    if part == "replicated" or tp == 1:
        return [(full, zero)]
    if part in ("rows", "cols"):
        dim = 0 if part == "rows" else 1
        n = shape[dim] // tp
        box = tuple((tp_rank * n, (tp_rank + 1) * n) if d == dim else r for d, r in enumerate(full))
        return [(box, zero)]
    half = shape[0] // 2  # fc1 = [gate; up], each split by rows
    n = half // tp
    gate = ((tp_rank * n, (tp_rank + 1) * n), *full[1:])
    up = ((half + tp_rank * n, half + (tp_rank + 1) * n), *full[1:])
    return [(gate, zero), (up, (n, *zero[1:]))]


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _to_local(box: Box, piece: Box, offset: tuple[int, ...]) -> Box:
    return tuple((lo - p[0] + o, hi - p[0] + o) for (lo, hi), p, o in zip(box, piece, offset, strict=True))


def _sources(adapter: StateDictAdapter, name: str, layout: Layout) -> list[tuple[Box, tuple[int, ...], list[int]]]:
    """(box, offset, ranks holding that shard) of the training shards of ``name``."""
    owner = adapter.stage_of(name, layout.train_pp)
    if adapter.partition(name) == "replicated" or layout.train_tp == 1:
        holders = [g for g, p in enumerate(layout.places) if p.train_pp_rank == owner]
        return [(box, off, holders) for box, off in shard_boxes(adapter, name, 1, 0)]
    out: list[tuple[Box, tuple[int, ...], list[int]]] = []
    for tt in range(layout.train_tp):
        holders = [g for g, p in enumerate(layout.places) if p.train_pp_rank == owner and p.train_tp_rank == tt]
        out.extend((box, off, holders) for box, off in shard_boxes(adapter, name, layout.train_tp, tt))
    return out


def _unit_transfers(
    adapter: StateDictAdapter, name: str, layout: Layout, rows: Range,
    sources: list[tuple[Box, tuple[int, ...], list[int]]],
) -> list[Transfer]:
    out: list[Transfer] = []
    for dst, place in enumerate(layout.places):
        for dbox, doff in shard_boxes(adapter, name, layout.rollout_tp, place.rollout_tp_rank):
            wanted = _intersect(dbox, (rows, *dbox[1:]))
            if wanted is None:
                continue
            for sbox, soff, holders in sources:
                box = _intersect(wanted, sbox)
                if box is None:
                    continue
                # the destination itself when it holds the shard (a local copy), else spread the
                # senders over the holders
                src = dst if dst in holders else holders[dst % len(holders)]
                out.append(Transfer(name, src, dst, _to_local(box, sbox, soff), _to_local(box, dbox, doff)))
    return out


def _traffic(transfers: Sequence[Transfer], world: int, element_size: int) -> list[int]:
    cost = [0] * world
    for t in transfers:
        if t.remote:
            cost[t.src] += t.numel * element_size
            cost[t.dst] += t.numel * element_size
    return cost


def plan_reshard(adapter: StateDictAdapter, layout: Layout, *, bucket_bytes: int, element_size: int) -> ReshardPlan:
    """Plan a resharding from the training to the rollout layout (the same on every rank).

    Args:
        adapter: The model's converter (names, shapes, partitions, stages).
        layout: Both layouts.
        bucket_bytes: Per-rank bound of send + receive bytes in one bucket.
        element_size: Bytes per element of the rollout's dtype.

    Raises:
        WeightSyncError: ``bucket_bytes`` < 1 or the model has no language-model head.
    """
    if bucket_bytes < 1:
        raise WeightSyncError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if adapter.dims.head != "lm":
        raise WeightSyncError("a rollout engine takes a language model; this model has a value head")
    world = layout.world_size
    units: list[list[Transfer]] = []
    for name in adapter.megatron_names():
        n_rows = adapter.megatron_shape(name)[0]
        sources = _sources(adapter, name, layout)
        k = 1
        while True:
            blocks = [(i * n_rows // k, (i + 1) * n_rows // k) for i in range(k)]
            pieces = [_unit_transfers(adapter, name, layout, rows, sources) for rows in blocks]
            worst = max(max(_traffic(p, world, element_size)) for p in pieces)
            if worst <= bucket_bytes or k >= n_rows:
                break
            # traffic scales with the rows of a block: grow k to the estimate, at least by one
            k = min(n_rows, max(k + 1, math.ceil(k * worst / bucket_bytes)))
        units.extend(p for p in pieces if p)
    buckets: list[Bucket] = []
    current: list[Transfer] = []
    load = [0] * world
    for unit in units:
        cost = _traffic(unit, world, element_size)
        if current and any(a + c > bucket_bytes for a, c in zip(load, cost, strict=True)):
            buckets.append(Bucket(tuple(current)))
            current, load = [], [0] * world
        current.extend(unit)
        load = [a + c for a, c in zip(load, cost, strict=True)]
    if current:
        buckets.append(Bucket(tuple(current)))
    return ReshardPlan(layout, tuple(buckets), element_size, bucket_bytes)


@dataclass(frozen=True)
class ReshardStats:
    """What one rank did in :func:`run_reshard`."""

    buckets: int
    collectives: int
    sent_bytes: int
    received_bytes: int
    local_bytes: int
    peak_buffer_bytes: int


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def run_reshard(
    plan: ReshardPlan,
    rank: int,
    train: Mapping[str, Tensor],
    rollout: Mapping[str, Tensor],
    *,
    group: Any = None,
) -> ReshardStats:
    """Execute ``plan`` on ``rank``: every rank of the layout calls it with its own shards.

    Args:
        plan: The plan (identical on every rank).
        rank: This rank's index in ``plan.layout`` (its rank in ``group``).
        train: This rank's training shards by Megatron global name.
        rollout: This rank's rollout shards by Megatron global name (written in place).
        group: The process group spanning the layout (None: the default group).
    """
    world = plan.layout.world_size
    sent = received = local = collectives = 0
    ref = next(iter(rollout.values()))
    # one buffer for the whole sync, as large as the largest bucket's send + receive on this rank
    size = plan.peak_buffer_bytes(rank) // plan.element_size
    buffer = torch.empty(size, dtype=ref.dtype, device=ref.device) if size else None
    with torch.no_grad():
        for bucket in plan.buckets:
            if bucket.remote:
                sends = sorted((t for t in bucket.transfers if t.src == rank and t.remote), key=lambda t: t.dst)
                recvs = sorted((t for t in bucket.transfers if t.dst == rank and t.remote), key=lambda t: t.src)
                in_splits, out_splits = [0] * world, [0] * world
                for t in sends:
                    in_splits[t.dst] += t.numel
                for t in recvs:
                    out_splits[t.src] += t.numel
                n_send, n_recv = sum(in_splits), sum(out_splits)
                flat = buffer if buffer is not None else ref.new_empty(0)
                send, recv = flat[:n_send], flat[n_send: n_send + n_recv]
                offset = 0
                for t in sends:
                    view = send[offset: offset + t.numel].view([hi - lo for lo, hi in t.src_box])
                    view.copy_(train[t.name][_slices(t.src_box)])
                    offset += t.numel
                if world > 1:
                    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
                    collectives += 1
                offset = 0
                for t in recvs:
                    view = recv[offset: offset + t.numel].view([hi - lo for lo, hi in t.dst_box])
                    rollout[t.name][_slices(t.dst_box)].copy_(view)
                    offset += t.numel
                sent += n_send * plan.element_size
                received += n_recv * plan.element_size
            for t in bucket.transfers:
                if t.src == rank and t.dst == rank:
                    dst = rollout[t.name]
                    dst[_slices(t.dst_box)].copy_(train[t.name][_slices(t.src_box)])
                    local += t.numel * dst.element_size()
    del buffer
    return ReshardStats(len(plan.buckets), collectives, sent, received, local, size * plan.element_size)


class MegatronDirectSync(WeightSync):
    """The direct WeightSync from a Megatron actor to a colocated Megatron rollout engine.

    Every rank holds both engines and calls :meth:`sync` together. Pairs it does not handle (other
    engine classes) go through the canonical stream.

    Args:
        bucket_bytes: Per-rank bound of the bytes one bucket sends plus receives.
        during_rollout: ``keep`` or ``offload`` the actor's optimizer state and gradients while
            the rollout runs; None takes the actor's ``during_rollout`` backend option.
    """

    def __init__(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, during_rollout: Literal["keep", "offload"] | None = None
    ) -> None:
        if bucket_bytes < 1:
            raise WeightSyncError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.during_rollout = during_rollout
        self._plans: dict[tuple[Any, ...], ReshardPlan] = {}
        self.last_stats: ReshardStats | None = None

    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Move ``source``'s weights into ``target`` slice by slice (canonical stream for other pairs)."""
        from verl_megatron.rollout import MegatronRolloutEngine
        from verl_megatron.training import MegatronTrainingEngine

        if not isinstance(source, MegatronTrainingEngine) or not isinstance(target, MegatronRolloutEngine):
            return StreamWeightSync(self.bucket_bytes).sync(source, target, version=version)
        t0 = time.perf_counter()
        mode = self.during_rollout or source.options.during_rollout
        switch_s = source.offload_training_state() if mode == "offload" else 0.0
        t1 = time.perf_counter()
        plan = self.plan(source, target)
        target.begin_weight_update()
        stats = run_reshard(plan, dist.get_rank(), source.stage_parameters(), target.shard_parameters())
        _synchronize(target)
        target.commit_weight_update(version)
        self.last_stats = stats
        t2 = time.perf_counter()
        details = {
            "direct": 1.0,
            "switch_to_rollout_s": switch_s,
            "reshard_s": t2 - t1,
            "buckets": float(stats.buckets),
            "sent_bytes": float(stats.sent_bytes),
            "received_bytes": float(stats.received_bytes),
            "local_bytes": float(stats.local_bytes),
            "peak_buffer_bytes": float(stats.peak_buffer_bytes),
        }
        n = len(target.shard_parameters())
        return SyncReport(version, n, stats.received_bytes + stats.local_bytes, t2 - t0, details)

    def plan(self, source: MegatronTrainingEngine, target: MegatronRolloutEngine) -> ReshardPlan:
        """The plan for this pair (computed once per layout, dtype and model; a collective)."""
        _check_pair(source, target)
        mine = (source.tp_rank, source.pp_rank, target.tp_rank)
        world = dist.get_world_size()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        layout = Layout(source.tp, source.pp, target.tp, tuple(RankPlace(*g) for g in gathered))
        elem = torch.empty((), dtype=target.weight_dtype).element_size()
        key = (layout, elem, source.dims)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_reshard(source.adapter, layout, bucket_bytes=self.bucket_bytes, element_size=elem)
            self._plans[key] = plan
        return plan


def _synchronize(target: MegatronRolloutEngine) -> None:
    dev = next(iter(target.shard_parameters().values())).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _check_pair(source: MegatronTrainingEngine, target: MegatronRolloutEngine) -> None:
    if source.dims.head != "lm":
        raise WeightSyncError(
            f"the direct sync moves an actor's weights; the source engine is a {source.spec.role} with a value head"
        )
    if source.dims != target.dims:
        diff = [f for f in source.dims.__dataclass_fields__ if getattr(source.dims, f) != getattr(target.dims, f)]
        raise WeightSyncError(
            f"the training and rollout engines hold different models (they differ in {diff}); "
            "build both from the same model folder"
        )
    if dist.get_world_size() != source.tp * source.pp * source.dp:
        raise WeightSyncError(
            f"the direct sync needs the training engine on every rank of the world "
            f"({dist.get_world_size()} ranks, the engine spans {source.tp * source.pp * source.dp}); "
            "use verl_core.StreamWeightSync"
        )
    if dist.get_world_size() != target.tp * target.spec.parallel.dp:
        raise WeightSyncError(
            f"the direct sync needs the rollout engine on every rank of the world ({dist.get_world_size()} "
            f"ranks, the engine spans tp={target.tp} x dp={target.spec.parallel.dp}); use verl_core.StreamWeightSync"
        )
