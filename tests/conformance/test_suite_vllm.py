"""The whole conformance suite on the in-tree `vllm` backend (differential checks against `hf`)."""

from __future__ import annotations

import pytest
from suite_runner import run_suite


@pytest.mark.slow
def test_suite_vllm() -> None:
    run_suite("vllm", against="hf")
