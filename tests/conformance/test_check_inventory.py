"""The check inventory cannot drift: every declared capability gates a check, every gate names one."""

from __future__ import annotations

import pytest

from verl_conformance.checks import CHECKS
from verl_conformance.checks._registry import capability_fields, check
from verl_conformance.inventory import NOT_GATED


def _gated() -> set[str]:
    return {g for c in CHECKS.values() for g in c.gates}


def test_every_capability_gates_a_check() -> None:
    """Each field of the capabilities dataclasses is read by at least one check (a declaration is held to)."""
    missing = [f for f in capability_fields() if f not in _gated() and f not in NOT_GATED]
    assert not missing, (
        f"declared capabilities that gate no conformance check: {missing}; a backend could declare them and be "
        "wrong. Add a check that reads each (declare it with @check(area, gates=(...)))"
    )


def test_exemptions_are_current() -> None:
    """An exempted capability that a check now gates, or that no longer exists, is removed from NOT_GATED."""
    fields = set(capability_fields())
    stale = sorted(f for f in NOT_GATED if f in _gated() or f not in fields)
    assert not stale, f"remove {stale} from NOT_GATED in verl_conformance/inventory.py"


def test_a_gate_must_name_a_capability() -> None:
    with pytest.raises(ValueError, match=r"check gates \['training\.ofload'\] name no capability"):
        check("stateful", gates=("training.ofload",))
