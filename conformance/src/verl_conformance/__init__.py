"""verl-conformance: the suite and test kit that prove a backend computes what the others compute.

* ``pytest --pyargs verl_conformance --verl-backend NAME`` runs the suite on an installed backend;
* ``verl conformance NAME [--against OTHER]`` prints a table per area and writes a JSON report;
* :func:`check_backend` / :func:`check_backends_match` run it from Python and raise
  :class:`ConformanceError`; :func:`check_buffer` runs the replay-buffer checks on a buffer factory;
* :mod:`verl_conformance.suite` holds test classes to subclass with your own engine fixtures.

Heavy modules load on first use, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["ConformanceError", "__version__", "check_backend", "check_backends_match", "check_buffer"]

if TYPE_CHECKING:
    from verl_conformance.api import check_backend, check_backends_match, check_buffer
    from verl_conformance.errors import ConformanceError


def __getattr__(name: str) -> Any:
    if name in ("check_backend", "check_backends_match", "check_buffer"):
        from verl_conformance import api

        return getattr(api, name)
    if name == "ConformanceError":
        from verl_conformance.errors import ConformanceError

        return ConformanceError
    raise AttributeError(f"module 'verl_conformance' has no attribute {name!r}")
