"""The tool demo (examples/agent): its data, tokenizer and reward, and a shortened run of the recipe.

The full recipe (SFT 400 steps, GRPO 20 steps, both variants; ``examples/agent/recipe.py``) takes
minutes on 2 CPU cores; its figures are in the README. Here a short SFT teaches the call's format,
then one GRPO step of episodes: the model calls the calculator, the tool's result is appended as
observation tokens, and the loss mask covers the model's tokens only.
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
def test_a_shortened_recipe_calls_the_tool_and_trains_on_the_models_tokens(tmp_path: Path) -> None:
    path = demo_model.build(tmp_path / "model", seed=0)
    quiet = ["logging.sinks=[]", "logging.progress=false"]
    sft = load_config(ROOT / "examples/configs/agent_sft.toml",
                      [*quiet, f"model.path={str(path)!r}", f"output_dir={str(tmp_path / 'sft')!r}", "steps=60"])
    with SFTTrainer(sft) as trainer:
        history = trainer.train()
        sft_model = trainer.model_dir
    assert history[-1]["train/loss"] < history[0]["train/loss"] / 2
    grpo = load_config(ROOT / "examples/configs/agent_grpo.toml",
                       [*quiet, f"model.path={str(sft_model)!r}", f"output_dir={str(tmp_path / 'grpo')!r}", "steps=1",
                        "batch.prompts_per_step=8", "checkpoint.final=false", "data.eval=''"])
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
        metrics = trainer.train()[-1]
        tok = trainer.rollout.tokenizer
    assert metrics["agent/tool_calls"] > 0.5 and metrics["update/optimizer_steps"] == 1
    (batch,) = batches
    calls = 0
    for row, info in enumerate(batch.extras[EPISODE_KEY]):
        mask = batch["response_mask"][row]
        ids = batch["response_ids"][row][mask].tolist()
        loss = batch["loss_mask"][row][mask].tolist()
        turn0 = [t for t, (i, keep) in enumerate(zip(batch["turn_ids"][row][mask].tolist(), loss)) if i == 0 and keep]
        first = tok.decode([ids[t] for t in turn0], skip_special_tokens=True)
        parsed = HermesToolParser().parse(first)
        if not parsed.calls or info["turns"] < 2:
            continue
        calls += 1
        args = parsed.calls[0].arguments
        start, end = len(turn0), loss.index(True, len(turn0))  # the observation: after turn 0, before turn 1
        assert not any(loss[start:end]) and all(loss[:start])
        observation = tok.decode(ids[start:end], skip_special_tokens=False)
        if info["messages"][2]["content"].isdigit():  # the call ran: its result follows the template's tool header
            assert observation == f"\n<|im_start|>tool\n{args['a'] + args['b']}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(ids[:start], skip_special_tokens=False).endswith("</tool_call><|im_end|>")
    assert calls >= batch.batch_size // 2
