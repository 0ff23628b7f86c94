"""Meta-tests of the multi-turn checks: broken backends (tests/plugins/verl-broken-backends,
``verl_broken_backends.multiturn``) that get observation tokens, long prompts, stop ids or a prefix
cache wrong fail the check aimed at their fault, and pass the single-turn checks listed beside it
(the gap the multi-turn check closes). The unbroken backends passing them is proven by the
test_suite_<backend>.py runs.
"""

from __future__ import annotations

import pytest
from test_meta_faults import test_broken_backend_fails_targeted_checks as fails_targeted_checks

from verl_conformance import check_backend

pytestmark = pytest.mark.usefixtures("broken_backends")

FAULTS = [
    # (backend, checks to run, checks that must fail, fragments the message must contain)
    ("broken-loss-mask", ["numerics::loss_and_grads_match_reference", "numerics::multi_turn_loss_ignores_observations"],
     ["numerics::multi_turn_loss_ignores_observations"],
     ["whose observation tokens hold other advantages", "hand the loss function each micro-batch with its loss_mask"]),
    ("broken-observation-outputs", ["schema::forward_layout", "numerics::multi_turn_outputs_match_reference"],
     ["numerics::multi_turn_outputs_match_reference"],
     ["log_probs is not 0 at 13 of 13 observation tokens", "mask them with TensorBatch.loss_mask"]),
    ("broken-turn-positions", ["numerics::log_probs_match_reference", "numerics::multi_turn_outputs_match_reference"],
     ["numerics::multi_turn_outputs_match_reference"],
     ["float64 reference of the exact id sequence", "they continue across turns"]),
    ("broken-prompt-special-tokens", ["numerics::rollout_log_probs_match_reference",
                                      "invariance::rollout_continues_multi_turn_prefix"],
     ["invariance::rollout_continues_multi_turn_prefix"],
     ["observation tokens opening with EOS and BOS", "no re-tokenizing"]),
    ("broken-prompt-window", ["numerics::rollout_log_probs_match_reference",
                              "invariance::rollout_continues_multi_turn_prefix"],
     ["invariance::rollout_continues_multi_turn_prefix"], ["[18, 40, 10] ids", "no dropped or truncated tokens"]),
    ("broken-stop-ids", ["schema::multi_turn_stop_and_truncation"], ["schema::multi_turn_stop_and_truncation"],
     ["episode 0 (prompt 'xA'", "the first turn should end at stop id 44 (SamplingParams.stop_token_ids)"]),
    ("broken-stale-prefix-cache", ["invariance::rollout_continues_multi_turn_prefix",
                                   "invariance::prefix_continuation_matches_rerun"],
     ["invariance::prefix_continuation_matches_rerun"],
     ["then observation B (as long as A)", "a stale entry serves another prompt's samples"]),
    # the engine without the earlier calls shares this fault (one call on every prompt fills the cache too)
    ("broken-prefix-keyed-cache", ["invariance::rollout_continues_multi_turn_prefix",
                                   "invariance::prefix_continuation_matches_rerun"],
     ["invariance::prefix_continuation_matches_rerun"],
     ["then observation B (as long as A)): rollout_log_probs vs the float64 reference of those exact ids",
      "within a call as across calls"]),
    ("broken-surviving-prefix-cache", ["invariance::prefix_continuation_matches_rerun",
                                       "invariance::prefix_continuation_after_weight_update"],
     ["invariance::prefix_continuation_after_weight_update"],
     ["the turn sampled before update_weights(stream of llama-alt, version 7)",
      "a cached prefix (KV cache) kept across update_weights serves the old weights' keys and values: drop it "
      "when weights are written"]),
    # the tiny backend with a prefix cache (tests/plugins/verl-broken-backends, prefix_cache): the drop on
    # one weight path too few; each passes the checks listed before the one that fails
    ("broken-prefix-cache-early-drop", ["invariance::prefix_continuation_after_weight_update",
                                        "weight_sync::update_during_generate",
                                        "invariance::prefix_continuation_across_concurrent_update"],
     ["invariance::prefix_continuation_across_concurrent_update"],
     ["in flight when update_weights(stream of", "not when update_weights is called"]),
    ("broken-prefix-cache-direct-sync", ["invariance::prefix_continuation_after_weight_update",
                                         "weight_sync::trainer_to_rollout_sync",
                                         "weight_sync::prefix_continuation_after_trainer_sync"],
     ["weight_sync::prefix_continuation_after_trainer_sync"],
     ["PrefixCacheDirectSync.sync(actor, rollout, version=1)", "a direct sync that bypasses update_weights too"]),
    ("broken-prefix-cache-wake", ["stateful::sleep_until_sync_then_sync",
                                  "invariance::prefix_continuation_after_weight_update"],
     ["invariance::prefix_continuation_after_weight_update"],
     ["before sleep_until_sync(), wake() and update_weights(stream of llama, version 8)",
      "a cache kept through sleep_until_sync()"]),
]

