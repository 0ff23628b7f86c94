"""MkDocs hook: generate the API reference, one page per public module, from a walk of the packages.

Nothing of the API reference is written by hand, so a module that moves, appears or disappears
changes the site on the next build and cannot leave a stale page or a broken nav entry behind.

The walk reads the source folders listed as ``paths`` of the mkdocstrings python handler in
``mkdocs.yml`` (the file system only: nothing is imported). A module is public when no part of its
dotted name starts with ``_`` and it is not a pytest file (``test_*``). Each module gets the page
``api/<dotted.name>.md`` holding one ``::: dotted.name`` directive; a package's page renders its
docstring, links its submodules and links each name of its ``__all__`` to the page that defines
it, without re-rendering those names (a facade such as ``verl_core`` re-exports a hundred names:
rendering them again made the single largest page of the site). Pages are grouped in the nav by
layer: the ``verl_core`` layers (kernel, algorithms, enginekit, trainer), the backends and the
conformance suite.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_DIR = "api"
NAV_TITLE = "API reference"
OVERVIEW = f"{API_DIR}/index.md"

# Layers in nav order: (title, prefix of the dotted names it holds, one line on what it is).
LAYERS: tuple[tuple[str, str, str], ...] = (
    ("Kernel", "verl_core.kernel", "The protocols, TensorBatch and its schema, capabilities, the weight "
     "stream's messages, the plugin registry and the errors. Everything else builds on these."),
    ("Algorithms", "verl_core.algorithms", "Advantage estimators, policy and value losses, KL, aggregation "
     "and the Algorithm bundle."),
    ("Engine kit", "verl_core.enginekit", "Helpers a backend may use: the rollout engine facade, "
     "reproducible sampling, the weight stream, precision, retokenization, checkpoints, "
     "bring-your-own-model adapters."),
    ("Trainer", "verl_core.trainer", "The run configuration, the Trainer, executors, pipelines, replay "
     "buffers, data and rewards."),
    ("Facade and CLI", "verl_core", "The `verl_core` package (re-exports of the layers) and the `verl` "
     "command."),
    ("Backends", "verl_hf verl_megatron verl_vllm", "Each backend's entry point, options and engines."),
    ("Conformance", "verl_conformance", "The conformance suite: the checker, the check registry, the "
     "harness and the test kit."),
)
OTHER_LAYER = ("Other packages", "", "Packages outside the layers above.")


@dataclass(frozen=True)
class Module:
    """One public module found by the walk."""

    name: str  # dotted
    path: Path  # the .py file (``__init__.py`` for a package)
    is_package: bool

    @property
    def page(self) -> str:
        """The docs-relative path of the module's page."""
        return f"{API_DIR}/{self.name}.md"


def _public(parts: list[str]) -> bool:
    return not any(p.startswith("_") or p.startswith("test_") for p in parts)


def walk(src_dirs: list[Path]) -> list[Module]:
    """Every public module under the top-level packages of ``src_dirs``, sorted by dotted name."""
    found: list[Module] = []
    for src in src_dirs:
        if not src.is_dir():
            continue
        for init in sorted(src.glob("*/__init__.py")):
            top = init.parent
            for dirpath, dirnames, filenames in os.walk(top):
                here = Path(dirpath)
                dirnames[:] = sorted(d for d in dirnames if (here / d / "__init__.py").is_file())
                rel = here.relative_to(src).parts
                if not _public(list(rel)) or "__init__.py" not in filenames:
                    dirnames[:] = []
                    continue
                found.append(Module(".".join(rel), here / "__init__.py", True))
                for f in sorted(filenames):
                    if f.endswith(".py") and f != "__init__.py" and _public([f[:-3]]):
                        found.append(Module(".".join((*rel, f[:-3])), here / f, False))
    return sorted(found, key=lambda m: m.name)


