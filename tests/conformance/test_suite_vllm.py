"""The whole conformance suite on the in-tree `vllm` backend (differential checks against `hf`).

The engines run eager (``enforce_eager=True``), as the backend's GPU default does: on CPU the
default compiles the model at every engine start (2 s eager against 5 s with a warm compile cache
and 12-30 s cold, for each of the suite's ~36 engines). tests/vllm keeps the compiled CPU default
under test.
"""

from __future__ import annotations

import pytest
from suite_runner import run_suite


@pytest.mark.slow
def test_suite_vllm() -> None:
    run_suite("vllm", against="hf", options={"enforce_eager": True})
