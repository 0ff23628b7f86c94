"""The episode loop on a real tiny model (the hf rollout engine through the registry)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from agent_helpers import RecordingRollout, chat_model_path, ids_of

from verl_conformance.testkit import TinyModelSpec, assert_close, tiny_model
from verl_core import (
    BatchValidationError,
    ConfigError,
    EngineSpec,
    RolloutEngine,
    SamplingParams,
    TensorBatch,
    TrainingEngine,
    get_rollout_engine,
    get_training_engine,
)
from verl_core.agent import (
    EPISODE_KEY,
    AgentLoop,
    Environment,
    EpisodeLimits,
    ObservationRenderer,
    ParsedTurn,
    StepResult,
    ToolCall,
    ToolEnvironment,
    environment_seconds,
    episode_metrics,
    render_prompts,
)
from verl_core.kernel.schema import TURNS_EXTRA

pytestmark = pytest.mark.slow

QUESTIONS = ("hi", "what is 2+2?", "name a colour", "go", "count to 3")


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from more; the machine is shared
    yield
    torch.set_num_threads(before)


@functools.cache
def rollout(max_response_len: int = 200, max_prompt_len: int = 400, chat: bool = True) -> RolloutEngine:
    path = chat_model_path() if chat else str(tiny_model(TinyModelSpec()))
    spec = EngineSpec(model_path=path, role="rollout", max_prompt_len=max_prompt_len, max_response_len=max_response_len)
    return get_rollout_engine("hf", spec)


@functools.cache
def actor() -> TrainingEngine:
    return get_training_engine("hf", EngineSpec(model_path=chat_model_path(), role="actor", max_prompt_len=400,
                                                max_response_len=400))


def stops(engine: RolloutEngine) -> tuple[int, ...]:
    """Ten frequent characters and the template's end-of-turn token: random-weight turns stay short."""
    return ids_of(engine.tokenizer, "abcdefghij") + ids_of(engine.tokenizer, ["<|im_end|>"])


def prompts(engine: RolloutEngine, n: int, **extras: Sequence[Any]) -> tuple[TensorBatch, list[list[dict[str, str]]]]:
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:n]]
    return render_prompts(engine.tokenizer, convs, group_ids=list(range(10, 10 + n)), extras=extras), convs


def tool_message(k: int) -> list[dict[str, str]]:
    return [{"role": "tool", "content": f"result {k}"}]


class Counting:
    """Answers turn k with a tool message ``result k``; done after ``row['turns']`` turns."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.turns = int(row.get("turns", 1_000_000))
        self.seen: list[tuple[str, list[int]]] = []

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        self.seen.append((text, list(token_ids)))
        k = len(self.seen)
        return StepResult(tool_message(k), reward=float(k), done=k >= self.turns, metrics={"calls": 1})


def runs(flags: list[bool]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal flags: (flag, start, end)."""
    out: list[tuple[bool, int, int]] = []
    for t, f in enumerate(flags):
        if out and out[-1][0] == f:
            out[-1] = (f, out[-1][1], t + 1)
        else:
            out.append((f, t, t + 1))
    return out


