"""The weight-sync contract: a stream of WeightManifest, WeightChunks and a WeightCommit.

The interchange is transformers naming, so N training backends and M rollout backends need N + M
adapters. A sender streams a manifest (names, shapes, dtypes, bytes, tied embeddings), then chunks
bucketed by bytes that never split a fusion group (a layer's q/k/v travel together, gate/up
together), then a commit. A receiver checks the manifest against its model before applying
anything, applies on commit, and on any failure marks itself stale so generation raises until a
complete sync succeeds.

The helpers that write and read such streams (bucketing by fusion group, checked application into
a receiver's tensors) are in :mod:`verl_core.enginekit.weight_stream`.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from verl_core.kernel.training import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from verl_core.kernel.rollout import RolloutEngine
    from verl_core.kernel.training import TrainingEngine

__all__ = ["StreamWeightSync", "SyncReport", "TensorInfo", "WeightChunk", "WeightCommit", "WeightManifest",
           "WeightMessage", "WeightSync"]


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one streamed tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class WeightManifest:
    """First message of a weight stream: everything the receiver checks before applying.

    Attributes:
        version: Weight version the stream carries (the trainer's step count).
        tensors: Name -> shape and dtype of every tensor that will follow, in transformers naming.
        tied_embeddings: True when lm_head shares the input embedding (and is not sent).
    """

    version: int
    tensors: Mapping[str, TensorInfo]
    tied_embeddings: bool = False

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors in the stream."""
        return sum(info.nbytes for info in self.tensors.values())


@dataclass(frozen=True)
class WeightChunk:
    """One bucket of (name, tensor) pairs; valid only until the next message is requested."""

    tensors: tuple[tuple[str, Tensor], ...]

    @property
    def nbytes(self) -> int:
        """Bytes in this chunk."""
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass(frozen=True)
class WeightCommit:
    """Last message of a weight stream: the receiver may now serve the new version."""

    version: int


WeightMessage = WeightManifest | WeightChunk | WeightCommit
"""One message of a weight stream."""

@dataclass(frozen=True)
class SyncReport:
    """What one weight sync moved and how long it took."""

    version: int
    num_tensors: int
    bytes: int
    seconds: float
    details: Mapping[str, float] = field(default_factory=dict)
    """More figures of the sync; the trainer reports each as ``weight_sync/<key>`` (a key ending in ``_s``,
    a duration, as ``time/weight_sync/<key>``). ``direct``: 1.0 when a backend pair's direct path moved the
    weights, 0.0 when the stream did (:class:`StreamWeightSync` sets it)."""

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


class WeightSync(Protocol):
    """Moves an actor's weights into a rollout engine.

    After :meth:`sync` returns, the rollout engine's log-probs equal the training engine's (up to
    the dtype tier). A failed sync leaves the rollout engine stale (generate raises) until a
    complete sync succeeds.
    """

    @abstractmethod
    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Move ``source``'s current weights into ``target`` as ``version``."""


class StreamWeightSync(WeightSync):
    """The canonical path: ``target.update_weights(source.export_weights(...))``; a rollout engine
    built with ``spec.lora`` gets ``source.export_adapter(...)`` instead.

    Args:
        bucket_bytes: Bytes per chunk of the stream (chunks of the sender's own memory cost none).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes

    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Stream the weights in the target's dtype and report the volume and time."""
        t0 = time.perf_counter()
        counted: list[int] = [0, 0]

        def counting(stream: Iterable[WeightMessage]) -> Iterator[WeightMessage]:
            for msg in stream:
                if isinstance(msg, WeightManifest):
                    msg = WeightManifest(version, msg.tensors, msg.tied_embeddings)
                elif isinstance(msg, WeightCommit):
                    msg = WeightCommit(version)
                elif isinstance(msg, WeightChunk):
                    counted[0] += len(msg.tensors)
                    counted[1] += msg.nbytes
                yield msg

        if target.spec.lora is not None:  # a rollout that applies adapters gets the adapter, in its own dtypes
            stream = source.export_adapter(bucket_bytes=self.bucket_bytes)
        else:
            stream = source.export_weights(dtype=target.weight_dtype, bucket_bytes=self.bucket_bytes)
        target.update_weights(counting(stream))
        return SyncReport(version, counted[0], counted[1], time.perf_counter() - t0, {"direct": 0.0})
