"""Runs checks outside pytest and reports: results, known gaps, tables and JSON."""

from __future__ import annotations

import fnmatch
import json
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from verl_conformance.checks import AREAS, CHECKS, Check
from verl_conformance.errors import CheckFailed, CheckSkipped
from verl_conformance.harness import Harness, Subject
from verl_conformance.timelimit import CheckTimedOut, check_time_limit

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "KnownGaps",
    "load_known_gaps",
    "reproduction",
    "run_checks",
    "select_checks",
    "suite_version",
]

Status = Literal["passed", "failed", "skipped", "xfailed", "xpassed"]


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    Attributes:
        id: The check's id, ``area::name``.
        area: Its area (``schema``, ``numerics``, ...).
        status: ``passed``, ``failed``, ``skipped``, ``xfailed`` (a failure declared a known gap) or
            ``xpassed`` (a declared known gap that passed).
        message: A failure's message, a skip's reason, what a pass compared or refused (often
            empty), or a known gap's reason.
        seconds: Wall time of the check.
    """

    id: str
    area: str
    status: Status
    message: str = ""
    seconds: float = 0.0


def suite_version() -> str:
    """The version of the suite: the installed ``verl-conformance`` distribution's (the package's
    ``__version__`` where it runs without being installed, from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl-conformance")
    except PackageNotFoundError:
        from verl_conformance import __version__

        return __version__


@dataclass
class ConformanceReport:
    """Every check's result for one backend (and the optional second backend).

    Attributes:
        backend: The backend under test: its registry name, or the label given with factories.
        version: The backend's distribution and version (``"verl-hf 0.1.0"``; empty for factories).
        against: The second backend of the differential checks, or None.
        suite_version: The version of the suite that ran (the ``verl-conformance`` distribution's).
        checks_registered: How many checks that suite registers (all of them, run or not): with
            ``suite_version`` it tells reports of different suites apart.
        results: One result per check run, in suite order.
        seconds: Wall time of the whole run.
        dtype: The dtype every engine was built in (the tolerance tier).
        device: The device every engine was built on.
    """

    backend: str
    version: str
    against: str | None
    suite_version: str = field(default_factory=suite_version)
    checks_registered: int = field(default_factory=lambda: len(CHECKS))
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def failures(self) -> list[CheckResult]:
        """Checks that failed and are not declared known gaps."""
        return [r for r in self.results if r.status == "failed"]

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps(asdict(self), indent=1)

    def table(self) -> str:
        """A text table per area: status, check, time, and under each check its whole message (a skip's
        reason, an expected failure's, what a pass compared) or the first line of its failure."""
        lines = [f"verl conformance: {self.backend} ({self.version or 'engines given as factories'})"
                 + (f" against {self.against}" if self.against else "") + f", {self.dtype} on {self.device}"]
        for area in AREAS:
            rows = [r for r in self.results if r.area == area]
            if not rows:
                continue
            counts = {s: sum(r.status == s for r in rows) for s in ("passed", "failed", "skipped", "xfailed", "xpassed")}
            summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            lines.append("")
            lines.append(f"[{area}] {summary}")
            for r in rows:
                name = r.id.split("::", 1)[1]
                lines.append(f"  {r.status.upper():<8} {name:<38} {r.seconds:6.1f}s")
                if r.message:
                    # the whole reason (or what a pass compared), on lines of its own under the check (a
                    # failure's first line: the failures are repeated in full with their reproduction below the table)
                    text = r.message.splitlines()[0] if r.status == "failed" else r.message
                    lines.extend(f"           {line}" for line in text.splitlines())
        totals = {s: sum(r.status == s for r in self.results) for s in ("passed", "failed", "skipped", "xfailed", "xpassed")}
        lines.append("")
        lines.append("total: " + ", ".join(f"{n} {s}" for s, n in totals.items() if n) + f" in {self.seconds:.1f}s")
        return "\n".join(lines)


