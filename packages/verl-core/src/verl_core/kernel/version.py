"""Version of the verl-core distribution and of the protocol it defines."""

from __future__ import annotations

from typing import Final

__all__ = ["PROTOCOL_VERSION", "__version__", "protocol_compatible"]

__version__: Final = "0.1.0"
PROTOCOL_VERSION: Final = "1.0"
"""Version of the protocols: a backend built for MAJOR.MINOR works with this core when the majors
are equal and its minor is not newer."""


def protocol_compatible(version: str) -> bool:
    """Whether a backend implementing protocol ``version`` works with this core."""
    try:
        major, minor = (int(x) for x in version.split("."))
    except ValueError:
        return False
    core_major, core_minor = (int(x) for x in PROTOCOL_VERSION.split("."))
    return major == core_major and minor <= core_minor
