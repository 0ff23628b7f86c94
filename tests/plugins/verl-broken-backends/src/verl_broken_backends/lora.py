"""Broken LoRA backends: the hf backend with one LoRA fault each, in its actor or its rollout.

Registered only by tests/conformance/test_meta_faults_lora.py (``VERL_PLUGINS`` names the plugin
objects below), so the other meta-tests' backends are unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection, Iterable, Iterator

import torch

from verl_broken_backends.plugin import BrokenHFBackend
from verl_core import (
    EngineSpec,
    ModelOutput,
    TensorBatch,
    WeightCommit,
    WeightManifest,
    WeightMessage,
)
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_hf import checkpoint as ckpt
from verl_hf.config import HFOptions
from verl_hf.optim import HFOptimizer
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine

__all__ = [
    "AdapterSyncDropsFull",
    "AdapterVersionZero",
    "BaseForwardKeepsAdapter",
    "BaseForwardKeepsTrainedFull",
    "BaseForwardSharedSwitch",
    "BaseForwardSwapsFullUnlocked",
    "BaseTrained",
    "CheckpointWithoutAdapterMoments",
    "DropoutAlwaysOn",
    "DropoutIgnored",
    "LmHeadAdapterBypassed",
    "LoadKeepsStaleMasters",
    "MergedStreamUnmerged",
    "RolloutIgnoresInitPath",
    "ScaleIsAlpha",
    "UnseededAdapterInit",
    "lora_base_forward",
    "lora_base_forward_full",
    "lora_base_trained",
    "lora_checkpoint",
    "lora_dropout_always_on",
    "lora_dropout_ignored",
    "lora_forward_switch",
    "lora_full_swap",
    "lora_lm_head_bypassed",
    "lora_rollout_ignores_init",
    "lora_scale",
    "lora_stale_masters",
    "lora_sync_drops_full",
    "lora_unmerged_stream",
    "lora_unseeded_init",
    "lora_version_zero",
]

_LORA = "verl_broken_backends.lora"


class ScaleIsAlpha(HFTrainingEngine):
    """The adapter's update is scaled by alpha instead of alpha / rank (forward and gradients)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if self.lora is not None and spec.lora is not None:
            for module in self.model.modules():
                scaling = getattr(module, "scaling", None)
                if isinstance(scaling, dict) and "default" in scaling:
                    scaling["default"] = float(spec.lora.alpha)


class BaseTrained(HFTrainingEngine):
    """The base weights are trained beside the adapter (every parameter requires grad)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if self.lora is not None:
            self.model.requires_grad_(True)
            self._optim = HFOptimizer(self.model, spec.optim, self._device, self._dp, fsdp=False,
                                      master_weights=self._options.master_weights)


class MergedStreamUnmerged(HFTrainingEngine):
    """The merged weight stream leaves the adapter out (the rollout serves the base)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if self.lora is not None:
            self.lora.spec = dataclasses.replace(self.lora.spec, alpha=1e-30)  # merged W + ~0 * B A


class BaseForwardKeepsAdapter(HFTrainingEngine):
    """base_forward runs the adapted model (the adapter is never disabled)."""

    def base_forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The adapted forward, wrongly."""
        return self.forward(batch, outputs)


class BaseForwardKeepsTrainedFull(HFTrainingEngine):
    """base_forward disables the LoRA layers but serves the trained copies of the fully trained modules."""

    def base_forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The base forward with peft's trained ``modules_to_save`` copies switched back on, wrongly."""
        from peft.utils.other import ModulesToSaveWrapper

        if self._lora is None:
            return super().base_forward(batch, outputs)
        with self._lora.disabled():
            wrappers = [m for m in self.model.modules() if isinstance(m, ModulesToSaveWrapper)]
            for w in wrappers:
                w._disable_adapters = False
            try:
                return self.forward(batch, outputs)
            finally:
                for w in wrappers:
                    w._disable_adapters = True


class CheckpointWithoutAdapterMoments(HFTrainingEngine):
    """save_checkpoint leaves the adapter's Adam moments out."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save, then drop the optimizer state from the committed trainer state."""
        super().save_checkpoint(path)
        state = ckpt.current_state_dir(path) / "trainer_state.pt"
        trainer = torch.load(state, map_location="cpu", weights_only=True)
        trainer["optimizer"] = None
        torch.save(trainer, state)


class LoadKeepsStaleMasters(HFTrainingEngine):
    """load_checkpoint restores the weights but leaves the float32 masters (bfloat16: those of the
    fully trained modules) as they were before the load, so the next step's store() overwrites the
    resumed weights with values stepped from the stale masters."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load, then put the masters back as they were."""
        master = self._optim.master if self._optim is not None else None
        before = master.state() if master is not None else None
        super().load_checkpoint(path)
        if master is not None and before is not None:
            with torch.no_grad():
                for m, s in zip(master.masters, before, strict=True):
                    m.copy_(s.to(m.device))