@dataclass(frozen=True)
class KnownGaps:
    """Declared known gaps: check id (or pattern) -> reason."""

    entries: Mapping[str, str]
    source: str = ""

    def reason(self, check_id: str, nodeid: str = "") -> str | None:
        """The reason if ``check_id`` (or a pytest ``nodeid``) is declared a known gap."""
        c = CHECKS.get(check_id)
        nodeid = nodeid or (pytest_suffix(c) if c is not None else "")
        for pattern, why in self.entries.items():
            if _matches(pattern, check_id, nodeid):
                return why or "declared known gap"
        return None

    def unmatched(self) -> list[str]:
        """Entries that name no known check (typos or removed checks)."""
        return [p for p in self.entries
                if not any(_matches(p, c.id, pytest_suffix(c)) for c in CHECKS.values())]


def pytest_suffix(c: Check) -> str:
    """``TestArea::test_name``: how the check's pytest id ends."""
    return f"Test{''.join(w.title() for w in c.area.split('_'))}::test_{c.name}"


def _matches(pattern: str, check_id: str, nodeid: str) -> bool:
    if fnmatch.fnmatchcase(check_id, pattern):
        return True
    return bool(nodeid) and (nodeid == pattern or nodeid.endswith("::" + pattern) or nodeid.endswith("/" + pattern))


def load_known_gaps(path: str | os.PathLike[str]) -> KnownGaps:
    """Read a known-gaps file: one ``check-id  # reason`` per line (``#`` lines are comments).

    A check id is ``area::name`` (``*`` wildcards allowed) or a pytest id ending in
    ``TestArea::test_name``. Entries that match no check are reported by :meth:`KnownGaps.unmatched`.
    """
    entries: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        ident, _, reason = line.partition("#")
        entries[ident.strip()] = reason.strip()
    return KnownGaps(entries, str(path))


def select_checks(checks: Sequence[str] | None = None, areas: Sequence[str] | None = None) -> list[Check]:
    """Checks by id pattern (``area::name``, wildcards allowed) and/or area, in suite order."""
    if areas:
        unknown = sorted(set(areas) - set(AREAS))
        if unknown:
            raise ValueError(f"unknown area(s) {unknown}; areas: {', '.join(AREAS)}")
    out = []
    for c in CHECKS.values():
        if areas and c.area not in areas:
            continue
        if checks and not any(fnmatch.fnmatchcase(c.id, p) or p == c.name for p in checks):
            continue
        out.append(c)
    if checks and not out:
        if areas and any(fnmatch.fnmatchcase(c.id, p) or p == c.name for c in CHECKS.values() for p in checks):
            raise ValueError(f"no check of area(s) {list(areas)} matches {list(checks)}: the areas and the check "
                             "patterns both select (a check must match both); drop one, or name a check of those areas")
        raise ValueError(f"no check matches {list(checks)}; checks: {', '.join(CHECKS)}")
    return out


def reproduction(check_id: str, backend: str | Subject, against: str | None = None, *,
                 pytest_flags: Sequence[str] = ()) -> str:
    """Commands that re-run one check alone.

    An installed backend (a name, or a registry Subject) gets the pytest and the Python command;
    engines given as factories get the ``check_backend`` call with those factories (and their
    imports), since no installed backend ran. ``pytest_flags`` (such as ``--verl-dtype bfloat16``)
    are settings only the pytest form takes: the pytest command gets them and the Python command,
    which would run float32 on cpu with no options, is left out.
    """
    if isinstance(backend, Subject):
        if not backend.registered:
            return _factories_reproduction(check_id, backend, against)
        backend = backend.name
    c = CHECKS[check_id]
    if c.area == "buffer":  # ``backend`` is the buffer's MODULE:FACTORY
        return (
            f"pytest --pyargs verl_conformance --verl-buffer {backend} -k 'TestBuffer and test_{c.name}'\n"
            f"python -c \"from verl_conformance.api import check_buffer; from verl_core.kernel.registry import "
            f"import_string; check_buffer(import_string({backend!r}), checks=[{check_id!r}])\""
        )
    ag = f" --verl-against {against}" if against else ""
    ag_py = f", against={against!r}" if against else ""
    flags = "".join(f" {f}" for f in pytest_flags)
    command = (f"pytest --pyargs verl_conformance --verl-backend {backend}{ag}{flags} "
               f"-k '{pytest_suffix(c).split('::')[0]} and test_{c.name}'")
    if pytest_flags:
        return command
    return (
        f"{command}\n"
        f"python -c \"from verl_conformance import check_backend; check_backend({backend!r}{ag_py}, checks=[{check_id!r}])\""
    )


