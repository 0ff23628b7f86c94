"""The pluggy hook specifications of the verl SDK (project name ``verl``).

A plugin is a module listed under the ``verl.plugins`` entry-point group; the entry name is the
backend name users type. Plugin modules must be import-light: they describe engines by import
strings and import the engine library only inside the factories.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from verl_core.kernel.algorithm import AlgorithmComponent, Preset
    from verl_core.kernel.registry import BackendSpec
    from verl_core.kernel.weights import WeightSync

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "verl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a plugin's hook implementation: ``@hookimpl def verl_backend(): ...``."""


@hookspec
def verl_backend() -> BackendSpec | None:
    """Describe the backend this plugin provides.

    Called once per plugin when the registry first loads plugins. Returns a BackendSpec whose
    ``name`` equals the plugin's entry-point name, or None for a plugin that only adds algorithms.
    Must not import the engine library.
    """


@hookspec
def verl_algorithm_components() -> list[AlgorithmComponent]:  # type: ignore[empty-body]
    """Register advantage estimators, policy losses, KL estimators or aggregation modes.

    Called once when the registry loads plugins (verl-core registers its built-in algorithms
    through this same hook). Returns the components this plugin adds; a name already taken by
    another plugin for the same kind is an error naming both.
    """


@hookspec
def verl_algorithm_presets() -> list[Preset]:  # type: ignore[empty-body]
    """Register named algorithms: each :class:`~verl_core.kernel.algorithm.Preset` is a value of a
    run's ``algorithm.name``.

    Called once when the registry loads plugins (verl-core registers its own presets through this
    same hook). A preset may name the plugin's own advantage estimator (``Preset.estimator``); a
    preset name already taken, by verl-core or another plugin, is an error naming both.
    """


@hookspec(firstresult=True)
def verl_weight_sync(source: str, target: str) -> WeightSync | None:
    """Return a direct WeightSync from training backend ``source`` to rollout backend ``target``.

    Called when the trainer pairs two backends. Return None when this plugin has no direct path
    for the pair; the canonical stream (:class:`~verl_core.kernel.weights.StreamWeightSync`) is used when
    no plugin answers.
    """
