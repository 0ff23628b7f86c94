"""The whole conformance suite on the pure-torch example backend, through pytest as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_suite_example_through_pytest() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.setdefault("OMP_NUM_THREADS", "2")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                        "--pyargs", "verl_conformance", "--verl-backend", "example"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout[-4000:])
    print(f"conformance suite on example: {time.perf_counter() - t0:.1f}s")
    assert r.returncode == 0, r.stdout[-6000:]
    assert " failed" not in r.stdout
    # the final line counts outcomes: no errors (skip reasons may well mention a ConfigError)
    final = r.stdout.strip().splitlines()[-1]
    assert " passed" in final and not re.search(r"\d+ errors?\b", final), final
