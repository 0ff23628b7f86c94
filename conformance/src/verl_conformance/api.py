"""The callable API for use outside pytest: check_backend and check_backends_match."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from verl_conformance.errors import ConformanceError
from verl_conformance.harness import (
    BufferFactory,
    BufferSubject,
    EngineCache,
    EngineFactory,
    Harness,
    Subject,
)
from verl_conformance.runner import (
    CheckResult,
    ConformanceReport,
    load_known_gaps,
    reproduction,
    run_checks,
    select_checks,
)
from verl_conformance.timelimit import DEFAULT_CHECK_TIMEOUT_S
from verl_core import Role

__all__ = ["DTYPES", "check_backend", "check_backends_match", "check_buffer", "parse_options", "run_conformance",
           "undeclared_dtype"]


def run_conformance(
    backend: str | Subject,
    *,
    against: str | Subject | None = None,
    checks: Sequence[str] | None = None,
    areas: Sequence[str] | None = None,
    known_gaps: str | os.PathLike[str] | None = None,
    options: Mapping[str, Any] | None = None,
    check_timeout_s: float | None = DEFAULT_CHECK_TIMEOUT_S,
    progress: Callable[[CheckResult, int, int], None] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> ConformanceReport:
    """Run checks on a backend and return the report (never raises for failing checks).

    ``options``: backend options given to every engine of ``backend`` (as pytest's
    ``--verl-options``); a check's own options win. ``check_timeout_s``: seconds one check may run
    before it fails, naming where the run was (None: no limit; see :mod:`verl_conformance.timelimit`).
    ``progress``: called after each check with its result, its position and the number of checks.
    ``dtype`` and ``device``: what every engine the suite builds runs in (pytest's ``--verl-dtype``
    and ``--verl-device``; the dtype selects the tolerance tier).

    Raises:
        ValueError: ``dtype`` is not float32, bfloat16 or float16, or no role of an installed
            ``backend`` declares it (:func:`undeclared_dtype`).
    """
    subject = backend if isinstance(backend, Subject) else Subject.from_registry(backend)
    refusal = undeclared_dtype(subject, dtype)
    if refusal:
        raise ValueError(refusal)
    other = None if against is None else against if isinstance(against, Subject) else Subject.from_registry(against)
    harness = Harness(subject, other, EngineCache(), dtype=dtype, device=device, options=dict(options or {}),
                      time_limit_s=check_timeout_s)
    gaps = load_known_gaps(known_gaps) if known_gaps is not None else None
    try:
        return run_checks(harness, select_checks(checks, areas), gaps, progress)
    finally:
        harness.cache.close()


def parse_options(raw: str | None, flag: str = "--options") -> dict[str, Any]:
    """The backend options of a command line: a JSON object (empty when ``raw`` is empty or None).

    Raises:
        ValueError: ``raw`` is not JSON or not an object, naming ``flag``.
    """
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object, got {raw!r}: {e} (e.g. '{{\"enforce_eager\": true}}')") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {raw!r} (backend options by name)")
    return value


DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes the suite builds engines in (each has its tolerance tier)."""


def undeclared_dtype(backend: str | Subject, dtype: str, flag: str = "--dtype") -> str | None:
    """Why the suite cannot run ``backend`` in ``dtype``, or None: the dtype is not one of :data:`DTYPES`,
    or no role of an installed backend declares it (engines given as factories declare nothing
    up front; their dtype checks decide). ``flag`` is the option the advice names (``--dtype`` of
    ``verl conformance``, pytest's ``--verl-dtype``)."""
    if dtype not in DTYPES:
        return f"dtype {dtype!r} is not one the suite runs in; expected one of {', '.join(DTYPES)}"
    if dtype == "float32":
        return None
    from verl_conformance.harness import declared_dtypes
    from verl_core import VerlError, get_backend

    name = backend.name if isinstance(backend, Subject) else backend
    if isinstance(backend, Subject) and not backend.registered:
        return None
    try:
        spec = get_backend(name)
    except VerlError:
        return None  # building the subject reports it
    declared = declared_dtypes(spec)
    if declared and not any(dtype in d for d in declared.values()):
        listed = ", ".join(f"{role} {'/'.join(sorted(d))}" for role, d in declared.items())
        return (f"dtype {dtype}: backend {name!r} declares {dtype} for none of its roles (capabilities.dtypes: "
                f"{listed}); run with {flag} {'/'.join(sorted({t for d in declared.values() for t in d}))}, or "
                f"declare {dtype} on the roles that build in it")
    return None


def _raise_failures(report: ConformanceReport, subject: str | Subject | None = None,
                    options: Mapping[str, Any] | None = None) -> ConformanceReport:
    failures = report.failures
    if not failures:
        return report
    what = "replay buffer" if all(r.area == "buffer" for r in report.results) else "backend"
    flags = [f"--verl-dtype {report.dtype}"] if report.dtype != "float32" else []
    if report.device != "cpu":
        flags.append(f"--verl-device {report.device}")
    if options:
        flags.append(f"--verl-options {shlex.quote(json.dumps(dict(options)))}")
    parts = [f"{what} {report.backend!r} failed {len(failures)} conformance check(s)"
             + (f" against {report.against!r}" if report.against else "") + ":"]
    for r in failures:
        parts.append(f"\n- {r.id}: {r.message}\n  reproduce:\n    "
                     + reproduction(r.id, subject or report.backend, report.against, pytest_flags=flags
                                    ).replace("\n", "\n    "))
    raise ConformanceError("\n".join(parts), report)


