#!/usr/bin/env python3
"""Print the size of verl-core's layers, the largest classes and the largest modules.

Usage: python scripts/arch_stats.py [--max-kernel-lines N] [--max-class-lines N]
Exits 1 when a limit is given and exceeded (the lint phase passes the limits of
docs/architecture.md). Lines are physical lines of the source files.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
CORE = PACKAGES / "verl-core" / "src" / "verl_core"
LAYERS = ("kernel", "algorithms", "enginekit", "trainer")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kernel-lines", type=int)
    parser.add_argument("--max-class-lines", type=int)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    print("verl-core layers (lines):")
    sizes = {}
    for layer in LAYERS:
        sizes[layer] = sum(_lines(p) for p in _sources(CORE / layer))
        print(f"  {layer:<11} {sizes[layer]:>6}")
    rest = [p for p in _sources(CORE) if p.relative_to(CORE).parts[0] not in LAYERS]
    print(f"  {'(top level)':<11} {sum(_lines(p) for p in rest):>6}  {', '.join(p.name for p in rest)}")
    every = [p for d in sorted(PACKAGES.iterdir()) for p in _sources(d / "src")]
    classes = sorted((c for p in every for c in _classes(p)), reverse=True)
    modules = sorted(((_lines(p), str(p.relative_to(ROOT))) for p in every), reverse=True)
    print("largest classes (lines), all packages:")
    for n, name in classes[: args.top]:
        print(f"  {n:>5}  {name}")
    print("largest modules (lines), all packages:")
    for n, name in modules[: args.top]:
        print(f"  {n:>5}  {name}")
    failed = []
    if args.max_kernel_lines is not None and sizes["kernel"] > args.max_kernel_lines:
        failed.append(f"the kernel has {sizes['kernel']} lines (limit {args.max_kernel_lines})")
    if args.max_class_lines is not None and classes and classes[0][0] > args.max_class_lines:
        failed.append(f"class {classes[0][1]} has {classes[0][0]} lines (limit {args.max_class_lines})")
    for f in failed:
        print(f"arch_stats: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
