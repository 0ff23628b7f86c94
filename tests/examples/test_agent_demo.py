"""The tool demo (examples/agent): its data, tokenizer and reward, and its recipe for seed 0.

The recipe's tool variant runs as shipped (SFT 400 steps on tool conversations, then 20 GRPO steps
of episodes; about a minute of CPU): the held-out greedy success reaches 0.9 (the README's figures
give 1.0 for seeds 0-2), every episode calls the calculator, the tool's result is appended as
observation tokens, and the loss mask covers the model's tokens only. The baseline without the
tool and the other seeds are ``examples/agent/recipe.py``'s (README).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from verl_core import SamplingParams, TensorBatch
from verl_core.agent import EPISODE_KEY, HermesToolParser
from verl_core.trainer import Trainer, load_config
from verl_core.trainer.sft.trainer import SFTTrainer

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "agent"
sys.path.insert(0, str(DEMO))
import calculator  # noqa: E402
import make_data  # noqa: E402
import model as demo_model  # noqa: E402


def _rows(name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (DEMO / f"{name}.jsonl").read_text().splitlines()]


def test_data_files_are_what_make_data_writes_and_do_not_overlap(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(DEMO / "make_data.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("sft_tool", "sft_direct", "train", "eval"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (DEMO / f"{name}.jsonl").read_bytes(), name
    questions = {name: [r["messages"][0]["content"] for r in _rows(name)]  # type: ignore[index]
                 for name in ("sft_tool", "train", "eval")}
    assert [len(q) for q in questions.values()] == [400, 1000, 200]
    assert not set(questions["eval"]) & (set(questions["sft_tool"]) | set(questions["train"]))
    assert [r["messages"][0] for r in _rows("sft_direct")] == [r["messages"][0] for r in _rows("sft_tool")]  # type: ignore[index]
    for row in _rows("sft_tool"):
        user, call, result, answer = row["messages"]  # type: ignore[misc]
        a, b = (int(x) for x in user["content"].split("+"))
        parsed = HermesToolParser().parse(call["content"])
        assert parsed.calls[0].name == "add" and dict(parsed.calls[0].arguments) == {"a": a, "b": b}
        assert result == {"role": "tool", "content": str(a + b)} and answer["content"] == str(a + b)
        assert len(str(a + b)) == 7
    assert all(r["answer"] == str(sum(int(x) for x in r["messages"][0]["content"].split("+")))  # type: ignore[index]
               for r in _rows("eval"))
    assert make_data.SIZES == {"sft": 400, "train": 1000, "eval": 200}


def test_the_tokenizer_keeps_the_call_short_and_decodes_exactly() -> None:
    tok = demo_model.tokenizer()
    call = make_data.call(512345, 687654)
    ids = tok.encode(call, add_special_tokens=False)
    assert len(ids) == 17  # two tags, two JSON pieces, 12 digits, the closing braces
    assert tok.decode(ids, skip_special_tokens=True) == call
    schema = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {}}}]
    text = tok.apply_chat_template(make_data.question(512345, 687654), tools=schema, add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>system\ntools: add<|im_end|>\n<|im_start|>user\n512345+687654<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert tok.unk_token_id not in tok.encode(text, add_special_tokens=False)


def test_the_reward_is_exact_match_of_the_final_turn() -> None:
    got = calculator.exact_answer(completions=["1200000", "1200000 ", make_data.call(1, 2), ""],
                                  answer=["1200000"] * 4)
    assert got == [1.0, 0.0, 0.0, 0.0]
    assert calculator.add(a=2, b=3) == 5
    assert calculator.answer_only({}).step("7", [1]).done


@pytest.fixture
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(ROOT)  # the demo's configs name their files from the repository root
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.usefixtures("_repo_root")
def test_the_recipe_for_seed_0_learns_to_use_the_tool(tmp_path: Path) -> None:
    path = demo_model.build(tmp_path / "model", seed=0)
    quiet = ["logging.sinks=[]", "logging.progress=false"]
    sft = load_config(ROOT / "examples/configs/agent_sft.toml",
                      [*quiet, f"model.path={str(path)!r}", f"output_dir={str(tmp_path / 'sft')!r}"])
    with SFTTrainer(sft) as trainer:
        history = trainer.train()
        sft_model = trainer.model_dir
    assert history[-1]["train/loss"] < 0.05 * history[0]["train/loss"]
    grpo = load_config(ROOT / "examples/configs/agent_grpo.toml",
                       [*quiet, f"model.path={str(sft_model)!r}", f"output_dir={str(tmp_path / 'grpo')!r}",
                        "checkpoint.final=false"])
    batches: list[TensorBatch] = []
    with Trainer(grpo, base_dir=ROOT) as trainer:
        trainer.setup()
        episodes = trainer.generation.episodes
        assert episodes is not None
        run = episodes.run

        def recording(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
            batches.append(run(prompts, params))
            return batches[-1]

        episodes.run = recording  # type: ignore[method-assign]
        history = trainer.train()
        tok = trainer.rollout.tokenizer
    last = history[-1]
    assert last["eval/reward/exact_answer/mean"] >= 0.9 and last["eval/agent/tool_calls"] >= 0.9
    assert history[0]["agent/tool_calls"] >= 0.9 and history[0]["update/optimizer_steps"] == 1
    batch = batches[0]  # the first step's episodes (the last batch is the held-out evaluation's)
    calls = 0
    for row, info in enumerate(batch.extras[EPISODE_KEY]):
        mask = batch["response_mask"][row]
        ids = batch["response_ids"][row][mask].tolist()
        loss = batch["loss_mask"][row][mask].tolist()
        turns = batch["turn_ids"][row][mask].tolist()
        start = loss.index(False) if False in loss else len(loss)  # turn 0: the model's first tokens
        parsed = HermesToolParser().parse(tok.decode(ids[:start], skip_special_tokens=True))
        if not parsed.calls or info["turns"] != 2:  # a call, then the answer
            continue
        calls += 1
        assert set(turns[:start]) == {0} and tok.decode(ids[:start], skip_special_tokens=False).endswith(
            "</tool_call><|im_end|>")
        end = loss.index(True, start)  # the observation: after turn 0, before turn 1
        assert set(turns[start:end]) == {0} and set(turns[end:]) == {1} and all(loss[end:])
        args = parsed.calls[0].arguments
        assert tok.decode(ids[start:end], skip_special_tokens=False) == (
            f"\n<|im_start|>tool\n{args['a'] + args['b']}<|im_end|>\n<|im_start|>assistant\n")
        assert info["messages"][-1]["content"] == tok.decode(ids[end:], skip_special_tokens=True)
    assert calls >= 0.9 * batch.batch_size