def layer_of(name: str) -> tuple[str, str, str]:
    """The layer a dotted module name belongs to (the most specific prefix wins)."""
    best = OTHER_LAYER
    best_len = -1
    for layer in LAYERS:
        for prefix in layer[1].split():
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def _docstring_summary(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except SyntaxError:
        return ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _all_names(path: Path) -> list[str]:
    """The string items of a literal ``__all__`` in the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [v for v in value if isinstance(v, str)]
    return []


def _imported_from(path: Path, package: str) -> dict[str, str]:
    """Name -> dotted path it is imported from, for the ``from x import y`` statements of a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def _defined_here(path: Path) -> list[str]:
    """Public functions and classes a package's ``__init__`` defines itself (not re-exports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and not n.name.startswith("_")]


def _resolve(target: str, modules: dict[str, Module], depth: int = 0) -> str:
    """Follow re-exports until the module that defines ``target`` (``pkg.Name``) is reached."""
    mod, _, name = target.rpartition(".")
    if target in modules or depth > 10:
        return target
    m = modules.get(mod)
    if m is None:
        return target
    src = _imported_from(m.path, mod if m.is_package else mod.rpartition(".")[0])
    return _resolve(src[name], modules, depth + 1) if name in src else target


def page_markdown(m: Module, modules: dict[str, Module]) -> str:
    """The Markdown of the page of module ``m``."""
    lines = [f"# {m.name}", ""]
    if not m.is_package:
        lines += [f"::: {m.name}", ""]
        return "\n".join(lines)
    own = _defined_here(m.path)
    members = f"[{', '.join(repr(n) for n in own)}]" if own else "false"
    lines += [f"::: {m.name}", "    options:", f"      members: {members}", "      show_root_heading: false", ""]
    subs = [s for s in modules.values() if s.name.rpartition(".")[0] == m.name]
    if subs:
        lines += ["## Modules", "", "| module | summary |", "|---|---|"]
        lines += [f"| [`{s.name}`]({s.name}.md) | "
                  f"{_docstring_summary(s.path).replace('|', '&#124;')} |" for s in subs]
        lines.append("")
    names = _all_names(m.path)
    if names:
        imported = _imported_from(m.path, m.name)
        lines += ["## Exported names", "",
                  f"Importable as `from {m.name} import NAME`; each links to where it is documented.", ""]
        for n in names:
            where = _resolve(imported[n], modules) if n in imported else f"{m.name}.{n}"
            if where in modules:
                lines.append(f"- [`{n}`]({where}.md)")
            else:  # a link when the name is documented (it may be private or undocumented), else code
                lines.append(f'- <autoref identifier="{where}" optional><code>{n}</code></autoref>')
        lines.append("")
    return "\n".join(lines)


def overview_markdown(modules: list[Module]) -> str:
    """The API overview page: every layer with its modules and their one-line summaries."""
    lines = ["# API reference", "",
             "Generated from the docstrings at every build, one page per public module (the docstrings are",
             "the contract; the [conformance suite](../conformance.md) is its proof). Backend authors: the",
             "[contract checklist](../contract.md) lists every rule of each protocol method with the check",
             "that proves it.", ""]
    for title, _, blurb, mods in grouped(modules):
        lines += [f"## {title}", "", blurb, "", "| module | summary |", "|---|---|"]
        lines += [f"| [`{m.name}`]({m.name}.md) | {_docstring_summary(m.path).replace('|', '&#124;')} |"
                  for m in mods]
        lines.append("")
    return "\n".join(lines)


def grouped(modules: list[Module]) -> Iterator[tuple[str, str, str, list[Module]]]:
    """(title, prefixes, blurb, modules) per layer with at least one module, in nav order."""
    for layer in (*LAYERS, OTHER_LAYER):
        mods = [m for m in modules if layer_of(m.name) == layer]
        if mods:
            yield (*layer, mods)


def _src_dirs(config: Any) -> list[Path]:
    root = Path(config["config_file_path"]).parent
    handler = config["plugins"]["mkdocstrings"].config["handlers"]["python"]
    return [root / p for p in handler.get("paths", [])]


_MODULES: list[Module] = []


def on_config(config: Any, **kwargs: Any) -> Any:
    """Walk the packages and replace the API reference section of the nav by the generated pages."""
    _MODULES[:] = walk(_src_dirs(config))
    section: list[Any] = [{"Overview": OVERVIEW}]
    for title, _, _, mods in grouped(_MODULES):
        section.append({title: [{m.name: m.page} for m in mods]})
    nav = config["nav"] or []
    for i, entry in enumerate(nav):
        if isinstance(entry, dict) and NAV_TITLE in entry:
            nav[i] = {NAV_TITLE: section}
            break
    else:
        nav.append({NAV_TITLE: section})
    config["nav"] = nav
    return config


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add the generated pages (replacing any hand-written page of the same path)."""
    from mkdocs.structure.files import File

    by_name = {m.name: m for m in _MODULES}
    pages = {OVERVIEW: overview_markdown(_MODULES)}
    pages.update({m.page: page_markdown(m, by_name) for m in _MODULES})
    for uri, content in pages.items():
        old = files.get_file_from_path(uri)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, uri, content=content))
    return files
