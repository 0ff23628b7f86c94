"""The whole conformance suite on the in-tree `hf` backend (differential checks against `example`)."""

from __future__ import annotations

import pytest
from suite_runner import run_suite


@pytest.mark.slow
def test_suite_hf() -> None:
    run_suite("hf", against="example")
