"""Fixtures of the hf backend tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)
