"""verl-conformance: the suite and test kit that prove a backend computes what the others compute."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
