"""Broken backends of prefix caches and weight writes: the tiny backend with a rollout that keeps a
prefix cache (:mod:`verl_broken_backends.prefix_cache_engines`) and a direct weight sync from its
actor, the cache dropped right (``prefix-cache-ok``, the control) or on one write path too few."""

from __future__ import annotations

from verl_core import PROTOCOL_VERSION, BackendSpec, WeightSync, hookimpl

__all__ = [
    "PrefixCacheBackend",
    "prefix_cache_direct_sync",
    "prefix_cache_direct_sync_rollout_only",
    "prefix_cache_dropped_before_turn",
    "prefix_cache_ok",
    "prefix_cache_restored_after_wake",
]

_ENGINES = "verl_broken_backends.prefix_cache_engines"


class PrefixCacheBackend:
    """A plugin declaring the tiny backend with a prefix-cache rollout engine and a direct sync to it."""

    def __init__(self, name: str, fault: str, engine: str, *, actor_from: str | None = None) -> None:
        self.name = name
        self.fault = fault
        self.engine = engine
        self.actor_from = actor_from
        """None: the backend's own tiny actor; else a rollout-only backend whose direct sync comes from
        the installed backend of that name (the tiny backend's actor), paired with ``--verl-against``."""

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        """The tiny backend with the rollout engine ``engine``."""
        from verl_tiny_backend.plugin import ACTOR_CAPABILITIES, CRITIC_CAPABILITIES

        from verl_broken_backends.prefix_cache_engines import PREFIX_CACHE_ROLLOUT

        training = "verl_tiny_backend.training:build_training_engine"
        rollout = f"{_ENGINES}:{self.engine}"
        own = self.actor_from is None
        return BackendSpec(
            name=self.name,
            roles={"actor": training, "reference": training, "critic": training, "rollout": rollout} if own
            else {"rollout": rollout},
            capabilities={"actor": ACTOR_CAPABILITIES, "reference": ACTOR_CAPABILITIES,
                          "critic": CRITIC_CAPABILITIES, "rollout": PREFIX_CACHE_ROLLOUT} if own
            else {"rollout": PREFIX_CACHE_ROLLOUT},
            protocol_version=PROTOCOL_VERSION,
            description=f"BROKEN on purpose: {self.fault}" if self.fault else "a prefix cache dropped at every commit",
        )

    @hookimpl
    def verl_weight_sync(self, source: str, target: str) -> WeightSync | None:
        """The direct actor -> rollout path of this backend; None for other pairs."""
        if target == self.name and source == (self.actor_from or self.name):
            from verl_broken_backends.prefix_cache_engines import PrefixCacheDirectSync

            return PrefixCacheDirectSync()
        return None


prefix_cache_ok = PrefixCacheBackend("prefix-cache-ok", "", "PrefixCacheRollout")
prefix_cache_dropped_before_turn = PrefixCacheBackend(
    "broken-prefix-cache-early-drop", "the prefix cache is dropped when a weight write is called, before it waits for "
    "the generate call in flight, not at the commit", "CacheDroppedBeforeTurn")
prefix_cache_direct_sync = PrefixCacheBackend(
    "broken-prefix-cache-direct-sync", "update_weights drops the prefix cache, the direct weight sync does not",
    "DirectSyncKeepsCache")
prefix_cache_direct_sync_rollout_only = PrefixCacheBackend(
    "broken-prefix-cache-direct-sync-rollout", "a rollout-only backend whose direct sync from the tiny actor keeps "
    "the prefix cache (update_weights drops it)", "DirectSyncKeepsCache", actor_from="tiny")
prefix_cache_restored_after_wake = PrefixCacheBackend(
    "broken-prefix-cache-wake", "sleep_until_sync keeps the prefix cache on the host and the first generate after "
    "wake pages it back in, after the sync", "CacheRestoredAfterWake")
