"""Chat rendering: HFTokenizer.render, observation deltas and prompt batches."""

from __future__ import annotations

import json

import pytest
import torch
from agent_helpers import chat_tokenizer_object

from verl_conformance.testkit import TinyModelSpec, load_tokenizer, tiny_model
from verl_core import ConfigError, HFTokenizer
from verl_core.agent import (
    ObservationRenderer,
    StepResultError,
    Tool,
    prompts_from_ids,
    render_prompts,
)
from verl_core.kernel.tokenizer import ChatTokenizer


def _tok(template: str | None = None) -> HFTokenizer:
    inner = chat_tokenizer_object() if template is None else chat_tokenizer_object(template=template)
    return HFTokenizer(inner)


def lookup(a: int, key: str) -> str:
    """Look a key up.

    Args:
        a: A number.
        key: The key.
    """
    return key * a


def test_hf_tokenizer_renders_messages_and_tools() -> None:
    tok = _tok()
    assert isinstance(tok, ChatTokenizer) and tok.has_chat_template
    messages = [{"role": "user", "content": "hi"}]
    schema = Tool.from_function(lookup).schema
    plain = tok.render(messages, add_generation_prompt=True)
    assert tok.decode(plain, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_tools = tok.decode(tok.render(messages, tools=[schema], add_generation_prompt=False), skip_special_tokens=False)
    assert with_tools.startswith("<|im_start|>system\nTools:\n")
    assert json.loads(with_tools.split("\n")[2].replace("<|im_end|>", "")) == schema
    assert with_tools.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_render_without_template_is_refused() -> None:
    inner = chat_tokenizer_object()
    inner.chat_template = None
    tok = HFTokenizer(inner)
    assert not tok.has_chat_template
    with pytest.raises(ConfigError, match="has no chat template"):
        tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_a_failing_template_is_reported() -> None:
    tok = _tok("{{ raise_exception('no tools here') if messages[0]['role'] == 'tool' else 'ok' }}")
    with pytest.raises(ConfigError, match="failed on 1 message.*no tools here"):
        tok.render([{"role": "tool", "content": "x"}], add_generation_prompt=False)


@pytest.mark.parametrize("end", ["<|im_end|>", "c"])
def test_turn_plus_delta_is_the_rendered_conversation(end: str) -> None:
    """A turn ending with the template's end-of-turn token (or another stop token) plus the delta
    equals the template's rendering of the whole conversation, token for token."""
    tok = _tok()
    renderer = ObservationRenderer(tok)
    assert renderer.uses_chat_template
    assert tok.decode(renderer.tail, skip_special_tokens=False) == "<|im_end|>\n"
    conv = [{"role": "user", "content": "what is 6*7?"}]
    turn = tok.encode("ab") + tok.encode(end)
    obs = [{"role": "tool", "content": "42"}, {"role": "user", "content": "ok?"}]
    delta = renderer.tokens(obs, after=turn[-1])
    content = "ab" + ("" if end == "<|im_end|>" else end)
    whole = tok.render([*conv, {"role": "assistant", "content": content}, *obs], add_generation_prompt=True)
    assert tok.render(conv, add_generation_prompt=True) + turn + delta == whole
    # the delta leaves out only the end-of-turn token the model sampled
    assert len(renderer.tokens(obs, after=-1)) == len(renderer.tokens(obs, after=renderer.tail[0])) + 1


def test_text_and_empty_observations() -> None:
    renderer = ObservationRenderer(_tok())
    assert renderer.tokens("as is\n") == _tok().encode("as is\n")
    assert renderer.tokens("") == []
    assert renderer.tokens(()) == []
    with pytest.raises(StepResultError, match=r"observation\[0\]\['content'\] must be a string"):
        renderer.tokens([{"role": "tool", "content": 3}])


def test_unstable_template_is_refused() -> None:
    # Renders the last message differently, so earlier messages change when a new one follows.
    template = "{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    renderer = ObservationRenderer(_tok(template))
    with pytest.raises(ConfigError, match="does not render observations as a suffix.*changes at token 1"):
        renderer.tokens([{"role": "tool", "content": "42"}])


def test_without_chat_template_messages_are_text() -> None:
    tok = load_tokenizer(tiny_model(TinyModelSpec()))
    renderer = ObservationRenderer(tok)
    assert not renderer.uses_chat_template and renderer.tail == []
    obs = [{"role": "tool", "content": "42"}, {"role": "user", "content": "go"}]
    assert renderer.tokens(obs) == tok.encode("42\ngo")
    with pytest.raises(ConfigError, match="has no chat template"):
        render_prompts(tok, [obs], group_ids=[0])


def test_prompt_batches() -> None:
    tok = _tok()
    batch = render_prompts(tok, [[{"role": "user", "content": "hi"}], "plain text"], group_ids=[5, 6],
                           tools=[Tool.from_function(lookup).schema], extras={"answer": ["a", "b"]})
    batch.check()
    first = batch["prompt_ids"][0][batch["prompt_mask"][0]].tolist()
    assert tok.decode(first, skip_special_tokens=False).startswith("<|im_start|>system\nTools:")
    assert batch["prompt_ids"][1][batch["prompt_mask"][1]].tolist() == tok.encode("plain text")
    assert not bool(batch["prompt_mask"][1, 0])  # left-padded
    assert batch["group_ids"].tolist() == [5, 6] and batch.extras["answer"] == ("a", "b")
    direct = prompts_from_ids([[3, 4], [5]], 0, group_ids=[0, 1])
    assert torch.equal(direct["prompt_ids"], torch.tensor([[3, 4], [0, 5]]))
    with pytest.raises(ConfigError, match="has no tokens"):
        prompts_from_ids([[3], []], 0, group_ids=[0, 1])
    with pytest.raises(ConfigError, match="2 prompts but 1 group ids"):
        prompts_from_ids([[3], [4]], 0, group_ids=[0])
