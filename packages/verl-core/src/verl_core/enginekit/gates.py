"""The boundary checks every engine makes the same way: a spec it does not declare, and model inputs.

An engine builds only in what its capabilities declare (``robustness::undeclared_settings_refused``)
and refuses a batch that is malformed or longer than its spec's limits before any model code runs
(``robustness::bad_training_input_rejected``). Both rules have one owner here, so every backend
words them alike.
"""

from __future__ import annotations

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RolloutCapabilities, TrainingCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import BatchValidationError, ConfigError

__all__ = ["MODEL_INPUTS", "check_model_inputs", "refuse_undeclared"]

MODEL_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""The fields a training engine's forward reads (``batch.require(*MODEL_INPUTS, where=...)``)."""


def refuse_undeclared(spec: EngineSpec, capabilities: TrainingCapabilities | RolloutCapabilities, *,
                      engine: str, why: str = "") -> None:
    """Refuse a ``spec`` asking for what ``capabilities`` do not declare: a dtype outside
    ``capabilities.dtypes``, a device type outside ``capabilities.devices``, a parallel degree above 1
    the engine does not declare (``tensor_parallel``, ``pipeline_parallel``, a training engine's
    ``data_parallel``; a rollout's dp is not refused here: a rollout that shares its ranks with the
    actor's takes the actor's sizes, each dp rank generating its own share), or
    ``gradient_checkpointing`` of a training engine that does not declare it (a rollout ignores the
    setting).

    Args:
        spec: The spec the engine is being built from.
        capabilities: What the engine declares (its plugin's ``BackendSpec``).
        engine: The engine's name for the message ("the hf training engine").
        why: Appended to the dtype message (e.g. "float16 would need loss scaling").

    Raises:
        ConfigError: naming the setting, what the engine declares and what to set instead.
    """
    if spec.dtype not in capabilities.dtypes:
        declared = sorted(capabilities.dtypes)
        raise ConfigError(
            f"{engine} runs in {' or '.join(declared)} (its declared dtypes), not EngineSpec.dtype={spec.dtype!r}"
            + (f" ({why})" if why else "") + f"; set EngineSpec.dtype to {declared[-1]!r}"
        )
    device = spec.device.split(":")[0]
    if device not in capabilities.devices:
        raise ConfigError(
            f"{engine} runs on {' or '.join(sorted(capabilities.devices))} (its declared devices), not "
            f"EngineSpec.device={spec.device!r}; set EngineSpec.device to one of them"
        )
    training = capabilities if isinstance(capabilities, TrainingCapabilities) else None
    p = spec.parallel
    undeclared = [f"{key}={size} ({name}=False)" for key, size, name, ok in (
        ("tp", p.tp, "tensor_parallel", capabilities.tensor_parallel),
        ("pp", p.pp, "pipeline_parallel", capabilities.pipeline_parallel),
        ("dp", p.dp, "data_parallel", training is None or training.data_parallel),  # a rollout's dp: the engine's
    ) if size > 1 and not ok]
    if undeclared:
        raise ConfigError(f"{engine} does not declare EngineSpec.parallel {', '.join(undeclared)}; set those sizes to 1")
    if training is not None and spec.gradient_checkpointing and not training.gradient_checkpointing:
        raise ConfigError(
            f"{engine} does not declare gradient checkpointing (capabilities.gradient_checkpointing=False); "
            "set EngineSpec.gradient_checkpointing=False"
        )


def check_model_inputs(batch: TensorBatch, spec: EngineSpec, *, where: str, vocab_size: int) -> None:
    """The model inputs of ``batch`` present and valid (``TensorBatch.check``), and its longest prompt
    and response within ``spec.max_prompt_len`` and ``spec.max_response_len``.

    Raises:
        BatchValidationError: naming ``where``, the field or the lengths, and the limits.
    """
    batch.require(*MODEL_INPUTS, where=where)
    batch.check(where=where, vocab_size=vocab_size)
    if batch.batch_size:
        p = int(batch["prompt_mask"].sum(1).max())
        r = int(batch["response_mask"].sum(1).max())
        if p > spec.max_prompt_len or r > spec.max_response_len:
            raise BatchValidationError(
                f"{where}: longest prompt has {p} tokens and longest response {r}, but the engine was built for "
                f"max_prompt_len={spec.max_prompt_len}, max_response_len={spec.max_response_len}; raise them in "
                "the EngineSpec"
            )
