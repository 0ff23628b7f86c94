"""The static decode loop's cache windows and its CUDA-graph capture policy (enginekit.sampling).

CUDA graphs cannot be captured on a CPU: the capture is injected. The injected "graph" records
nothing and runs the step when replayed, which is what a captured CUDA graph does; a loop that
assumed the capture itself ran a step, or replayed a window's graph for another window, would
then draw other tokens than the eager loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from verl_core import SamplingParams, TensorBatch
from verl_core.enginekit.sampling import (
    MAX_CACHE_WINDOWS,
    GraphCaptures,
    StaticDecodeLoop,
    StaticDecoders,
    TokenSampler,
    cache_windows,
    release_generator_after_failed_capture,
    uniform_table,
)

VOCAB = 7


class _StepLoop(StaticDecodeLoop):
    """Logits that depend on the step index (a device tensor updated in place) and on the window a
    step runs at, as an engine's attention over a cache window would: a step run at the wrong
    window, or a graph of another window replayed, draws another token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, int]] = []  # (done, window) of every step run (eagerly or replayed)
        self.where = torch.zeros(1, dtype=torch.int64)  # the window a step runs at, as a device value

    def _logits(self, bump: Tensor) -> torch.Tensor:
        base = torch.arange(VOCAB, dtype=torch.float32).expand(self.out_tok.shape[0], -1)
        return base * 0.1 + torch.nn.functional.one_hot(bump % VOCAB, VOCAB).float() * 3.0

    def _prefill(self, chunk: TensorBatch) -> torch.Tensor:
        return self._logits(torch.zeros(self.out_tok.shape[0], dtype=torch.int64))

    def _advance(self) -> torch.Tensor:
        self.seen.append((self.done, self.window))
        self.where.fill_(self.window)  # recorded by a real capture as a constant of the window
        return self._logits((self.t + self.where).expand(self.out_tok.shape[0]))


Tensor = torch.Tensor


class _Graph:
    """What a captured CUDA graph does on replay: the recorded step, run again."""

    def __init__(self, step: Callable[[], None], loop: _StepLoop) -> None:
        self.step, self.loop, self.window = step, loop, loop.window
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        assert self.loop.window == self.window, "a graph replayed for another window"
        self.step()


class _Capture:
    """Captures (without running the step) except for the windows in ``fail``, which raise."""

    def __init__(self, loop: list[_StepLoop], fail: set[int]) -> None:
        self.loop, self.fail = loop, fail
        self.calls: list[int] = []

    def __call__(self, step: Callable[[], None], pool: Any) -> _Graph:
        loop = self.loop[0]
        self.calls.append(loop.window)
        if loop.window in self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _Graph(step, loop)


def _loop(windows: tuple[int, ...], filled: int, max_new: int = 20, rows: int = 3) -> _StepLoop:
    params = SamplingParams(max_new_tokens=max_new, seed=1)
    sampler = TokenSampler(params, pad=0, stops=torch.tensor([VOCAB + 5]),  # never drawn: every row runs to the end
                           uniforms=uniform_table(list(range(rows)), max_new))
    loop = _StepLoop(rows, max_new, sampler, torch.device("cpu"), torch.nn.Linear(1, 1), "test",
                     windows=windows, filled=filled)
    loop.shape = ("rows", rows, "filled", filled)
    return loop


def _decode(loop: _StepLoop, graphs: GraphCaptures | None = None) -> tuple[Tensor, ...]:
    loop.seen.clear()
    loop.start(TensorBatch({"group_ids": torch.arange(loop.out_tok.shape[0])}), loop.sampler.uniforms)
    loop.run(2, graphs=graphs)
    return loop.result()


def test_cache_windows_are_multiples_of_a_step_and_end_with_the_whole_cache() -> None:
    assert cache_windows(32, 2080, 256) == (256, 512, 768, 1024, 1280, 1536, 1792, 2080)  # 2048: within a tenth
    assert cache_windows(32, 544, 256) == (256, 544)  # 512 is within a tenth of 544
    assert cache_windows(32, 160, 256) == (160,)
    assert cache_windows(300, 1200, 256) == (512, 768, 1024, 1200)  # 256 cannot hold the prompt and a token
    assert cache_windows(32, 2080, 0) == (2080,)
    # past MAX_CACHE_WINDOWS steps of the smallest window, the step is the smallest multiple that
    # keeps to it: a step reads at most one step of unwritten slots, with a bounded count of graphs
    long = cache_windows(64, 16448, 256)
    assert len(long) <= MAX_CACHE_WINDOWS and long[:2] == (1280, 2560) and long[-1] == 16448
    assert all(b - a == 1280 for a, b in itertools.pairwise(long[:-1]))


def test_each_step_runs_at_the_smallest_window_holding_what_it_reads() -> None:
    windows = cache_windows(4, 24, 5)
    assert windows == (5, 10, 15, 20, 24)
    loop = _loop(windows, filled=4)
    plain = _decode(loop)
    assert [d for d, _ in loop.seen] == list(range(1, 20))
    for done, window in loop.seen:  # a step with `done` tokens drawn reads filled + done slots
        assert window >= 4 + done and all(w < 4 + done for w in windows if w < window)
    one = _loop((24,), filled=4)
    assert torch.equal(_decode(one)[0][:, :1], plain[0][:, :1])  # the first token comes from the prefill alone
    assert {w for _, w in one.seen} == {24}