@pytest.mark.parametrize("max_response_len", [200, 5], ids=["whole-turns", "engine-cut-turns"])
def test_episodes_are_exact_token_sequences(max_response_len: int) -> None:
    """Every generate call saw the episode's exact ids so far; what it sampled is in the output
    unchanged, with loss_mask True exactly there and its log-probs; observations are the rendered
    deltas; a training forward on the final sequences gives the same log-probs."""
    engine = RecordingRollout(rollout(max_response_len))
    tok = engine.tokenizer
    batch, convs = prompts(engine, 2, turns=[2, 3])
    limit = 300
    loop = AgentLoop(engine, EpisodeLimits(max_turns=5, max_total_tokens=limit))
    params = SamplingParams(seed=7, stop_token_ids=stops(engine), n=2)
    out = loop.run(batch, Counting, params, prompt_messages=convs)
    out.check()
    assert out.batch_size == 4 and out["group_ids"].tolist() == [10, 10, 11, 11]
    assert out["sample_index"].tolist() == [0, 1, 0, 1]
    assert torch.equal(out["prompt_ids"], batch.repeat_interleave(2)["prompt_ids"])
    n = out.batch_size
    initial = [out["prompt_ids"][i][out["prompt_mask"][i]].tolist() for i in range(n)]
    response = [out["response_ids"][i][out["response_mask"][i]].tolist() for i in range(n)]
    final = [initial[i] + response[i] for i in range(n)]
    sampled = [[False] * len(response[i]) for i in range(n)]
    log_probs = torch.zeros_like(out["rollout_log_probs"])
    for _, params_used, _ in engine.calls:
        assert params_used.stop_token_ids[-1] == tok.eos_token_id and params_used.n == 1
        assert params_used.max_new_tokens <= max_response_len
    seen: dict[int, set[int]] = {}
    for row, (prompt, ids, lps, max_new) in enumerate(engine.rows()):
        assert len(ids) <= max_new
        matches = []
        for i in range(n):
            room = limit - (len(prompt) - len(initial[i]))
            kept = ids[:room]
            if final[i][: len(prompt) + len(kept)] == prompt + kept and len(prompt) >= len(initial[i]):
                matches.append((i, kept))
        assert len(matches) == 1, f"row {row}: the prompt and sample match episodes {[m[0] for m in matches]}"
        i, kept = matches[0]
        start = len(prompt) - len(initial[i])
        for t in range(start, start + len(kept)):
            assert not sampled[i][t], f"episode {i}: position {t} sampled twice"
            sampled[i][t] = True
        log_probs[i, start : start + len(kept)] = torch.tensor(lps[: len(kept)])
        seen.setdefault(i, set()).add(row)
    assert set(seen) == set(range(n))
    loss = out["loss_mask"]
    for i in range(n):
        assert loss[i][: len(response[i])].tolist() == sampled[i]
        assert not bool(loss[i][len(response[i]) :].any())
    # the rollout log-probs are the engine's, exactly, and zero off the sampled tokens
    assert torch.equal(out["rollout_log_probs"], log_probs)
    assert bool((out["rollout_log_probs"][loss] < 0).all())
    # observation tokens are the renderer's deltas; turn ids count the model turns
    renderer = ObservationRenderer(tok)
    for i in range(n):
        info = out.extras[EPISODE_KEY][i]
        turns = out.extras[TURNS_EXTRA][i]
        pieces = runs(sampled[i])
        model_runs = [p for p in pieces if p[0]]
        assert len(model_runs) == info["turns"] == len(turns)
        for k, (_, a, b) in enumerate(model_runs):
            assert set(out["turn_ids"][i, a:b].tolist()) == {k}
            assert turns[k]["model_tokens"] == b - a
        for k, (_, a, b) in enumerate(p for p in pieces if not p[0]):
            assert response[i][a:b] == renderer.tokens(tool_message(k + 1), after=response[i][a - 1])
            assert set(out["turn_ids"][i, a:b].tolist()) == {k}
            assert turns[k]["observation_tokens"] == b - a
        want = [2, 2, 3, 3][i]
        assert info["termination"] == "done" and info["message"] is None and not bool(out["truncated"][i])
        assert info["turns"] == want and info["rewards"] == [float(k) for k in range(1, want + 1)]
        assert info["metrics"] == {"calls": float(want)} and info["env_errors"] == 0
        assert info["model_tokens"] == sum(sampled[i]) and info["observation_tokens"] == len(response[i]) - sum(sampled[i])
        roles = [m["role"] for m in info["messages"]]
        assert roles == ["user"] + ["assistant", "tool"] * (want - 1) + ["assistant"]
        assert info["messages"][1]["content"] == tok.decode(response[i][: model_runs[0][2]], skip_special_tokens=True)
    # a training forward on the exact final sequences (positions continuous across turns)
    forward = actor().forward(out, ["log_probs"])
    assert_close(forward["log_probs"][loss], out["rollout_log_probs"][loss], dtype="float32", quantity="log_probs")
    if max_response_len == 5:  # a turn longer than the engine's limit was sampled over several calls
        assert any(m[2] - m[1] > 5 for i in range(n) for m in runs(sampled[i]) if m[0])


