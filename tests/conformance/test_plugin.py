"""The pytest plugin end to end: options, header, known gaps, reproduction snippets, subclassing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("broken_backends")


def _pytest(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_header_known_gaps_and_reproduction(tmp_path: Path) -> None:
    """One run: the header, a declared gap turned xfail, a warning for an unknown id, a failure with its snippet."""
    gaps = tmp_path / "gaps.txt"
    gaps.write_text(
        "# known gaps of a backend that ignores the temperature\n"
        "numerics::log_probs_match_reference  # temperature is not applied yet\n"
        "numerics::no_such_check  # a typo\n"
    )
    r = _pytest("--pyargs", "verl_conformance", "--verl-backend", "broken-temperature",
                "--verl-xfails-file", str(gaps), "-rxXf",
                "-k", "TestNumerics and (test_log_probs_match_reference or test_entropy_matches_reference)")
    out = r.stdout
    assert r.returncode == 1, out[-3000:]
    assert "verl backend: broken-temperature (VERL_PLUGINS verl_broken_backends.plugin:temperature, protocol 1.0)" in out
    assert "rollout: temperature, top_p" in out  # capabilities in the header
    assert "1 failed" in out and "1 xfailed" in out, out[-3000:]
    assert "known gap: temperature is not applied yet" in out
    assert "'numerics::no_such_check' matches no conformance check" in out
    assert "verl conformance: reproduce" in out
    assert "check_backend('broken-temperature', checks=['numerics::entropy_matches_reference'])" in out
    assert "entropy at temperature 0.7" in out


@pytest.mark.slow
def test_no_backend_selected_skips_with_the_reason() -> None:
    r = _pytest("--pyargs", "verl_conformance", "-k", "test_forward_layout", "-rs")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "no backend selected: run with --verl-backend NAME" in r.stdout


@pytest.mark.slow
def test_a_dtype_no_role_declares_is_refused_once_before_any_check() -> None:
    r = _pytest("--pyargs", "verl_conformance", "--verl-backend", "example", "--verl-dtype", "bfloat16")
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.count("--verl-dtype bfloat16: backend 'example' declares bfloat16 for none of its roles") == 1
    assert "actor float32" in r.stderr and "run with --verl-dtype float32" in r.stderr
    assert "passed" not in r.stdout and "failed" not in r.stdout


def test_a_role_that_does_not_declare_the_runs_dtype_skips_its_checks_with_the_reason() -> None:
    """A backend declaring bfloat16 for its rollout only: in a bfloat16 run its training checks skip, naming the dtypes."""
    from verl_conformance.errors import CheckSkipped
    from verl_conformance.harness import EngineCache, Harness, Subject

    def unreachable(spec: object) -> object:
        raise AssertionError("an engine of an undeclared dtype was built")

    subject = Subject("partial", unreachable, unreachable, roles=frozenset({"actor", "rollout"}),  # type: ignore[arg-type]
                      dtypes={"actor": frozenset({"float32"}), "rollout": frozenset({"float32", "bfloat16"})})
    harness = Harness(subject, None, EngineCache(), dtype="bfloat16")
    with pytest.raises(CheckSkipped, match=r"declares dtypes \['float32'\] for its actor engine .* in bfloat16"):
        harness.training()
    with pytest.raises(AssertionError, match="an engine of an undeclared dtype was built"):
        harness.rollout()  # declared: built (here the factory's error shows it was reached)
    with pytest.raises(AssertionError, match="an engine of an undeclared dtype was built"):
        harness.training(dtype="float32")  # another dtype than the run's is the check's own choice


@pytest.mark.slow
def test_third_party_subclass_with_own_fixtures(tmp_path: Path) -> None:
    """A backend that is not installed as a plugin runs the suite by overriding the engine fixtures."""
    (tmp_path / "test_mine.py").write_text(
        "import pytest\n"
        "from verl_conformance.suite import SchemaSuite, WeightSyncSuite\n"
        "from verl_example_backend.training import ExampleTrainingEngine\n"
        "from verl_broken_backends.engines import IgnoredWeightSync\n"
        "\n"
        "class TestMine(SchemaSuite, WeightSyncSuite):\n"
        "    @pytest.fixture\n"
        "    def make_training_engine(self):\n"
        "        return ExampleTrainingEngine\n"
        "\n"
        "    @pytest.fixture\n"
        "    def make_rollout_engine(self):\n"
        "        return IgnoredWeightSync\n"
    )
    r = _pytest(str(tmp_path / "test_mine.py"), "-k", "forward_layout or rollout_applies_stream", "-rA",
                cwd=tmp_path)
    out = r.stdout
    assert "PASSED" in out and "test_forward_layout" in out, out[-3000:]
    assert "FAILED" in out and "test_rollout_applies_stream" in out, out[-3000:]
    assert "a sync that does not apply the weights" in out
    # the snippet re-runs the test and the factories the fixtures returned
    assert "test_mine.py::TestMine::test_rollout_applies_stream'" in out
    assert "make_training_engine=ExampleTrainingEngine, make_rollout_engine=IgnoredWeightSync" in out


@pytest.mark.slow
def test_provided_roles_fixture_skips_the_checks_of_a_missing_role(tmp_path: Path) -> None:
    """Engines without a critic, given as fixtures, declare their roles; the critic's checks skip saying why."""
    (tmp_path / "test_mine.py").write_text(
        "import pytest\n"
        "from verl_conformance.suite import NumericsSuite, SchemaSuite\n"
        "from verl_core import ConfigError\n"
        "from verl_tiny_backend.training import build_training_engine\n"
        "\n"
        "def no_critic(spec):\n"
        "    if spec.role == 'critic':\n"
        "        raise ConfigError('this backend has no critic')\n"
        "    return build_training_engine(spec)\n"
        "\n"
        "class TestMine(SchemaSuite, NumericsSuite):\n"
        "    @pytest.fixture\n"
        "    def make_training_engine(self):\n"
        "        return no_critic\n"
        "\n"
        "    @pytest.fixture\n"
        "    def provided_roles(self):\n"
        "        return {'actor', 'reference'}\n"
    )
    r = _pytest(str(tmp_path / "test_mine.py"), "-k", "forward_layout or critic_layout or values_match_reference",
                "-rs", cwd=tmp_path)
    out = r.stdout
    assert r.returncode == 0, out[-3000:]
    assert "1 passed, 2 skipped" in out, out[-3000:]
    assert "SKIPPED [2]" in out and "backend 'TestMine' provides no training engine for role 'critic'" in out, out[-3000:]


