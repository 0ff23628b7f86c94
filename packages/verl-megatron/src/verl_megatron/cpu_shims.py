"""Workarounds that let megatron-core 0.16 run on a machine without a CUDA device.

megatron-core hard-codes CUDA in a few places (measured on 0.16.1):

1. ``torch.cuda.current_device()`` is the device of RoPE buffers, attention scratch space and
   tensor/pipeline-parallel communication buffers; on a CPU-only torch it raises.
2. ``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"``.
3. ``pipeline_parallel.schedules`` allocates ``torch.zeros(..., device="cuda")`` in every schedule.
4. ``LanguageModule.setup_embeddings_and_output_layer`` moves a tied output weight with
   ``Tensor.cuda()`` before syncing it across pipeline stages; during that call only,
   ``Tensor.cuda`` returns the tensor itself.
5. megatron-core's optimizer and gradient buffers (``optimizer.optimizer``,
   ``optimizer.distrib_optimizer``, ``optimizer.clip_grads``,
   ``distributed.param_and_grad_buffer``, and ``utils``' local multi-tensor fallbacks used
   without TransformerEngine/Apex) allocate flags and norms with ``device="cuda"``, and
   the constructors of ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer`` accept
   only parameters whose ``Tensor.type()`` names a CUDA tensor: those modules' tensor factories
   map CUDA to the CPU, and during those two constructors only, ``Tensor.type()`` (no argument)
   of a CPU tensor answers the CUDA name of its dtype (``torch.cuda.FloatTensor``).

(The CUDA RNG tracker is the fifth: :func:`verl_megatron.parallel.init_distributed` selects the
inference tracker on CPU, which forks no generator state.)

:func:`apply_cpu_shims` patches exactly these, and only when ``torch.cuda.is_available()`` is
False; with a CUDA device it does nothing, so GPU runs use megatron-core unmodified. It is
idempotent. Nothing else in this package touches megatron-core's internals.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Iterator
from typing import Any, Final

import torch

__all__ = ["apply_cpu_shims", "cpu_shims_active"]

_lock = threading.Lock()
_applied = False
_CPU: Final = torch.device("cpu")


def cpu_shims_active() -> bool:
    """Whether the CPU shims have been applied in this process."""
    return _applied


def _current_device() -> torch.device:
    return _CPU


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=_CPU), diagonal=1)


class _CpuTorch(types.ModuleType):
    """A view of the ``torch`` module whose tensor factories map ``device="cuda"`` to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _fix(kwargs: dict[str, Any]) -> dict[str, Any]:
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = _CPU
        return kwargs

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.zeros`` with CUDA devices mapped to the CPU."""
        return torch.zeros(*args, **self._fix(kwargs))

    def ones(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.ones`` with CUDA devices mapped to the CPU."""
        return torch.ones(*args, **self._fix(kwargs))

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.empty`` with CUDA devices mapped to the CPU."""
        return torch.empty(*args, **self._fix(kwargs))

    def tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.tensor`` with CUDA devices mapped to the CPU."""
        return torch.tensor(*args, **self._fix(kwargs))


@contextlib.contextmanager
def _tensor_type_names_cuda() -> Iterator[None]:
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _constructed_with_cuda_type_names(cls: Any) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def init_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        with _tensor_type_names_cuda():
            init(self, *args, **kwargs)

    cls.__init__ = init_on_cpu


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def apply_cpu_shims() -> bool:
    """Patch megatron-core's CUDA assumptions when no CUDA device exists.

    Returns:
        True when the shims are (now or already) active, False when a CUDA device is present and
        nothing was changed.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        from megatron.core import utils as megatron_utils
        from megatron.core.distributed import param_and_grad_buffer
        from megatron.core.fusions import fused_softmax
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.optimizer import clip_grads, distrib_optimizer
        from megatron.core.optimizer import optimizer as megatron_optimizer
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.transformer import utils as transformer_utils

        # Megatron asks torch.cuda for "the" device of every buffer it allocates.
        torch.cuda.current_device = _current_device  # type: ignore[assignment]
        transformer_utils.get_default_causal_mask = _default_causal_mask
        fused_softmax.get_default_causal_mask = _default_causal_mask
        for module in (schedules, megatron_optimizer, distrib_optimizer, clip_grads, param_and_grad_buffer,
                       megatron_utils):
            module.torch = _CpuTorch()
        _constructed_with_cuda_type_names(megatron_optimizer.Float16OptimizerWithFloat16Params)
        _constructed_with_cuda_type_names(distrib_optimizer.DistributedOptimizer)
        setup = LanguageModule.setup_embeddings_and_output_layer

        @functools.wraps(setup)
        def setup_on_cpu(self: Any) -> None:
            with _tensor_cuda_is_identity():
                setup(self)

        LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu
        _applied = True
        return True