class BaseForwardSharedSwitch(HFTrainingEngine):
    """base_forward switches the adapter off for the whole engine (a flag, no lock) while it runs."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._adapter_off = False

    def forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The adapted forward, or the base's while the engine's switch is off."""
        if self._lora is None or not self._adapter_off:
            return super().forward(batch, outputs)
        with self._lora.disabled():
            return super().forward(batch, outputs)

    def base_forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The switch off, some work, the forward, the switch on: a forward of another thread meanwhile is the base's."""
        if self._lora is None:
            return super().base_forward(batch, outputs)
        self._adapter_off = True
        try:
            time.sleep(0.01)  # work before the forward (the batch's preparation): the switch stays off across it
            return self.forward(batch, outputs)
        finally:
            self._adapter_off = False


class BaseForwardSwapsFullUnlocked(HFTrainingEngine):
    """base_forward copies the base values of the fully trained modules over their trained values, runs
    the forward (the adapters disabled under the engine's lock) and copies the trained values back, the
    two copies outside the lock: a forward of another thread meanwhile serves the base's full modules."""

    def base_forward(self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})) -> TensorBatch:
        """The swap in, some work, the forward with the LoRA layers off, some work, the swap back."""
        from peft.utils.other import ModulesToSaveWrapper

        wrappers = [] if self._lora is None else [
            m for m in self.model.modules() if isinstance(m, ModulesToSaveWrapper)]
        if not wrappers:
            return super().base_forward(batch, outputs)
        pairs = [(p, dict(w.original_module.named_parameters())[n])
                 for w in wrappers for n, p in w.modules_to_save["default"].named_parameters()]
        trained = [p.detach().clone() for p, _ in pairs]
        with torch.no_grad():
            for p, base in pairs:
                p.copy_(base)  # base values in, in place, for every thread's forward
        try:
            time.sleep(0.01)  # work before the forward (the batch's preparation): the swap stays in across it
            assert self._lora is not None
            with self._lora.disabled():
                for w in wrappers:
                    w._disable_adapters = False  # the LoRA layers off, the (swapped) copies on
                try:
                    return self.forward(batch, outputs)
                finally:
                    for w in wrappers:
                        w._disable_adapters = True
        finally:
            time.sleep(0.01)  # work after the forward, before the swap back
            with torch.no_grad():
                for (p, _), t in zip(pairs, trained, strict=True):
                    p.copy_(t)  # trained values back


class RolloutIgnoresInitPath(HFRolloutEngine):
    """An adapter rollout ignores LoraSpec.init_path: it starts from B = 0 and the base's full modules."""

    def __init__(self, spec: EngineSpec, options: HFOptions | None = None) -> None:
        lora = spec.lora
        if lora is not None and lora.init_path:
            super().__init__(dataclasses.replace(spec, lora=dataclasses.replace(lora, init_path="")), options)
            self._spec = spec  # reports the spec it was given
        else:
            super().__init__(spec, options)


class AdapterSyncDropsFull(HFRolloutEngine):
    """The adapter sync applies only the lora_A / lora_B tensors: the fully trained modules keep their values."""

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply the stream with its tensors other than ``lora_`` ones put back afterwards (the base's values)."""
        kept = {} if self._lora is None else {
            n: t.detach().clone() for n, t in self._lora.adapter().items() if ".lora_" not in n}
        super().update_weights(stream)
        if self._lora is not None:
            with torch.no_grad():
                for name, t in self._lora.adapter().items():
                    if name in kept:
                        t.copy_(kept[name])


class _AlwaysDrop(torch.nn.Dropout):
    """Dropout that drops in eval mode too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, self.p, training=True)


def _lora_dropouts(model: torch.nn.Module) -> list[tuple[torch.nn.ModuleDict, str]]:
    """(the ModuleDict, key) of every adapter's dropout module (PEFT's ``lora_dropout``)."""
    return [(module.lora_dropout, key) for module in model.modules()
            if isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict)
            for key in module.lora_dropout]


class DropoutAlwaysOn(HFTrainingEngine):
    """The adapter's dropout also runs outside the update (forward, log-probs): the module stays in training mode."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if self.lora is not None and spec.lora is not None and spec.lora.dropout > 0:
            for dropouts, key in _lora_dropouts(self.model):
                dropouts[key] = _AlwaysDrop(spec.lora.dropout)


class DropoutIgnored(HFTrainingEngine):
    """LoraSpec.dropout is ignored: the adapters are built without dropout."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if self.lora is not None:
            for dropouts, key in _lora_dropouts(self.model):
                dropouts[key] = torch.nn.Identity()


class LmHeadAdapterBypassed(HFTrainingEngine):
    """The logits come from lm_head's base weight alone: its adapter is left out of forward (the merged
    export still includes it)."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        for name, module in self.model.named_modules():
            if name.endswith("lm_head") and hasattr(module, "base_layer"):
                module.forward = module.base_layer.forward


