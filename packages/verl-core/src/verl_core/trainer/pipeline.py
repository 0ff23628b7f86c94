"""HybridPipeline: run the stages of one RL step from a declared dependency graph.

Each stage is a function of named inputs returning named outputs. When the pipeline is built, every
input must be produced by exactly one stage or given to :meth:`HybridPipeline.run`, and the graph
must be acyclic; violations raise :class:`PipelineError` naming the stage and the missing input or
the cycle. During a step, every stage whose inputs are ready runs at once (torch releases the GIL
inside its kernels, so e.g. reward scoring really overlaps reference log-probs).

Threads: PyTorch keeps caches per thread (cuDNN's attention graphs, the CUDA current stream,
autocast and grad mode), so the first call of an engine on a new thread is much slower than the
next ones (4x measured for a GPU rollout). Stages therefore never run on fresh threads:

* a stage that can never overlap another (every other stage is before or after it in the graph,
  as the rollout that starts a step) runs on the thread that calls :meth:`HybridPipeline.run`,
  exactly as if the caller called its function, and sees the caller's thread-local torch state;
* every other stage runs on a long-lived thread of its own, one per stage name, from
  :class:`StageThreads`. The trainer owns one for the run and hands it to the pipeline of each
  step, so a stage runs on the same thread at every step; a pipeline given none owns its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from verl_core.kernel.errors import ConfigError, VerlError

__all__ = ["HybridPipeline", "PipelineError", "PipelineResult", "Stage", "StageError", "StageThreads"]


class PipelineError(ConfigError):
    """The declared stage graph is invalid (duplicate, missing input, cycle)."""


class StageError(VerlError, RuntimeError):
    """A stage raised during a step; the step's outputs were discarded.

    Attributes:
        stage: Name of the stage that failed.
    """

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"pipeline stage {stage!r} failed: {type(error).__name__}: {error}")
        self.stage = stage


@dataclass(frozen=True)
class Stage:
    """One stage of a pipeline.

    Attributes:
        name: Unique stage name (used in errors and as the timing key ``time/<name>``).
        fn: Called with the stage's inputs as keyword arguments; returns a mapping holding exactly
            the declared ``outputs``.
        inputs: Names of the values the stage reads (pipeline inputs or other stages' outputs).
        outputs: Names of the values the stage produces.
        after: Stages that must finish first although no value flows between them.
    """

    name: str
    fn: Callable[..., Mapping[str, Any]]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineResult:
    """What a successful step produced.

    Attributes:
        outputs: Every value produced by the stages (pipeline inputs are not repeated).
        timings: ``time/<stage>`` wall seconds per stage, plus ``time/pipeline`` for the whole step.
    """

    outputs: Mapping[str, Any]
    timings: Mapping[str, float] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.outputs[name]


class StageThreads:
    """Long-lived threads that run pipeline stages: a stage name always gets the same thread.

    One object serves any number of pipelines in turn (the trainer builds a pipeline per step);
    they run one at a time (:attr:`run_lock`), because their stages usually share engines.
    :meth:`close` ends the threads; a later run starts new ones, so an owner may close it
    whenever it releases its engines and still run again after building them anew.

    Args:
        name_prefix: Thread names are ``<name_prefix>-<stage>``.
    """

    def __init__(self, *, name_prefix: str = "verl-stage") -> None:
        self._prefix = name_prefix
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._guard = threading.Lock()  # guards _pools
        self.run_lock = threading.Lock()

    def submit(self, stage: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the thread of ``stage`` (started on first use)."""
        with self._guard:
            pool = self._pools.get(stage)
            if pool is None:
                pool = self._pools[stage] = ThreadPoolExecutor(1, thread_name_prefix=f"{self._prefix}-{stage}")
        return pool.submit(fn, *args)

    def close(self) -> None:
        """End every thread after its current work (idempotent; a later submit starts new ones)."""
        with self._guard:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)

    def __enter__(self) -> StageThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HybridPipeline:
    """A validated stage graph that runs ready stages concurrently.

    Args:
        stages: The stages, in any order.
        inputs: Names of the values given to :meth:`run` (available before any stage runs).
        threads: The long-lived threads that run the stages which may overlap others (see the
            module docstring). Give the same object to the pipelines of successive steps so a
            stage keeps its thread; the caller closes it. Default: threads of this pipeline,
            ended by :meth:`close` (or when the pipeline is garbage-collected).

    Raises:
        PipelineError: duplicate stage names or producers, an input nobody produces, an unknown
            ``after`` stage, or a dependency cycle (the message names the stages involved).
    """

    def __init__(
        self, stages: Sequence[Stage], *, inputs: Iterable[str] = (), threads: StageThreads | None = None
    ) -> None:
        self._inputs = frozenset(inputs)
        self._stages: dict[str, Stage] = {}
        producer: dict[str, str] = {}
        for st in stages:
            if st.name in self._stages:
                raise PipelineError(f"two stages are named {st.name!r}; stage names must be unique")
            self._stages[st.name] = st
            for out in st.outputs:
                if out in self._inputs:
                    raise PipelineError(
                        f"stage {st.name!r} outputs {out!r}, which is already a pipeline input"
                    )
                if out in producer:
                    raise PipelineError(
                        f"stages {producer[out]!r} and {st.name!r} both output {out!r}; "
                        "each value must have exactly one producer"
                    )
                producer[out] = st.name
        self._deps: dict[str, frozenset[str]] = {}
        for st in stages:
            deps: set[str] = set()
            for name in st.inputs:
                if name in self._inputs:
                    continue
                if name not in producer:
                    known = sorted(self._inputs | set(producer))
                    raise PipelineError(
                        f"stage {st.name!r} needs input {name!r}, which no stage produces and is not "
                        f"a pipeline input; available: {', '.join(known) or 'none'}"
                    )
                deps.add(producer[name])
            for other in st.after:
                if other not in self._stages:
                    raise PipelineError(
                        f"stage {st.name!r} runs after unknown stage {other!r}; "
                        f"stages: {', '.join(self._stages)}"
                    )
                deps.add(other)
            self._deps[st.name] = frozenset(deps)
        self._order = self._toposort()
        self._inline = self._never_overlapping()
        self._owns_threads = threads is None
        self._threads = StageThreads() if threads is None else threads

    @property
    def stages(self) -> tuple[str, ...]:
        """Stage names in a valid execution order."""
        return self._order

    def close(self) -> None:
        """End the threads this pipeline started (not those given to it as ``threads``)."""
        if self._owns_threads:
            self._threads.close()

    def __enter__(self) -> HybridPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _never_overlapping(self) -> frozenset[str]:
        """Stages ordered against every other stage (each other one is an ancestor or descendant)."""
        ancestors: dict[str, set[str]] = {}
        for name in self._order:  # dependencies come first
            anc = set(self._deps[name])
            for dep in self._deps[name]:
                anc |= ancestors[dep]
            ancestors[name] = anc
        return frozenset(
            name for name in self._order
            if all(o == name or o in ancestors[name] or name in ancestors[o] for o in self._order)
        )

    def _toposort(self) -> tuple[str, ...]:
        state: dict[str, int] = {}  # 1 = on the current path, 2 = done
        order: list[str] = []

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = [*path[path.index(name):], name]
                raise PipelineError(f"stage dependency cycle: {' -> '.join(cycle)}")
            state[name] = 1
            path.append(name)
            for dep in sorted(self._deps[name]):
                visit(dep, path)
            path.pop()
            state[name] = 2
            order.append(name)

        for name in self._stages:
            visit(name, [])
        return tuple(order)

    def run(self, **inputs: Any) -> PipelineResult:
        """Run one step: every stage once, each as soon as its dependencies finished.

        Raises:
            PipelineError: a declared input is missing or an unknown one is given.
            StageError: a stage raised, or returned other names than it declared. Stages already
                running are awaited, nothing not yet started runs, and no output is returned.
        """
        missing = sorted(self._inputs - set(inputs))
        extra = sorted(set(inputs) - self._inputs)
        if missing or extra:
            raise PipelineError(
                f"pipeline run needs inputs {sorted(self._inputs)}; missing {missing}, unexpected {extra}"
            )
        values: dict[str, Any] = dict(inputs)
        timings: dict[str, float] = {}
        done: set[str] = set()
        started: set[str] = set()
        t0 = time.perf_counter()
        # one pipeline run at a time: the stage functions usually share engines
        with self._threads.run_lock:
            running: dict[Future[tuple[Mapping[str, Any], float]], str] = {}
            while len(done) < len(self._stages):
                for name in self._order:
                    if name not in started and self._deps[name] <= done:
                        st = self._stages[name]
                        kwargs = {k: values[k] for k in st.inputs}
                        if name in self._inline:  # nothing else is running or ready
                            running[_run_here(st.fn, kwargs)] = name
                        else:
                            running[self._threads.submit(name, _timed, st.fn, kwargs)] = name
                        started.add(name)
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                failure: tuple[str, BaseException] | None = None
                for fut in finished:
                    name = running.pop(fut)
                    err = fut.exception()
                    if err is not None:
                        failure = failure or (name, err)
                        continue
                    out, seconds = fut.result()
                    st = self._stages[name]
                    if not isinstance(out, Mapping) or set(out) != set(st.outputs):
                        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
                        failure = failure or (
                            name,
                            TypeError(f"returned {got}, declared outputs {sorted(st.outputs)}"),
                        )
                        continue
                    values.update(out)
                    timings[f"time/{name}"] = seconds
                    done.add(name)
                if failure is not None:
                    wait(running)  # let running stages finish; their results are dropped
                    raise StageError(*failure) from failure[1]
        timings["time/pipeline"] = time.perf_counter() - t0
        outputs = {k: v for k, v in values.items() if k not in self._inputs}
        return PipelineResult(outputs, timings)


def _timed(fn: Callable[..., Mapping[str, Any]], kwargs: dict[str, Any]) -> tuple[Mapping[str, Any], float]:
    t = time.perf_counter()
    out = fn(**kwargs)
    return out, time.perf_counter() - t


def _run_here(
    fn: Callable[..., Mapping[str, Any]], kwargs: dict[str, Any]
) -> Future[tuple[Mapping[str, Any], float]]:
    """Run a stage on the calling thread; its result or error as a finished future."""
    fut: Future[tuple[Mapping[str, Any], float]] = Future()
    try:
        fut.set_result(_timed(fn, kwargs))
    except Exception as e:  # reported as the stage's error, like a threaded stage's
        fut.set_exception(e)
    return fut
