"""MkDocs hook: generate the contract checklist for backend authors from the conformance check registry.

The page ``contract.md`` is generated from three sources, so it cannot drift from the suite; it is
committed as ``docs/contract.md`` (readable in the repository), rewritten by ``python
docs/_hooks/contract_page.py`` or ``python scripts/gen_conformance_inventory.py`` (a docs test
fails while the committed page differs), and regenerated at every site build:

* the protocols (``TrainingEngine``, ``RolloutEngine``, ``RewardEngine``, ``ReplayBuffer``): each
  method's signature and docstring (the rules it must keep);
* the check registry (``verl_conformance.checks.CHECKS``): which checks exercise each method, found
  by reading the source of each check and of the suite's helpers it calls, and the rule each check
  proves (its docstring's first line);
* the capability dataclasses: what each capability declares, its default, and the checks it gates.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAGE = "contract.md"
PAGE_PATH = Path(__file__).resolve().parents[1] / PAGE
"""The committed copy of the page."""

# Which harness accessor hands a check an object of each protocol (``h.rollout("eos")``).
ACCESSORS: dict[str, tuple[str, ...]] = {
    "TrainingEngine": ("training",),
    "RolloutEngine": ("rollout",),
    "RewardEngine": ("reward",),
    "ReplayBuffer": ("require_buffer",),
}
# Read-only properties every check reads in passing; listed by check id, not as rules they prove.
ACCESSOR_PROPERTIES = frozenset({"spec", "capabilities", "tokenizer", "weight_dtype"})


def _protocols() -> list[type]:
    from verl_core.kernel.buffer import ReplayBuffer
    from verl_core.kernel.reward import RewardEngine
    from verl_core.kernel.rollout import RolloutEngine
    from verl_core.kernel.training import TrainingEngine

    return [TrainingEngine, RolloutEngine, RewardEngine, ReplayBuffer]


def protocol_methods(proto: type) -> list[str]:
    """The public methods and properties a protocol declares, in source order."""
    return [n for n in proto.__dict__ if not n.startswith("_") or n == "__len__"
            if callable(proto.__dict__[n]) or isinstance(proto.__dict__[n], property)]


def _names_used(func: Callable[..., Any], seen: set[Any]) -> set[str]:
    """Attribute names read by ``func`` and by the verl_conformance functions it calls, transitively."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return set()
    module = sys.modules.get(getattr(func, "__module__", ""), None)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and module is not None:
            target = getattr(module, node.id, None)
            if (inspect.isfunction(target) and target not in seen
                    and target.__module__.startswith("verl_conformance")):
                seen.add(target)
                out |= _names_used(target, seen)
    return out


def check_methods() -> dict[str, dict[str, list[str]]]:
    """check id -> protocol name -> the protocol's methods the check (or its helpers) calls."""
    from verl_conformance.checks import CHECKS

    protos = _protocols()
    result: dict[str, dict[str, list[str]]] = {}
    for cid, c in CHECKS.items():
        used = _names_used(c.func, set())
        reached = [p for p in protos if any(a in used for a in ACCESSORS[p.__name__])]
        per: dict[str, list[str]] = {}
        for p in reached or protos:
            methods = [m for m in protocol_methods(p) if m in used]
            if methods:
                per[p.__name__] = methods
        result[cid] = per
    return result


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


_SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Attributes|Note|Notes|Example|Examples):$")
_ENTRY = re.compile(r"^    (\S[^:]*):(.*)$")


def _markdown(doc: str) -> str:
    """A Google-style docstring as Markdown: sections in bold, their entries as list items.

    Left as written, the indented section bodies would render as code blocks.
    """
    out: list[str] = []
    for line in doc.splitlines():
        section = _SECTION.match(line)
        entry = _ENTRY.match(line)
        if section:
            out.append(f"**{section.group(1)}:**")
        elif line.startswith("        "):  # continuation of an entry
            out.append("  " + line.strip())
        elif entry and out and (out[-1].startswith("**") or out[-1].startswith(("- ", "  "))):
            out.append(f"- `{entry.group(1)}`:{entry.group(2)}")
        elif line.startswith("    "):
            out.append(line.strip())
        else:
            out.append(line)
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "{" + ", ".join(repr(v) for v in sorted(value)) + "}" if isinstance(value, frozenset) else repr(value)
    return "required"


def _signature(proto: type, name: str) -> str:
    attr = proto.__dict__[name]
    if isinstance(attr, property):
        ret = inspect.signature(attr.fget).return_annotation if attr.fget else ""
        return f"{name}: {ret}" if ret is not inspect.Signature.empty else name
    sig = inspect.signature(attr)

    def ann(a: Any) -> str:  # annotations are strings under ``from __future__ import annotations``
        return a if isinstance(a, str) else inspect.formatannotation(a)

    params: list[str] = []
    for p in sig.parameters.values():
        text = p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {ann(p.annotation)}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        params.append(("*, " if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in "".join(params)
                       else "") + text)
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {ann(sig.return_annotation)}"
    return f"{name}({', '.join(params)}){ret}"


def _doc(proto: type, name: str) -> str:
    attr = proto.__dict__[name]
    doc = inspect.getdoc(attr.fget if isinstance(attr, property) else attr) or ""
    return doc.strip()


def _anchor(method: str) -> str:
    """The id mkdocs gives the heading ``### `Protocol.method```: lower case, word characters only."""
    return re.sub(r"[^\w-]", "", method.lower())


