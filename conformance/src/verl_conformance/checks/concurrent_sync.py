"""Weight updates during generation: ``update_weights`` on one thread while ``generate`` calls run on others.

The rule (``RolloutEngine.update_weights``, declared by ``rollout.concurrent_weight_update``): every
response of one ``generate`` call comes from exactly one complete weight version, the returned
batch's ``meta.weight_version`` names it, and a ``generate`` call that starts after
``update_weights`` returned uses that version.

The check first syncs each of four weight sets alone and records the engine's own greedy outputs
for it (so it needs no float64 reference and holds inexact engines to the rule too). Then a pushing
thread syncs versions cycling through the four sets; halfway through each stream, two other threads
call ``generate`` and the stream waits briefly for them (an engine that writes while they sample
serves a mix, one that takes turns makes them wait). After each update returns, the pushing thread
generates once itself. Consecutive sets differ in every tensor
(:func:`verl_conformance.testkit.perturbed_model`), so weights written while a call samples give
outputs of none of them.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.weight_sync import folder_stream
from verl_conformance.harness import Harness
from verl_conformance.testkit import tolerance
from verl_core import RolloutEngine, SamplingParams, TensorBatch, WeightChunk, WeightMessage

WEIGHT_SETS: Final = ("llama-perturbed-a", "llama-alt", "llama-perturbed-b", "llama")
"""The weight sets versions cycle through: version v >= 1 is ``WEIGHT_SETS[(v - 1) % 4]``, version 0
the ``llama`` folder the engine loads. Each differs from the next in every tensor."""

_PUSHED: Final = 8  # versions pushed while generate calls run (two cycles)
_GENERATORS: Final = 2  # threads calling generate halfway through each stream
_OVERLAP_S: Final = 0.05  # how long a stream waits for the generate calls it started to return
_DEADLINE_S: Final = 180.0  # the whole concurrent phase; past it the engine is taken to hang
_PARAMS: Final = SamplingParams(greedy=True, temperature=1.0, max_new_tokens=4)


def weight_set(version: int) -> str:
    """The weight set of ``version`` (see :data:`WEIGHT_SETS`)."""
    return "llama" if version == 0 else WEIGHT_SETS[(version - 1) % len(WEIGHT_SETS)]


def _prompts(h: Harness) -> TensorBatch:
    return h.batch(seed=61, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")


@dataclass
class _Call:
    """One generate call of the concurrent phase.

    Attributes:
        after: The last version whose ``update_weights`` had returned when the call started.
        before: The last version whose ``update_weights`` had begun when the call returned.
        out: What it returned.
        thread: Who called it (``generate thread N`` or ``the pushing thread``).
    """

    after: int
    before: int
    out: TensorBatch
    thread: str


class _Outputs:
    """The engine's greedy outputs of each weight set, taken alone, and row-wise matching against them."""

    def __init__(self, h: Harness) -> None:
        self.of: dict[str, TensorBatch] = {}
        self.tol = tolerance(h.dtype, "log_probs")

    def row_matches(self, out: TensorBatch, name: str, row: int) -> bool:
        """Whether sample ``row`` of ``out`` is sample ``row`` of weight set ``name``'s output: the same
        tokens, their log-probs within the dtype tier."""
        ids, lps = _sample_of(out, row)
        want_ids, want_lps = _sample_of(self.of[name], row)
        if ids.shape != want_ids.shape or not bool((ids == want_ids).all()):
            return False
        return bool(((lps - want_lps).abs() <= self.tol.atol + self.tol.rtol * want_lps.abs()).all())

    def sets_of_row(self, out: TensorBatch, row: int) -> list[str]:
        """The weight sets whose output row ``row`` of ``out`` is."""
        return [name for name in self.of if self.row_matches(out, name, row)]


def _sample_of(out: TensorBatch, row: int) -> tuple[Tensor, Tensor]:
    """Sample ``row``'s response tokens and their log-probs (float64), on the CPU."""
    mask = out["response_mask"][row].cpu()
    return out["response_ids"][row].cpu()[mask], out["rollout_log_probs"][row].cpu()[mask].double()


def _versions(names: Iterable[str], low: int, high: int) -> str:
    """The versions in [low, high] of the weight sets ``names``, for messages."""
    wanted = set(names)
    found = [v for v in range(low, high + 1) if weight_set(v) in wanted]
    return ", ".join(map(str, found)) if found else f"none in {low}..{high}"


