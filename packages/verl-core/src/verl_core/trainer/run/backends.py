"""The backends a run selects, checked before the output folder is claimed: each is installed,
provides its role, takes its options and declares what the run asks of it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, cast

from verl_core.kernel.errors import ConfigError, PluginError, UnknownNameError

if TYPE_CHECKING:
    from verl_core.kernel.capabilities import Capabilities
    from verl_core.kernel.engine import Role
    from verl_core.trainer.config import RunConfig

__all__ = ["check_backends"]


def check_backends(config: RunConfig, roles: Mapping[str, str]) -> None:
    """Every role -> backend of ``roles`` is installed, provides that role, takes its options and
    declares what the ``model`` section asks of it (``model.dtype``, ``model.device``, LoRA, gradient
    checkpointing) and what
    ``async_training.partial_rollouts`` asks of the rollout.

    Building the engines checks the same, but only after the output folder is claimed and the tiny
    model written; this fails a misspelt backend name, an option or a setting the backend does not
    declare first. With the Ray executor the workers' installation is what counts, so it is left
    to them.

    Raises:
        ConfigError: naming the config key that is wrong, the backend, and what it provides.
    """
    from verl_core.kernel.registry import get_backend, import_string, parse_options

    if config.executor != "local":
        return
    b = config.backends
    for role, name in roles.items():
        key = f"backends.{role}"
        try:
            backend = get_backend(name)
        except (UnknownNameError, PluginError) as e:  # not installed, or installed but broken
            raise ConfigError(f"config key {key!r}: {e}") from e
        if role not in backend.spec.roles:
            raise ConfigError(
                f"config key {key!r} = {name!r}: that backend has no {role} engine; it provides "
                f"{', '.join(backend.spec.roles)}"
            )
        _check_declared(config, cast("Role", role), name, backend.capabilities(cast("Role", role)))
        options = b.options.get(role, {})
        if backend.spec.config_class is not None:
            parse_options(import_string(backend.spec.config_class), options,
                          where=f"config key 'backends.options.{role}' (backend {name!r})")
        elif options:
            raise ConfigError(f"config key 'backends.options.{role}': backend {name!r} takes no options")


def _check_declared(config: RunConfig, role: Role, name: str, caps: Capabilities) -> None:
    """Refuse a ``model`` setting the capabilities ``backend name`` declares for ``role`` leave out.

    The engine of ``role`` is built with ``model.dtype`` and ``model.device`` (and, for the actor
    and for the rollout under adapter sync, ``model.lora``: see :func:`~verl_core.trainer.run.model.engine_spec`).
    """
    from verl_core.kernel.capabilities import RolloutCapabilities, TrainingCapabilities
    from verl_core.trainer.run.model import TRAINED_ROLES, lora_of

    m = config.model
    which = f"backend {name!r} (config key 'backends.{role}')"
    dtypes = caps.dtypes if isinstance(caps, TrainingCapabilities | RolloutCapabilities) else None
    if dtypes is not None and m.dtype not in dtypes:
        raise ConfigError(
            f"config key 'model.dtype' = {m.dtype!r}, but {which} declares its {role} engine runs in "
            f"{', '.join(sorted(dtypes))} only; set model.dtype to {_one_of(dtypes)}, or choose a backend for "
            f"the {role} that declares {m.dtype} (`verl backends` lists each backend's capabilities)"
        )
    device = m.device.partition(":")[0]
    if device not in caps.devices:
        raise ConfigError(
            f"config key 'model.device' = {m.device!r}, but {which} declares its {role} engine runs on "
            f"{', '.join(sorted(caps.devices))} only; set model.device to {_one_of(caps.devices)}, or choose a "
            f"backend for the {role} that declares {device} (`verl backends` lists each backend's capabilities)"
        )
    if (m.gradient_checkpointing and role in TRAINED_ROLES and isinstance(caps, TrainingCapabilities)
            and not caps.gradient_checkpointing):
        raise ConfigError(
            f"config key 'model.gradient_checkpointing' is true, but {which} does not declare gradient checkpointing "
            f"for its {role} engine (TrainingCapabilities.gradient_checkpointing is false); set "
            f"model.gradient_checkpointing=false, or choose a backend for the {role} that declares it (e.g. hf)"
        )
    partial = config.async_training.partial_rollouts
    if partial != "finish" and isinstance(caps, RolloutCapabilities) and not caps.concurrent_weight_update:
        raise ConfigError(
            f"config key 'async_training.partial_rollouts' = {partial!r} sends new weights while the rollout is "
            f"under way, but {which} does not declare RolloutCapabilities.concurrent_weight_update for its rollout "
            "engine; set async_training.partial_rollouts='finish', or choose a rollout backend that declares it "
            "(e.g. hf, vllm)"
        )
    if isinstance(caps, RolloutCapabilities) and config.rollout.stop_token_ids and not caps.stop_token_ids:
        raise ConfigError(
            f"config key 'rollout.stop_token_ids' = {list(config.rollout.stop_token_ids)}, but {which} does not "
            "declare stop token ids for its rollout engine (RolloutCapabilities.stop_token_ids is false); "
            "leave rollout.stop_token_ids empty, or choose a rollout backend that declares it (e.g. hf, vllm)"
        )
    if lora_of(config, role) is None:
        return
    if isinstance(caps, TrainingCapabilities) and not caps.lora:
        raise ConfigError(
            f"config key 'model.lora.enabled' is true, but {which} does not declare LoRA training for its "
            f"{role} engine (TrainingCapabilities.lora is false); set model.lora.enabled=false, or choose an "
            "actor backend that declares it (e.g. hf)"
        )
    if isinstance(caps, RolloutCapabilities) and not caps.lora_adapters:
        raise ConfigError(
            f"config key 'model.lora.sync' = 'adapter', but {which} does not declare adapter streams for its "
            "rollout engine (RolloutCapabilities.lora_adapters is false); set model.lora.sync='merged', or "
            "choose a rollout backend that declares it"
        )


def _one_of(values: Collection[str]) -> str:
    """``a`` for one value, ``one of a, b`` for several (sorted)."""
    names = sorted(values)
    return names[0] if len(names) == 1 else f"one of {', '.join(names)}"
