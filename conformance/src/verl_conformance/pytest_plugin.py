"""pytest plugin of the conformance suite (import-light: heavy modules load inside hooks and fixtures).

Options: ``--verl-backend NAME`` (or ``$VERL_BACKEND``) selects the installed backend under test,
``--verl-against NAME`` adds differential checks against a second backend, ``--verl-buffer
MODULE:FACTORY`` selects a replay buffer for the ``buffer`` area, ``--verl-options JSON``
gives backend options to every engine of the backend under test, ``--verl-xfails-file
PATH`` declares known gaps (check ids with reasons). Fixtures: ``make_training_engine``,
``make_rollout_engine`` and ``make_reward_engine`` (override them to test engines that are not
installed as a plugin), ``provided_roles`` (override it to declare which roles those factories
provide; the checks of the others are skipped),
``verl_harness`` (what each check runs against). Markers: ``verl_check(id)`` on every suite
test and ``verl_<area>`` (e.g. ``-m verl_numerics``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import warnings
from collections.abc import Callable, Generator
from typing import Any

import pytest

_AREAS = ("schema", "numerics", "invariance", "differential", "weight_sync", "robustness", "reward", "stateful",
          "buffer")
_GAPS_KEY = pytest.StashKey[Any]()
_UNMATCHED_KEY = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the --verl-* options."""
    group = parser.getgroup("verl-conformance", "verl conformance suite")
    group.addoption("--verl-backend", default=None, metavar="NAME",
                    help="installed verl backend to run the conformance suite on (default: $VERL_BACKEND)")
    group.addoption("--verl-device", default="cpu", metavar="DEVICE",
                    help="device of every engine the suite builds (cpu, cuda); default cpu")
    group.addoption("--verl-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="parameter dtype of every engine the suite builds; selects the tolerance tier")
    group.addoption("--verl-against", default=None, metavar="NAME",
                    help="second installed backend for the differential checks")
    group.addoption("--verl-buffer", default=None, metavar="MODULE:FACTORY",
                    help="replay buffer for the buffer area: a callable taking capacity=, memory_samples=, "
                         "spill_dir= (e.g. verl_core.trainer.batching.replay:HybridReplayBuffer)")
    group.addoption("--verl-options", default=None, metavar="JSON",
                    help="backend options (a JSON object) for every engine of the backend under test, "
                         'e.g. \'{"optimizer": "megatron"}\'')
    group.addoption("--verl-check-timeout", default=None, type=float, metavar="S",
                    help="seconds one check may run before it fails, naming where it hung (default 900; 0: no "
                         "limit; pytest-timeout's --timeout, where given, replaces it)")
    group.addoption("--verl-xfails-file", default=None, metavar="PATH",
                    help="known gaps: one check id (area::name or TestArea::test_name) per line, '# reason'")


def pytest_configure(config: pytest.Config) -> None:
    """Register the suite's markers; check ``--verl-options`` and that the backend declares ``--verl-dtype``."""
    _options(config)
    _check_dtype_declared(config)
    config.addinivalue_line("markers", "verl_check(id): a verl conformance check (id = area::name)")
    for area in _AREAS:
        config.addinivalue_line("markers", f"verl_{area}: verl conformance checks of the {area} area")


def _check_dtype_declared(config: pytest.Config) -> None:
    """Refuse a ``--verl-dtype`` that no role of the ``--verl-backend`` declares, in one message."""
    name, dtype = _backend_name(config), config.getoption("--verl-dtype", None)
    if not name or not dtype:
        return
    from verl_conformance.api import undeclared_dtype

    refusal = undeclared_dtype(name, dtype, "--verl-dtype")
    if refusal:
        raise pytest.UsageError(f"--verl-{refusal}")  # "--verl-dtype bfloat16: backend ..."


def _backend_name(config: pytest.Config) -> str | None:
    name = config.getoption("--verl-backend", None) or os.environ.get("VERL_BACKEND") or None
    return str(name) if name else None


def _caps_line(caps: object) -> str:
    on = []
    for f in dataclasses.fields(caps):  # type: ignore[arg-type]
        v = getattr(caps, f.name)
        if v is True:
            on.append(f.name)
        elif isinstance(v, frozenset):
            on.append(f"{f.name}={'/'.join(sorted(v))}")
        elif isinstance(v, str):
            on.append(f"{f.name}={v}")
    return ", ".join(on)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Name the backend(s) under test, their versions and declared capabilities."""
    lines = []
    for label, name in (("backend", _backend_name(config)), ("against", config.getoption("--verl-against", None))):
        if not name:
            continue
        from verl_core import VerlError, get_backend

        try:
            b = get_backend(str(name))
        except VerlError as e:
            lines.append(f"verl {label}: {name} (NOT AVAILABLE: {e})")
            continue
        lines.append(f"verl {label}: {name} ({b.distribution} {b.version}, protocol {b.spec.protocol_version})")
        for role in b.spec.roles:
            lines.append(f"  {role}: {_caps_line(b.capabilities(role))}")
    if lines:
        lines.append(f"verl engines: device {config.getoption('--verl-device')}, dtype {config.getoption('--verl-dtype')}")
    gaps = config.getoption("--verl-xfails-file", None)
    if gaps:
        lines.append(f"verl known gaps: {gaps}")
    return lines or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add area markers, and expected-failure marks for declared known gaps."""
    suite_items = [(item, m) for item in items if (m := item.get_closest_marker("verl_check")) is not None]
    for item, marker in suite_items:
        item.add_marker(f"verl_{str(marker.args[0]).split('::')[0]}")
    path = config.getoption("--verl-xfails-file", None)
    if not path:
        return
    from verl_conformance.runner import load_known_gaps

    gaps = load_known_gaps(str(path))
    config.stash[_GAPS_KEY] = gaps
    unmatched = gaps.unmatched()
    config.stash[_UNMATCHED_KEY] = unmatched
    for entry in unmatched:
        warnings.warn(pytest.PytestWarning(
            f"known-gaps file {path}: {entry!r} matches no conformance check (typo, or the check was renamed)"
        ), stacklevel=1)
    for item, marker in suite_items:
        why = gaps.reason(str(marker.args[0]), item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.xfail(reason=f"known gap: {why}", strict=False))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Repeat known-gap entries that match nothing, so they are not missed."""
    unmatched = config.stash.get(_UNMATCHED_KEY, [])
    if unmatched:
        terminalreporter.section("verl known gaps")
        for entry in unmatched:
            terminalreporter.write_line(f"WARNING: {entry!r} matches no conformance check")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Attach a reproduction snippet to every failing suite test."""
    report = yield
    marker = item.get_closest_marker("verl_check")
    if marker is not None and report.when == "call" and report.failed:
        check_id = str(marker.args[0])
        backend = _backend_name(item.config)
        if check_id.startswith("buffer::"):
            backend = item.config.getoption("--verl-buffer", None)
        against = item.config.getoption("--verl-against", None)
        cls = getattr(item, "cls", None)
        harness = getattr(item, "funcargs", {}).get("verl_harness")
        subject = getattr(harness, "subject", None)
        from verl_conformance.runner import reproduction

        flags = _setting_flags(item.config)
        node = " ".join([f"pytest '{item.nodeid}'", *flags])
        if subject is not None and not subject.registered:
            # engines from overridden fixtures: --verl-backend (if any) is not what ran
            text = f"{node}\n" + reproduction(check_id, subject, against)
        elif backend and cls is not None and cls.__module__ == "verl_conformance.test_conformance":
            text = reproduction(check_id, backend, against, pytest_flags=flags)
        else:
            text = node
        report.sections.append(("verl conformance: reproduce", f"check {check_id}\n{text}"))
    return report


def _setting_flags(config: pytest.Config) -> list[str]:
    """The --verl-dtype, --verl-device and --verl-options a run was given other than the defaults."""
    flags = [f"{flag} {value}" for flag, value, default in (
        ("--verl-dtype", config.getoption("--verl-dtype"), "float32"),
        ("--verl-device", config.getoption("--verl-device"), "cpu")) if value != default]
    raw = config.getoption("--verl-options", None)
    if raw:
        flags.append(f"--verl-options {shlex.quote(raw)}")
    return flags


@pytest.fixture(scope="session")
def verl_backend_subject(request: pytest.FixtureRequest) -> Any:
    """The backend named by --verl-backend as a harness Subject (None when no backend is named)."""
    name = _backend_name(request.config)
    if not name:
        return None
    from verl_conformance.harness import Subject
    from verl_core import VerlError

    try:
        return Subject.from_registry(name)
    except VerlError as e:
        pytest.fail(f"--verl-backend {name}: {e}", pytrace=False)


@pytest.fixture(scope="session")
def verl_against_subject(request: pytest.FixtureRequest) -> Any:
    """The backend named by --verl-against (None when not given)."""
    name = request.config.getoption("--verl-against", None)
    if not name:
        return None
    from verl_conformance.harness import Subject
    from verl_core import VerlError

    try:
        return Subject.from_registry(str(name))
    except VerlError as e:
        pytest.fail(f"--verl-against {name}: {e}", pytrace=False)


@pytest.fixture(scope="session")
def verl_buffer_subject(request: pytest.FixtureRequest) -> Any:
    """The replay buffer named by --verl-buffer as a BufferSubject (None when not given)."""
    path = request.config.getoption("--verl-buffer", None)
    if not path:
        return None
    from verl_conformance.harness import BufferSubject
    from verl_core import VerlError
    from verl_core.kernel.registry import import_string

    try:
        factory = import_string(str(path))
    except VerlError as e:
        raise pytest.UsageError(f"--verl-buffer {path}: {e}") from None
    if not callable(factory):
        raise pytest.UsageError(f"--verl-buffer {path}: {factory!r} is not callable; name a buffer class or factory")
    return BufferSubject(str(path), factory)


@pytest.fixture
def make_training_engine(verl_backend_subject: Any) -> Callable[[Any], Any] | None:
    """Builds training engines from an EngineSpec (override to test your own engines)."""
    return None if verl_backend_subject is None else verl_backend_subject.make_training


@pytest.fixture
def make_rollout_engine(verl_backend_subject: Any) -> Callable[[Any], Any] | None:
    """Builds rollout engines from an EngineSpec (override to test your own engines)."""
    return None if verl_backend_subject is None else verl_backend_subject.make_rollout


@pytest.fixture
def make_reward_engine(verl_backend_subject: Any) -> Callable[[Any], Any] | None:
    """Builds reward engines from an EngineSpec (override to test your own reward model or functions)."""
    return None if verl_backend_subject is None else verl_backend_subject.make_reward


@pytest.fixture
def provided_roles() -> Any:
    """The roles the ``make_*_engine`` fixtures provide (override with a collection of role names).

    None: every role of each factory given (``make_training_engine`` builds actor, reference and
    critic). A role left out skips its checks with the reason, as for an installed backend whose
    ``BackendSpec.roles`` lacks it (e.g. ``{"actor", "reference", "rollout"}`` without a critic).
    """
    return None


@pytest.fixture(scope="session")
def verl_engine_cache() -> Generator[Any, None, None]:
    """Engines shared across the session's checks (closed at the end)."""
    from verl_conformance.harness import EngineCache

    cache = EngineCache()
    yield cache
    cache.close()


@pytest.fixture
def verl_harness(
    request: pytest.FixtureRequest,
    make_training_engine: Any,
    make_rollout_engine: Any,
    make_reward_engine: Any,
    verl_backend_subject: Any,
    verl_against_subject: Any,
    verl_engine_cache: Any,
    verl_buffer_subject: Any,
    provided_roles: Any,
) -> Any:
    """What each conformance check runs against."""
    from verl_conformance.harness import Harness, Subject
    from verl_conformance.timelimit import limit_from_option

    subject = verl_backend_subject
    marker = request.node.get_closest_marker("verl_check")
    buffer_check = marker is not None and str(marker.args[0]).startswith("buffer::")
    no_engines = make_training_engine is None and make_rollout_engine is None and make_reward_engine is None
    if no_engines and not (buffer_check and verl_buffer_subject):
        pytest.skip("no backend selected: run with --verl-backend NAME (installed backends: `verl backends`), "
                    "or override the make_training_engine / make_rollout_engine / make_reward_engine fixtures")
    if subject is None or (make_training_engine is not subject.make_training
                           or make_rollout_engine is not subject.make_rollout
                           or make_reward_engine is not subject.make_reward):
        label = request.cls.__name__ if request.cls is not None else "custom"
        try:
            subject = Subject.from_factories(label, make_training_engine, make_rollout_engine, make_reward_engine,
                                             roles=provided_roles)
        except ValueError as e:
            raise pytest.UsageError(f"provided_roles fixture: {e}") from None
    elif provided_roles is not None:
        raise pytest.UsageError(
            f"the provided_roles fixture declares the roles of engines given by the make_*_engine fixtures; "
            f"the installed backend {subject.name!r} provides the roles of its BackendSpec (see `verl backends`)")
    return Harness(subject, verl_against_subject, verl_engine_cache,
                   dtype=request.config.getoption("--verl-dtype"), device=request.config.getoption("--verl-device"),
                   options=_options(request.config), buffer=verl_buffer_subject,
                   time_limit_s=limit_from_option(request.config.getoption("--verl-check-timeout", None)))


def _options(config: pytest.Config) -> dict[str, Any]:
    """The ``--verl-options`` object (empty when not given)."""
    from verl_conformance.api import parse_options

    try:
        return parse_options(config.getoption("--verl-options", None), "--verl-options")
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