def test_a_failed_capture_affects_only_its_shape_and_is_retried_once() -> None:
    windows = (5, 10, 20, 24)
    eager = _decode(_loop(windows, filled=2, max_new=22))
    loop = _loop(windows, filled=2, max_new=22)
    capture = _Capture([loop], fail={10})
    graphs = GraphCaptures("test rollout", capture=capture)
    with pytest.warns(RuntimeWarning, match=r"capture failed for shape .*10\).*tries again"):
        first = _decode(loop, graphs)
    for got, want in zip(first, eager, strict=True):
        assert torch.equal(got, want), "graphs and the eager fallback must draw what eager steps draw"
    # every window was captured after two warm-up steps; window 10 failed and ran eagerly
    assert sorted(capture.calls) == [5, 10, 20, 24]
    assert sorted(loop.graphs) == [5, 20, 24] and graphs.captured == 3 and graphs.failures == 1
    assert graphs.allowed((loop.shape, 10)) and graphs.eager_shapes == {}
    replays = {w: g.replays for w, g in loop.graphs.items()}
    assert all(n > 0 for n in replays.values())

    capture.calls.clear()
    with pytest.warns(RuntimeWarning, match="after 2 failures this shape decodes eagerly from now on"):
        second = _decode(loop, graphs)  # the kept graphs replay; window 10 is tried once more
    assert capture.calls == [10] and graphs.failures == 2 and graphs.captured == 3
    assert all(loop.graphs[w].replays > n for w, n in replays.items())
    assert list(graphs.eager_shapes) == [(loop.shape, 10)]
    assert "operation not permitted" in graphs.eager_shapes[(loop.shape, 10)]
    capture.calls.clear()
    third = _decode(loop, graphs)  # given up on: no capture is tried, no warning
    assert capture.calls == []
    for decoded in (second, third):
        for a, b in zip(decoded, eager, strict=True):
            assert torch.equal(a, b)
    assert graphs.metrics() == {"graph_captures": 3.0, "graph_capture_failures": 2.0, "graph_eager_shapes": 1.0}

    # another shape with the same engine record captures the same window
    other = _loop(windows, filled=2, max_new=22, rows=2)
    capture.loop[0], capture.fail = other, set()
    _decode(other, graphs)
    assert 10 in other.graphs and sorted(capture.calls) == [5, 10, 20, 24]


def test_a_capture_without_room_for_warm_up_steps_is_not_attempted() -> None:
    loop = _loop((5, 24), filled=4, max_new=10)  # window 5 serves only the first step after the prefill
    capture = _Capture([loop], fail=set())
    _decode(loop, GraphCaptures("test", capture=capture))
    assert capture.calls == [24]


def test_graph_captures_live_across_rebuilt_decoders() -> None:
    """Decoders are rebuilt on sleep and wake; a shape given up on stays given up on."""
    model = torch.nn.Linear(1, 1)
    decoders: StaticDecoders[_StepLoop] = StaticDecoders()
    params = SamplingParams(max_new_tokens=12, seed=1)
    built: list[_StepLoop] = []

    def build(sampler: TokenSampler) -> _StepLoop:
        sampler.stops = torch.tensor([VOCAB + 5])
        built.append(_StepLoop(2, 12, sampler, torch.device("cpu"), model, "test", windows=(8, 16), filled=4))
        return built[-1]

    def get() -> _StepLoop:
        return decoders.get(model, 2, 4, params, [VOCAB + 5], uniform_table([1, 2], 12), 0, torch.device("cpu"),
                            build)

    capture = _Capture([get()], fail={8})
    graphs = GraphCaptures("test", capture=capture, attempts=1)
    with pytest.warns(RuntimeWarning, match="after 1 failures"):
        _decode(built[0], graphs)
    decoders.clear()  # a sleep
    capture.loop[0] = get()
    assert len(built) == 2 and built[1].shape == built[0].shape
    capture.calls.clear()
    _decode(built[1], graphs)
    assert capture.calls == [16], "the new decoder of the same shape does not try the failed window again"
    with pytest.raises(ValueError, match="at least one attempt"):
        GraphCaptures("test", attempts=0)


class _FakeCudaGenerator:
    """What :func:`release_generator_after_failed_capture` uses of a CUDA generator: seed, offset, graph-safe state."""

    def __init__(self, seed: int = 0, offset: int = 0) -> None:
        self.seed, self.offset = seed, offset
        self.state: object = object()

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def manual_seed(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def graphsafe_get_state(self) -> object:
        return self

    def graphsafe_set_state(self, state: _FakeCudaGenerator) -> None:
        self.state = state


def test_a_failed_capture_gives_the_generator_a_fresh_state_at_the_same_seed_and_offset() -> None:
    """A capture that fails leaves PyTorch's generator marked as capturing; its state is replaced, its stream kept."""
    stuck = _FakeCudaGenerator(seed=1234, offset=4096)
    stuck_state = stuck.state
    made: list[_FakeCudaGenerator] = []

    def fresh() -> _FakeCudaGenerator:
        made.append(_FakeCudaGenerator(seed=7, offset=12))
        return made[-1]

    release_generator_after_failed_capture(stuck, fresh)
    assert len(made) == 1 and stuck.state is made[0] and stuck.state is not stuck_state
    assert (made[0].seed, made[0].offset) == (1234, 4096), "the random stream goes on where it was"