def check_backend(
    backend: str,
    *,
    against: str | None = None,
    checks: Sequence[str] | None = None,
    areas: Sequence[str] | None = None,
    known_gaps: str | os.PathLike[str] | None = None,
    make_training_engine: EngineFactory | None = None,
    make_rollout_engine: EngineFactory | None = None,
    make_reward_engine: EngineFactory | None = None,
    roles: Collection[Role] | None = None,
    options: Mapping[str, Any] | None = None,
    check_timeout_s: float | None = DEFAULT_CHECK_TIMEOUT_S,
    dtype: str = "float32",
    device: str = "cpu",
) -> ConformanceReport:
    """Run the conformance suite on ``backend`` and raise ConformanceError if any check fails.

    Args:
        backend: Installed backend name, or a label when factories are given.
        against: A second installed backend for the differential checks.
        checks: Check ids to run (``area::name``, wildcards allowed); default all.
        areas: Areas to run (schema, numerics, invariance, differential, weight_sync, robustness,
            reward, stateful, buffer).
        known_gaps: A known-gaps file (failures of listed checks are expected).
        make_training_engine: Build training engines with this instead of the registry.
        make_rollout_engine: Build rollout engines with this instead of the registry.
        make_reward_engine: Build reward engines (a reward model, or reward functions wrapped in
            ``verl_core.FunctionReward`` or ``verl_core.trainer.inputs.rewards.RewardFunctions``) with this
            instead of the registry.
        roles: With factories, the roles they provide, as ``BackendSpec.roles`` declares those of
            an installed backend (e.g. ``["actor", "reference", "rollout"]`` for a backend without
            a critic): the checks of a role left out are skipped with the reason. Default: when
            ``backend`` names an installed backend, the roles its ``BackendSpec`` declares that a
            factory given builds; otherwise every role of each factory given
            (``make_training_engine`` builds actor, reference and critic). A ConfigError of the
            training factory for a role it was taken to build says how to pass ``roles``.
        options: Backend options given to every engine of ``backend`` (pytest's
            ``--verl-options``), such as ``{"enforce_eager": True}`` for vllm; a check's own
            options win.
        check_timeout_s: Seconds one check may run; past it the check fails, naming the backend
            frame the run was in (an engine call that never returns), and the next check runs.
            None: no limit. See :mod:`verl_conformance.timelimit`.
        dtype: The dtype every engine is built in (``float32``, ``bfloat16``, ``float16``; pytest's
            ``--verl-dtype``): it selects the tolerance tier.
        device: The device every engine is built on (``cpu``, ``cuda``; pytest's ``--verl-device``).

    Returns:
        The report (every check passed, was skipped with a reason, or is a declared gap).

    Raises:
        ConformanceError: naming each failing check, what was wrong and how to re-run it alone.
        ValueError: ``roles`` without factories (an installed backend provides the roles of its
            ``BackendSpec``), an unknown role, a role whose factory is not given, or a ``dtype``
            the suite does not run in or no role of the installed backend declares.
    """
    if make_training_engine is not None or make_rollout_engine is not None or make_reward_engine is not None:
        subject: str | Subject = Subject.from_factories(backend, make_training_engine, make_rollout_engine,
                                                        make_reward_engine, roles=roles)
    else:
        if roles is not None:
            raise ValueError(f"roles= declares the roles of engines given as factories; the installed backend "
                             f"{backend!r} provides the roles of its BackendSpec (see `verl backends`)")
        subject = backend
    report = run_conformance(subject, against=against, checks=checks, areas=areas, known_gaps=known_gaps,
                             options=options, check_timeout_s=check_timeout_s, dtype=dtype, device=device)
    return _raise_failures(report, subject, options)


def check_backends_match(
    a: str, b: str, *, checks: Sequence[str] | None = None, known_gaps: str | os.PathLike[str] | None = None
) -> ConformanceReport:
    """Run the differential checks of backend ``a`` against backend ``b``; raise ConformanceError on a mismatch."""
    report = run_conformance(a, against=b, checks=list(checks or ["differential::against_*"]),
                             known_gaps=known_gaps)
    return _raise_failures(report)


def check_buffer(
    make_buffer: BufferFactory,
    *,
    disk_tier: bool = True,
    checks: Sequence[str] | None = None,
    name: str | None = None,
) -> ConformanceReport:
    """Run the ``buffer`` checks on a replay buffer implementation; raise ConformanceError if any fails.

    Args:
        make_buffer: Builds a buffer from the keyword arguments ``capacity``, ``memory_samples``
            and ``spill_dir`` (see :data:`~verl_conformance.harness.BufferFactory`);
            :class:`verl_core.trainer.batching.replay.HybridReplayBuffer` is one as it is.
        disk_tier: Whether the buffer spills past ``memory_samples`` (False skips the spill check).
        checks: Buffer check ids to run (``buffer::*`` by default; wildcards allowed).
        name: Label in reports (default: ``module:qualname`` of ``make_buffer``, which the
            reproduction snippets pass to ``--verl-buffer``).

    Returns:
        The report.

    Raises:
        ConformanceError: naming each failing check, what was wrong and how to re-run it alone.
    """
    label = name or f"{getattr(make_buffer, '__module__', '?')}:{getattr(make_buffer, '__qualname__', '?')}"
    buffer = BufferSubject(label, make_buffer, disk_tier)
    harness = Harness(Subject(label, None, None, version="replay buffer"), buffer=buffer)
    selected = select_checks(list(checks or ["buffer::*"]))
    outside = [c.id for c in selected if c.area != "buffer"]
    if outside:
        raise ValueError(f"check_buffer runs buffer checks only; got {outside}")
    return _raise_failures(run_checks(harness, selected))
