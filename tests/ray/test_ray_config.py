"""The ``executor`` and ``[ray]`` config keys are validated; a missing Ray says how to install it."""

from __future__ import annotations

import sys

import pytest

from verl_core.kernel.errors import ConfigError
from verl_core.trainer.config import load_config
from verl_core.trainer.executor import LocalExecutor, RayConfig, make_executor


def test_default_is_local_and_ray_is_accepted() -> None:
    assert load_config(None, []).executor == "local"
    cfg = load_config(None, ["executor=ray", "ray.placement=colocated", "ray.parallel={actor={dp=2}}",
                             "ray.num_cpus_per_worker=0.5"])
    assert cfg.executor == "ray"
    assert cfg.ray.placement == "colocated"
    assert cfg.ray.parallel_of("actor") is not None and cfg.ray.parallel_of("actor").dp == 2  # type: ignore[union-attr]
    assert cfg.ray.parallel_of("critic") is None
    assert cfg.ray.max_rollout_restarts == 3
    assert load_config(None, ["ray.max_rollout_restarts=0"]).ray.max_rollout_restarts == 0
    assert isinstance(make_executor("local"), LocalExecutor)


@pytest.mark.parametrize(("override", "message"), [
    ("executor=slurm", "config key 'executor': 'slurm' is not valid; choices: 'local', 'ray'"),
    ("ray.placement=mixed", "config key 'ray.placement': 'mixed' is not valid"),
    ("ray.workers=2", "unknown config key 'ray.workers'"),
    ("ray.num_cpus_per_worker=-1", "'ray.num_cpus_per_worker' must be >= 0"),
    ("ray.parallel={learner={dp=2}}", "'ray.parallel.learner': unknown role"),
    ("ray.parallel={actor={ep=2}}", "'ray.parallel.actor.ep': unknown; valid keys: tp, pp, dp"),
    ("ray.parallel={actor={dp=0}}", "'ray.parallel.actor.dp' must be an integer >= 1"),
    ("ray.parallel={rollout={tp=2}}", "only dp \\(replicas\\) is placed by the executor"),
    ("ray.max_rollout_restarts=-1", "'ray.max_rollout_restarts' must be >= 0 \\(0 = a dead rollout worker fails"),
])
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_executor_name() -> None:
    with pytest.raises(ConfigError, match="unknown executor 'k8s'; choices: 'local', 'ray'"):
        make_executor("k8s")


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'verl-core\[ray\]'"):
        make_executor("ray", RayConfig())


def test_importing_the_executor_package_leaves_ray_out() -> None:
    import subprocess

    code = "import verl_core.trainer.executor, verl_core.trainer.rl.trainer, sys; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