@pytest.mark.slow
def test_cli_table_and_json(tmp_path: Path) -> None:
    out_json = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "verl_core.cli", "conformance", "broken-unseeded",
                        "--area", "invariance", "--json", str(out_json)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[invariance]" in r.stdout and "FAILED   seeded_sampling_reproducible" in r.stdout
    assert "SKIPPED  data_parallel_invariance" in r.stdout and "backend declares data_parallel=False" in r.stdout
    # a line per check on stderr as it ends, before the tables (a long run is never silent)
    lines = [line for line in r.stderr.splitlines() if line.startswith("[")]
    assert lines and lines[-1].startswith(f"[{len(lines)}/{len(lines)}] invariance::"), r.stderr[-3000:]
    assert any(" invariance::seeded_sampling_reproducible failed (" in line for line in lines), lines
    import json

    data = json.loads(out_json.read_text())
    status = {x["id"]: x["status"] for x in data["results"]}
    assert status["invariance::seeded_sampling_reproducible"] == "failed"
    assert status["invariance::micro_batch_invariance"] == "passed"


def test_cli_dtype_device_and_options(tmp_path: Path) -> None:
    """``verl conformance`` runs in the dtype and with the options asked, records them in the report, and
    refuses a dtype the backend never declares and options that are not a JSON object (exit 2)."""
    import json

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "verl_core.cli", "conformance", *args], capture_output=True,
                              text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "2"})

    r = cli("example", "--dtype", "bfloat16")
    assert r.returncode == 2 and "dtype bfloat16: backend 'example' declares bfloat16 for none of its roles" in r.stderr, \
        r.stderr[-2000:]
    r = cli("hf", "--options", "[1]")
    assert r.returncode == 2 and "--options must be a JSON object, got '[1]'" in r.stderr, r.stderr[-2000:]
    out_json = tmp_path / "bf16.json"
    r = cli("hf", "--dtype", "bfloat16", "--check", "schema::forward_layout", "--options", '{"rollout_cache": "dynamic"}',
            "--json", str(out_json))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert ", bfloat16 on cpu" in r.stdout.splitlines()[0], r.stdout[:500]
    data = json.loads(out_json.read_text())
    assert (data["dtype"], data["device"]) == ("bfloat16", "cpu")
    assert [(x["id"], x["status"]) for x in data["results"]] == [("schema::forward_layout", "passed")]
    r = cli("hf", "--check", "schema::forward_layout", "--options", '{"rollout_cache": "bogus"}',
            "--json", str(tmp_path / "bogus.json"))
    assert r.returncode == 1 and "rollout_cache': 'bogus' is not valid" in r.stdout, r.stdout[-3000:]
    assert "--verl-options '{\"rollout_cache\": \"bogus\"}'" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_verl_options_reach_every_engine_of_the_backend_under_test() -> None:
    # An invalid value proves the options reach the engines: the backend's own validation refuses it.
    r = _pytest("--pyargs", "verl_conformance", "--verl-backend", "hf", "-k", "test_forward_layout",
                "--verl-options", '{"rollout_cache": "bogus"}')
    assert r.returncode == 1, r.stdout[-3000:]
    assert "rollout_cache': 'bogus' is not valid; choices: 'auto', 'dynamic', 'static'" in r.stdout
    r = _pytest("--pyargs", "verl_conformance", "--verl-backend", "hf", "-k", "test_forward_layout",
                "--verl-options", '{"rollout_cache": "static"}')
    assert r.returncode == 0, r.stdout[-3000:]
    r = _pytest("--pyargs", "verl_conformance", "--verl-backend", "hf", "--verl-options", "[1]")
    assert r.returncode == 4 and "--verl-options must be a JSON object, got '[1]'" in r.stderr, r.stderr[-2000:]


