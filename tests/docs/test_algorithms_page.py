"""docs/algorithms.md lists every preset with exactly the options and defaults its constructor takes."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from verl_core.algorithms import PRESET_TABLE, PRESETS, preset_options
from verl_core.algorithms.config import AGG_MODES, KL_ESTIMATORS
from verl_core.kernel.registry import get_registry

PAGE = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
_OPTION = re.compile(r"`(\w+)=([^`]*)`")


def preset_rows() -> dict[str, str]:
    """Preset name -> the options cell of the table under '## Presets and their options'."""
    text = PAGE.read_text(encoding="utf-8").partition("## Presets and their options\n")[2]
    assert text, "docs/algorithms.md lost its '## Presets and their options' section"
    rows: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`(\w+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
        elif rows and not line.startswith("|"):
            break
    return rows


def signature_options(preset: str) -> dict[str, Any]:
    """Keyword options (name -> default) of the preset, as the trainer accepts them."""
    return preset_options(PRESET_TABLE[preset])


def test_every_preset_has_a_row() -> None:
    """The table has a row per preset of the preset table (dapo and grpo_token included)."""
    assert set(preset_rows()) == set(PRESET_TABLE)


def test_rows_match_the_constructors() -> None:
    """Each row names every option with its default, in order, and nothing else."""
    rows = preset_rows()
    for preset in PRESETS:
        documented = [(k, ast.literal_eval(v.replace("null", "None"))) for k, v in _OPTION.findall(rows[preset])]
        actual = list(signature_options(preset).items())
        assert documented == actual, (
            f"docs/algorithms.md row {preset!r} is stale:\n page: {documented}\n code: {actual}"
        )


def test_named_components_exist() -> None:
    """Every aggregation mode, KL estimator and built-in loss the page names is registered."""
    text = PAGE.read_text(encoding="utf-8")
    registry = get_registry()
    for mode in AGG_MODES:
        assert f"`{mode}`" in text, f"aggregation mode {mode!r} is not documented"
    for name in ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"):
        assert name in KL_ESTIMATORS and f"`{name}`" in text
        registry.component("kl", name)
    for loss in ("ppo", "gspo", "cispo", "reinforce", "importance_sampling"):
        registry.component("policy_loss", loss)
        assert f"| `{loss}` |" in text, f"policy loss {loss!r} has no row"
    for est in ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"):
        registry.component("advantage", est)
        assert f"| `{est}` |" in text, f"advantage estimator {est!r} has no row"


def test_config_keys_match_the_run_config() -> None:
    """The page's key table names every field of the ``[algorithm]`` section, and only those."""
    import dataclasses

    from verl_core.trainer.config import AlgorithmConfig

    text = PAGE.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `algorithm\.(\w+)` \|", text, flags=re.MULTILINE))
    fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    assert documented == fields, f"[algorithm] keys: page {sorted(documented)}, RunConfig {sorted(fields)}"
