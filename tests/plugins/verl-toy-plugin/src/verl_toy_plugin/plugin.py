"""Entry point of the ``toy`` test backend: one reward role and one extra advantage estimator."""

from __future__ import annotations

from dataclasses import dataclass

from verl_core import (
    PROTOCOL_VERSION,
    AlgorithmComponent,
    BackendSpec,
    RewardCapabilities,
    hookimpl,
)


@dataclass(frozen=True)
class ToyOptions:
    """Options of the toy backend."""

    bonus: float = 0.0


@hookimpl
def verl_backend() -> BackendSpec:
    """Declare the toy backend (import strings only)."""
    return BackendSpec(
        name="toy",
        roles={"reward": "verl_toy_plugin.engines:build_reward"},
        capabilities={"reward": RewardCapabilities(scores=True)},
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_toy_plugin.plugin:ToyOptions",
        description="test backend",
    )


def _zero_advantages(batch: object) -> object:
    return batch


@hookimpl
def verl_algorithm_components() -> list[AlgorithmComponent]:
    """A third-party advantage estimator, added through the same hook as a backend."""
    return [AlgorithmComponent("advantage", "toy_zero", _zero_advantages, doc="test estimator")]
