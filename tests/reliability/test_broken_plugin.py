"""An installed plugin that cannot be loaded fails only the runs that select it.

Two real distributions are installed for the test the way pip leaves them (a ``.dist-info`` folder
on the path, with ``METADATA`` and ``entry_points.txt``): one whose ``verl.plugins`` entry point
names a module that does not exist, one whose module raises when imported. Every other backend
still loads, ``verl backends`` lists both as broken with their errors, a run that selects neither
is valid, and a run (or a registry lookup) that selects one fails with its import error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_core import EngineSpec, PluginError, UnknownNameError
from verl_core.cli import main
from verl_core.kernel.registry import Registry, get_training_engine, reset_registry

MISSING = "ModuleNotFoundError: No module named 'verl_ghost_missing_xyz'"
RAISES = "RuntimeError: the plugin's import failed on purpose"


def _install(site: Path, dist: str, entry: str) -> None:
    info = site / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[verl.plugins]\n{entry}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A site folder on the path holding the two broken distributions."""
    _install(tmp_path, "verl-ghost", "ghost = verl_ghost_missing_xyz.plugin")
    _install(tmp_path, "verl-exploding", "exploding = verl_exploding_plugin")
    (tmp_path / "verl_exploding_plugin.py").write_text("raise RuntimeError(\"the plugin's import failed on purpose\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_registry()
    yield tmp_path
    reset_registry()


def test_the_other_backends_load_and_the_broken_ones_are_listed_with_their_errors(
    site: Path, tally: Counter[str]
) -> None:
    registry = Registry()
    backends = registry.backends()
    assert {"hf", "toy"} <= set(backends) and not {"ghost", "exploding"} & set(backends)
    broken = registry.broken()
    assert sorted(broken) == ["exploding", "ghost"]
    assert (broken["ghost"].distribution, broken["ghost"].version, broken["ghost"].target) == (
        "verl-ghost", "0.3", "verl_ghost_missing_xyz.plugin")
    assert broken["ghost"].error == MISSING and broken["exploding"].error == RAISES
    tally["fuzz/broken plugin (missing module, raising module)"] += 2

    with pytest.raises(PluginError, match=rf"backend 'ghost': verl plugin 'ghost' \(verl_ghost_missing_xyz.plugin\) "
                                          rf"from verl-ghost 0.3 is installed but cannot be loaded: {MISSING}"):
        registry.backend("ghost")
    with pytest.raises(PluginError, match=RAISES):
        get_training_engine("exploding", EngineSpec(model_path="unused", role="actor"))
    with pytest.raises(UnknownNameError, match=rf"unknown advantage 'nope'; registered: .*; verl plugin 'exploding'.*{RAISES}"):
        registry.component("advantage", "nope")
    assert registry.backend("toy").distribution == "verl-toy-plugin"  # the others work as before


def test_verl_backends_lists_them_as_broken(site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    table = subprocess.run([sys.executable, "-m", "verl_core.cli", "backends"], capture_output=True, text=True,
                           timeout=120, env=env)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip()}
    assert "hf" in rows and "toy" in rows
    assert rows["ghost"].split()[1:3] == ["verl-ghost", "0.3"] and rows["ghost"].endswith(f"broken: {MISSING}")
    assert rows["exploding"].endswith(f"broken: {RAISES}")
    listing = subprocess.run([sys.executable, "-m", "verl_core.cli", "backends", "--json"], capture_output=True,
                             text=True, timeout=120, env=env)
    data = json.loads(listing.stdout)
    assert data["ghost"] == {"distribution": "verl-ghost", "version": "0.3", "roles": {}, "broken": MISSING}
    assert data["hf"]["roles"]["actor"] and "broken" not in data["hf"]


def test_only_a_run_that_selects_a_broken_plugin_fails(site: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "steps=2", "--check"]) == 0
    assert "config is valid" in capsys.readouterr().err
    out = tmp_path / "run"
    for role in ("actor", "rollout"):
        assert main(["train", f"backends.{role}=ghost", f"--output-dir={out}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"verl train: error: config key 'backends.{role}': backend 'ghost'")
        assert MISSING in err
    assert main(["sft", "data.train=x.jsonl", "backends.actor=exploding", "--check"]) == 2
    assert RAISES in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written
