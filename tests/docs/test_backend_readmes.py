"""Each backend README's options table lists the backend's options, no more and no fewer."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from verl_hf.config import HFOptions

ROOT = Path(__file__).resolve().parents[2]


def _table_keys(readme: Path, heading: str) -> list[str]:
    """The first-column keys of the first table under ``heading``."""
    text = readme.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)


def test_the_hf_readme_lists_every_option_once() -> None:
    keys = _table_keys(ROOT / "packages/verl-hf/README.md", "## Options")
    fields = [f.name for f in dataclasses.fields(HFOptions)]
    assert sorted(keys) == sorted(fields), (
        f"missing from the table: {sorted(set(fields) - set(keys))}; not options: {sorted(set(keys) - set(fields))}")
    assert len(keys) == len(set(keys))


def test_the_hf_readme_gives_each_literal_default() -> None:
    """Options whose default is a value (not None, decided at build) show that value."""
    text = (ROOT / "packages/verl-hf/README.md").read_text(encoding="utf-8")
    for f in dataclasses.fields(HFOptions):
        row = re.search(rf"^\| `{f.name}` \| ([^|]+) \|", text, flags=re.MULTILINE)
        assert row is not None, f.name
        shown = row.group(1).strip()
        if f.default is None:
            assert shown.startswith("None"), (f.name, shown)
        elif isinstance(f.default, bool | str):
            assert shown.strip("`").startswith(str(f.default)), (f.name, shown, f.default)
        else:
            assert shown == f"{f.default // (1 << 20)} MiB", (f.name, shown, f.default)
