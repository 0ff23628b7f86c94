"""Loading never runs code that came with the data, and plugins come only from installed entry points.

- Every ``torch.load`` in the repository (packages, backends, conformance, examples, benchmarks,
  tests) passes ``weights_only=True``; no source file unpickles (``pickle``/``dill``/``joblib``
  loads, ``np.load(allow_pickle=True)``) and none passes ``trust_remote_code=True``.
- A model folder whose config or tokenizer points at custom code (``auto_map``) is refused by
  every hf engine role and by the megatron backend's config reader, and its code never runs.
- A module that declares a backend but is not an installed entry point is never loaded, and
  ``VERL_DISABLE_PLUGIN_AUTOLOAD=1`` loads no plugin at all while the built-in algorithms stay.
(Batch files and checkpoints holding code-running pickles: test_fuzz_batch.py, test_checkpoints.py.)
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from verl_conformance.testkit import TinyModelSpec, build_tiny_model
from verl_core import (
    EngineSpec,
    VerlError,
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
)

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("packages", "conformance", "examples", "benchmarks", "tests", "scripts")


def _sources() -> list[Path]:
    out = []
    for top in SCANNED:
        for p in (ROOT / top).rglob("*.py"):
            if not any(part in (".venv", "build", "dist", "node_modules") or part.startswith(".") for part in p.parts):
                out.append(p)
    return out


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


UNPICKLERS = ("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load", "dill.loads", "cloudpickle.load",
              "cloudpickle.loads", "joblib.load", "marshal.loads")


def test_no_source_file_unpickles_or_trusts_remote_code(tally: Counter[str]) -> None:
    bad: list[str] = []
    loads = 0
    files = _sources()
    assert len(files) > 100
    for path in files:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        tree = ast.parse(text, str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name.endswith("torch.load"):
                loads += 1
                flag = _kw(node, "weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    bad.append(f"{where}: torch.load without weights_only=True")
            library = path.relative_to(ROOT).parts[0] in ("packages", "conformance")
            if library and name in UNPICKLERS:
                bad.append(f"{where}: {name}")
            if library and name.endswith(".from_pretrained"):
                flag = _kw(node, "trust_remote_code")
                via_dict = any(k.arg is None for k in node.keywords) and '"trust_remote_code": False' in text
                if not via_dict and not (isinstance(flag, ast.Constant) and flag.value is False):
                    # without an explicit False, transformers may ask on a terminal and run the code
                    bad.append(f"{where}: from_pretrained without trust_remote_code=False")
            if name.endswith("np.load") or name.endswith("numpy.load"):
                flag = _kw(node, "allow_pickle")
                if isinstance(flag, ast.Constant) and flag.value is True:
                    bad.append(f"{where}: np.load(allow_pickle=True)")
            flag = _kw(node, "trust_remote_code")
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                bad.append(f"{where}: trust_remote_code={ast.unparse(flag)}")
    tally["scan/source files checked for unsafe loading"] += len(files)
    assert loads >= 5, "the scan found too few torch.load calls: it is not looking at the code"
    assert not bad, "unsafe loading:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------- remote code
MARKER_ENV = "VERL_RELIABILITY_REMOTE_CODE_MARKER"


def _remote_code_folder(tmp: Path, where: str, head: str = "causal_lm") -> tuple[Path, Path]:
    """A tiny model folder whose config (or tokenizer config) maps to a code file that leaves a marker."""
    path = build_tiny_model(tmp / "model", TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                                                         head_dim=32, intermediate_size=64, head=head))  # type: ignore[arg-type]
    marker = tmp / "remote-code-ran"
    (path / "rogue.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class RogueConfig(LlamaConfig):\n    model_type = 'rogue'\n"
        "class RogueModel(LlamaForCausalLM):\n    config_class = RogueConfig\n"
        "class RogueTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    if where == "config":
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(model_type="rogue", auto_map={
            "AutoConfig": "rogue.RogueConfig", "AutoModelForCausalLM": "rogue.RogueModel",
            "AutoModelForTokenClassification": "rogue.RogueModel",
            "AutoModelForSequenceClassification": "rogue.RogueModel",
        })
        (path / "config.json").write_text(json.dumps(cfg))
    else:
        tok = json.loads((path / "tokenizer_config.json").read_text())
        tok["auto_map"] = {"AutoTokenizer": [None, "rogue.RogueTokenizer"]}
        tok["tokenizer_class"] = "RogueTokenizer"
        (path / "tokenizer_config.json").write_text(json.dumps(tok))
    return path, marker


@pytest.mark.parametrize(("role", "where"), [("actor", "config"), ("rollout", "config"), ("reward", "config"),
                                             ("actor", "tokenizer"), ("rollout", "tokenizer")])
def test_hf_engines_never_run_code_shipped_with_a_model(
    role: str, where: str, tmp_path: Path, tally: Counter[str]
) -> None:
    path, marker = _remote_code_folder(tmp_path, where, "reward" if role == "reward" else "causal_lm")
    spec = EngineSpec(model_path=str(path), role=role)  # type: ignore[arg-type]
    build = {"actor": get_training_engine, "rollout": get_rollout_engine, "reward": get_reward_engine}[role]
    tally[f"fuzz/model folder with remote code ({where})"] += 1
    def load() -> object:
        # training engines load their tokenizer on first use
        return build("hf", spec).tokenizer

    with pytest.raises(VerlError, match="trust_remote_code|custom code"):
        load()
    assert not marker.exists(), "code shipped with the model folder ran"


def test_megatron_config_reader_never_runs_code_shipped_with_a_model(tmp_path: Path, tally: Counter[str]) -> None:
    path, marker = _remote_code_folder(tmp_path, "config")
    code = (
        "import sys\nfrom verl_megatron.model import model_dims\n"
        "try:\n    model_dims(sys.argv[1], 'lm')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "else:\n    print('loaded')\n"
    )
    tally["fuzz/model folder with remote code (megatron)"] += 1
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "loaded" not in out.stdout.splitlines(), out.stdout
    assert not marker.exists(), "code shipped with the model folder ran"


# ---------------------------------------------------------------------------------------- plugins
def _python(code: str, tmp: Path, **env: str) -> str:
    rogue = tmp / "rogue_pkg"
    rogue.mkdir(exist_ok=True)
    marker = tmp / "rogue-imported"
    (rogue / "verl_rogue_backend.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).touch()\n"
        "from verl_core import hookimpl\n"
        "@hookimpl\ndef verl_backend():\n    raise SystemExit('a rogue plugin ran')\n"
    )
    full_env = {**os.environ, "PYTHONPATH": str(rogue), **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full_env)
    assert out.returncode == 0, out.stderr
    assert not marker.exists(), "a module that is not an installed entry point was imported"
    return out.stdout


def test_only_installed_entry_points_are_loaded(tmp_path: Path, tally: Counter[str]) -> None:
    code = (
        "import sys\nfrom verl_core import available_backends\n"
        "names = sorted(available_backends())\n"
        "print(' '.join(names))\n"
    )
    tally["fuzz/plugin discovery (module on the path, not an entry point)"] += 1
    names = _python(code, tmp_path).split()
    assert "rogue" not in names and all("rogue" not in n for n in names)


def test_autoload_off_loads_no_plugin_and_keeps_the_builtin_algorithms(tmp_path: Path, tally: Counter[str]) -> None:
    code = (
        "import sys\nfrom verl_core import available_backends\nfrom verl_core.algorithms import Algorithm\n"
        "print(len(available_backends()))\n"
        "print(Algorithm.grpo().name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('verl_hf', 'verl_megatron', 'verl_vllm', "
        "'verl_example', 'verl_broken'))))\n"
    )
    tally["fuzz/plugin discovery (autoload off)"] += 1
    lines = _python(code, tmp_path, VERL_DISABLE_PLUGIN_AUTOLOAD="1").splitlines()
    assert lines == ["0", "grpo", "[]"], lines
    out = subprocess.run([sys.executable, "-m", "verl_core.cli", "backends", "--json"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "VERL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0 and json.loads(out.stdout) == {}