def test_seeded_episodes_are_reproducible() -> None:
    engine = rollout()
    batch, _ = prompts(engine, 2)
    loop = AgentLoop(engine, EpisodeLimits(max_turns=3, max_total_tokens=80))
    params = SamplingParams(seed=3, stop_token_ids=stops(engine), n=2)
    a = loop.run(batch, Counting, params)
    b = loop.run(batch, Counting, params)
    assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert a["response_ids"][0].tolist() != a["response_ids"][1].tolist()  # two samples of one group differ
    c = loop.run(batch, Counting, SamplingParams(seed=4, stop_token_ids=stops(engine), n=2))
    assert not torch.equal(a["response_ids"][:, :5], c["response_ids"][:, :5])


class VersionPerCall(RecordingRollout):
    """Reports weight version 7, 5, 9, ... for its successive calls (as if updates arrived between turns)."""

    VERSIONS = (7, 5, 9, 9, 9, 9)

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        out = super().generate(prompts, params)
        return out.with_meta(weight_version=self.VERSIONS[len(self.calls) - 1])


class EmptyResponses(RecordingRollout):
    """Drops every sampled token from its responses (a stop id taken out instead of kept, say)."""

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        out = super().generate(prompts, params)
        return out.update(response_mask=torch.zeros_like(out["response_mask"]))


def test_an_engine_that_returns_empty_responses_is_refused_not_asked_again_forever() -> None:
    engine = EmptyResponses(rollout())
    batch, _ = prompts(engine, 2)
    with pytest.raises(BatchValidationError, match="returned an empty response .* for episode 0, so the episode "
                                                   "cannot advance"):
        AgentLoop(engine, EpisodeLimits(max_turns=3, max_total_tokens=200)).run(
            batch, lambda row: Counting({"turns": 3}), SamplingParams(seed=3, stop_token_ids=stops(engine)))
    assert len(engine.calls) == 1


def test_an_episode_sampled_from_several_weight_versions_reports_the_oldest() -> None:
    engine = VersionPerCall(rollout())
    batch, _ = prompts(engine, 2)
    out = AgentLoop(engine, EpisodeLimits(max_turns=3, max_total_tokens=200)).run(
        batch, lambda row: Counting({"turns": 3}), SamplingParams(seed=3, stop_token_ids=stops(engine)))
    assert len(engine.calls) >= 3 and out.meta.weight_version == min(VersionPerCall.VERSIONS[:len(engine.calls)])


class VersionAfter(RecordingRollout):
    """Reports weight version ``versions(k)`` for its k-th call (0-based): updates that change nothing
    in the weights, so an episode sampled again replays what it sampled before."""

    def __init__(self, engine: RolloutEngine, versions: Callable[[int], int]) -> None:
        super().__init__(engine)
        self.versions = versions

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        out = super().generate(prompts, params)
        return out.with_meta(weight_version=self.versions(len(self.calls) - 1))


class Built:
    """A factory of :class:`Counting` environments of three turns that keeps every one it built."""

    def __init__(self) -> None:
        self.envs: list[Counting] = []

    def __call__(self, row: Mapping[str, Any]) -> Counting:
        self.envs.append(Counting({"turns": 3}))
        return self.envs[-1]


def _restart_run(versions: Callable[[int], int], max_restarts: int) -> tuple[TensorBatch, TensorBatch, Built]:
    """The episodes of 3 prompts x 2 samples with weights that never change (the reference) and with
    ``versions`` reported per call under ``max_restarts``; and the factory of the second run."""
    engine = rollout()
    batch, convs = prompts(engine, 3)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=300)
    params = SamplingParams(seed=5, stop_token_ids=stops(engine), n=2)
    reference = AgentLoop(engine, limits).run(batch, Built(), params, prompt_messages=convs)
    built = Built()
    out = AgentLoop(VersionAfter(engine, versions), limits, max_restarts=max_restarts).run(
        batch, built, params, prompt_messages=convs)
    assert [i["termination"] for i in reference.extras[EPISODE_KEY]] == ["done"] * 6  # three turns, one call each
    return reference, out, built


