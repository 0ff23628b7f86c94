"""The site builds strictly, its generated pages cover the code, and no page is too large.

The API reference (``docs/_hooks/api_pages.py``) and the contract checklist
(``docs/_hooks/contract_page.py``, also committed as ``docs/contract.md``) are generated at build
time from the packages and the check registry; these tests check the generators, the committed
checklist and the built site.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_PAGE_BYTES = 300 * 1024


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "_hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


api_pages = _hook("api_pages")
contract_page = _hook("contract_page")


def _src_dirs() -> list[Path]:
    import yaml

    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    plugins = {k: v for p in cfg["plugins"] if isinstance(p, dict) for k, v in p.items()}
    return [ROOT / p for p in plugins["mkdocstrings"]["handlers"]["python"]["paths"]]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once with ``mkdocs build --strict``; fails on any warning."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert proc.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{log[-6000:]}"
    return out


def test_walk_finds_public_modules_and_skips_private_ones(tmp_path: Path) -> None:
    """A moved module gets its page at the new path; private modules and test files get none."""
    pkg = tmp_path / "src" / "pkg"
    (pkg / "kernel").mkdir(parents=True)
    (pkg / "_private").mkdir()
    for f in ("__init__.py", "a.py", "_b.py", "test_c.py", "kernel/__init__.py", "kernel/d.py",
              "_private/__init__.py", "_private/e.py"):
        (pkg / f).write_text('"""Doc."""\n')
    names = [m.name for m in api_pages.walk([tmp_path / "src"])]
    assert names == ["pkg", "pkg.a", "pkg.kernel", "pkg.kernel.d"]
    (pkg / "kernel" / "d.py").rename(pkg / "d.py")
    names = [m.name for m in api_pages.walk([tmp_path / "src"])]
    assert names == ["pkg", "pkg.a", "pkg.d", "pkg.kernel"]


def test_layers_group_the_real_packages() -> None:
    """Every module of the real packages falls in a named layer, never in the catch-all group."""
    modules = api_pages.walk(_src_dirs())
    assert len(modules) > 50
    stray = [m.name for m in modules if api_pages.layer_of(m.name) == api_pages.OTHER_LAYER]
    assert not stray, f"modules outside the layers of docs/_hooks/api_pages.py LAYERS: {stray}"
    assert api_pages.layer_of("verl_core.kernel.batch")[0] == "Kernel"
    assert api_pages.layer_of("verl_core.cli")[0] == "Facade and CLI"


def test_package_page_links_reexports_to_their_definitions() -> None:
    """The verl_core facade page links TensorBatch to the kernel page instead of rendering it again."""
    modules = {m.name: m for m in api_pages.walk(_src_dirs())}
    md = api_pages.page_markdown(modules["verl_core"], modules)
    assert '<autoref identifier="verl_core.kernel.batch.TensorBatch" optional>' in md
    assert "members: false" in md


def test_contract_lists_every_check_and_method() -> None:
    """Each registered check and each capability appears on the checklist; generate is proved by checks."""
    from verl_conformance.checks import CHECKS
    from verl_conformance.checks._registry import capability_fields

    md = contract_page.contract_markdown()
    missing = [cid for cid in CHECKS if f"`{cid}`" not in md]
    assert not missing, f"checks missing from the contract checklist: {missing}"
    for cap in capability_fields():
        kind, field = cap.split(".")
        assert f"### {kind}:" in md and f"| `{field}` |" in md, cap
    generate = md.split("### `RolloutEngine.generate`")[1].split("\n### ")[0]
    assert "`robustness::generate_edge_cases`" in generate and "`schema::eos_ends_response`" in generate


def test_committed_contract_page_is_current() -> None:
    """docs/contract.md (readable in the repository) is the page the hook generates."""
    page = ROOT / "docs" / "contract.md"
    assert page.is_file(), "docs/contract.md is missing: run python scripts/gen_conformance_inventory.py"
    assert page.read_text(encoding="utf-8") == contract_page.contract_markdown(), (
        "docs/contract.md is stale (a check, capability or protocol docstring changed): run "
        "python scripts/gen_conformance_inventory.py"
    )


@pytest.mark.slow
def test_site_builds_strictly_with_small_pages(site: Path) -> None:
    """``mkdocs build --strict`` passes, every module has its page, and no page exceeds 300 KiB."""
    pages = sorted(site.rglob("*.html"))
    sizes = {str(p.relative_to(site)): p.stat().st_size for p in pages}
    big = {k: v for k, v in sizes.items() if v > MAX_PAGE_BYTES}
    assert not big, f"built pages over {MAX_PAGE_BYTES} bytes (split them): {big}"
    largest = max(sizes, key=sizes.__getitem__)
    print(f"{len(pages)} pages, largest {largest} {sizes[largest] / 1024:.0f} KiB")
    for m in api_pages.walk(_src_dirs()):
        assert (site / "api" / m.name / "index.html").is_file(), f"no API page for {m.name}"
    html = (site / "api" / "verl_core.kernel.batch" / "index.html").read_text(encoding="utf-8")
    assert 'id="verl_core.kernel.batch.TensorBatch"' in html, "the API reference did not render TensorBatch"
    contract = (site / "contract" / "index.html").read_text(encoding="utf-8")
    assert re.search(r"robustness::generate_edge_cases", contract)
