#!/usr/bin/env python3
"""Print the size of verl-core's layers and the trainer's rooms, import depth, the largest classes and modules.

Usage: python scripts/arch_stats.py [--top N]
A report for docs/architecture.md, not a lint: structure is enforced by the import-linter contracts
of the root pyproject.toml. Lines are physical lines of the source files. The import depth of a
module is the length of the longest chain of verl_core imports below it (a module that imports no
other verl_core module has depth 0), over module-level imports only.
"""

from __future__ import annotations

import argparse
import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
CORE = PACKAGES / "verl-core" / "src" / "verl_core"
LAYERS = ("kernel", "algorithms", "enginekit", "agent", "trainer")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _classes(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [
        ((node.end_lineno or node.lineno) - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """verl_core modules imported at module level (not inside functions or TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in known)
    return found


def _depths() -> dict[str, int]:
    paths = {_module_name(p): p for p in _sources(CORE)}
    graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}

    @functools.cache
    def depth(m: str, seen: frozenset[str] = frozenset()) -> int:
        below = [depth(d, seen | {m}) for d in graph[m] if d not in seen and not m.startswith(d + ".")]
        return 1 + max(below) if below else 0

    return {m: depth(m) for m in graph}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    print("verl-core layers (lines):")
    for layer in LAYERS:
        if (CORE / layer).is_dir():
            print(f"  {layer:<11} {sum(_lines(p) for p in _sources(CORE / layer)):>6}")
    rest = [p for p in _sources(CORE) if p.relative_to(CORE).parts[0] not in LAYERS]
    print(f"  {'(top level)':<11} {sum(_lines(p) for p in rest):>6}  {', '.join(p.name for p in rest)}")
    print("trainer rooms (lines, modules):")
    trainer = CORE / "trainer"
    for room in sorted(trainer.iterdir()):
        files = _sources(room) if room.is_dir() else [room] if room.suffix == ".py" else []
        if files:
            print(f"  {room.name:<16} {sum(_lines(p) for p in files):>6}  {len(files):>3}")
    depths = _depths()
    deepest = max(depths.values())
    print(f"import levels in verl_core: {deepest + 1} (deepest: "
          f"{', '.join(sorted(m for m, d in depths.items() if d == deepest))})")
    every = [p for d in sorted(PACKAGES.iterdir()) for p in _sources(d / "src")]
    classes = sorted((c for p in every for c in _classes(p)), reverse=True)
    modules = sorted(((_lines(p), str(p.relative_to(ROOT))) for p in every), reverse=True)
    print("largest classes (lines), all packages:")
    for n, name in classes[: args.top]:
        print(f"  {n:>5}  {name}")
    print("largest modules (lines), all packages:")
    for n, name in modules[: args.top]:
        print(f"  {n:>5}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
