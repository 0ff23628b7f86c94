"""Entry point of the ``hf`` backend (import-light: no engine library is imported here)."""

from __future__ import annotations

from verl_core import BackendSpec, hookimpl


@hookimpl
def verl_backend() -> BackendSpec | None:
    """The backend is not implemented yet."""
    return None
