"""Fixtures of the reliability tests, and the tally of inputs tried, faults injected and kill points.

The tally is printed at the end of the session (whatever ``-s`` or ``-q`` say), so a CI log shows
how much bad input and how many faults the guarantees were checked against.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from reliability_helpers import TALLY


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    # One thread: tiny models gain nothing from two, and a forked child must not inherit a busy pool.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tally() -> Counter[str]:
    """The session's counters (``tally["fuzz/..."] += 1`` per input tried, ...)."""
    return TALLY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TALLY:
        return
    tr = terminalreporter
    tr.section("reliability tally")
    groups: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    for key, n in TALLY.items():
        groups[key.split("/")[0]] += n
        areas[key.split(" (")[0]] += n
    for area, n in sorted(areas.items()):
        kinds = sorted(k.split(" (", 1)[1].rstrip(")") for k in TALLY if k.split(" (")[0] == area and " (" in k)
        tr.write_line(f"{area:<32} {n:>6}" + (f"  ({len(kinds)} kinds)" if kinds else ""))
    tr.write_line(
        "reliability: {} bad inputs tried (each rejected with a typed VerlError, no engine entered), "
        "{} faults injected, {} SIGKILL points survived".format(
            groups.get("fuzz", 0), groups.get("fault", 0), groups.get("kill", 0)
        )
    )
