"""Registers the built-in algorithm components with the plugin manager (not via an entry point)."""

from __future__ import annotations

from verl_core.algorithm import AlgorithmComponent
from verl_core.hookspecs import hookimpl


@hookimpl
def verl_algorithm_components() -> list[AlgorithmComponent]:
    """The algorithms verl-core ships."""
    return []