def _same_episodes(a: TensorBatch, b: TensorBatch) -> None:
    for key in ("response_ids", "response_mask", "loss_mask", "turn_ids", "rollout_log_probs"):
        assert torch.equal(a[key], b[key]), key
    assert [i["messages"] for i in a.extras[EPISODE_KEY]] == [i["messages"] for i in b.extras[EPISODE_KEY]]


def test_an_episode_that_spans_a_weight_update_restarts_from_its_first_turn() -> None:
    """Versions 3, 3, then 4: at the third call (the third turn) every episode is abandoned and sampled
    again from its prompt with a fresh environment; the weights did not really change, so it replays
    the reference's episode, now wholly on version 4."""
    reference, out, built = _restart_run(lambda k: 3 if k < 2 else 4, max_restarts=1)
    _same_episodes(reference, out)
    infos, ref_infos = out.extras[EPISODE_KEY], reference.extras[EPISODE_KEY]
    assert [i["restarts"] for i in infos] == [1] * 6
    # the abandoned attempt sampled the first three turns: as many tokens as the whole episode has
    assert [i["restarted_tokens"] for i in infos] == [i["model_tokens"] for i in ref_infos]
    assert all(t["weight_versions"] == [4] for ep in out.extras[TURNS_EXTRA] for t in ep)
    assert out.meta.weight_version == 4  # the abandoned turns of version 3 do not count
    # a fresh environment per attempt: the abandoned one saw two turns, the kept one the three kept turns
    assert [len(e.seen) for e in built.envs] == [2] * 6 + [3] * 6
    m = episode_metrics(out)
    assert m["agent/restarted_episodes"] == 1 and m["agent/mixed_versions"] == 0
    assert m["agent/restarted_tokens"] == pytest.approx(sum(i["model_tokens"] for i in ref_infos) / 6)
    assert m["agent/model_tokens"] == episode_metrics(reference)["agent/model_tokens"]
    # without restarts the same run continues across the update, its turns tagged
    _, kept, _ = _restart_run(lambda k: 3 if k < 2 else 4, max_restarts=0)
    _same_episodes(reference, kept)
    assert [[t["weight_versions"] for t in ep] for ep in kept.extras[TURNS_EXTRA]] == [[[3], [3], [4]]] * 6
    assert episode_metrics(kept)["agent/restarted_episodes"] == 0 and kept.meta.weight_version == 3


def test_an_episode_restarted_max_restarts_times_continues_across_later_updates() -> None:
    """A new version at every call: each episode is restarted twice (calls 1 and 3 see a version its
    attempt did not start with), then finishes over versions 4, 5 and 6, its turns tagged and counted."""
    reference, out, built = _restart_run(lambda k: k, max_restarts=2)
    _same_episodes(reference, out)
    assert [i["restarts"] for i in out.extras[EPISODE_KEY]] == [2] * 6
    assert [[t["weight_versions"] for t in ep] for ep in out.extras[TURNS_EXTRA]] == [[[4], [5], [6]]] * 6
    assert [len(e.seen) for e in built.envs] == [1] * 12 + [3] * 6
    m = episode_metrics(out)
    assert m["agent/restarted_episodes"] == 1 and m["agent/mixed_versions"] == 1 and out.meta.weight_version == 4


def test_restarts_need_a_factory_and_a_count() -> None:
    engine = rollout()
    batch, _ = prompts(engine, 1)
    with pytest.raises(ConfigError, match=r"max_restarts=1.*pass a factory"):
        AgentLoop(engine, max_restarts=1).run(batch, [Counting({})], SamplingParams())
    with pytest.raises(ConfigError, match="max_restarts"):
        AgentLoop(engine, max_restarts=-1)