def _factories_reproduction(check_id: str, subject: Subject, against: str | None) -> str:
    imports = ["from verl_conformance import check_backend"]
    args = [repr(subject.name)]
    for keyword, factory in (("make_training_engine", subject.make_training),
                             ("make_rollout_engine", subject.make_rollout),
                             ("make_reward_engine", subject.make_reward)):
        if factory is None:
            continue
        module = getattr(factory, "__module__", None) or "?"
        qualname = getattr(factory, "__qualname__", None) or repr(factory)
        if "<" in qualname or module in ("?", "__main__"):
            args.append(f"{keyword}=<{module}.{qualname}: not importable, pass the same factory>")
        else:
            imports.append(f"from {module} import {qualname.split('.')[0]}")
            args.append(f"{keyword}={qualname}")
    if subject.roles is not None:
        args.append(f"roles={sorted(subject.roles)!r}")
    if against:
        args.append(f"against={against!r}")
    args.append(f"checks=[{check_id!r}]")
    return f"python -c \"{'; '.join(imports)}; check_backend({', '.join(args)})\""


def run_one(check: Check, harness: Harness) -> tuple[Status, str]:
    """Run one check; return its status and message: a skip's reason, a failure's message (for a
    crash the exception's type and text, then its notes), or what a pass reports (:meth:`Harness.note`)."""
    harness.notes.clear()
    try:
        with check_time_limit(harness.time_limit_s, check.id):
            check.func(harness)
    except CheckTimedOut as e:
        return "failed", str(e)
    except CheckSkipped as e:
        return "skipped", str(e)
    except CheckFailed as e:
        return "failed", str(e)
    except Exception as e:
        notes = "".join(f"; {note}" for note in getattr(e, "__notes__", ()))
        return "failed", f"{type(e).__name__}: {e}{notes}{raised_at(e)}"
    finally:
        harness.close_fresh()
    return "passed", "; ".join(harness.notes)


def raised_at(error: BaseException) -> str:
    """`` (raised at FILE:LINE in FUNCTION)`` of the innermost frame of ``error``'s traceback that is
    not the suite's own code (a backend's line, or a library's it called), or "" when there is none.

    A crash's type and text alone ("AttributeError: 'list' object has no attribute 'items'") do not
    say which of a backend's functions failed; the suite's JSON and table keep only this message.
    """
    suite = str(Path(__file__).resolve().parent)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not str(Path(f.filename).resolve()).startswith(suite)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (raised at {f.filename}:{f.lineno} in {f.name})"


def run_checks(harness: Harness, checks: Sequence[Check], gaps: KnownGaps | None = None,
               progress: Callable[[CheckResult, int, int], None] | None = None) -> ConformanceReport:
    """Run ``checks`` on the harness and collect a report (known gaps turn failures into xfails).

    ``progress``, when given, is called after each check with its result, its position (1-based) and
    the number of checks (``verl conformance`` prints a line per check with it).
    """
    report = ConformanceReport(harness.subject.name, harness.subject.version,
                               harness.against.name if harness.against else None,
                               dtype=harness.dtype, device=harness.device)
    if gaps is not None:
        for entry in gaps.unmatched():
            warnings.warn(f"known-gaps file {gaps.source}: {entry!r} matches no conformance check", stacklevel=2)
    t_all = time.perf_counter()
    for c in checks:
        t0 = time.perf_counter()
        status, message = run_one(c, harness)
        why = gaps.reason(c.id) if gaps is not None else None
        if why is not None:
            if status == "failed":
                status, message = "xfailed", f"known gap: {why} ({message.splitlines()[0] if message else ''})"
            elif status == "passed":
                status, message = "xpassed", f"declared a known gap ({why}) but passed: remove it from {gaps.source}"  # type: ignore[union-attr]
        report.results.append(CheckResult(c.id, c.area, status, message, time.perf_counter() - t0))
        if progress is not None:
            progress(report.results[-1], len(report.results), len(checks))
    report.seconds = time.perf_counter() - t_all
    return report
