"""A minimal third-party verl backend in plain torch (the worked example of the backend guide)."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
