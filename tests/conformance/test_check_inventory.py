"""The check inventory cannot drift: every declared capability gates a check (no exemptions), every gate names one."""

from __future__ import annotations

import pytest

from verl_conformance.checks import CHECKS
from verl_conformance.checks._registry import capability_fields, check


def _gated() -> set[str]:
    return {g for c in CHECKS.values() for g in c.gates}


def test_every_capability_gates_a_check() -> None:
    """Each field of the capabilities dataclasses is read by at least one check (a declaration is held to)."""
    missing = [f for f in capability_fields() if f not in _gated()]
    assert not missing, (
        f"declared capabilities that gate no conformance check: {missing}; a backend could declare them and be "
        "wrong. Add a check that reads each (declare it with @check(area, gates=(...)))"
    )


def test_a_gate_must_name_a_capability() -> None:
    with pytest.raises(ValueError, match=r"check gates \['training\.ofload'\] name no capability"):
        check("stateful", gates=("training.ofload",))
