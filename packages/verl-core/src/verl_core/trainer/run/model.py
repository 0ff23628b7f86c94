"""The run's model and engine specs: the tiny random model a run builds when ``model.path`` is empty,
the check of the critic's and reward model's folders, and the :class:`~verl_core.kernel.engine.EngineSpec`
of each role from the run config."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from verl_core.kernel.engine import EngineSpec, LoraSpec, OptimConfig, Role
from verl_core.kernel.errors import ConfigError, StorageError
from verl_core.trainer.config import RunConfig
from verl_core.trainer.run.checkpoints import write_failed
from verl_core.trainer.run.folder import RunDir

__all__ = ["build_run_model", "check_model_folders", "engine_spec", "lora_of", "lora_sync"]

TRAINED_ROLES: tuple[str, ...] = ("actor", "critic")
"""The roles whose engines run backward passes (``model.gradient_checkpointing`` applies to them)."""


def check_model_folders(config: RunConfig, *, use_critic: bool) -> None:
    """Refuse a ``critic_model`` (when the run has a critic) or ``reward_model`` that is not an existing folder.

    Runs before the output folder is claimed (``Trainer.setup``, ``verl train --check``), so a
    misspelt folder fails with nothing written. With an executor other than ``local`` the folders
    are the workers' to find (as the backends are), so nothing is checked here.

    Args:
        config: The run.
        use_critic: The run builds a critic (its folder is ``critic_model`` when set).

    Also refuses a ``rollout.stop_token_ids`` entry outside the model's vocabulary (``model.path``'s
    ``config.json``, or ``model.vocab_size`` for the run's tiny model).

    Raises:
        ConfigError: naming the key, its value and whether the path is missing or a file (or the
            stop id and the vocabulary).
    """
    _check_stop_ids(config)
    if config.executor != "local":
        return
    keys = (("critic_model", config.critic_model if use_critic else ""), ("reward_model", config.reward_model))
    for key, value in keys:
        if not value:
            continue
        try:
            folder = Path(value).is_dir()
            what = "is a file, not a folder" if Path(value).exists() else "does not exist"
        except (OSError, ValueError) as e:  # a name the system refuses: too long, a NUL byte
            folder, what = False, f"cannot be a folder name ({getattr(e, 'strerror', None) or e})"
        if not folder:
            raise ConfigError(
                f"config key {key!r} = {value!r} {what}; expected the folder of the {key.partition('_')[0]} model "
                "(for the hf backend a transformers folder with config.json and its weights)"
            )


def _check_stop_ids(config: RunConfig) -> None:
    """Every ``rollout.stop_token_ids`` entry is a row of the model's vocabulary (when it is known)."""
    from verl_core.enginekit.model_folder import vocab_size

    stops = config.rollout.stop_token_ids
    if not stops:
        return
    path = config.model.path
    vocab = vocab_size(path) if path else config.model.vocab_size
    where = f"model.path {path!r}'s config.json" if path else "model.vocab_size"
    bad = [t for t in stops if vocab is not None and t >= vocab]
    if bad:
        raise ConfigError(
            f"config key 'rollout.stop_token_ids' = {list(stops)}: {', '.join(map(str, bad))} not in [0, {vocab}), "
            f"the vocabulary ({where}); a rollout can never sample such an id, so it would never stop on it"
        )


def build_run_model(config: RunConfig, run: RunDir, *, max_position: int) -> str:
    """The run's model folder: ``model.path``, or a tiny random model built in ``<output_dir>/model``.

    The tiny model (shape from the ``model`` section, init seeded by ``seed``) is built once, in a
    temporary folder named by the run id that is renamed into place, so a killed build never
    leaves a partial model and never touches another run's files.

    Raises:
        ConfigError: ``model.path`` is empty and transformers is not installed.
    """
    m = config.model
    if m.path:
        return m.path
    dest = run.path / "model"
    if (dest / "config.json").is_file():
        return str(dest)
    from verl_core.trainer.inputs.tiny_model import TinyModelSpec, build_tiny_model

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "config key 'model.path' is empty, which builds a tiny random model with transformers; "
            "install it (pip install verl-hf) or set model.path to a transformers folder"
        )
    spec = TinyModelSpec(
        arch=m.arch, tied=m.tied, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        intermediate_size=m.intermediate_size, vocab_size=m.vocab_size, max_position=max_position,
        init_std=m.init_std, seed=config.seed,
    )
    tmp = run.model_tmp  # named by the run id: a leftover of this run's killed build, never another's
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build_tiny_model(tmp, spec)
        os.replace(tmp, dest)
    except Exception as e:  # a full disk, a quota: this run's half-built folder goes
        shutil.rmtree(tmp, ignore_errors=True)
        if not write_failed(e):
            raise
        raise StorageError(
            f"the tiny model (config key 'model.path' is empty) could not be written to {str(dest)!r}: "
            f"{getattr(e, 'strerror', None) or e}; nothing of it was kept; free space, or set model.path to a model folder"
        ) from e
    return str(dest)


def lora_sync(config: RunConfig) -> str | None:
    """What the weight sync of a LoRA run sends (``model.lora.sync``: ``merged`` or ``adapter``);
    None when the run trains full weights."""
    return config.model.lora.sync if config.model.lora.enabled else None


def lora_of(config: RunConfig, role: Role) -> LoraSpec | None:
    """The LoRA spec of ``role``: the actor trains it; the rollout applies its stream under adapter sync."""
    if role == "actor" or (role == "rollout" and lora_sync(config) == "adapter"):
        return config.model.lora.spec() if config.model.lora.enabled else None
    return None


def engine_spec(
    config: RunConfig, role: Role, path: str, *, max_prompt_len: int, max_response_len: int,
    optim: OptimConfig | None = None,
) -> EngineSpec:
    """The spec a run builds ``role``'s engine from: the ``model`` section (with ``model.lora`` for the
    actor, and for the rollout under adapter sync; ``model.gradient_checkpointing`` for the trained
    roles, actor and critic), the seed and the role's options."""
    m = config.model
    kwargs: dict[str, Any] = {}
    if m.gradient_checkpointing and role in TRAINED_ROLES:
        kwargs["gradient_checkpointing"] = True
    if optim is not None:
        kwargs["optim"] = optim
    lora = lora_of(config, role)
    if lora is not None:
        kwargs["lora"] = lora
    return EngineSpec(
        model_path=path, role=role, dtype=m.dtype, device=m.device, seed=config.seed,
        options=dict(config.backends.options.get(role, {})),
        max_prompt_len=max_prompt_len, max_response_len=max_response_len, **kwargs,
    )