def test_token_budget_and_max_turns_truncate() -> None:
    engine = rollout()
    batch, _ = prompts(engine, 2)
    # a budget smaller than one turn: cut inside the first turn
    out = AgentLoop(engine, EpisodeLimits(max_turns=4, max_total_tokens=6)).run(
        batch, Counting, SamplingParams(seed=1, stop_token_ids=ids_of(engine.tokenizer, ["<|im_end|>"])))
    out.check()
    assert out["truncated"].all() and out.response_len == 6 and bool(out["loss_mask"].all())
    for info in out.extras[EPISODE_KEY]:
        assert info["termination"] == "max_total_tokens" and info["turns"] == 1
        assert "max_total_tokens=6 ran out during turn 0" in (info["message"] or "")
    # an environment that never ends the episode: max_turns
    out = AgentLoop(engine, EpisodeLimits(max_turns=2, max_total_tokens=300)).run(
        batch, Counting, SamplingParams(seed=1, stop_token_ids=stops(engine)))
    out.check()
    assert out["truncated"].all()
    for i, info in enumerate(out.extras[EPISODE_KEY]):
        assert info["termination"] == "max_turns" and info["turns"] == 2 and len(info["rewards"]) == 2
        assert info["message"] == f"episode {i}: the environment did not end the episode within max_turns=2 turns"
        # the last observation, which no turn would answer, is not appended
        assert not out["response_mask"][i][out["loss_mask"][i]].logical_not().any()
        last = int(out["response_mask"][i].sum()) - 1
        assert bool(out["loss_mask"][i, last])
    metrics = episode_metrics(out)
    assert metrics["agent/termination/max_turns"] == 1.0 and metrics["agent/turns"] == 2.0


def test_observation_that_does_not_fit_and_context_limit() -> None:
    engine = rollout()
    batch, _ = prompts(engine, 1)

    class Long:
        def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
            return StepResult("z" * 50)

    out = AgentLoop(engine, EpisodeLimits(max_turns=9, max_total_tokens=40)).run(
        batch, [Long()], SamplingParams(seed=2, stop_token_ids=stops(engine)))
    info = out.extras[EPISODE_KEY][0]
    assert info["termination"] == "max_total_tokens" and bool(out["truncated"][0])
    assert "leaves no room for another turn" in (info["message"] or "") and info["observation_tokens"] == 0
    # the engine's max_prompt_len bounds the context of the next turn
    small = rollout(max_prompt_len=60)
    out = AgentLoop(small, EpisodeLimits(max_turns=9, max_total_tokens=300)).run(
        batch, Counting, SamplingParams(seed=2, stop_token_ids=stops(small)))
    out.check()
    info = out.extras[EPISODE_KEY][0]
    assert info["termination"] == "context_limit" and bool(out["truncated"][0])
    assert "max_prompt_len=60" in (info["message"] or "")
    assert int(out["prompt_mask"][0].sum() + out["response_mask"][0].sum()) > 60


class Raising:
    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        raise RuntimeError("tool server down")


class WrongType:
    def step(self, text: str, token_ids: Sequence[int]) -> Any:
        return {"observation": "x", "done": True}


class BadObservation:
    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        return StepResult(observation=42)  # type: ignore[arg-type]


class Hanging:
    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        time.sleep(60)
        return StepResult(done=True)


