"""The errors of the conformance suite."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_core import VerlError

if TYPE_CHECKING:
    from verl_conformance.runner import ConformanceReport

__all__ = ["CheckFailed", "CheckSkipped", "ConformanceError"]


class ConformanceError(VerlError, AssertionError):
    """A backend failed conformance checks; the message lists each failure and how to reproduce it.

    Attributes:
        report: The full report (every check's status), when one was produced.
    """

    def __init__(self, message: str, report: ConformanceReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class CheckFailed(AssertionError):  # noqa: N818  (reads as an outcome, like pytest.Failed)
    """One check found a behaviour that breaks the contract (the message says which and where)."""


class CheckSkipped(Exception):  # noqa: N818
    """One check does not apply to the backend (the message says why, e.g. a declared capability)."""
