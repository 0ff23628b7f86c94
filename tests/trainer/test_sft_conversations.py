"""SFT on whole conversations: rendered token for token as a multi-turn rollout appends them, trained on the
assistant's tokens only (``loss_mask``), on the hf tiny model with a ChatML template that lists tools."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core import ConfigError, TensorBatch
from verl_core.agent import ObservationRenderer, render_prompts
from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.kernel.training import GlobalBatchStats
from verl_core.trainer import load_config
from verl_core.trainer.sft.conversations import render_conversation
from verl_core.trainer.sft.trainer import SFTDataset, SFTLoss, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from agent_helpers import CHAT_TEMPLATE, chat_model_path, chat_tokenizer_object

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def conversation(k: int = 0) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"2+3 {k}"},
            {"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"},
            {"role": "assistant", "content": f"it is 5 {k}"}]


@pytest.fixture
def tok() -> HFTokenizer:
    return HFTokenizer(chat_tokenizer_object())


def test_the_rendering_is_the_rollouts_token_sequence(tok: HFTokenizer) -> None:
    """Prompt + response equal what an episode appends: the prompt rendered with the tools, each turn's
    tokens and the end-of-turn token, the observation's delta; loss_mask is True exactly on the turns."""
    conv = conversation()
    done = render_conversation(tok, conv, tools=TOOLS)
    end = tok.encode("<|im_end|>")
    prompt = render_prompts(tok, [conv[:2]], group_ids=[0], tools=TOOLS)["prompt_ids"][0].tolist()
    turn1 = tok.encode(CALL) + end
    observation = ObservationRenderer(tok).tokens([conv[3]], after=end[0])
    turn2 = tok.encode("it is 5 0") + end
    assert done.prompt == prompt
    assert done.response == turn1 + observation + turn2
    assert done.loss_mask == [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    # the whole conversation as the template renders it, up to the last end-of-turn token
    whole = tok.render(conv, tools=TOOLS, add_generation_prompt=False)
    assert whole[: len(done.prompt) + len(done.response)] == done.prompt + done.response
    assert tok.decode(whole[len(done.prompt) + len(done.response):], skip_special_tokens=False) == "\n"


@pytest.mark.parametrize(("messages", "words"), [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], "starts with an assistant message"),
])
def test_conversations_without_a_prompt_or_a_reply_are_refused(tok: HFTokenizer, messages: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        render_conversation(tok, messages, where="data.train: row 0")


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    # earlier assistant messages are rendered as "..." once another message follows them
    tok = HFTokenizer(chat_tokenizer_object(template=CHAT_TEMPLATE.replace(
        "{{ m['content'] }}", "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}")))
    with pytest.raises(ConfigError, match="changes the tokens already rendered"):
        render_conversation(tok, conversation(), where="data.train: row 3")


def test_the_sft_loss_counts_the_loss_mask_only() -> None:
    log_probs = torch.tensor([[-1.0, -2.0, -4.0], [-8.0, -16.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss_mask = torch.tensor([[True, False, True], [False, True, False]])
    batch = TensorBatch({"prompt_ids": torch.ones(2, 1, dtype=torch.int64), "prompt_mask": torch.ones(2, 1, dtype=torch.bool),
                         "response_ids": torch.ones(2, 3, dtype=torch.int64), "response_mask": mask,
                         "loss_mask": loss_mask, "log_probs": log_probs})
    out = SFTLoss()(batch, GlobalBatchStats.of(batch))
    assert float(out.loss) == pytest.approx((1 + 4 + 16) / 3)
    assert float(out.metrics["tokens"]) == 3
    plain = batch.drop("loss_mask")  # a prompt/response row: every response token
    assert float(SFTLoss()(plain, GlobalBatchStats.of(plain)).loss) == pytest.approx((1 + 2 + 4 + 8 + 16) / 5)


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_dataset_reads_conversations_with_the_tools(tmp_path: Path, tok: HFTokenizer) -> None:
    data = _write(tmp_path / "c.jsonl", [{"messages": conversation(k)} for k in range(3)])
    cfg = load_config(None, [f"data.train={json.dumps(str(data))}", "data.prompt_key=messages"])
    ds = SFTDataset.from_config(cfg.data, tok, tools=TOOLS)
    assert len(ds) == 3 and ds.loss_masks is not None
    want = render_conversation(tok, conversation(1), tools=TOOLS)
    assert list(ds.prompts[1]) == want.prompt and list(ds.responses[1]) == want.response
    batch = ds.batch([0, 1, 2])
    assert torch.equal(batch.loss_mask[1][: len(want.response)], torch.tensor(want.loss_mask))
    assert not bool(batch.loss_mask[~batch["response_mask"]].any())
    # without the tools the system block differs: the tools reach the rendering
    assert list(SFTDataset.from_config(cfg.data, tok).prompts[1]) != want.prompt
    # a prompt column of questions without a response column is neither pairs nor conversations
    questions = _write(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    cfg = load_config(None, [f"data.train={json.dumps(str(questions))}", "data.prompt_key=messages"])
    with pytest.raises(ConfigError, match="no column 'response'.*whole conversations"):
        SFTDataset.from_config(cfg.data, tok)


@pytest.fixture
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.usefixtures("_one_thread")
def test_verl_sft_on_conversations_trains_the_assistant_tokens(tmp_path: Path) -> None:
    data = _write(tmp_path / "c.jsonl", [{"messages": conversation(k)} for k in range(8)])
    (tmp_path / "tools.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n'
                                      '        b: B.\n    """\n    return a + b\n')
    cfg = load_config(None, [
        f"model.path={json.dumps(chat_model_path())}", f"data.train={json.dumps(str(data))}",
        f"data.eval={json.dumps(str(data))}", "data.prompt_key=messages", f"output_dir={json.dumps(str(tmp_path / 'run'))}",
        f"agent.tools={json.dumps([str(tmp_path / 'tools.py') + ':add'])}", "steps=6", "batch.prompts_per_step=4",
        "optim.lr=3e-3", "logging.progress=false",
    ])
    with SFTTrainer(cfg) as trainer:
        history = trainer.train()
        ds = trainer.train_data
        tok = trainer.actor.tokenizer
    assert ds.loss_masks is not None
    schema_prompt = tok.decode(list(ds.prompts[0]), skip_special_tokens=False)
    assert schema_prompt.startswith("<|im_start|>system\nTools:") and '"add"' in schema_prompt
    assistant = [sum(m) for m in ds.loss_masks]
    assert all(0 < a < len(r) for a, r in zip(assistant, ds.responses))
    assert len(set(assistant)) == 1  # every row has as many assistant tokens: a step of 4 rows has 4 times that
    assert all(m["train/response_tokens"] == 4 * assistant[0] for m in history)
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    assert history[-1]["eval/response_tokens"] == sum(assistant)
    assert (tmp_path / "run" / "model-sft" / "config.json").is_file()