PREFIX_CACHE_CHECKS = ["invariance::prefix_continuation_matches_rerun",
                       "invariance::prefix_continuation_after_weight_update",
                       "invariance::prefix_continuation_across_concurrent_update",
                       "weight_sync::prefix_continuation_after_trainer_sync", "weight_sync::update_during_generate",
                       "weight_sync::bad_streams_rejected", "weight_sync::trainer_to_rollout_sync",
                       "stateful::sleep_until_sync_then_sync", "stateful::update_while_asleep_refused"]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "checks", "must_fail", "fragments"), FAULTS, ids=[f[0] for f in FAULTS])
def test_multi_turn_fault_fails_its_check(backend: str, checks: list[str], must_fail: list[str],
                                          fragments: list[str]) -> None:
    fails_targeted_checks(backend, checks, must_fail, fragments)


@pytest.mark.slow
def test_prefix_cache_dropped_on_weight_update_passes() -> None:
    """The same cache, dropped when weights are written, passes both prefix-continuation checks."""
    from collections.abc import Iterable

    from verl_broken_backends.multiturn_engines import SurvivingPrefixCache

    from verl_core import WeightMessage

    class DroppedPrefixCache(SurvivingPrefixCache):
        def update_weights(self, stream: Iterable[WeightMessage]) -> None:
            self._cached.clear()
            super().update_weights(stream)

    checks = ["invariance::prefix_continuation_matches_rerun", "invariance::prefix_continuation_after_weight_update"]
    report = check_backend("mine", make_rollout_engine=DroppedPrefixCache, checks=checks)
    assert [(r.id, r.status) for r in report.results] == [(c, "passed") for c in checks]


@pytest.mark.slow
def test_prefix_cache_dropped_at_every_commit_passes() -> None:
    """The tiny backend's prefix cache dropped at the commit of every weight path (stream, direct sync,
    sleep_until_sync) passes every prefix-continuation and weight-write check, the concurrent one included."""
    report = check_backend("prefix-cache-ok", checks=PREFIX_CACHE_CHECKS)
    assert sorted((r.id, r.status) for r in report.results) == sorted((c, "passed") for c in PREFIX_CACHE_CHECKS), \
        [(r.id, r.status, r.message) for r in report.results if r.status != "passed"]


@pytest.mark.slow
def test_a_rollout_only_backend_is_held_to_the_direct_sync_of_its_pair() -> None:
    """A rollout-only backend (paired with --verl-against's actor) whose cache survives the pair's direct
    sync fails prefix_continuation_after_trainer_sync, which once skipped without an actor of its own;
    the stream path drops the cache and passes."""
    from verl_conformance import ConformanceError

    checks = ["weight_sync::prefix_continuation_after_trainer_sync",
              "invariance::prefix_continuation_after_weight_update"]
    with pytest.raises(ConformanceError) as info:
        check_backend("broken-prefix-cache-direct-sync-rollout", against="tiny", checks=checks)
    report = info.value.report
    assert report is not None
    assert {r.id: r.status for r in report.results} == {checks[0]: "failed", checks[1]: "passed"}
    assert "PrefixCacheDirectSync.sync(actor, rollout, version=1)" in str(info.value)
