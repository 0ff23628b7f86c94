"""pytest plugin of the conformance suite (import-light)."""

from __future__ import annotations
