"""A prefix-cache rollout and the ways its author may keep the cache across a change of weights.

:class:`PrefixCacheRollout` is the tiny backend's rollout (the engine kit's facade, weight writes
that take turns with ``generate``) with a prefix cache done right: each sequence it sampled (prompt
and response) is kept with the model that computed it (standing for its keys and values), a prompt
extending a cached sequence is continued on that model, and every path that changes the weights it
serves (a stream, the direct sync of :class:`PrefixCacheDirectSync`, ``sleep_until_sync``) drops
the cache inside the write window, at the commit. Weights are written into a copy of the model that
replaces it at the commit, so a cache entry kept past a write really serves the old weights.

Each subclass moves the drop somewhere an author plausibly puts it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Final

import torch
from torch import Tensor
from verl_tiny_backend.model import Model
from verl_tiny_backend.plugin import ROLLOUT_CAPABILITIES as TINY_ROLLOUT
from verl_tiny_backend.rollout import TinyRolloutEngine
from verl_tiny_backend.training import TinyTrainingEngine

from verl_core import (
    EngineSpec,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    StreamWeightSync,
    SyncReport,
    TensorBatch,
    TensorInfo,
    TrainingEngine,
    WeightMessage,
    WeightSync,
    apply_weight_stream,
)
from verl_core.enginekit.rollout_base import Responses, RolloutEngineBase

__all__ = [
    "PREFIX_CACHE_ROLLOUT",
    "CacheDroppedBeforeTurn",
    "CacheRestoredAfterWake",
    "DirectSyncKeepsCache",
    "PrefixCacheDirectSync",
    "PrefixCacheRollout",
]

PREFIX_CACHE_ROLLOUT: Final = replace(TINY_ROLLOUT, prefix_continuation=True)
"""The tiny rollout's capabilities (concurrent_weight_update among them) with prefix_continuation."""

Key = tuple[int, ...]


class PrefixCacheRollout(TinyRolloutEngine):
    """The tiny rollout with a prefix cache dropped at every commit of new weights (see the module)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._cache: dict[Key, Model] = {}

    @property
    def capabilities(self) -> RolloutCapabilities:
        """The tiny rollout's capabilities with prefix_continuation=True."""
        return PREFIX_CACHE_ROLLOUT

    # ------------------------------------------------------------------ the cache
    def _hit(self, key: Key) -> Model | None:
        """The model of the longest cached sequence ``key`` extends, if any."""
        best: Key | None = None
        for k in self._cache:
            if len(k) < len(key) and key[: len(k)] == k and (best is None or len(k) > len(best)):
                best = k
        return None if best is None else self._cache[best]

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        """Sample on the cached model when every row extends a sequence one model computed; cache each row."""
        keys = [tuple(rows["prompt_ids"][b][rows["prompt_mask"][b]].tolist()) for b in range(rows.batch_size)]
        found = [self._hit(k) for k in keys]
        model = found[0] if found[0] is not None and all(m is found[0] for m in found) else self.model
        current = self.model
        self.model = model
        try:
            ids, mask, log_probs, truncated = super()._sample(rows, params, seeds)
        finally:
            self.model = current
        for b, key in enumerate(keys):
            self._cache[key + tuple(ids[b][mask[b]].tolist())] = model
        return ids, mask, log_probs, truncated

    def _drop_cache(self) -> None:
        self._cache.clear()

    def _commit_weights(self, version: int) -> None:
        """Drop the cache, then serve the new weights as ``version``."""
        self._drop_cache()
        super()._commit_weights(version)

    # ------------------------------------------------------------------ weight paths
    def _install(self, tensors: Mapping[str, Tensor]) -> None:
        """Write ``tensors`` into a copy of the model and serve the copy (the caller holds the write turn)."""
        model = copy.deepcopy(self.model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        self.model = model

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Check the whole stream, then serve a copy of the model holding it; a failure leaves the engine stale."""
        staged: dict[str, Tensor] = {}
        with self._writing_weights():
            expected = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self.model.named_parameters()}
            manifest = apply_weight_stream(stream, expected, staged.update)
            self._install(staged)
            self._commit_weights(manifest.version)

    def load_from(self, actor: TinyTrainingEngine, *, version: int) -> int:
        """The direct path: copy ``actor``'s parameters in as ``version``; returns the bytes copied."""
        with self._writing_weights():
            tensors = {n: p.detach() for n, p in actor.model.named_parameters()}
            self._install(tensors)
            self._commit_weights(version)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def sleep(self) -> None:
        """Pause: ``generate`` refuses until :meth:`wake` (the cache and weights are kept)."""
        with self._turns.writing():
            self._asleep = True

    def sleep_until_sync(self) -> None:
        """Drop the weights and the cache: stale after :meth:`wake` until a complete sync."""
        with self._turns.writing():
            self._mark_stale("sleep_until_sync() dropped the weights; a complete weight sync restores them")
            self._drop_cache()
            self._asleep = True

    def wake(self) -> None:
        """End the sleep."""
        with self._turns.writing():
            self._asleep = False


class PrefixCacheDirectSync(WeightSync):
    """The direct tiny actor -> :class:`PrefixCacheRollout` path (:meth:`PrefixCacheRollout.load_from`);
    the canonical stream for any other pair."""

    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Copy ``source``'s parameters into ``target`` as ``version``."""
        if not (isinstance(source, TinyTrainingEngine) and isinstance(target, PrefixCacheRollout)):
            return StreamWeightSync().sync(source, target, version=version)
        t0 = time.perf_counter()
        moved = target.load_from(source, version=version)
        return SyncReport(version, len(list(source.model.parameters())), moved, time.perf_counter() - t0)


class CacheDroppedBeforeTurn(PrefixCacheRollout):
    """Drops the cache when a weight write is called, before it takes the write turn, not at the commit:
    sequential syncs are right, but a ``generate`` call in flight when ``update_weights`` is called
    stores what the old weights computed after the drop, and a continuation after the sync is served it."""

    def _commit_weights(self, version: int) -> None:
        RolloutEngineBase._commit_weights(self, version)

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Drop the cache, then write (waiting for the turn)."""
        self._drop_cache()
        super().update_weights(stream)

    def load_from(self, actor: TinyTrainingEngine, *, version: int) -> int:
        """Drop the cache, then copy (waiting for the turn)."""
        self._drop_cache()
        return super().load_from(actor, version=version)


class DirectSyncKeepsCache(PrefixCacheRollout):
    """Drops the cache in ``update_weights`` (inside the write window) only: the direct sync path,
    which writes through ``_writing_weights`` and ``_commit_weights`` itself, keeps it."""

    def _commit_weights(self, version: int) -> None:
        RolloutEngineBase._commit_weights(self, version)

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Drop the cache inside the write window, then write."""
        with self._writing_weights():
            self._drop_cache()
            super().update_weights(stream)


class CacheRestoredAfterWake(PrefixCacheRollout):
    """``sleep_until_sync`` moves the cache to the host instead of dropping it, and the first
    ``generate`` after ``wake`` pages it back in, after the sync that followed has committed other
    weights (the commit drops only the cache in use)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._host: dict[Key, Model] = {}

    def sleep_until_sync(self) -> None:
        """Drop the weights; move the cache to the host."""
        with self._turns.writing():
            self._host.update(self._cache)
            super().sleep_until_sync()

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        """Page the host copy of the cache back in, then sample."""
        self._cache.update(self._host)
        self._host.clear()
        return super()._sample(rows, params, seeds)
