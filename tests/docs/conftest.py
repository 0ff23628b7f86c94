"""List the docs code blocks that are not run, at the end of a run that collected the docs tests."""

from __future__ import annotations

from typing import Any


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print each ``not-run`` block with its reason, so the skipped examples stay visible."""
    if not any("tests/docs" in str(getattr(i, "nodeid", "")) or "test_doc_blocks" in str(getattr(i, "nodeid", ""))
               for i in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])):
        return
    from test_doc_blocks import not_run_blocks

    blocks = not_run_blocks()
    terminalreporter.section(f"docs code blocks not run: {len(blocks)}")
    for b in blocks:
        terminalreporter.write_line(f"{b.id} ({b.language}): {b.argument}")
