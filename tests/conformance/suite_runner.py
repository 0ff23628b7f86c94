"""Shared helper of the test_suite_<backend>.py files: run the whole suite on one installed backend."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from verl_conformance.api import run_conformance

GAPS = Path(__file__).parent / "known_gaps"


def implemented(name: str) -> str | None:
    """Why the backend cannot run yet (not installed, or its plugin returns no BackendSpec), or None."""
    from verl_core import available_backends

    backends = available_backends()
    if name not in backends:
        return (f"backend {name!r} is not installed or its verl_backend() returns None (not implemented "
                f"yet); installed: {', '.join(backends)}")
    return None


def run_suite(name: str, against: str | None = None, options: dict[str, object] | None = None) -> None:
    """Run every check on ``name`` (with its known gaps and ``options`` for its engines) and fail
    listing each failing check."""
    why = implemented(name)
    if why is not None:
        pytest.skip(why)
    if against is not None and implemented(against) is not None:
        against = None
    gaps = GAPS / f"{name}.txt"
    t0 = time.perf_counter()
    report = run_conformance(name, against=against, known_gaps=gaps if gaps.exists() else None, options=options)
    print(report.table())
    print(f"conformance suite on {name}" + (f" against {against}" if against else "")
          + f": {time.perf_counter() - t0:.1f}s")
    assert not report.failures, "\n".join(f"{r.id}: {r.message}" for r in report.failures)
    xpassed = [r.id for r in report.results if r.status == "xpassed"]
    assert not xpassed, f"declared known gaps now pass, remove them from {gaps}: {xpassed}"
