"""The backends of a run against what the ``model`` section asks of them, checked before the output folder
is claimed; and the line a run prints when its roles use more than one backend.

The tiny backend (examples/tiny-backend, installed) declares float32 and cpu only, and no LoRA: the
real backend of a third party that declares less than hf does.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from verl_core import ConfigError
from verl_core.cli import main
from verl_core.trainer import Trainer
from verl_core.trainer.config import BackendsConfig, load_config
from verl_core.trainer.run.backends import check_backends

# a one-step run small enough to build every engine in a few seconds
TINY = ("task.name=copy", "task.digits=1", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_heads=1", "model.num_kv_heads=1", "model.num_layers=1", "rollout.n=2",
        "rollout.max_new_tokens=3", "batch.prompts_per_step=2", "batch.micro_batch_tokens=64",
        "logging.plot=false", "steps=1")
# every role of a GRPO run (actor, rollout, reference) on the tiny backend
ALL_TINY = ("backends.actor=tiny", "backends.rollout=tiny", "backends.reference=tiny")


def _train(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["train", *argv])
    return code, capsys.readouterr().err


def test_check_refuses_a_dtype_the_backends_do_not_declare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, err = _train([*TINY, *ALL_TINY, "model.dtype=bfloat16", "--check", "--output-dir", str(out)], capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert ("config key 'model.dtype' = 'bfloat16', but backend 'tiny' (config key 'backends.actor') declares its "
            "actor engine runs in float32 only; set model.dtype to float32") in err, err
    assert not out.exists()
    # the dtype it declares passes
    code, err = _train([*TINY, *ALL_TINY, "model.dtype=float32", "--check", "--output-dir", str(out)], capsys)
    assert code == 0 and "config is valid" in err, err


def test_a_run_with_an_undeclared_dtype_claims_no_folder_and_a_retry_there_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run (no --check) is refused before it writes anything, so the corrected run starts in the same folder."""
    out = tmp_path / "run"
    code, err = _train([*TINY, *ALL_TINY, "model.dtype=bfloat16", "--output-dir", str(out)], capsys)
    assert code == 2 and "'model.dtype' = 'bfloat16'" in err, err
    assert not out.exists(), f"the refused run wrote {sorted(p.name for p in out.iterdir())}"
    code, err = _train([*TINY, *ALL_TINY, "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert (out / "verl_run.json").is_file()


@pytest.mark.parametrize("role", ["rollout", "reference", "critic"])
def test_each_role_s_declared_dtypes_are_checked(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    """hf declares bfloat16 for every role; one role on the tiny backend is enough to refuse it."""
    code, err = _train([*TINY, "algorithm.name=ppo", f"backends.{role}=tiny", "model.dtype=bfloat16", "--check"],
                       capsys)
    assert code == 2, err
    assert f"backend 'tiny' (config key 'backends.{role}') declares its {role} engine runs in float32 only" in err, err


def test_the_device_is_checked_against_each_backend(tmp_path: Path) -> None:
    """``model.device`` names a device type the backend does not declare (checked without a GPU here:
    whether this machine has one is check_device_here's business)."""
    cfg = load_config(None, [*TINY, "backends.rollout=tiny", "model.device=cuda:1", f"output_dir={json.dumps(str(tmp_path))}"])
    with pytest.raises(ConfigError, match=r"config key 'model.device' = 'cuda:1', but backend 'tiny' \(config key "
                                          r"'backends.rollout'\) declares its rollout engine runs on cpu only; "
                                          r"set model.device to cpu"):
        check_backends(cfg, {"actor": "hf", "rollout": "tiny"})
    check_backends(cfg, {"actor": "hf", "rollout": "hf"})  # hf declares cuda


def test_lora_is_checked_against_the_actor_and_the_adapter_rollout(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _train([*TINY, "backends.actor=tiny", "model.lora.enabled=true", "--check"], capsys)
    assert code == 2 and "config key 'model.lora.enabled' is true, but backend 'tiny' (config key 'backends.actor')" in err, err
    # the rollout is given the adapter only under adapter sync
    code, err = _train([*TINY, "backends.rollout=tiny", "model.lora.enabled=true", "--check"], capsys)
    assert code == 0, err
    code, err = _train([*TINY, "backends.rollout=tiny", "model.lora.enabled=true", "model.lora.sync=adapter",
                        "--check"], capsys)
    assert code == 2 and "config key 'model.lora.sync' = 'adapter', but backend 'tiny'" in err, err


# ---------------------------------------------------------------------------- the backend of each role
def test_an_unset_role_is_hf_and_a_run_mixing_backends_names_each_role_s(tmp_path: Path) -> None:
    assert "A role left unset runs on ``hf``" in (BackendsConfig.__doc__ or "")
    cfg = load_config(None, [*TINY, "algorithm.name=ppo", "backends.actor=tiny", "backends.rollout=tiny",
                             "backends.reference=tiny", f"output_dir={json.dumps(str(tmp_path / 'mixed'))}"])
    stream = io.StringIO()
    with Trainer(cfg, stream=stream) as trainer:
        trainer.setup()
        assert trainer.critic is not None and type(trainer.critic).__module__.startswith("verl_hf")
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("backends:")]
    assert lines == ["backends: actor tiny, rollout tiny, reference tiny, critic hf"]


def test_the_backends_line_names_the_reward_and_shows_with_progress_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Actor and reference on hf, the rollout and the reward model elsewhere, no progress bar: the line lists
    the reward's backend and is a WARNING of the trainer's logger (Python prints it on stderr unconfigured)."""
    cfg = load_config(None, [*TINY, "algorithm.use_reference=true", "backends.rollout=tiny", "backends.reward=toy",
                             "logging.progress=false", f"output_dir={json.dumps(str(tmp_path / 'mixed'))}"])
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="verl_core"), Trainer(cfg, stream=stream) as trainer:
        assert trainer.backend_roles() == {"actor": "hf", "rollout": "tiny", "reference": "hf", "reward": "toy"}
        trainer.setup()
    lines = [(r.levelno, r.name, r.getMessage()) for r in caplog.records if r.getMessage().startswith("backends:")]
    assert lines == [(logging.WARNING, "verl_core.trainer.rl.trainer",
                      "backends: actor hf, rollout tiny, "
                      "reference hf, reward toy")]
    assert stream.getvalue() == ""  # no progress bar: nothing is written above one
    # the rule reward is no engine: not listed
    rule = load_config(None, [*TINY, "backends.rollout=tiny", f"output_dir={json.dumps(str(tmp_path / 'rule'))}"])
    with Trainer(rule) as trainer:
        assert trainer.backend_roles() == {"actor": "hf", "rollout": "tiny", "reference": "hf"}


def test_a_run_on_one_backend_prints_no_backends_line(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, *ALL_TINY, f"output_dir={json.dumps(str(tmp_path / 'one'))}"])
    stream = io.StringIO()
    with Trainer(cfg, stream=stream) as trainer:
        assert trainer.backend_roles() == dict.fromkeys(("actor", "rollout", "reference"), "tiny")
        trainer.setup()
    assert "backends:" not in stream.getvalue()


@pytest.mark.parametrize("partial", ["continue", "restart"])
def test_check_refuses_partial_rollouts_on_a_rollout_without_concurrent_weight_updates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], partial: str
) -> None:
    """The example backend's rollout takes no weights while it generates: --check says so, before any folder."""
    out = tmp_path / "run"
    async_keys = ["async_training.mode=async", "async_training.max_staleness=1",
                  f"async_training.partial_rollouts={partial}"]
    code, err = _train([*TINY, "backends.rollout=example", *async_keys, "--check", "--output-dir", str(out)], capsys)
    assert code == 2, err
    assert (f"config key 'async_training.partial_rollouts' = '{partial}'" in err
            and "backend 'example' (config key 'backends.rollout')" in err
            and "concurrent_weight_update" in err), err
    assert not out.exists()
    code, err = _train([*TINY, "backends.rollout=example", *async_keys[:2], "--check", "--output-dir", str(out)],
                       capsys)
    assert code == 0 and "config is valid" in err, err


def test_the_python_api_refuses_an_undeclared_dtype_before_it_claims_the_folder(tmp_path: Path) -> None:
    """Trainer.setup() from Python checks the backends as `verl train` does, before writing anything."""
    out = tmp_path / "run"
    cfg = load_config(None, [*TINY, *ALL_TINY, "model.dtype=bfloat16", f"output_dir={json.dumps(str(out))}"])
    with Trainer(cfg) as trainer, pytest.raises(ConfigError, match="'model.dtype' = 'bfloat16'.*float32 only"):
        trainer.setup()
    assert not out.exists()


# ---------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_is_checked_against_the_trained_roles(capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny backend declares no gradient checkpointing: refused for the actor and the critic, which
    train; a tiny reference or rollout is not asked for it."""
    code, err = _train([*TINY, "backends.actor=tiny", "model.gradient_checkpointing=true", "--check"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("config key 'model.gradient_checkpointing' is true, but backend 'tiny' (config key 'backends.actor') "
            "does not declare gradient checkpointing for its actor engine") in err, err
    code, err = _train([*TINY, "algorithm.name=ppo", "backends.critic=tiny", "model.gradient_checkpointing=true",
                        "--check"], capsys)
    assert code == 2 and "(config key 'backends.critic') does not declare gradient checkpointing" in err, err
    code, err = _train([*TINY, "backends.reference=tiny", "backends.rollout=tiny", "model.gradient_checkpointing=true",
                        "--check"], capsys)
    assert code == 0, err


def test_gradient_checkpointing_reaches_the_actor_and_trains_as_without(tmp_path: Path) -> None:
    """``model.gradient_checkpointing`` is the actor's ``EngineSpec.gradient_checkpointing`` (hf recomputes
    its activations), not the reference's; the step's loss and gradient norm are those of a run without it."""
    runs = {}
    for on in (False, True):
        cfg = load_config(None, [*TINY, "algorithm.use_reference=true", "algorithm.options.kl_loss_coef=0.01",
                                 f"model.gradient_checkpointing={'true' if on else 'false'}",
                                 f"output_dir={json.dumps(str(tmp_path / str(on)))}", "logging.sinks=[]"])
        with Trainer(cfg) as trainer:
            trainer.setup()
            assert trainer.actor.spec.gradient_checkpointing is on
            assert trainer.reference is not None and trainer.reference.spec.gradient_checkpointing is False
            assert trainer.actor.model.is_gradient_checkpointing is on  # type: ignore[attr-defined]
            runs[on] = trainer.train()[-1]
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-5, abs=1e-7), key


def test_a_run_whose_built_roles_name_another_backend_needs_no_hf(tmp_path: Path) -> None:
    """GRPO builds no critic: its ``backends.critic`` (``hf`` by default) is never imported, so a run
    whose actor, rollout and reference are another backend trains with ``verl_hf`` unimportable."""
    import subprocess
    import sys

    argv = [*TINY, *ALL_TINY, f"output_dir={json.dumps(str(tmp_path / 'run'))}"]
    code = ("import sys; sys.modules['verl_hf'] = None\n"  # every `import verl_hf` now raises ImportError
            "from verl_core.cli import main\n"
            f"rc = main(['train', *{argv!r}])\n"
            "assert 'verl_hf' in sys.modules and sys.modules['verl_hf'] is None, 'verl_hf was imported'\n"
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file(), done.stderr[-3000:]


def test_rollout_stop_token_ids_reach_every_rollout_call_and_are_checked(tmp_path: Path) -> None:
    """``rollout.stop_token_ids`` goes into the training rollout's and evaluation's SamplingParams;
    an id past the vocabulary, or a rollout backend that declares no stop ids, is refused by name
    before the output folder is claimed."""
    import dataclasses

    from verl_core.kernel.capabilities import RolloutCapabilities
    from verl_core.trainer.run import backends as run_backends
    from verl_core.trainer.run.model import check_model_folders

    cfg = load_config(None, [*TINY, "rollout.stop_token_ids=[5, 7]", f"output_dir={json.dumps(str(tmp_path / 'a'))}"])
    assert cfg.rollout.stop_token_ids == (5, 7)
    assert cfg.rollout.sampling_params(seed=3).stop_token_ids == (5, 7)
    assert cfg.rollout.sampling_params(seed=0, n=1, greedy=True).stop_token_ids == (5, 7)
    with Trainer(cfg, stream=io.StringIO()) as trainer:
        assert trainer.sampling_params().stop_token_ids == (5, 7)

    far = load_config(None, [*TINY, "rollout.stop_token_ids=[5, 96]", f"output_dir={json.dumps(str(tmp_path / 'b'))}"])
    with pytest.raises(ConfigError, match=r"config key 'rollout.stop_token_ids' = \[5, 96\]: 96 not in \[0, 96\), "
                                          r"the vocabulary \(model.vocab_size\)"):
        check_model_folders(far, use_critic=False)
    assert not (tmp_path / "b").exists()
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50}))
    on_path = load_config(None, [*TINY, "rollout.stop_token_ids=[49, 60]", f"model.path={json.dumps(str(folder))}"])
    with pytest.raises(ConfigError, match=r"60 not in \[0, 50\), the vocabulary \(model.path .*config.json\)"):
        check_model_folders(on_path, use_critic=False)
    with pytest.raises(ConfigError, match=r"config key 'rollout.stop_token_ids'.* -1"):
        load_config(None, [*TINY, "rollout.stop_token_ids=[-1]"])

    no_stops = dataclasses.replace(RolloutCapabilities(), stop_token_ids=False)
    with pytest.raises(ConfigError, match=r"'rollout.stop_token_ids' = \[5, 7\], but backend 'tiny' .* does not "
                                          r"declare stop token ids"):
        run_backends._check_declared(cfg, "rollout", "tiny", no_stops)
    run_backends._check_declared(cfg, "rollout", "tiny", RolloutCapabilities())  # declared: accepted


@pytest.mark.parametrize(("rollout", "path", "direct"),
                         [("hf", "HFDirectSync", 1.0), ("tiny", "the weight stream (StreamWeightSync)", 0.0)])
def test_the_weight_sync_path_is_logged_and_in_the_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], rollout: str, path: str,
    direct: float
) -> None:
    """Which sync moves the weights (a plugin's direct path or the canonical stream) is named once at setup,
    and each step's weight_sync/direct says which path moved them (the other metrics look the same)."""
    out = tmp_path / rollout
    with caplog.at_level(logging.INFO, logger="verl_core"):
        code, err = _train([*TINY, f"backends.rollout={rollout}", "--output-dir", str(out)], capsys)
    assert code == 0, err
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight sync from")]
    assert lines == [f"weight sync from the actor (hf) to the rollout ({rollout}): {path}"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_sync/direct"] for m in metrics] == [direct]


def test_a_sync_reports_details_become_weight_sync_metrics() -> None:
    """SyncReport.details reach the step's metrics as weight_sync/<key>, beside weight_sync/bytes (durations
    under time/, which a resumed run need not repeat)."""
    from types import SimpleNamespace

    from verl_core.kernel.weights import SyncReport
    from verl_core.trainer.rl.weight_sync import WeightSyncStage

    class Direct:
        def sync(self, source: object, target: object, *, version: int) -> SyncReport:
            return SyncReport(version, 3, 120, 0.01, {"buckets": 2, "direct": 1.0, "reshard_s": 0.25})

    engines = SimpleNamespace(actor=object(), rollout=object(), sync=Direct())
    progress = SimpleNamespace(weight_version=4, stage="update")
    state = SimpleNamespace(metrics={}, timings={})
    WeightSyncStage(engines, progress).sync(state)  # type: ignore[arg-type]
    assert state.metrics == {"weight_sync/bytes": 120, "weight_sync/buckets": 2.0, "weight_sync/direct": 1.0}
    assert state.timings["time/weight_sync/reshard_s"] == 0.25  # a duration: with the time/* metrics
    assert progress.weight_version == 5