def test_failing_environments_end_their_episode_only() -> None:
    engine = rollout()
    batch, _ = prompts(engine, 5)
    envs: list[Environment] = [Raising(), WrongType(), BadObservation(), Hanging(), Counting({})]
    start = time.monotonic()
    out = AgentLoop(engine, EpisodeLimits(max_turns=3, max_total_tokens=200, step_timeout_s=1.0)).run(
        batch, envs, SamplingParams(seed=5, stop_token_ids=stops(engine)))
    assert time.monotonic() - start < 50  # the hanging step was not waited for
    out.check()
    infos = out.extras[EPISODE_KEY]
    assert [i["termination"] for i in infos] == ["error", "error", "error", "error", "max_turns"]
    assert infos[0]["message"] == "episode 0: Raising.step (turn 0) raised RuntimeError: tool server down"
    assert infos[1]["message"] == ("episode 1: WrongType.step (turn 0) returned {'observation': 'x', 'done': True} "
                                   "(dict); expected a StepResult(observation=..., reward=..., done=...)")
    assert infos[2]["message"] == ("episode 2: BadObservation.step (turn 0) raised StepResultError: "
                                   "StepResult.observation must be a list of chat messages, got 42 (int)")
    assert infos[3]["message"] == ("episode 3: Hanging.step (turn 0) did not return within step_timeout_s=1 s; "
                                   "the episode was ended and the step's thread abandoned")
    assert [i["env_errors"] for i in infos] == [1, 1, 1, 0, 0]
    assert [i["env_timeouts"] for i in infos] == [0, 0, 0, 1, 0]
    assert [i["turns"] for i in infos] == [1, 1, 1, 1, 3]
    assert out["truncated"].tolist() == [False, False, False, False, True]
    for i in range(4):  # the failed episodes keep their one model turn, no observation
        assert torch.equal(out["loss_mask"][i], out["response_mask"][i]) and bool(out["loss_mask"][i].any())
    assert episode_metrics(out)["agent/env_errors"] == pytest.approx(3 / 5)


class Sleeping:
    """Sleeps 0.2 s in every step; done after ``row['turns']`` turns."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.turns, self.steps = int(row["turns"]), 0

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        time.sleep(0.2)
        self.steps += 1
        return StepResult(tool_message(self.steps), done=self.steps >= self.turns)


def test_seconds_in_environments_are_shared_among_the_episodes_stepped_together() -> None:
    """Each wait on the environments of a turn is divided evenly among the episodes stepped in it: the
    shares add up to the loop's wall-clock seconds in environments (the steps run concurrently, so
    two turns of 0.2 s steps are at least 0.4 s, not 1.0 s), the rest of its time is sampling."""
    engine = rollout()
    batch, _ = prompts(engine, 3, turns=[1, 2, 2])
    start = time.perf_counter()
    out = AgentLoop(engine, EpisodeLimits(max_turns=3, max_total_tokens=300)).run(
        batch, Sleeping, SamplingParams(seed=3, stop_token_ids=ids_of(engine.tokenizer, ["<|im_end|>"])))
    wall = time.perf_counter() - start
    infos = out.extras[EPISODE_KEY]
    assert [i["termination"] for i in infos] == ["done", "done", "done"] and [i["turns"] for i in infos] == [1, 2, 2]
    shares = [i["env_seconds"] for i in infos]
    total = environment_seconds(out)
    assert total == pytest.approx(sum(shares)) and 0.4 <= total < wall
    # turn 0 stepped all three episodes together, turn 1 the last two
    assert shares[1] == pytest.approx(shares[2]) and shares[1] > shares[0] >= 0.2 / 3
    assert episode_metrics(out)["agent/env_seconds"] == pytest.approx(total / 3)
    with pytest.raises(ConfigError, match=r"environment_seconds\(\) needs a batch from AgentLoop.run\(\)"):
        environment_seconds(batch)


def test_environment_factories_that_fail() -> None:
    engine = rollout()
    batch, _ = prompts(engine, 3, kind=["ok", "raise", "none"])

    def factory(row: Mapping[str, Any]) -> Any:
        if row["kind"] == "raise":
            raise ValueError("no such task")
        return None if row["kind"] == "none" else Counting({"turns": 1})

    out = AgentLoop(engine, EpisodeLimits(max_turns=3, max_total_tokens=100)).run(
        batch, factory, SamplingParams(seed=5, stop_token_ids=stops(engine)))
    out.check()
    infos = out.extras[EPISODE_KEY]
    assert [i["termination"] for i in infos] == ["done", "error", "error"]
    assert infos[1]["message"] == "episode 1: the environment factory factory raised ValueError: no such task"
    assert infos[2]["message"] == ("episode 2: the environment is None (NoneType), which has no step(text, "
                                   "token_ids) method; expected an Environment")
    assert not bool(out["response_mask"][1:].any()) and infos[1]["turns"] == 0
    with pytest.raises(ConfigError, match="2 environments for 3 episodes"):
        AgentLoop(engine).run(batch, [Counting({}), Counting({})], SamplingParams())


class SlowCall:
    """A parser that reads every turn as a call of the tool ``slow`` (random weights write no JSON)."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn((ToolCall("slow", {"seconds": 30.0}),), ())


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def test_a_tool_timeout_is_an_observation_the_model_reads() -> None:
    engine = rollout()
    tok = engine.tokenizer
    batch, _ = prompts(engine, 2)
    out = AgentLoop(engine, EpisodeLimits(max_turns=2, max_total_tokens=300, step_timeout_s=10)).run(
        batch, lambda row: ToolEnvironment([slow], parser=SlowCall(), timeout_s=0.3),
        SamplingParams(seed=9, stop_token_ids=stops(engine)))
    out.check()
    error = "Error: tool 'slow' did not finish within 0.3 s; the call was abandoned"
    for i, info in enumerate(out.extras[EPISODE_KEY]):
        assert info["termination"] == "max_turns"
        assert info["tool_calls"] == 2 and info["tool_timeouts"] == 2 and info["tool_errors"] == 2
        assert info["messages"][1] == {"role": "tool", "name": "slow", "content": error}
        observed = out["response_ids"][i][out["response_mask"][i] & ~out["loss_mask"][i]].tolist()
        text = tok.decode(observed, skip_special_tokens=False)
        assert text.endswith(f"<|im_end|>\n<|im_start|>tool\n{error}<|im_end|>\n<|im_start|>assistant\n")


