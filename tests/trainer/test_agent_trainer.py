"""Multi-turn RL in the trainer (``[agent]``): config and user-code checks, the generation path, episode
rewards and metrics, on the hf tiny model with a ChatML template that lists tools."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core import ConfigError, SamplingParams, TensorBatch
from verl_core.agent import EPISODE_KEY, Tool
from verl_core.kernel.schema import TURNS_EXTRA
from verl_core.trainer import Trainer, load_config
from verl_core.trainer.config import RunConfig
from verl_core.trainer.inputs.agent import PROMPT_MESSAGES, AgentSetup, episode_keywords
from verl_core.trainer.inputs.rewards import RewardFunctions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from agent_helpers import chat_model_path, chat_tokenizer_object

USER_CODE = '''
from verl_core.agent import StepResult, Tool


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def no_docstring(x: int) -> int:
    return x


def untyped(x):
    """Return x.

    Args:
        x: A value.
    """
    return x


def make_tool() -> Tool:
    return Tool.from_function(add, name="plus")


NOT_CALLABLE = 3


def no_arguments():
    return None


class TwoTurns:
    """Answers the first turn with a tool message about the row; ends the episode at the second."""

    def __init__(self, row):
        self.answer = row["answer"]
        self.turns = 0

    def step(self, text, token_ids):
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "tool", "content": "the answer is " + self.answer}], reward=0.25,
                              metrics={"tool_calls": 1.0})
        return StepResult(done=True, reward=1.0)


def conversation_length(completions, messages, answer, completion_ids):
    out = []
    for text, conv, ids in zip(completions, messages, completion_ids):
        finals = [m["content"] for m in conv if m["role"] == "assistant"]
        assert text == (finals[-1] if finals else ""), (text, finals)
        assert conv[0] == {"role": "user", "content": "q"}, conv[0]
        out.append(float(len(conv)))
    return out
'''

# turns end at these frequent characters (or the template's end-of-turn token): a random model's
# turns stay short
STOPS = list("abcdefghij")


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def code(tmp_path: Path) -> Path:
    path = tmp_path / "usercode.py"
    path.write_text(USER_CODE)
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": "q"}], "answer": str(i)}) + "\n" for i in range(6)))
    return path


def agent_config(tmp: Path, *extra: str) -> RunConfig:
    return load_config(None, [
        f"model.path={json.dumps(chat_model_path())}", f"data.train={json.dumps(str(tmp / 'train.jsonl'))}",
        f"output_dir={json.dumps(str(tmp / 'run'))}", "steps=2", "rollout.n=2", "rollout.max_new_tokens=24",
        "batch.prompts_per_step=3", "agent.max_turns=3", "agent.max_total_tokens=80",
        f"agent.stop_tokens={json.dumps([*STOPS, '<|im_end|>'])}", "algorithm.options={kl_loss_coef=0.0}",
        "logging.progress=false", "logging.plot=false", *extra,
    ])


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize(("overrides", "words"), [
    (["agent.max_turns=3"], ["'agent.max_turns'", "'agent.environment'", "'agent.tools'"]),
    (["agent.tools=['m:f']"], ["'agent.tools'", "'data.train'"]),
    (["agent.tools=['m:f']", "data.train=x.jsonl", "agent.concurrency=-1"], ["'agent.concurrency'", ">= 0"]),
    (["agent.tools=['m:f']", "data.train=x.jsonl", "agent.max_total_tokens=0"], ["'agent.max_total_tokens'"]),
    (["agent.tools=['m:f']", "data.train=x.jsonl", "agent.tool_timeout_s=0"], ["'agent.tool_timeout_s'"]),
    (["agent.tools=['nocolon']", "data.train=x.jsonl"], ["'agent.tools[0]'", "module:attr"]),
    (["agent.environment='x.py'", "data.train=x.jsonl"], ["'agent.environment'"]),
    (["agent.tools=['m:f']", "data.train=x.jsonl", "agent.stop_tokens=['']"], ["'agent.stop_tokens[0]'"]),
    (["agent.max_turn=3"], ["unknown config key 'agent.max_turn'", "did you mean 'agent.max_turns'"]),
])
def test_agent_keys_are_checked_when_the_config_loads(overrides: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_agent_is_off_by_default() -> None:
    cfg = load_config(None, [])
    assert not cfg.agent.enabled
    assert load_config(None, ["agent.tools=['m:f']", "data.train=x.jsonl"]).agent.enabled


def _resolve(code: Path, *extra: str) -> AgentSetup:
    cfg = load_config(None, ["data.train=x.jsonl", *extra])
    return AgentSetup.resolve(cfg.agent, base_dir=code.parent)


@pytest.mark.parametrize(("extra", "words"), [
    (["agent.tools=['usercode.py:no_docstring']"], ["'agent.tools[0]'", "'no_docstring'", "no docstring"]),
    (["agent.tools=['usercode.py:untyped']"], ["'agent.tools[0]'", "parameter 'x'", "no type annotation"]),
    (["agent.tools=['usercode.py:NOT_CALLABLE']"], ["'agent.tools[0]'", "expected a function"]),
    (["agent.tools=['usercode.py:add', 'usercode.py:add']"], ["'agent.tools'", "share the name"]),
    (["agent.tools=['no_such_module_xyz:f']"], ["'agent.tools[0]'", "cannot import module 'no_such_module_xyz'"]),
    (["agent.environment='no_such_module_xyz:make'"], ["'agent.environment'", "cannot import module"]),
    (["agent.environment='missing_file.py:make'"], ["'agent.environment'", "does not exist"]),
    (["agent.environment='usercode.py:nothing_here'"], ["'agent.environment'", "has no attribute 'nothing_here'"]),
    (["agent.environment='usercode.py:NOT_CALLABLE'"], ["'agent.environment'", "expected an environment factory"]),
    (["agent.environment='usercode.py:no_arguments'"], ["'agent.environment'", "one argument"]),
    (["agent.tools=['usercode.py:add']", "agent.tool_timeout_s=60", "agent.step_timeout_s=60"],
     ["'agent.step_timeout_s'", "'agent.tool_timeout_s'"]),
])
def test_user_code_errors_name_the_key(code: Path, extra: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _resolve(code, *extra)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_tools_from_functions_tool_objects_and_factories(code: Path) -> None:
    setup = _resolve(code, "agent.tools=['usercode.py:add', 'usercode.py:make_tool', "
                           "'verl_core.agent.sandbox:python_tool']")
    assert [t.name for t in setup.tools] == ["add", "plus", "python"]
    assert all(isinstance(t, Tool) for t in setup.tools)
    assert setup.schemas is not None and setup.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    env = setup.factory({"answer": "1"})
    result = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', [])
    assert result.observation[0]["content"] == "5" and not result.done  # type: ignore[index]
    assert env.step("no call", []).done


def test_stop_tokens_default_to_the_templates_end_of_turn(code: Path) -> None:
    from verl_core.enginekit.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(chat_tokenizer_object())
    setup = _resolve(code, "agent.tools=['usercode.py:add']")
    assert setup.stop_token_ids(tok) == tuple(tok.encode("<|im_end|>"))
    with pytest.raises(ConfigError, match=r"'agent.stop_tokens\[0\]' = 'ab' encodes to 2 tokens"):
        _resolve(code, "agent.tools=['usercode.py:add']", "agent.stop_tokens=['ab']").stop_token_ids(tok)


def test_a_bad_tool_is_refused_before_anything_is_built(tmp_path: Path, code: Path) -> None:
    cfg = agent_config(tmp_path, "model.path=''", "agent.tools=['usercode.py:untyped']",
                       "reward.functions=['usercode.py:conversation_length']")
    with Trainer(cfg, base_dir=tmp_path) as trainer, pytest.raises(ConfigError, match="agent.tools"):
        trainer.setup()
    assert not (tmp_path / "run").exists()  # no run folder claimed, no tiny model built


def test_tools_with_text_prompts_warn_that_the_model_never_sees_their_schemas(
        tmp_path: Path, code: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"prompt": "q", "answer": str(i)}) + "\n" for i in range(3)))
    for data, warned in (("text.jsonl", True), ("train.jsonl", False)):  # text prompts; chat messages
        cfg = agent_config(tmp_path, f"data.train={json.dumps(str(tmp_path / data))}",
                           "agent.tools=['usercode.py:add']", "reward.functions=['usercode.py:conversation_length']")
        caplog.clear()
        with caplog.at_level("WARNING"), Trainer(cfg, base_dir=tmp_path) as trainer:
            trainer.source.load()
        said = "data.train: 3 of 3 prompts are text used as it is, so the model is never shown the schemas"
        assert (said in caplog.text) is warned, caplog.text


# ---------------------------------------------------------------------------- rewards
def _episode_batch() -> TensorBatch:
    """Two episodes: turn 0 (3 tokens), an observation (2), turn 1 (2); and one turn of 2 tokens."""
    ids = torch.tensor([[5, 6, 7, 40, 41, 8, 9], [11, 12, 0, 0, 0, 0, 0]])
    resp = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    loss = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    turns = torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    msgs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"},
             {"role": "tool", "content": "r"}, {"role": "assistant", "content": "final"}],
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "only"}]]
    infos = [{"messages": m, "rewards": [0.5, None]} for m in msgs]
    return TensorBatch({"prompt_ids": torch.tensor([[3], [3]]), "prompt_mask": torch.ones(2, 1, dtype=torch.bool),
                        "response_ids": ids, "response_mask": resp, "loss_mask": loss, "turn_ids": turns},
                       extras={EPISODE_KEY: infos, TURNS_EXTRA: [[], []], "answer": ["final", "x"]})


def test_reward_functions_get_the_final_turn_and_the_conversation() -> None:
    got = episode_keywords(_episode_batch())
    assert got is not None
    assert got["completions"] == ["final", "only"]
    assert got["completion_ids"] == [[8, 9], [11, 12]]
    assert [len(m) for m in got["messages"]] == [4, 2]
    seen: dict[str, Any] = {}

    def fn(completions: list[str], **kw: Any) -> list[float]:
        seen.update(kw, completions=completions)
        return [float(c == a) for c, a in zip(completions, kw["answer"])]

    from verl_core.enginekit.hf_tokenizer import HFTokenizer

    scored = RewardFunctions([fn], HFTokenizer(chat_tokenizer_object())).score(_episode_batch())
    assert scored["scores"].tolist() == [1.0, 0.0]
    assert seen["completions"] == ["final", "only"] and "messages" in seen
    assert EPISODE_KEY not in seen and TURNS_EXTRA not in seen and PROMPT_MESSAGES not in seen


def test_a_single_turn_batch_keeps_every_column() -> None:
    """Without episodes nothing changes: a dataset column named like an episode extra still reaches the
    function, and the completions are the decoded responses."""
    from verl_core.enginekit.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(chat_tokenizer_object())
    batch = _episode_batch().drop("loss_mask", "turn_ids")
    batch = TensorBatch({k: batch[k] for k in batch}, extras={"turns": [1, 2], "episode": ["e1", "e2"],
                                                               "answer": ["a", "b"]})
    assert episode_keywords(batch) is None
    seen: dict[str, Any] = {}

    def fn(completions: list[str], **kw: Any) -> list[float]:
        seen.update(kw, completions=completions)
        return [0.0, 0.0]

    RewardFunctions([fn], tok).score(batch)
    assert seen["turns"] == [1, 2] and seen["episode"] == ["e1", "e2"] and "messages" not in seen
    assert seen["completions"] == [tok.decode(batch["response_ids"][i][batch["response_mask"][i]].tolist())
                                   for i in range(2)]


# ---------------------------------------------------------------------------- runs
@pytest.mark.slow
def test_without_agent_the_rollout_is_one_generate_call(tmp_path: Path) -> None:
    """The single-turn path is the old one: no episode loop, one generate call per step with the step's parameters."""
    cfg = load_config(None, ["task.name=copy", "task.digits=1", "model.hidden_size=32", "model.intermediate_size=64",
                             "model.num_heads=1", "model.num_kv_heads=1", "rollout.n=2", "rollout.max_new_tokens=3",
                             "batch.prompts_per_step=2", "steps=1", "logging.progress=false", "logging.plot=false",
                             f"output_dir={json.dumps(str(tmp_path / 'run'))}"])
    calls: list[SamplingParams] = []
    with Trainer(cfg) as trainer:
        trainer.setup()
        expected = trainer.sampling_params()
        assert trainer.generation.episodes is None and trainer.evaluator.episodes is None
        assert trainer.source.agent is None
        assert trainer.rollout.spec.max_prompt_len == trainer.source.prompt_limit()
        assert trainer.rollout.spec.max_response_len == 3 == trainer.actor.spec.max_response_len
        generate = trainer.rollout.generate

        def recording(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
            calls.append(params)
            out = generate(prompts, params)
            assert "loss_mask" not in out and EPISODE_KEY not in out.extras
            return out

        trainer.rollout.generate = recording  # type: ignore[method-assign]
        metrics = trainer.train_step()
    assert calls == [expected] and expected.stop_token_ids == () and expected.n == 2
    assert not any(k.startswith(("agent/", "reward/environment")) for k in metrics)


@pytest.mark.slow
def test_multi_turn_steps(tmp_path: Path, code: Path) -> None:
    """Two GRPO steps of episodes: prompts rendered with the tools, loss_mask on the sampled tokens only,
    the reward functions' keywords, the environment's rewards summed, agent/ metrics, an update."""
    cfg = agent_config(tmp_path, "agent.tools=['usercode.py:add']", "agent.environment='usercode.py:TwoTurns'",
                       "reward.functions=['usercode.py:conversation_length']")
    batches: list[TensorBatch] = []
    with Trainer(cfg, base_dir=tmp_path) as trainer:
        trainer.setup()
        episodes = trainer.generation.episodes
        assert episodes is not None and trainer.evaluator.episodes is episodes
        # the rollout engine takes the prompt and the whole episode so far; training engines the episode
        assert trainer.rollout.spec.max_prompt_len == trainer.source.prompt_limit() + 80
        assert trainer.rollout.spec.max_response_len == 24 and trainer.actor.spec.max_response_len == 80
        run = episodes.run

        def recording(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
            assert PROMPT_MESSAGES in prompts.extras
            out = run(prompts, params)
            batches.append(out)
            return out

        episodes.run = recording  # type: ignore[method-assign]
        history = trainer.train()
        tok = trainer.rollout.tokenizer
    assert len(history) == 2 and len(batches) == 2
    for batch, metrics in zip(batches, history):
        assert batch.batch_size == 6  # 3 prompts x n=2
        prompt = tok.decode(batch["prompt_ids"][0][batch["prompt_mask"][0]].tolist(), skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>system\nTools:") and '"add"' in prompt
        loss, resp = batch["loss_mask"], batch["response_mask"]
        assert bool((loss <= resp).all()) and bool(loss[:, 0].all())
        assert bool((batch["rollout_log_probs"][~loss] == 0).all()) and bool((batch["rollout_log_probs"][loss] < 0).all())
        infos = batch.extras[EPISODE_KEY]
        assert [i["model_tokens"] for i in infos] == loss.sum(1).tolist()
        assert [i["model_tokens"] + i["observation_tokens"] for i in infos] == resp.sum(1).tolist()
        for row, info in enumerate(infos):
            turns = batch["turn_ids"][row][resp[row]]
            assert int(turns.max()) + 1 == info["turns"]
            if info["termination"] == "done":  # the environment's rewards: 0.25 then 1.0
                assert info["turns"] == 2 and info["rewards"] == [0.25, 1.0]
                assert [m["role"] for m in info["messages"]] == ["user", "assistant", "tool", "assistant"]
                assert info["messages"][2]["content"] == f"the answer is {batch.extras['answer'][row]}"
        env = [sum(r for r in i["rewards"] if r is not None) for i in infos]
        lengths = [len(i["messages"]) for i in infos]
        assert metrics["reward/environment/mean"] == pytest.approx(sum(env) / 6)
        assert metrics["reward/conversation_length/mean"] == pytest.approx(sum(lengths) / 6)
        assert metrics["reward/mean"] == pytest.approx((sum(env) + sum(lengths)) / 6, rel=1e-6)
        assert metrics["agent/turns"] == pytest.approx(sum(i["turns"] for i in infos) / 6)
        assert metrics["agent/tool_calls"] == pytest.approx(sum(i["tool_calls"] for i in infos) / 6)
        assert metrics["agent/termination/done"] > 0
        assert metrics["update/optimizer_steps"] == 1 and torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
        # the update's forward over the whole episodes gives the rollout's log-probs on the model's tokens
        assert metrics["logprob_mismatch/mean"] < 1e-4


@pytest.mark.slow
def test_concurrency_runs_the_same_episodes_refilled_as_they_end(tmp_path: Path, code: Path) -> None:
    """``agent.concurrency`` bounds the episodes run at once; each episode's random stream is its own,
    so episodes started as others end give the episodes of one run at once."""
    outs = []
    for concurrency in (0, 4):
        cfg = agent_config(tmp_path, "agent.environment='usercode.py:TwoTurns'", f"agent.concurrency={concurrency}",
                           "reward.functions=['usercode.py:conversation_length']", f"output_dir='{tmp_path / str(concurrency)}'")
        with Trainer(cfg, base_dir=tmp_path) as trainer:
            trainer.setup()
            assert trainer.generation.episodes is not None
            prompts = trainer.prompts(0)
            outs.append(trainer.generation.episodes.run(prompts, trainer.sampling_params()))
    a, b = outs
    assert a.batch_size == b.batch_size == 6
    assert a["group_ids"].tolist() == b["group_ids"].tolist() and a["sample_index"].tolist() == [0, 1] * 3
    a, b = a.trim(), b.trim()
    for name in ("response_ids", "response_mask", "loss_mask", "turn_ids"):
        assert torch.equal(a[name], b[name]), name
    assert [i["messages"] for i in a.extras[EPISODE_KEY]] == [i["messages"] for i in b.extras[EPISODE_KEY]]
