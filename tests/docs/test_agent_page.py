"""The ``[agent]`` keys are documented with their defaults on the multi-turn page and the dataset page."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from verl_core.trainer.config import AgentConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
_ROW = re.compile(r"^\|\s*`agent\.(\w+)`\s*\|\s*`([^`]*)`\s*\|")


def documented(page: str) -> dict[str, object]:
    """``agent.<key>`` -> the default the page's table gives."""
    rows = {}
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(1)] = ast.literal_eval(m.group(2))
    return rows


@pytest.mark.parametrize("page", ["multi-turn-and-tools.md", "train-on-your-dataset.md"])
def test_every_agent_key_is_documented_with_its_default(page: str) -> None:
    actual = {f.name: getattr(AgentConfig(), f.name) for f in dataclasses.fields(AgentConfig)}
    assert documented(page) == actual, f"docs/{page}: the [agent] key table is stale"
