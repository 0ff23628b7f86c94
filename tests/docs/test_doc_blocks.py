"""The documentation site builds without warnings, and every code block marked runnable runs.

A block is runnable when the line right before its opening fence is ``<!-- runnable -->`` (an HTML
comment, invisible on the site). Runnable ``python`` blocks run with this interpreter and
``bash`` blocks with ``bash -euo pipefail``, each in a fresh empty directory with the virtual
environment's ``bin`` first on PATH; a block fails the test when it exits non-zero (its own
asserts count). Blocks that cannot run on a CPU machine, or take minutes, stay unmarked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = "<!-- runnable -->"
LANGUAGES = ("python", "bash")
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a docs page."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    runnable: bool

    @property
    def id(self) -> str:
        """``page.md:line`` for test ids and messages."""
        return f"{_name(self.path)}:{self.line}"


def _name(path: Path) -> str:
    return str(path.relative_to(DOCS)) if path.is_relative_to(DOCS) else path.name


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with whether the marker line precedes it.

    Raises:
        ValueError: a marker that is not directly followed by a fenced block, or an unclosed fence.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    name = _name(path)
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped == MARKER:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not _FENCE.match(nxt.strip()):
                raise ValueError(
                    f"{name}:{i + 1}: {MARKER} must be the line right before a "
                    f"fenced code block, found {nxt!r}"
                )
        m = _FENCE.match(stripped)
        if m is None:
            i += 1
            continue
        fence, language = m.group(1), m.group(2).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{name}:{start + 1}: code block is never closed")
        runnable = start > 0 and lines[start - 1].strip() == MARKER
        blocks.append(Block(path, start + 1, language, "\n".join(body) + "\n", runnable))
        i += 1
    return blocks


def doc_pages() -> list[Path]:
    """The Markdown pages of the site."""
    return sorted(DOCS.rglob("*.md"))


def runnable_blocks() -> list[Block]:
    """Every block marked runnable, across all pages."""
    return [b for p in doc_pages() for b in parse_blocks(p) if b.runnable]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


def test_markers_sit_on_python_or_bash_blocks() -> None:
    """Every marker is followed by a block in a language the test can run."""
    blocks = runnable_blocks()
    wrong = [f"{b.id} ({b.language or 'no language'})" for b in blocks if b.language not in LANGUAGES]
    assert not wrong, f"runnable blocks must be one of {LANGUAGES}; fix the fence language of: {wrong}"


def test_the_main_pages_have_runnable_blocks() -> None:
    """The quickstart, concepts, algorithms and conformance pages each keep a runnable example."""
    pages = {b.path.name for b in runnable_blocks()}
    missing = {"quickstart.md", "concepts.md", "algorithms.md", "conformance.md"} - pages
    assert not missing, f"pages without a runnable block (marker {MARKER!r} lost?): {sorted(missing)}"


def test_parser_finds_marked_and_unmarked_blocks(tmp_path: Path) -> None:
    """The parser tells marked blocks from unmarked ones and rejects a dangling marker."""
    page = tmp_path / "page.md"
    page.write_text(f"# t\n\n{MARKER}\n```python\nx = 1\n```\n\n```bash\nls\n```\n")
    blocks = parse_blocks(page)
    assert [(b.language, b.runnable, b.line) for b in blocks] == [("python", True, 4), ("bash", False, 8)]
    assert blocks[0].code == "x = 1\n"
    page.write_text(f"{MARKER}\n\ntext\n")
    with pytest.raises(ValueError, match="right before a fenced code block"):
        parse_blocks(page)


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.id)
def test_runnable_block(block: Block, tmp_path: Path) -> None:
    """The block exits 0 when run on its own in an empty directory."""
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S, check=False)
    assert proc.returncode == 0, (
        f"runnable block {block.id} exited {proc.returncode}\n--- code\n{block.code}"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )


@pytest.mark.parametrize("page", ["quickstart.md", "algorithms.md", "train-on-your-dataset.md",
                                  "reward-functions.md", "logging.md"])
def test_run_config_examples_are_valid(page: str) -> None:
    """The TOML run configs shown on these pages load as a RunConfig (no unknown key or bad value)."""
    import tomllib

    from verl_core.trainer.config import config_from_dict

    blocks = [b for b in parse_blocks(DOCS / page) if b.language == "toml"]
    assert blocks, f"{page} has no TOML example any more; drop it from this test"
    for b in blocks:
        config_from_dict(tomllib.loads(b.code))
