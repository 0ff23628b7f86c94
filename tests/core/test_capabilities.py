"""Capability declarations: the name sets (``dtypes``, ``devices``) are frozensets whatever a backend writes."""

from __future__ import annotations

import pytest

from verl_core import ConfigError
from verl_core.kernel.capabilities import (
    RewardCapabilities,
    RolloutCapabilities,
    TrainingCapabilities,
)


@pytest.mark.parametrize("cls", [TrainingCapabilities, RolloutCapabilities])
def test_a_list_or_tuple_of_dtypes_and_devices_is_stored_as_a_frozenset(cls: type) -> None:
    caps = cls(dtypes=("float32", "bfloat16"), devices=["cpu", "cuda"])
    assert caps.dtypes == frozenset({"float32", "bfloat16"}) and isinstance(caps.dtypes, frozenset)
    assert caps.devices == frozenset({"cpu", "cuda"}) and isinstance(caps.devices, frozenset)
    assert cls() == cls(dtypes=["float32"], devices=("cpu",))  # equal to the defaults, hashable
    hash(caps)


def test_a_bare_string_or_a_name_that_is_not_a_string_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"TrainingCapabilities.dtypes is 'bfloat16'; expected a set of names, "
                                          r"for example dtypes=frozenset\("):
        TrainingCapabilities(dtypes="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"RolloutCapabilities.devices is \[1\]"):
        RolloutCapabilities(devices=[1])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"RewardCapabilities.devices is None"):
        RewardCapabilities(devices=None)  # type: ignore[arg-type]
