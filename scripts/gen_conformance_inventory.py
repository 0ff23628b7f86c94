"""Write the generated conformance docs: the check inventory in docs/conformance.md and the
contract checklist docs/contract.md (both from the check registry).

Usage: python scripts/gen_conformance_inventory.py
(tests/docs/test_conformance_inventory.py and tests/docs/test_site.py fail while a page differs)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from verl_conformance.inventory import update_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "conformance.md"


def _contract_hook() -> object:
    spec = importlib.util.spec_from_file_location("contract_page", ROOT / "docs" / "_hooks" / "contract_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(f"{PAGE}: {'updated' if update_page(PAGE) else 'up to date'}")
    hook = _contract_hook()
    print(f"{hook.PAGE_PATH}: {'updated' if hook.write_page() else 'up to date'}")  # type: ignore[attr-defined]