def _verify(h: Harness, outputs: _Outputs, call: _Call) -> None:
    """Fail unless ``call``'s output is whole and of the version it reports, within its window."""
    out = call.out
    v = out.meta.weight_version
    where = (f"{call.thread}: a generate call that started after update_weights(version {call.after}) had returned "
             f"and returned before update_weights(version {call.before + 1}) began")
    h.expect(call.after <= v <= call.before,
             f"{where} reports meta.weight_version={v}; only versions {call.after} to {call.before} were "
             "complete while it ran (a generate that starts after update_weights returned uses the new version)")
    claimed = weight_set(v)
    for row in range(out.batch_size):
        if outputs.row_matches(out, claimed, row):
            continue
        found = outputs.sets_of_row(out, row)
        if found:
            h.fail(f"{where} reports meta.weight_version={v}, but its sample {row} is what version(s) "
                   f"{_versions(found, call.after, call.before)} ({', '.join(found)}) generate alone, not version "
                   f"{v} ({claimed}): the version reported is not the one that sampled (stamp the version the call "
                   "read its weights under, and read it while no update can change it)")
        h.fail(f"{where} reports meta.weight_version={v}, but its sample {row} matches the output of no complete "
               f"version (each taken alone before): a half-applied weight version was served (tokens "
               f"{_sample_of(out, row)[0].tolist()}, version {v} alone gives "
               f"{_sample_of(outputs.of[claimed], row)[0].tolist()}). update_weights must not write weights a "
               "generate call in flight reads: wait for it, or write between calls (RolloutEngineBase's "
               "_writing_weights does)")


class _Rounds:
    """The generate threads of the concurrent phase: each round, every thread makes one generate call.

    A round is started from inside a weight stream (:meth:`midway`), so the calls meet the update
    in progress. Each call records the versions complete when it started and begun when it returned.
    """

    def __init__(self, engine: RolloutEngine, prompts: TensorBatch) -> None:
        self.engine, self.prompts = engine, prompts
        self.started = self.committed = 0  # the last version whose update_weights began / returned
        self.calls: list[_Call] = []
        self.errors: list[str] = []
        self.done = False
        self._cond = threading.Condition()
        self._round = 0
        self._entered = self._returned = 0  # calls of the current round that began / returned
        self.threads = [threading.Thread(target=self._loop, args=(k,), daemon=True,
                                         name=f"verl-conformance-generate-{k}") for k in range(_GENERATORS)]

    def _loop(self, k: int) -> None:
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(functools.partial(self._round_after, seen))
                if self.done:
                    return
                seen = self._round
                after = self.committed
                self._entered += 1
                self._cond.notify_all()
            try:
                out = self.engine.generate(self.prompts, _PARAMS)
            except Exception as e:
                with self._cond:
                    self.errors.append(
                        f"generate thread {k}: generate raised {type(e).__name__}: {e} while update_weights(version "
                        f"{self.started}) ran on another thread; an engine declaring concurrent_weight_update waits "
                        "for the update or uses the previous version, it does not fail")
                    self.done = True
                    self._cond.notify_all()
                return
            with self._cond:
                self.calls.append(_Call(after, self.started, out, f"generate thread {k}"))
                self._returned += 1
                self._cond.notify_all()

    def _round_after(self, seen: int) -> bool:
        """Whether a round after ``seen`` began, or the phase ended."""
        return self.done or self._round > seen

    def midway(self, stream: Iterable[WeightMessage]) -> Iterator[WeightMessage]:
        """``stream``; before its middle chunk, a round of generate calls, waited for up to
        :data:`_OVERLAP_S` once all of them began."""
        msgs = list(stream)
        chunks = [i for i, m in enumerate(msgs) if isinstance(m, WeightChunk)]
        middle = chunks[len(chunks) // 2] if chunks else len(msgs) - 1
        for i, msg in enumerate(msgs):
            if i == middle:
                with self._cond:
                    self._round += 1
                    self._entered = self._returned = 0
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self.done or self._entered == _GENERATORS)
                    self._cond.wait_for(lambda: self.done or self._returned == _GENERATORS, timeout=_OVERLAP_S)
            yield msg

    def settle(self) -> None:
        """Wait until the calls of the last round returned (the next update must not hold the turn
        they wait for while its stream waits for a new round)."""
        with self._cond:
            self._cond.wait_for(lambda: self.done or self._returned == self._entered)

    def record(self, call: _Call) -> None:
        """Add a call made outside the rounds."""
        with self._cond:
            self.calls.append(call)

    def stop(self) -> None:
        """End the generate threads once their calls return."""
        with self._cond:
            self.done = True
            self._cond.notify_all()


