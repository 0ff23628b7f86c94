"""Fixtures of the hf backend tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads() -> None:
    # One thread: tiny models gain nothing from two, and OpenMP threads spin badly on a shared machine.
    torch.set_num_threads(1)
