"""The named algorithm presets, declared once as data.

:data:`PRESET_TABLE` is verl-core's list of the names ``algorithm.name`` accepts (registered through
the ``verl_algorithm_presets`` hook, as a plugin's presets are; the registry's
:meth:`~verl_core.kernel.registry.Registry.presets` holds them all). Each row (a
:class:`~verl_core.kernel.algorithm.Preset`) names the
:class:`~verl_core.algorithms.bundle.Algorithm` constructor that builds it, the constructor
arguments the preset fixes, the defaults it changes, the advantage estimator it swaps in and
whether the trainer turns on dynamic sampling for it. The constructors' keyword arguments (minus
the fixed ones and the ones of :data:`SECTION_OPTIONS`) are the preset's options, with the changed
defaults. :data:`PRESETS` is derived from it: the rows that are a constructor as it is, not a recipe on top
of one. :func:`build_preset` builds any registered preset (``Algorithm.from_name`` and the
trainer's ``build_algorithm`` call it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from verl_core.algorithms import constructors as _ctors
from verl_core.kernel.algorithm import Preset
from verl_core.kernel.errors import ConfigError, PluginError, VerlError

if TYPE_CHECKING:
    from verl_core.algorithms.bundle import Algorithm

__all__ = ["CONSTRUCTORS", "PRESETS", "PRESET_TABLE", "SECTION_OPTIONS", "Preset", "build_preset", "preset_options"]

CONSTRUCTORS: Final = tuple(_ctors.__all__)
"""The :class:`~verl_core.algorithms.bundle.Algorithm` constructors a preset may name (``Preset.constructor``)."""

SECTION_OPTIONS: Final[Mapping[str, str]] = MappingProxyType({"offpolicy": "algorithm.offpolicy"})
"""Constructor keywords a run's config sets in a section of their own (by the section's key), not
in ``algorithm.options``: every preset takes them, so they are not listed as its options."""


def _constructor(preset: Preset) -> Callable[..., Any]:
    """The :class:`Algorithm` constructor ``preset`` names.

    Raises:
        PluginError: the preset names no constructor of :class:`Algorithm` (a plugin's typo).
    """
    from verl_core.algorithms.bundle import Algorithm

    if preset.constructor not in CONSTRUCTORS:
        raise PluginError(
            f"algorithm preset {preset.name!r} names the constructor {preset.constructor!r}, which Algorithm does "
            f"not have; constructors: {', '.join(CONSTRUCTORS)}"
        )
    ctor: Callable[..., Any] = getattr(Algorithm, preset.constructor)
    return ctor


def preset_options(preset: Preset) -> dict[str, Any]:
    """The options of ``preset`` in order, each with its default (``inspect.Parameter.empty`` when required):
    its constructor's keyword arguments minus the fixed ones and those of :data:`SECTION_OPTIONS`,
    with the preset's changed defaults."""
    params = inspect.signature(_constructor(preset)).parameters
    return {k: preset.defaults.get(k, p.default) for k, p in params.items()
            if k not in preset.fixed and k not in SECTION_OPTIONS and p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_preset(preset: Preset, options: Mapping[str, Any], **sections: Any) -> Algorithm:
    """The :class:`Algorithm` of ``preset`` with ``options``.

    Args:
        preset: The preset (a row of :data:`PRESET_TABLE` or a plugin's).
        options: The preset's options (``algorithm.options``).
        **sections: Keywords of :data:`SECTION_OPTIONS` (``offpolicy=``), from their own sections.

    Raises:
        ConfigError: an option the preset does not take (naming ``algorithm.options.<key>``
            and listing the valid ones; a keyword of :data:`SECTION_OPTIONS` names its
            section), or a value the constructor refuses.
        PluginError: the preset names no constructor of :class:`Algorithm`.
    """
    for key in sorted(set(options) & set(SECTION_OPTIONS)):
        raise ConfigError(
            f"config key 'algorithm.options.{key}' is not an option of algorithm {preset.name!r}: set it in "
            f"its own section, [{SECTION_OPTIONS[key]}]"
        )
    extra = sorted(set(sections) - set(SECTION_OPTIONS))
    if extra:
        raise TypeError(f"build_preset: unknown section keyword(s) {extra}; valid: {list(SECTION_OPTIONS)}")
    valid = list(preset_options(preset))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"config key 'algorithm.options.{unknown[0]}' is not an option of algorithm {preset.name!r}; "
            f"valid options: {', '.join(valid)}"
        )
    options = {**options, **{k: v for k, v in sections.items() if v is not None}}
    try:
        algo: Algorithm = _constructor(preset)(**preset.fixed, **{**preset.defaults, **options})
        if preset.estimator is not None:
            algo = algo.replace(name=preset.name, estimator=preset.estimator)
        return algo
    except (VerlError, TypeError) as e:
        raise ConfigError(f"config section 'algorithm.options' of {preset.name!r}: {e}") from e


PRESET_TABLE: Final[Mapping[str, Preset]] = MappingProxyType({p.name: p for p in (
    Preset("ppo", "ppo", summary="GAE with a critic, clipped policy and value losses, KL in the reward"),
    Preset("grpo", "grpo", summary="group-normalised advantages, PPO clip, KL loss to the reference"),
    Preset("dr_grpo", "dr_grpo", summary="GRPO without std normalisation, constant-length aggregation, no KL"),
    Preset("rloo", "rloo", summary="leave-one-out baseline, PPO clip"),
    Preset("reinforce_pp", "reinforce_pp", summary="REINFORCE++, KL in the reward"),
    Preset("reinforce_pp_baseline", "reinforce_pp", fixed=MappingProxyType({"baseline": True}),
           summary="REINFORCE++ with the group-mean baseline"),
    Preset("remax", "remax", summary="the greedy response's score as baseline"),
    Preset("gspo", "gspo", summary="GRPO advantages with the sequence-level ratio"),
    Preset("cispo", "cispo", summary="GRPO advantages, REINFORCE weighted by the clipped ratio"),
    Preset("dapo", "grpo", defaults=MappingProxyType({"clip_high": 0.28, "kl_loss_coef": 0.0}),
           dynamic_sampling=True, summary="GRPO with clip-higher, no KL loss and dynamic sampling"),
    Preset("grpo_token", "grpo", estimator="grpo_token",
           summary="GRPO's loss with per-position group normalisation of dense token scores"),
)})
"""verl-core's named algorithms, by ``algorithm.name`` (a plugin's are added through the hook)."""

PRESETS: Final = tuple(name for name, p in PRESET_TABLE.items() if not p.is_recipe)
"""verl-core's presets that are a constructor as it is (not a recipe on top of one)."""
