"""The check registry: areas, the Check record and the decorator that registers one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from verl_conformance.harness import Harness

__all__ = ["AREAS", "CHECKS", "Area", "Check", "check"]

Area = Literal["schema", "numerics", "invariance", "differential", "weight_sync", "robustness", "reward"]
AREAS: Final[tuple[Area, ...]] = (
    "schema", "numerics", "invariance", "differential", "weight_sync", "robustness", "reward",
)


@dataclass(frozen=True)
class Check:
    """One conformance check.

    Attributes:
        area: The kind of check.
        name: Name within the area (the pytest test is ``test_<name>`` in ``Test<Area>``).
        func: Runs the check; raises CheckFailed or CheckSkipped.
        doc: What the check proves (first docstring line of ``func``).
    """

    area: Area
    name: str
    func: Callable[[Harness], None]
    doc: str

    @property
    def id(self) -> str:
        """``area::name``, the id used by known-gap files, ``checks=`` and reports."""
        return f"{self.area}::{self.name}"


CHECKS: dict[str, Check] = {}
"""Every registered check by id."""


def check(area: Area) -> Callable[[Callable[[Harness], None]], Callable[[Harness], None]]:
    """Register the decorated function as a check of ``area`` named after the function."""

    def deco(func: Callable[[Harness], None]) -> Callable[[Harness], None]:
        name = func.__name__.removeprefix("check_")
        doc = (func.__doc__ or "").strip().splitlines()[0] if func.__doc__ else name
        c = Check(area, name, func, doc)
        if c.id in CHECKS:
            raise ValueError(f"check {c.id} is registered twice")
        CHECKS[c.id] = c
        return func

    return deco
