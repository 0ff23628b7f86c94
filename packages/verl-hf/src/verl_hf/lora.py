"""LoRA adapters on the hf engines, through the ``peft`` library (``EngineSpec.lora``).

:class:`HFLora` injects the adapters into a loaded transformers model in place (peft's
``get_peft_model``; the engines keep calling the transformers model, whose target layers now add
``scale * B A x``), freezes the base, and gives the engines what they need by the stream's names
(:mod:`verl_core.enginekit.lora`): the live adapter tensors, the merged weights computed one tensor
at a time, the base model's forward (peft's ``disable_adapter()``), and an identity of the base
weights that checkpoints keep.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.enginekit.lora import LORA_A, LORA_B, merge_lora
from verl_core.enginekit.weight_stream import first_non_finite
from verl_core.kernel.engine import LoraSpec, lora_matches
from verl_core.kernel.errors import ConfigError, WeightSyncError
from verl_core.kernel.weights import TensorInfo
from verl_hf.modeling import export_order

__all__ = ["HFLora", "base_identity", "resolve_lora_modules"]

_ADAPTER = "default"  # peft's name of the one adapter


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _suffixes(names: list[str]) -> list[str]:
    """The distinct last parts of module names (``q_proj``, ``lm_head``), in order: what patterns usually name."""
    return list(dict.fromkeys(re.sub(r"^.*\.", "", n) for n in names))


def resolve_lora_modules(model: nn.Module, spec: LoraSpec) -> tuple[list[str], list[str]]:
    """The module names ``spec.targets`` and ``spec.full`` match in ``model`` (before any adapter).

    Raises:
        ConfigError: a target pattern matches no linear module, a ``full`` pattern matches no
            module with parameters, or a module is matched by both.
    """
    linear = _linear_names(model)
    targets: list[str] = []
    for pattern in spec.targets:
        hits = [n for n in linear if lora_matches(pattern, n)]
        if not hits:
            others = [n for n, _ in model.named_modules() if n and lora_matches(pattern, n)]
            extra = f" (it matches {others[:3]}, which are not linear layers: train them with LoraSpec.full)" \
                if others else ""
            raise ConfigError(
                f"LoraSpec.targets: pattern {pattern!r} matches no linear module of this "
                f"{type(model).__name__}{extra}; its linear modules end with {_suffixes(linear)}"
            )
        targets += [n for n in hits if n not in targets]
    with_params = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    full: list[str] = []
    for pattern in spec.full:
        hits = [n for n in with_params if lora_matches(pattern, n)]
        if not hits:
            raise ConfigError(
                f"LoraSpec.full: pattern {pattern!r} matches no module with parameters of this "
                f"{type(model).__name__}; such modules end with {_suffixes(with_params)}"
            )
        full += [n for n in hits if n not in full]
    both = sorted(set(targets) & set(full))
    if both:
        raise ConfigError(f"LoraSpec: {both[:3]} are matched by both targets and full; a module gets an adapter "
                          "or is trained fully, not both")
    return targets, full


def base_identity(state: Mapping[str, Tensor]) -> str:
    """A short hash of a base model's weights: every name and shape and 16 values of each tensor.

    Cheap for any model size (a few values per tensor), and different for another model, another
    shape or another training of one shape; a checkpoint of an adapter keeps it, so the adapter is
    never loaded onto another base.
    """
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        flat = t.reshape(-1)
        if flat.numel():
            sample = flat[:: max(1, flat.numel() // 16)][:16]
            h.update(sample.to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()[:24]


class HFLora:
    """A transformers model with LoRA adapters injected by peft, the base frozen.

    Args:
        model: The loaded transformers model (changed in place: its target layers become peft
            LoRA layers, its ``full`` modules peft's trainable copies).
        spec: The adapter.
        tied: The model ties lm_head to the input embedding (it is not exported).
        seed: Seed of ``A``'s random initialisation (``B`` starts at zero).

    Raises:
        ConfigError: a pattern matches nothing (see :func:`resolve_lora_modules`), or
            ``spec.init_path`` does not fit the adapter.
    """

    def __init__(self, model: Any, spec: LoraSpec, *, tied: bool, seed: int = 0) -> None:
        from peft import LoraConfig, get_peft_model

        self.spec = spec
        self.tied = tied
        base_state = model.state_dict()
        # the base model's tensors in export order (transformers naming, a tied lm_head left out)
        self.base_names = export_order([n for n in base_state if not (tied and n == "lm_head.weight")])
        self.base_infos = {n: TensorInfo(tuple(base_state[n].shape), base_state[n].dtype) for n in self.base_names}
        self.identity = base_identity({n: base_state[n] for n in self.base_names})
        self.targets, self.full = resolve_lora_modules(model, spec)
        # a fully trained embedding of a tied model stays tied to lm_head (one trained copy)
        tying: dict[str, Any] = {"ensure_weight_tying": True} if tied and self.full else {}
        config = LoraConfig(
            # peft annotates lora_alpha as int; it only divides it by r, so a float alpha is exact
            r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,  # type: ignore[arg-type]
            target_modules=list(self.targets),
            modules_to_save=list(self.full) or None, bias="none", init_lora_weights=True, **tying,
        )
        with torch.random.fork_rng(devices=[]):  # A's random init must not move the caller's generator
            torch.manual_seed(seed)
            self.peft: Any = get_peft_model(model, config, autocast_adapter_dtype=True)
        self.model = model
        self._adapter = self._adapter_tensors()
        self._lock = threading.RLock()
        if spec.init_path:
            from verl_core.enginekit.lora import read_adapter_folder

            self.load(read_adapter_folder(spec.init_path, spec), where=f"LoraSpec.init_path {spec.init_path!r}",
                      error=ConfigError)

    # ------------------------------------------------------------------ names and tensors
    def _adapter_tensors(self) -> dict[str, Tensor]:
        """Stream name -> live trainable parameter (lora_A/B per target, then the fully trained copies)."""
        out: dict[str, Tensor] = {}
        for name in self.targets:
            layer = self.model.get_submodule(name)
            out[name + LORA_A] = layer.lora_A[_ADAPTER].weight
            out[name + LORA_B] = layer.lora_B[_ADAPTER].weight
        seen = {id(t) for t in out.values()}
        for name, module in self.model.named_modules():
            copies = getattr(module, "modules_to_save", None)
            if not isinstance(copies, nn.ModuleDict) or _ADAPTER not in copies:
                continue
            for pname, p in copies[_ADAPTER].named_parameters():
                if id(p) not in seen:  # a tied lm_head shares the embedding's copy
                    seen.add(id(p))
                    out[f"{name}.{pname}"] = p
        return out

    def adapter(self) -> dict[str, Tensor]:
        """Stream name -> the live adapter tensor (what :meth:`export_adapter` streams and checkpoints hold)."""
        return dict(self._adapter)

    def merged(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` of every base tensor in export order, each merged as it is reached.

        A target's weight is ``W + scale * B A`` (a new tensor, computed in float32 and cast to
        ``dtype`` or the weight's dtype); a fully trained module's tensor is its trained copy;
        every other tensor is the live base tensor itself. At most one merged tensor is alive per
        step of the iteration, so a stream of them costs no second copy of the model.
        """
        scale = self.spec.scale
        targets = set(self.targets)
        for name in self.base_names:
            prefix, _, attr = name.rpartition(".")
            module = self.model.get_submodule(prefix)
            if prefix in targets and attr == "weight":
                base = module.base_layer.weight
                yield name, merge_lora(base, module.lora_A[_ADAPTER].weight, module.lora_B[_ADAPTER].weight, scale,
                                       dtype)
                continue
            if prefix in targets:
                module = module.base_layer
            copies = getattr(module, "modules_to_save", None)
            if isinstance(copies, nn.ModuleDict) and _ADAPTER in copies:
                module = copies[_ADAPTER]
            yield name, getattr(module, attr)

    # ------------------------------------------------------------------ forward of the base
    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter and trained copy left out while inside (peft's ``disable_adapter()``)."""
        with self._lock, self.peft.disable_adapter():
            yield

    @property
    def lock(self) -> threading.RLock:
        """Held by every forward of the model: the disabled state is the model's, not a thread's."""
        return self._lock

    # ------------------------------------------------------------------ loading
    def load(self, tensors: Mapping[str, Tensor], *, where: str, error: type[Exception] = WeightSyncError) -> None:
        """Copy adapter tensors (stream names) into the live adapter, after checking all of them.

        Raises:
            error: a name missing or unexpected, a shape or dtype that differs, or a NaN/inf
                (nothing is copied then).
        """
        live = self._adapter
        missing = sorted(set(live) - set(tensors))
        extra = sorted(set(tensors) - set(live))
        if missing or extra:
            raise error(f"{where}: the adapter tensors do not fit this model's LoRA (rank {self.spec.rank}, "
                        f"targets {list(self.spec.targets)}): missing {missing[:3]}, unexpected {extra[:3]}")
        for name, t in tensors.items():
            want = live[name]
            if tuple(t.shape) != tuple(want.shape):
                raise error(f"{where}: {name!r} is {tuple(t.shape)}, this model's adapter has {tuple(want.shape)}")
        bad = first_non_finite(list(tensors.items()))
        if bad is not None:
            raise error(f"{where}: {bad!r} holds NaN/inf")
        with torch.no_grad():
            for name, t in tensors.items():
                live[name].copy_(t.to(live[name].device, live[name].dtype))