def test_the_tiny_example_refuses_by_name_what_its_model_leaves_out(tmp_path: Path) -> None:
    """A folder declaring an MLP bias, a Llama o_proj bias or sliding windows is refused naming the setting."""
    import json
    import shutil

    from verl_tiny_backend.model import Cfg

    from verl_conformance.testkit import tiny_model
    from verl_core import ConfigError

    src = tiny_model()
    for key, value, named in (("mlp_bias", True, "mlp_bias"), ("attention_bias", True, "attention_bias"),
                              ("use_sliding_window", True, "sliding-window attention")):
        folder = tmp_path / key
        shutil.copytree(src, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ConfigError, match=f"does not implement {named}"):
            Cfg.load(str(folder))
    assert Cfg.load(str(src)).model_type == "llama"


def _config_of(example: str, folder: Path) -> tuple[int, float, float, str]:
    """(kv heads, rms_norm_eps, the RoPE's second inverse frequency, ``theta ** (-2 / head_dim)``, and the
    rope type a refusal names, else "-") of ``folder`` as the ``tiny`` or the ``example`` backend reads its
    config.json (the example backend computes default RoPE only and refuses any other type by name)."""
    from verl_example_backend.model import DecoderConfig
    from verl_tiny_backend.model import Cfg

    from verl_core import ConfigError

    if example == "tiny":
        cfg = Cfg.load(str(folder))
        return cfg.kv_heads, cfg.eps, float(cfg.rope.inv_freq[1]), "-"
    try:
        ex = DecoderConfig.from_folder(folder)
    except ConfigError as e:
        if "rope_type" not in str(e):
            raise
        return 0, 0.0, 0.0, str(e).rsplit("rope_type ", 1)[1]
    return ex.num_kv_heads, ex.rms_norm_eps, float(ex.rope_theta ** (-2 / ex.head_dim)), "-"


def _folder_with(tmp_path: Path, arch: str, name: str, drop: tuple[str, ...] = (), **keys: object) -> Path:
    """A copy of the test kit's ``arch`` folder whose config.json leaves ``drop`` out and sets ``keys``."""
    import json
    import shutil

    from verl_conformance.testkit import TinyModelSpec, tiny_model

    folder = tmp_path / f"{arch}-{name}"
    shutil.copytree(tiny_model(TinyModelSpec(arch=arch)), folder)  # type: ignore[arg-type]
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k not in drop}
    (folder / "config.json").write_text(json.dumps({**config, **keys}))
    return folder