def test_without_chat_template_observations_are_text() -> None:
    engine = rollout(chat=False)
    tok = engine.tokenizer
    batch = render_prompts(tok, ["2+2=", "3+3="], group_ids=[0, 1])

    class Mixed:
        def __init__(self) -> None:
            self.k = 0

        def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
            self.k += 1
            if self.k == 1:
                return StepResult(" obs: ")
            return StepResult([{"role": "tool", "content": "A"}, {"role": "user", "content": "B"}], done=self.k > 2)

    out = AgentLoop(engine, EpisodeLimits(max_turns=5, max_total_tokens=200)).run(
        batch, lambda row: Mixed(), SamplingParams(seed=1, stop_token_ids=ids_of(tok, "abcdefghij")))
    out.check()
    for i in range(2):
        flags = out["loss_mask"][i][out["response_mask"][i]].tolist()
        ids = out["response_ids"][i][out["response_mask"][i]].tolist()
        observations = [ids[a:b] for f, a, b in runs(flags) if not f]
        assert observations == [tok.encode(" obs: "), tok.encode("A\nB")]
        assert out.extras[EPISODE_KEY][i]["messages"][1] == {"role": "observation", "content": " obs: "}


class Gated(RecordingRollout):
    """Holds its first generate call until :attr:`gate` is set (so a second caller can arrive meanwhile)."""

    def __init__(self, engine: RolloutEngine) -> None:
        super().__init__(engine)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        self.entered.set()
        assert self.gate.wait(60)
        return super().generate(prompts, params)


def _in_threads(loop: AgentLoop, calls: Sequence[tuple[TensorBatch, SamplingParams]],
                engine: Gated) -> list[TensorBatch]:
    """Run ``calls`` on ``loop`` from one thread each, the later ones arriving while the first one's
    first generate call is held; each call's batch (or what it raised)."""
    results: list[Any] = [None] * len(calls)

    def work(i: int) -> None:
        try:
            results[i] = loop.run(calls[i][0], Counting, calls[i][1])
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    threads[0].start()
    assert engine.entered.wait(60)
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while len(loop._runs) < len(calls) and time.monotonic() < deadline:  # every call submitted, waiting
        time.sleep(0.01)
    engine.gate.set()
    for t in threads:
        t.join(120)
    return results


