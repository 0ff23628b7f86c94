"""docs/conformance.md holds the check inventory exactly as the check registry generates it."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_conformance.inventory import BEGIN, END, inventory_markdown, update_page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"


def test_inventory_matches_the_registry() -> None:
    """The tables between the markers equal the generated ones (regenerate with the script when not)."""
    text = PAGE.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{PAGE} lost its inventory markers"
    current = text.partition(BEGIN)[2].partition(END)[0].lstrip("\n")
    assert current == inventory_markdown(), (
        "the check inventory in docs/conformance.md is stale: run python scripts/gen_conformance_inventory.py"
    )


def test_update_page_rewrites_only_the_inventory(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\n{BEGIN}\n| old |\n{END}\n\nafter\n", encoding="utf-8")
    assert update_page(page)
    text = page.read_text(encoding="utf-8")
    assert text == f"# Title\n\n{BEGIN}\n{inventory_markdown()}{END}\n\nafter\n"
    assert not update_page(page)
    page.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no inventory markers"):
        update_page(page)