class UnseededAdapterInit(HFTrainingEngine):
    """A fresh adapter's A is drawn from the operating system's entropy, not from spec.seed."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if self.lora is not None and spec.lora is not None and not spec.lora.init_path:
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    if "lora_A" in name:
                        param.copy_(0.1 * torch.randn(param.shape, generator=g))


class AdapterVersionZero(HFTrainingEngine):
    """export_adapter streams version 0 whatever the step count."""

    def export_adapter(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        for msg in super().export_adapter(bucket_bytes=bucket_bytes):
            if isinstance(msg, WeightManifest):
                yield dataclasses.replace(msg, version=0)
            elif isinstance(msg, WeightCommit):
                yield WeightCommit(0)
            else:
                yield msg


lora_scale = BrokenHFBackend("broken-lora-scale", "the LoRA update is scaled by alpha, not alpha / rank",
                             "actor", f"{_LORA}:ScaleIsAlpha")
lora_base_trained = BrokenHFBackend("broken-lora-base-trained", "the base weights train beside the adapter",
                                    "actor", f"{_LORA}:BaseTrained")
lora_unmerged_stream = BrokenHFBackend("broken-lora-unmerged", "the merged weight stream leaves the adapter out",
                                       "actor", f"{_LORA}:MergedStreamUnmerged")
lora_base_forward = BrokenHFBackend("broken-lora-base-forward", "base_forward keeps the adapter on",
                                    "actor", f"{_LORA}:BaseForwardKeepsAdapter")
lora_base_forward_full = BrokenHFBackend("broken-lora-base-forward-full",
                                        "base_forward serves the trained values of the fully trained modules",
                                        "actor", f"{_LORA}:BaseForwardKeepsTrainedFull")
lora_checkpoint = BrokenHFBackend("broken-lora-checkpoint", "a LoRA checkpoint leaves the adapter's Adam moments out",
                                  "actor", f"{_LORA}:CheckpointWithoutAdapterMoments")

lora_stale_masters = BrokenHFBackend("broken-lora-stale-masters", "a LoRA checkpoint load leaves the float32 masters "
                                     "of the fully trained modules stale", "actor", f"{_LORA}:LoadKeepsStaleMasters")
lora_forward_switch = BrokenHFBackend("broken-lora-forward-switch", "base_forward switches the adapter off for the "
                                      "whole engine with a flag and no lock", "actor",
                                      f"{_LORA}:BaseForwardSharedSwitch")
lora_full_swap = BrokenHFBackend("broken-lora-full-swap", "base_forward swaps the fully trained modules' base values "
                                 "in and the trained ones back in place, outside the lock", "actor",
                                 f"{_LORA}:BaseForwardSwapsFullUnlocked")
lora_dropout_always_on = BrokenHFBackend("broken-lora-dropout-always-on", "the adapter's dropout runs outside the "
                                        "update too", "actor", f"{_LORA}:DropoutAlwaysOn")
lora_dropout_ignored = BrokenHFBackend("broken-lora-dropout-ignored", "LoraSpec.dropout is ignored", "actor",
                                      f"{_LORA}:DropoutIgnored")
lora_sync_drops_full = BrokenHFBackend("broken-lora-sync-full", "the adapter sync ignores the fully trained modules' "
                                       "tensors (LoraSpec.full)", "rollout", f"{_LORA}:AdapterSyncDropsFull")
lora_rollout_ignores_init = BrokenHFBackend("broken-lora-rollout-init", "an adapter rollout ignores "
                                            "LoraSpec.init_path (B = 0 and the base's full modules until a sync)",
                                            "rollout", f"{_LORA}:RolloutIgnoresInitPath")

lora_unseeded_init = BrokenHFBackend("broken-lora-unseeded-init", "a fresh adapter's A comes from the OS's entropy, not "
                                     "spec.seed", "actor", f"{_LORA}:UnseededAdapterInit")
lora_version_zero = BrokenHFBackend("broken-lora-adapter-version", "export_adapter streams version 0 after steps",
                                    "actor", f"{_LORA}:AdapterVersionZero")

lora_lm_head_bypassed = BrokenHFBackend("broken-lora-lm-head", "the LM head's adapter is left out of the logits",
                                        "actor", f"{_LORA}:LmHeadAdapterBypassed")


def verl_plugins() -> str:
    """The ``VERL_PLUGINS`` value registering every broken LoRA backend."""
    return ",".join(f"{obj.name}={__name__}:{attr}" for attr, obj in globals().items()
                    if isinstance(obj, BrokenHFBackend))