def test_calls_under_way_at_once_share_generate_calls_and_sample_what_each_samples_alone() -> None:
    """Two steps' episodes (other prompts, other seeds) run from two threads at once: every turn after
    the first is one generate call for both, and each call's batch equals the one it gives alone."""
    engine = rollout()
    limits = EpisodeLimits(max_turns=3, max_total_tokens=80)
    first, _ = prompts(engine, 2, turns=[3, 2])
    second, _ = prompts(engine, 3, turns=[1, 3, 2])
    second = second.update(group_ids=second["group_ids"] + 100)
    calls = [(first, SamplingParams(seed=3, stop_token_ids=stops(engine), n=2)),
             (second, SamplingParams(seed=4, stop_token_ids=stops(engine), n=2))]
    alone = [AgentLoop(RecordingRollout(engine), limits).run(b, Counting, p) for b, p in calls]
    gated = Gated(engine)
    shared = _in_threads(AgentLoop(gated, limits), calls, gated)
    for a, s in zip(alone, shared, strict=True):
        assert isinstance(s, TensorBatch), s
        a, s = a.trim(), s.trim()
        for name in ("response_ids", "loss_mask", "turn_ids", "group_ids", "sample_index"):
            assert torch.equal(a[name], s[name]), name
        torch.testing.assert_close(s["rollout_log_probs"], a["rollout_log_probs"], atol=1e-5, rtol=0)
        assert [i["messages"] for i in a.extras[EPISODE_KEY]] == [i["messages"] for i in s.extras[EPISODE_KEY]]
    sizes = [b.batch_size for b, _, _ in gated.calls]
    assert sizes[0] == 4 and max(sizes) > 6, sizes  # the first call held alone; later turns of both at once
    assert {p.seed for _, p, _ in gated.calls} == {0}  # the seeds travel in each row's stream


def test_max_active_starts_episodes_as_others_end() -> None:
    """``max_active`` bounds the rows of every generate call, episodes start as others end (a call
    holds a later episode's first turn beside an earlier one's later turn), and the batch equals an
    unbounded run's."""
    engine = rollout()
    batch, _ = prompts(engine, 3, turns=[1, 3, 2])
    params = SamplingParams(seed=6, stop_token_ids=stops(engine), n=2)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=80)
    free = AgentLoop(engine, limits).run(batch, Counting, params)
    recording = RecordingRollout(engine)
    bounded = AgentLoop(recording, limits, max_active=2).run(batch, Counting, params)
    assert max(b.batch_size for b, _, _ in recording.calls) <= 2
    mixed = [int((b["prompt_mask"].sum(-1) != b["prompt_mask"].sum(-1)[0]).any()) for b, _, _ in recording.calls]
    assert any(mixed), "no call held episodes at different turns"
    free, bounded = free.trim(), bounded.trim()
    for name in ("response_ids", "loss_mask", "turn_ids"):
        assert torch.equal(free[name], bounded[name]), name


class FailsOnSecondCall(Gated):
    failed = False

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        if len(self.calls) == 1 and not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().generate(prompts, params)


def test_a_failed_generate_call_fails_every_call_whose_episodes_it_held() -> None:
    engine = rollout()
    first, _ = prompts(engine, 2, turns=[3, 3])
    second, _ = prompts(engine, 2, turns=[3, 3])
    calls = [(first, SamplingParams(seed=1, stop_token_ids=stops(engine))),
             (second, SamplingParams(seed=2, stop_token_ids=stops(engine)))]
    gated = FailsOnSecondCall(engine)
    loop = AgentLoop(gated, EpisodeLimits(max_turns=3, max_total_tokens=80))
    out = _in_threads(loop, calls, gated)
    assert all(isinstance(o, RuntimeError) and "device lost" in str(o) for o in out), out
    assert not loop._runs  # nothing left behind: the loop serves the next call
    again = loop.run(first, Counting, calls[0][1])
    assert again.batch_size == 2
