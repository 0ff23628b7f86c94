"""The check registry: areas, the Check record and the decorator that registers one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from verl_conformance.harness import Harness
from verl_core.kernel.capabilities import (
    RewardCapabilities,
    RolloutCapabilities,
    TrainingCapabilities,
)

__all__ = ["AREAS", "CAPABILITY_CLASSES", "CHECKS", "Area", "Check", "capability_fields", "check"]

Area = Literal["schema", "numerics", "invariance", "differential", "weight_sync", "robustness", "reward",
               "stateful", "buffer"]
AREAS: Final[tuple[Area, ...]] = ("schema", "numerics", "invariance", "differential", "weight_sync", "robustness",
                                  "reward", "stateful", "buffer")

CAPABILITY_CLASSES: Final[dict[str, type]] = {
    "training": TrainingCapabilities,
    "rollout": RolloutCapabilities,
    "reward": RewardCapabilities,
}
"""The capabilities dataclass of each engine kind, by the prefix a gate uses (``training.offload``)."""


def capability_fields() -> list[str]:
    """Every declared capability as ``kind.field`` (``training.offload``, ``rollout.seeding``, ...)."""
    return [f"{kind}.{f.name}" for kind, cls in CAPABILITY_CLASSES.items() for f in dataclasses.fields(cls)]


@dataclass(frozen=True)
class Check:
    """One conformance check.

    Attributes:
        area: The kind of check.
        name: Name within the area (the pytest test is ``test_<name>`` in ``Test<Area>``).
        func: Runs the check; raises CheckFailed or CheckSkipped.
        doc: What the check proves (first docstring line of ``func``).
        gates: The declared capabilities (``kind.field``) that decide whether the check, or a part
            of it, runs: a backend declaring one of them is held to it by this check.
    """

    area: Area
    name: str
    func: Callable[[Harness], None]
    doc: str
    gates: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """``area::name``, the id used by known-gap files, ``checks=`` and reports."""
        return f"{self.area}::{self.name}"


CHECKS: dict[str, Check] = {}
"""Every registered check by id."""


def check(area: Area, *, gates: tuple[str, ...] = ()) -> Callable[[Callable[[Harness], None]], Callable[[Harness], None]]:
    """Register the decorated function as a check of ``area`` named after the function.

    Args:
        area: The check's area.
        gates: Capabilities (``kind.field``, see :func:`capability_fields`) the check reads to skip
            itself or a part of itself; every declared capability gates at least one check.

    Raises:
        ValueError: a check id registered twice, or a gate that names no capability field.
    """
    known = set(capability_fields())
    unknown = [g for g in gates if g not in known]
    if unknown:
        raise ValueError(f"check gates {unknown} name no capability; capabilities: {', '.join(sorted(known))}")

    def deco(func: Callable[[Harness], None]) -> Callable[[Harness], None]:
        name = func.__name__.removeprefix("check_")
        doc = (func.__doc__ or "").strip().splitlines()[0] if func.__doc__ else name
        c = Check(area, name, func, doc, tuple(gates))
        if c.id in CHECKS:
            raise ValueError(f"check {c.id} is registered twice")
        CHECKS[c.id] = c
        return func

    return deco