def _run_concurrently(h: Harness, engine: RolloutEngine, prompts: TensorBatch, first: int) -> list[_Call]:
    """Push versions ``first`` .. ``first + _PUSHED - 1``, each meeting a round of generate calls
    halfway; every generate call's record."""
    rounds = _Rounds(engine, prompts)
    rounds.started = rounds.committed = first - 1

    def pushing() -> None:
        try:
            for v in range(first, first + _PUSHED):
                rounds.settle()
                if rounds.done:
                    return
                rounds.started = v
                stream = folder_stream(h.model_path(weight_set(v)), v, dtype=engine.weight_dtype)
                engine.update_weights(rounds.midway(stream))
                rounds.committed = v
                out = engine.generate(prompts, _PARAMS)
                rounds.record(_Call(v, rounds.started, out,
                                    f"the pushing thread, right after update_weights(version {v}) returned"))
        except Exception as e:
            rounds.errors.append(f"update_weights(version {rounds.started}) or the generate after it raised "
                                 f"{type(e).__name__}: {e} while generate calls ran on other threads")
        finally:
            rounds.stop()

    pusher = threading.Thread(target=pushing, daemon=True, name="verl-conformance-push")
    for t in rounds.threads:
        t.start()
    pusher.start()
    deadline = time.monotonic() + _DEADLINE_S
    for t in (pusher, *rounds.threads):
        t.join(max(0.0, deadline - time.monotonic()))
    rounds.stop()
    hung = [t.name for t in (pusher, *rounds.threads) if t.is_alive()]
    h.expect(not hung, f"threads {hung} did not finish within {_DEADLINE_S:g} s while update_weights and generate "
             f"ran on separate threads (last version begun: {rounds.started}, last returned: {rounds.committed}): "
             "they wait for each other (a deadlock)")
    h.expect(not rounds.errors, rounds.errors[0] if rounds.errors else "")
    return rounds.calls


@check("weight_sync", gates=("rollout.concurrent_weight_update", "rollout.weight_update"))
def check_update_during_generate(h: Harness) -> None:
    """update_weights on one thread while two threads call generate: every call's responses are one complete version's (each version's greedy outputs taken alone first) and meta.weight_version names it; a generate after update_weights returned uses the new version."""
    engine = h.rollout(fresh=True)
    caps = engine.capabilities
    if not caps.weight_update:
        h.skip("backend declares weight_update=False")
    if not caps.concurrent_weight_update:
        h.skip("backend declares concurrent_weight_update=False: update_weights is never called while generate "
               "calls are in flight")
    prompts = _prompts(h)
    outputs = _Outputs(h)
    for v, name in enumerate(WEIGHT_SETS, 1):
        engine.update_weights(folder_stream(h.model_path(name), v, dtype=engine.weight_dtype))
        out = engine.generate(prompts, _PARAMS)
        h.expect(out.meta.weight_version == v, f"generate after update_weights(version {v}) returned, on the same "
                 f"thread, reports meta.weight_version={out.meta.weight_version}")
        outputs.of[name] = out
    for i, a in enumerate(WEIGHT_SETS):
        for b in WEIGHT_SETS[i + 1:]:
            same = all(outputs.row_matches(outputs.of[a], b, r) for r in range(prompts.batch_size))
            h.expect(not same, f"{a} and {b} give the same greedy outputs on this engine, so the check cannot tell "
                     "their versions apart (a suite bug)")
    calls = _run_concurrently(h, engine, prompts, len(WEIGHT_SETS) + 1)
    pushed = sum(c.thread.startswith("the pushing thread") for c in calls)
    h.expect(pushed == _PUSHED, f"only {pushed} of {_PUSHED} versions were pushed (a generate thread stopped early)")
    for call in calls:
        _verify(h, outputs, call)
