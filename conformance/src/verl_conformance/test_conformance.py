"""The suite as collected by ``pytest --pyargs verl_conformance --verl-backend NAME``."""

from __future__ import annotations

from verl_conformance.suite import (
    BufferSuite,
    DifferentialSuite,
    InvarianceSuite,
    NumericsSuite,
    RewardSuite,
    RobustnessSuite,
    SchemaSuite,
    StatefulSuite,
    WeightSyncSuite,
)


class TestSchema(SchemaSuite):
    """Every output is a valid TensorBatch in the canonical layout."""


class TestNumerics(NumericsSuite):
    """Log-probs, entropy, values, losses and gradients against the float64 reference."""


class TestInvariance(InvarianceSuite):
    """Results do not depend on micro-batching, padding or order; sampling is seeded."""


class TestDifferential(DifferentialSuite):
    """Trajectories and greedy decoding vs the reference and the --verl-against backend."""


class TestWeightSync(WeightSyncSuite):
    """Export streams are well formed; rollout engines apply good streams and reject bad ones."""


class TestRobustness(RobustnessSuite):
    """Edge lengths work; bad input is rejected with a clear error."""


class TestStateful(StatefulSuite):
    """Checkpoints, offload/onload and sleep/wake keep weights, optimizer state and schedule."""


class TestBuffer(BufferSuite):
    """A replay buffer keeps capacity and order, spills bit-exactly and samples reproducibly."""
class TestReward(RewardSuite):
    """Scores belong to their samples whatever the batch; non-finite scores are refused."""