@pytest.mark.parametrize("example", ["tiny", "example"])
def test_the_examples_read_rope_scaling_over_rope_parameters(tmp_path: Path, example: str) -> None:
    """writing-a-backend.md, RoPE scaling: a non-empty top-level rope_scaling replaces rope_parameters as a whole
    (its theta and its type); an empty one does not."""
    d = 32  # the test kit's head_dim
    both = _folder_with(tmp_path, "llama", "both", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                        rope_scaling={"rope_type": "default", "rope_theta": 500.0})
    assert _config_of(example, both)[2] == pytest.approx(500.0 ** (-2 / d)), "rope_parameters' theta read"
    linear = _folder_with(tmp_path, "llama", "linear", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    _, _, freq, rope_type = _config_of(example, linear)
    if example == "tiny":
        assert freq == pytest.approx(1e4 ** (-2 / d) / 2), "rope_scaling's linear factor ignored"
    else:  # the example computes default RoPE only and refuses another type by name
        assert rope_type == "'linear'", f"rope_scaling's linear type not read (read {rope_type})"
    empty = _folder_with(tmp_path, "llama", "empty-scaling", rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 500.0}, rope_scaling={})
    assert _config_of(example, empty)[2] == pytest.approx(500.0 ** (-2 / d)), "an empty rope_scaling replaced it"


@pytest.mark.parametrize("example", ["tiny", "example"])
@pytest.mark.parametrize(("arch", "kv_heads"), [("llama", "heads"), ("qwen2", 32), ("qwen3", 32)])
def test_the_examples_fill_omitted_keys_as_the_docs_table(tmp_path: Path, example: str, arch: str,
                                                         kv_heads: object) -> None:
    """writing-a-backend.md, Keys a config may omit: num_key_value_heads is num_attention_heads for Llama and 32
    for Qwen2 and Qwen3 (null: num_attention_heads for all three); rms_norm_eps is 1e-6 (null: a ConfigError
    naming the key and the file)."""
    import json

    from verl_core import ConfigError

    folder = _folder_with(tmp_path, arch, "omitted", drop=("num_key_value_heads", "rms_norm_eps"))
    heads = json.loads((folder / "config.json").read_text())["num_attention_heads"]
    kv, eps, _, _ = _config_of(example, folder)
    assert kv == (heads if kv_heads == "heads" else kv_heads), f"{arch} without num_key_value_heads gave {kv}"
    assert eps == 1e-6, f"{arch} without rms_norm_eps gave {eps}"
    null = _folder_with(tmp_path, arch, "null-kv", num_key_value_heads=None)
    assert _config_of(example, null)[0] == heads
    bad = _folder_with(tmp_path, arch, "null-eps", rms_norm_eps=None)
    with pytest.raises(ConfigError, match=r"config\.json: rms_norm_eps is null"):
        _config_of(example, bad)


@pytest.mark.parametrize("example", ["tiny", "example"])
@pytest.mark.parametrize(("arch", "default"), [("llama", "hidden/heads"), ("qwen2", "hidden/heads"), ("qwen3", 128)])
def test_the_examples_fill_head_dim_as_the_docs_table(tmp_path: Path, example: str, arch: str, default: object) -> None:
    """writing-a-backend.md, Keys a config may omit: head_dim is hidden_size / num_attention_heads for Llama and
    Qwen2 and 128 for Qwen3; a null head_dim is refused by Qwen3 (a ConfigError naming the key and the file)."""
    import json

    from verl_example_backend.model import DecoderConfig
    from verl_tiny_backend.model import Cfg

    from verl_core import ConfigError

    def head_dim(folder: Path) -> int:
        return Cfg.load(str(folder)).head_dim if example == "tiny" else DecoderConfig.from_folder(folder).head_dim

    folder = _folder_with(tmp_path, arch, "no-head-dim", drop=("head_dim",))
    raw = json.loads((folder / "config.json").read_text())
    want = raw["hidden_size"] // raw["num_attention_heads"] if default == "hidden/heads" else default
    assert head_dim(folder) == want, f"{arch} without head_dim"
    null = _folder_with(tmp_path, arch, "null-head-dim", head_dim=None)
    if arch == "qwen3":
        with pytest.raises(ConfigError, match=r"config\.json: head_dim is null"):
            head_dim(null)
    else:
        assert head_dim(null) == raw["hidden_size"] // raw["num_attention_heads"]


def test_the_tiny_example_reads_long_rope_without_max_position_embeddings(tmp_path: Path) -> None:
    """A LongRoPE Llama folder that leaves max_position_embeddings out takes 2048 (the docs table), not a
    bare KeyError."""
    import json
    import shutil

    from verl_tiny_backend.model import Cfg

    from verl_conformance.testkit import long_rope_model

    folder = tmp_path / "long-rope"
    shutil.copytree(long_rope_model(), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("max_position_embeddings", None)
    (folder / "config.json").write_text(json.dumps(raw))
    assert Cfg.load(str(folder)).model_type == "llama"
