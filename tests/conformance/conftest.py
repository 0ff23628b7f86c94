"""The ``broken_backends`` fixture: the meta-tests' faulty backends, registered for one test only.

They are not installed (no entry points), so the dev environment's ``verl backends`` lists none of
them. The fixture names them in ``VERL_PLUGINS``, which the registry reads in this process and in
every process a test starts, and puts their source on the path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_core.kernel.registry import PLUGINS_ENV, reset_registry

BROKEN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "verl-broken-backends" / "src"


@pytest.fixture
def broken_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Register the broken backends for this test (and the processes it starts), then forget them."""
    monkeypatch.syspath_prepend(str(BROKEN_SRC))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(BROKEN_SRC), os.environ.get("PYTHONPATH")) if p))
    from verl_broken_backends import verl_plugins

    monkeypatch.setenv(PLUGINS_ENV, verl_plugins())
    reset_registry()
    yield
    reset_registry()
