"""Test classes of the suite, one per area, for pytest (subclass them to test your own engines).

A third party whose backend is not installed as a plugin subclasses the classes and overrides the
``make_training_engine`` / ``make_rollout_engine`` / ``make_reward_engine`` fixtures (callables taking
an EngineSpec; a fixture left alone provides no engine, and that role's checks are skipped)::

    from verl_conformance.suite import ConformanceSuite

    class TestMyEngines(ConformanceSuite):
        @pytest.fixture
        def make_training_engine(self):
            return MyTrainingEngine          # called with an EngineSpec

        @pytest.fixture
        def make_rollout_engine(self):
            return MyRolloutEngine           # or None when there is no rollout role

        @pytest.fixture
        def make_reward_engine(self):
            return MyRewardEngine            # only with a reward model

        @pytest.fixture
        def provided_roles(self):
            return {"actor", "reference", "rollout", "reward"}   # no critic: its checks are skipped

``provided_roles`` is optional (default: every role of each factory given, so
``make_training_engine`` must then build a critic on a value-head folder too).

Each test calls one registered check (:mod:`verl_conformance.checks`) on the ``verl_harness``
fixture that the pytest plugin builds from those factories.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from verl_conformance.checks import AREAS, CHECKS, Check
from verl_conformance.errors import CheckSkipped
from verl_conformance.harness import Harness
from verl_conformance.timelimit import CheckTimedOut, check_time_limit

__all__ = [
    "BufferSuite",
    "ConformanceSuite",
    "DifferentialSuite",
    "InvarianceSuite",
    "NumericsSuite",
    "RewardSuite",
    "RobustnessSuite",
    "SchemaSuite",
    "StatefulSuite",
    "WeightSyncSuite",
    "run_check",
]


def run_check(check: Check, harness: Harness) -> None:
    """Run one check under pytest: skips become pytest skips, failures assertion errors, a check past
    its time limit (``--verl-check-timeout``) a failure."""
    try:
        with check_time_limit(harness.time_limit_s, check.id):
            check.func(harness)
    except CheckTimedOut as e:
        pytest.fail(str(e), pytrace=False)
    except CheckSkipped as e:
        pytest.skip(str(e))
    finally:
        harness.close_fresh()


def _test(check: Check) -> Callable[..., None]:
    def test(self: Any, verl_harness: Harness) -> None:
        run_check(check, verl_harness)

    test.__name__ = f"test_{check.name}"
    test.__qualname__ = test.__name__
    test.__doc__ = check.doc
    marked: Callable[..., None] = pytest.mark.verl_check(check.id)(test)
    return marked


def _fill(cls: type, area: str) -> None:
    for c in CHECKS.values():
        if c.area == area:
            setattr(cls, f"test_{c.name}", _test(c))


class SchemaSuite:
    """The schema checks: every output is a valid TensorBatch in the canonical layout."""


class NumericsSuite:
    """The numerics checks: outputs, losses and gradients against the float64 reference."""


class InvarianceSuite:
    """The invariance checks: micro-batching, padding, batch order, seeded sampling."""


class DifferentialSuite:
    """The differential checks: trajectories and greedy decoding vs the reference and a second backend."""


class WeightSyncSuite:
    """The weight-sync checks: export streams, applying good streams, rejecting bad ones."""


class RobustnessSuite:
    """The robustness checks: edge lengths and bad input."""


class StatefulSuite:
    """The stateful checks: checkpoint round trips, offload/onload and sleep/wake keep every state."""


class BufferSuite:
    """The replay-buffer checks (with a buffer selected): capacity, order, spill, seeded sampling."""


class RewardSuite:
    """The reward checks: scores belong to their samples whatever the batch; bad scores are refused."""


for _cls, _area in ((SchemaSuite, "schema"), (NumericsSuite, "numerics"), (InvarianceSuite, "invariance"),
                    (DifferentialSuite, "differential"), (WeightSyncSuite, "weight_sync"),
                    (RobustnessSuite, "robustness"), (RewardSuite, "reward"), (StatefulSuite, "stateful"),
                    (BufferSuite, "buffer")):
    _fill(_cls, _area)
assert {a for a in AREAS} == {"schema", "numerics", "invariance", "differential", "weight_sync", "robustness",
                              "reward", "stateful", "buffer"}


class ConformanceSuite(SchemaSuite, NumericsSuite, InvarianceSuite, DifferentialSuite,
                       WeightSyncSuite, RobustnessSuite, RewardSuite, StatefulSuite, BufferSuite):
    """Every check of every area."""
