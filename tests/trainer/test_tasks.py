"""Built-in tasks: deterministic prompts, multi-token answers, exact-match reward requiring EOS."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verl_conformance.testkit import CharTokenizer, TinyModelSpec, tiny_model
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.trainer.inputs.rewards import FunctionReward
from verl_core.trainer.inputs.tasks import TASKS, DigitTask, TaskReward, get_task, prompt_batch


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer(tiny_model(TinyModelSpec(vocab_size=96, tied=True)))


@given(name=st.sampled_from(TASKS), digits=st.integers(1, 5), seed=st.integers(0, 100), step=st.integers(0, 50))
def test_examples_are_deterministic_and_correct(name: str, digits: int, seed: int, step: int) -> None:
    task = get_task(name, digits)
    a = task.examples(6, seed=seed, step=step)
    assert a == task.examples(6, seed=seed, step=step)
    for prompt, answer in a:
        assert len(prompt) <= task.max_prompt_len()
        assert 1 <= len(answer) <= task.max_answer_len()
        body = prompt[:-1]
        if name == "copy":
            assert answer == body[1:]
        elif name == "reverse":
            assert answer == body[1:][::-1]
        else:
            x, y = body.split("+")
            assert int(answer) == int(x) + int(y)


def test_different_steps_and_seeds_differ() -> None:
    task = get_task("copy", 3)
    assert task.examples(8, seed=0, step=0) != task.examples(8, seed=0, step=1)
    assert task.examples(8, seed=0, step=0) != task.examples(8, seed=1, step=0)


def response_batch(tok: CharTokenizer, answers: list[str], responses: list[list[int]]) -> TensorBatch:
    prompts = prompt_batch([f"c{a}=" for a in answers], tok, group_ids=range(len(answers)),
                           extras={"answer": answers})
    width = max(1, max(len(r) for r in responses))
    ids = torch.full((len(responses), width), tok.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(responses), width), dtype=torch.bool)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[i, : len(r)] = True
    return prompts.update(response_ids=ids, response_mask=mask)


def test_reward_needs_exact_answer_then_eos(tok: CharTokenizer) -> None:
    eos = tok.eos_token_id
    enc = tok.encode
    answers = ["123", "123", "123", "123", "123", "045"]
    responses = [
        [*enc("123"), eos],  # right
        enc("123"),  # no EOS (cut at length): wrong
        [*enc("12"), eos],  # wrong answer
        [*enc("1234"), eos],  # extra token
        [],  # empty
        [*enc("045"), eos],  # leading zero kept
    ]
    scored = TaskReward(get_task("copy"), tok).score(response_batch(tok, answers, responses))
    assert scored["scores"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert scored["scores"].dtype == torch.float32
    assert TaskReward(get_task("copy"), tok).exact_match(response_batch(tok, answers, responses)).tolist() == [
        1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    partial = TaskReward(get_task("copy"), tok, mode="partial").score(response_batch(tok, answers, responses))
    # answer-then-EOS is 4 tokens: no EOS 3/4, wrong last digit "12"+EOS 2/4, extra token 3/5
    assert partial["scores"].tolist() == pytest.approx([1.0, 0.75, 0.5, 0.6, 0.0, 1.0])
    token = TaskReward(get_task("copy"), tok, mode="token").score(response_batch(tok, answers, responses))
    assert token["scores"].tolist() == partial["scores"].tolist()
    # dense scores sum to the partial score and sit on the matching positions
    assert token["token_scores"].sum(1).tolist() == pytest.approx([1.0, 0.75, 0.5, 0.6, 0.0, 1.0])
    assert token["token_scores"][2].tolist()[:4] == [0.25, 0.25, 0.0, 0.0]
    # the plain score function works with FunctionReward (text only; EOS is not visible there)
    fr = FunctionReward(DigitTask.score, tok).score(response_batch(tok, answers, responses))
    assert fr["scores"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_prompt_batch_is_left_padded_with_group_ids(tok: CharTokenizer) -> None:
    b = prompt_batch(["c1=", "12+345="], tok, group_ids=[10, 11], extras={"answer": ["1", "357"]})
    assert b["prompt_ids"].shape == (2, 7)
    assert b["prompt_mask"][0].tolist() == [False] * 4 + [True] * 3
    assert b["prompt_ids"][0, :4].tolist() == [tok.pad_token_id] * 4
    assert b["group_ids"].tolist() == [10, 11]
    assert b.meta.pad_token_id == tok.pad_token_id
    b.check(vocab_size=tok.vocab_size)
    with pytest.raises(ConfigError, match="2 prompts but 1 group ids"):
        prompt_batch(["a", "b"], tok, group_ids=[1])


def test_unknown_task_lists_choices() -> None:
    with pytest.raises(ConfigError, match="built-in tasks: copy, reverse, add"):
        get_task("sort")
