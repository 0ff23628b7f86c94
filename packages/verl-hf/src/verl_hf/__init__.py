"""verl-hf: the hf backend of the verl SDK."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
