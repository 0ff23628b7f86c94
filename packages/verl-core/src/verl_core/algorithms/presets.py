"""The named algorithm presets, declared once as data.

:data:`PRESET_TABLE` is the single list of the names ``algorithm.name`` accepts. Each row names the
:class:`~verl_core.algorithms.bundle.Algorithm` constructor that builds it, the constructor
arguments the preset fixes, the defaults it changes, the advantage estimator it swaps in and
whether the trainer turns on dynamic sampling for it. The constructors' keyword arguments (minus
the fixed ones and the ones of :data:`SECTION_OPTIONS`) are the preset's options, with the changed
defaults. :data:`PRESETS` (the names
:meth:`Algorithm.from_name` builds) is derived from it: the rows that are a constructor as it is,
not a recipe on top of one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from verl_core.kernel.errors import ConfigError, VerlError

__all__ = ["PRESETS", "PRESET_TABLE", "SECTION_OPTIONS", "Preset"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})

SECTION_OPTIONS: Final[Mapping[str, str]] = MappingProxyType({"offpolicy": "algorithm.offpolicy"})
"""Constructor keywords a run's config sets in a section of their own (by the section's key), not
in ``algorithm.options``: every preset takes them, so they are not listed as its options."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """One named algorithm.

    Attributes:
        name: The value of ``algorithm.name``.
        constructor: The :class:`Algorithm` classmethod that builds it.
        fixed: Constructor arguments the preset sets (not options of the preset).
        defaults: Option defaults that differ from the constructor's.
        estimator: An advantage estimator that replaces the constructor's (it must be registered).
        dynamic_sampling: The trainer drops groups whose scores are all equal (DAPO).
        summary: One line for listings.
    """

    name: str
    constructor: str
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    estimator: str | None = None
    dynamic_sampling: bool = False
    summary: str = ""

    @property
    def is_recipe(self) -> bool:
        """True when the preset is another constructor's with changed defaults, estimator or sampling."""
        return bool(self.defaults) or self.estimator is not None or self.dynamic_sampling

    def options(self) -> dict[str, Any]:
        """The preset's options in order, each with its default (``inspect.Parameter.empty`` when required)."""
        from verl_core.algorithms.bundle import Algorithm

        params = inspect.signature(getattr(Algorithm, self.constructor)).parameters
        return {k: self.defaults.get(k, p.default) for k, p in params.items()
                if k not in self.fixed and k not in SECTION_OPTIONS and p.kind is inspect.Parameter.KEYWORD_ONLY}

    def build(self, options: Mapping[str, Any], **sections: Any) -> Any:
        """The :class:`Algorithm` of this preset with ``options``.

        Args:
            options: The preset's options (``algorithm.options``).
            **sections: Keywords of :data:`SECTION_OPTIONS` (``offpolicy=``), from their own sections.

        Raises:
            ConfigError: an option the preset does not take (naming ``algorithm.options.<key>``
                and listing the valid ones; a keyword of :data:`SECTION_OPTIONS` names its
                section), or a value the constructor refuses.
        """
        from verl_core.algorithms.bundle import Algorithm

        for key in sorted(set(options) & set(SECTION_OPTIONS)):
            raise ConfigError(
                f"config key 'algorithm.options.{key}' is not an option of algorithm {self.name!r}: set it in "
                f"its own section, [{SECTION_OPTIONS[key]}]"
            )
        extra = sorted(set(sections) - set(SECTION_OPTIONS))
        if extra:
            raise TypeError(f"Preset.build: unknown section keyword(s) {extra}; valid: {list(SECTION_OPTIONS)}")
        valid = list(self.options())
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(
                f"config key 'algorithm.options.{unknown[0]}' is not an option of algorithm {self.name!r}; "
                f"valid options: {', '.join(valid)}"
            )
        options = {**options, **{k: v for k, v in sections.items() if v is not None}}
        try:
            algo = getattr(Algorithm, self.constructor)(**self.fixed, **{**self.defaults, **options})
            if self.estimator is not None:
                algo = algo.replace(name=self.name, estimator=self.estimator)
            return algo
        except (VerlError, TypeError) as e:
            raise ConfigError(f"config section 'algorithm.options' of {self.name!r}: {e}") from e


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
"""Every named algorithm, by ``algorithm.name``."""

PRESETS: Final = tuple(name for name, p in PRESET_TABLE.items() if not p.is_recipe)
"""Names accepted by :meth:`Algorithm.from_name`: the presets that are a constructor as it is."""
