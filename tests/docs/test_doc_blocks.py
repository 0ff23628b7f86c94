"""Every code block of every docs page is run or validated, and the site builds without warnings.

The line right before a block's opening fence may carry a marker (an HTML comment, invisible on
the site) that says what the test does with the block:

* ``<!-- runnable -->``: a ``python`` block runs with this interpreter, a ``bash`` block with
  ``bash -euo pipefail``, each in a fresh empty directory with the virtual environment's ``bin``
  first on PATH; the block fails the test when it exits non-zero (its own asserts count).
* ``<!-- not-run: REASON -->``: the block needs what CI does not have (a GPU, an installed
  third-party backend) or takes minutes. It is still compiled (``python``) or syntax-checked
  (``bash -n``); these blocks are counted and listed at the end of the run, and
  :data:`NOT_RUN_BUDGET` caps how many there may be.
* ``<!-- file: PATH -->``: the block is the exact text of the repository file ``PATH``, whose
  own tests run it.
* ``<!-- check: pyproject -->`` (``toml`` only): a ``pyproject.toml`` fragment; parsed, and it must
  hold a ``[project]``, ``[build-system]`` or ``[tool]`` table.

Every ``python`` and ``bash`` block needs one of the first three markers. Every ``toml`` block is
parsed; without a marker it must load as a run config (``verl_core.trainer.config.config_from_dict``).
``yaml`` and ``json`` blocks are parsed. Other languages (``text``, output samples) are prose.
"""

from __future__ import annotations

import json
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
NOT_RUN_BUDGET = 30
"""Most ``not-run`` blocks allowed across the site: make a block runnable rather than raise this."""
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"^<!--\s*(runnable|not-run|file|check)\s*(?::\s*(.*?))?\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a docs page."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    runnable: bool
    marker: str | None = None  # runnable, not-run, file, check
    argument: str = ""  # the reason, the copied path or what to check

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
        marked = _MARKER.match(stripped)
        if marked:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not _FENCE.match(nxt.strip()):
                raise ValueError(
                    f"{name}:{i + 1}: {stripped} must be the line right before a "
                    f"fenced code block, found {nxt!r}"
                )
            if marked.group(1) in ("not-run", "file", "check") and not marked.group(2):
                raise ValueError(f"{name}:{i + 1}: {stripped} needs an argument ({marked.group(1)}: ...)")
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
        before = _MARKER.match(lines[start - 1].strip()) if start > 0 else None
        marker, argument = (before.group(1), before.group(2) or "") if before else (None, "")
        blocks.append(Block(path, start + 1, language, "\n".join(body) + "\n", marker == "runnable",
                            marker, argument))
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
    # The backend guide's worked example runs from source whether or not it is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "examples" / "tiny-backend" / "src"),
                                                    env.get("PYTHONPATH", "")) if p)
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
    """The parser reads each marker and its argument, and rejects a dangling or empty marker."""
    page = tmp_path / "page.md"
    page.write_text(f"# t\n\n{MARKER}\n```python\nx = 1\n```\n\n```bash\nls\n```\n\n"
                    "<!-- not-run: needs a GPU -->\n```bash\nnvidia-smi\n```\n")
    blocks = parse_blocks(page)
    assert [(b.language, b.runnable, b.line, b.marker) for b in blocks] == [
        ("python", True, 4, "runnable"), ("bash", False, 8, None), ("bash", False, 13, "not-run")]
    assert blocks[0].code == "x = 1\n" and blocks[2].argument == "needs a GPU"
    page.write_text(f"{MARKER}\n\ntext\n")
    with pytest.raises(ValueError, match="right before a fenced code block"):
        parse_blocks(page)
    page.write_text("<!-- not-run -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="needs an argument"):
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


def all_blocks() -> list[Block]:
    """Every fenced block of every page."""
    return [b for p in doc_pages() for b in parse_blocks(p)]


def not_run_blocks() -> list[Block]:
    """The blocks marked ``not-run``, with their reasons."""
    return [b for b in all_blocks() if b.marker == "not-run"]


def test_every_code_block_is_run_or_validated() -> None:
    """Each python/bash block carries runnable, not-run or file; check markers sit on toml blocks only."""
    unmarked = [b.id for b in all_blocks() if b.language in LANGUAGES and b.marker in (None, "check")]
    assert not unmarked, (
        f"python/bash blocks without a marker (add <!-- runnable -->, <!-- not-run: REASON --> or "
        f"<!-- file: PATH --> on the line before the fence): {unmarked}")
    misplaced = [b.id for b in all_blocks()
                 if (b.marker == "check" and (b.language, b.argument) != ("toml", "pyproject"))
                 or (b.marker in ("runnable", "not-run") and b.language not in LANGUAGES)]
    assert not misplaced, f"markers on blocks they do not fit (see this module's docstring): {misplaced}"


def test_not_run_blocks_are_few() -> None:
    """The not-run blocks stay within the budget (each is listed at the end of the run)."""
    blocks = not_run_blocks()
    assert len(blocks) <= NOT_RUN_BUDGET, (
        f"{len(blocks)} blocks are marked not-run, more than NOT_RUN_BUDGET={NOT_RUN_BUDGET}: make some "
        f"runnable: {[b.id for b in blocks]}")


@pytest.mark.parametrize("block", not_run_blocks(), ids=lambda b: b.id)
def test_not_run_block_is_valid_syntax(block: Block) -> None:
    """A block that is not run still compiles (python) or parses (bash -n)."""
    if block.language == "python":
        compile(block.code, block.id, "exec")
    else:
        proc = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{block.id}: bash syntax error: {proc.stderr}"


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.marker == "file"], ids=lambda b: b.id)
def test_file_block_matches_its_file(block: Block) -> None:
    """A file block is exactly the file it names (the file's own tests run it)."""
    path = ROOT / block.argument
    assert path.is_file(), f"{block.id}: the file marker names {block.argument}, which does not exist"
    assert block.code.strip() == path.read_text(encoding="utf-8").strip(), (
        f"{block.id} is an outdated copy of {block.argument}; paste the file's current text into the page")


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.language in ("toml", "yaml", "yml", "json")],
                         ids=lambda b: b.id)
def test_data_block_parses(block: Block) -> None:
    """TOML blocks load as a run config (or are pyproject fragments); YAML and JSON blocks parse."""
    if block.language == "json":
        json.loads(block.code)
        return
    if block.language in ("yaml", "yml"):
        import yaml

        assert yaml.safe_load(block.code) is not None, f"{block.id}: empty YAML block"
        return
    import tomllib

    data = tomllib.loads(block.code)
    if block.marker == "check":
        tables = {"project", "build-system", "tool"} & set(data)
        assert tables, f"{block.id}: a pyproject fragment needs a [project], [build-system] or [tool] table"
        return
    from verl_core.trainer.config import config_from_dict

    config_from_dict(data)
