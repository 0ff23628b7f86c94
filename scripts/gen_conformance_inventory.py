"""Write the conformance check inventory into docs/conformance.md (generated from the check registry).

Usage: python scripts/gen_conformance_inventory.py
(tests/docs/test_conformance_inventory.py fails while the page differs from the registry)
"""

from __future__ import annotations

from pathlib import Path

from verl_conformance.inventory import update_page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"

if __name__ == "__main__":
    print(f"{PAGE}: {'updated' if update_page(PAGE) else 'up to date'}")
