"""docs/conformance.md names every option of `verl conformance` and of the pytest plugin, and every area."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from verl_conformance import cli, pytest_plugin
from verl_conformance.checks import CHECKS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"


def test_every_cli_option_is_documented() -> None:
    """Each long option of ``verl conformance`` appears on the page."""
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {s for a in sub.choices["conformance"]._actions for s in a.option_strings
               if s.startswith("--") and s != "--help"}
    text = PAGE.read_text(encoding="utf-8")
    missing = sorted(o for o in options if f"`{o}" not in text)
    assert options and not missing, f"verl conformance options missing from docs/conformance.md: {missing}"


def test_every_pytest_option_is_documented() -> None:
    """Each ``--verl-*`` option the pytest plugin adds appears on the page."""
    source = Path(pytest_plugin.__file__).read_text(encoding="utf-8")
    options = set(re.findall(r'addoption\(\s*"(--verl-[\w-]+)"', source))
    text = PAGE.read_text(encoding="utf-8")
    missing = sorted(o for o in options if o not in text)
    assert options and not missing, f"pytest options missing from docs/conformance.md: {missing}"


def test_every_area_has_a_row() -> None:
    """The area table lists every area a registered check belongs to."""
    areas = {c.area for c in CHECKS.values()}
    text = PAGE.read_text(encoding="utf-8")
    missing = sorted(a for a in areas if f"| `{a}` |" not in text)
    assert areas and not missing, f"areas missing from docs/conformance.md: {missing}"