def contract_markdown() -> str:
    """The whole checklist page."""
    from verl_conformance.checks import AREAS, CHECKS
    from verl_conformance.checks._registry import CAPABILITY_CLASSES

    by_check = check_methods()
    ordered = [c for area in AREAS for c in CHECKS.values() if c.area == area]
    lines = [
        "# Contract checklist",
        "",
        "Everything a backend must do, method by method, with the conformance check that proves each",
        "rule. This page is generated from the suite's check registry and the protocols' docstrings",
        "(`python scripts/gen_conformance_inventory.py` rewrites `docs/contract.md`, and a test fails",
        "while it is stale), so it lists exactly what the suite checks.",
        "",
        "How to read it: under each protocol method, **Contract** is the method's docstring (the rules);",
        "**Proved by** lists every check that calls the method, directly or through the suite's helpers,",
        "with the rule the check proves and the capabilities that gate it (a backend that declares a",
        "capability `False` skips the checks it gates; see the [capability table](#capabilities)).",
        "Check ids are what `--xfails-file` and `checks=` take; the [conformance page](conformance.md)",
        "explains how to run them, and [Writing a backend](writing-a-backend.md) walks through it.",
        "",
    ]
    unproved: list[str] = []
    first_shown: dict[str, str] = {}  # check id -> the method under which its whole rule is printed
    for proto in _protocols():
        pname = proto.__name__
        lines += [f"## {pname}", "",
                  f"API: [`{proto.__module__}.{pname}`][{proto.__module__}.{pname}].", ""]
        summary = (inspect.getdoc(proto) or "").split("\n\n")[0].replace("\n", " ")
        if summary:
            lines += [summary, ""]
        for name in protocol_methods(proto):
            checks = [c for c in ordered if name in by_check[c.id].get(pname, [])]
            # ``py``, not ``python``: a signature, not a block the docs tests would run
            lines += [f"### `{pname}.{name}`", "", "```py", _signature(proto, name), "```", ""]
            doc = _doc(proto, name)
            if doc:
                lines += ["**Contract:**", "", textwrap.indent(_markdown(doc), "> ", lambda _: True), ""]
            if not checks:
                unproved.append(f"`{pname}.{name}`")
                lines += ["**Proved by:** no check calls it directly.", ""]
            elif name in ACCESSOR_PROPERTIES or name == "close":
                ids = ", ".join(f"`{c.id}`" for c in checks)
                lines += [f"**Read by** {len(checks)} checks: {ids}.", ""]
            else:
                lines += ["**Proved by:**", "", "| | check | rule it proves | gated by |", "|---|---|---|---|"]
                for c in checks:
                    gates = ", ".join(f"`{g}`" for g in c.gates) or "always runs"
                    # a check that calls several methods prints its rule once, under the first of them
                    where = first_shown.setdefault(c.id, f"{pname}.{name}")
                    rule = (_cell(c.doc) if where == f"{pname}.{name}"
                            else f"its rule is under [`{where}`](#{_anchor(where)})")
                    lines.append(f"| [ ] | `{c.id}` | {rule} | {gates} |")
                lines.append("")
    lines += ["## Capabilities", "",
              "Each role's `BackendSpec.capabilities` entry (and the engine's `capabilities` property) is one",
              "of these dataclasses. Declare only what the engine does: a capability declared `True` is held",
              "to the checks it gates, one declared `False` skips them with the reason in the report. The",
              "`training.*` gates are read from the role each check builds: the actor, or, for a backend",
              "whose only training role is a critic, the critic. Such a backend is held to the critic checks",
              "(`schema::critic_layout`, `numerics::values_match_reference`,",
              "`numerics::value_loss_matches_reference`) and, built on its critic with the value loss, to the",
              "checkpoint, offload, micro-batch and input checks (`stateful::checkpoint_round_trip`,",
              "`stateful::load_drops_pending_gradients`, `stateful::offload_*`,",
              "`invariance::micro_batch_invariance`, `robustness::empty_responses_train`,",
              "`robustness::bad_training_input_rejected`, `robustness::failed_call_leaves_no_gradients`),",
              "`robustness::batch_of_one` and `robustness::undeclared_settings_refused`. The checks of log-probs",
              "(the reference numerics, padding, positions, LoRA) need an actor and skip without one.", ""]
    for kind, cls in CAPABILITY_CLASSES.items():
        docs = _attribute_docs(cls)
        lines += [f"### {kind}: [`{cls.__name__}`][{cls.__module__}.{cls.__name__}]", "",
                  "| capability | default | declares | checks it gates |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            gated = [c.id for c in ordered if f"{kind}.{f.name}" in c.gates]
            cell = ", ".join(f"`{i}`" for i in gated) or "none yet"
            lines.append(f"| `{f.name}` | `{_default(f)}` | {_cell(docs.get(f.name, ''))} | {cell} |")
        lines.append("")
    other = [c for c in ordered if not any(by_check[c.id].values())]
    if other:
        lines += ["## Checks of no single method", "",
                  "These checks exercise the backend as a whole (its registry entry, its declared capabilities,",
                  "or the distributed launcher):", "", "| check | what it checks | gated by |", "|---|---|---|"]
        lines += [f"| `{c.id}` | {_cell(c.doc)} | {', '.join(f'`{g}`' for g in c.gates) or 'always runs'} |"
                  for c in other]
        lines.append("")
    return "\n".join(lines)


def write_page(path: str | Path = PAGE_PATH) -> bool:
    """Write the checklist to ``path`` (``docs/contract.md``); True when the file changed."""
    page = Path(path)
    text = contract_markdown()
    if page.exists() and page.read_text(encoding="utf-8") == text:
        return False
    page.write_text(text, encoding="utf-8")
    return True


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add the generated checklist page."""
    from mkdocs.structure.files import File

    old = files.get_file_from_path(PAGE)
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, PAGE, content=contract_markdown()))
    return files


if __name__ == "__main__":
    print(f"{PAGE_PATH}: {'updated' if write_page() else 'up to date'}")
