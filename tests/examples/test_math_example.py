"""The math example (examples/math): its data files, reward, model builder and a 2-step run.

The run is the GPU config as shipped with the device and dtype overridden for a CPU (the tiny
model of ``make_model.py``, float32): the chat template builds the prompts, TensorBoard event files
and the held-out evaluation's metrics are written. The variant with the Python tool (SFT, then
GRPO with the tool) runs in ``test_math_tool.py``; its data and chat template are checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_core.trainer.config import load_config
from verl_core.trainer.inputs.rewards import load_function

ROOT = Path(__file__).resolve().parents[2]
MATH = ROOT / "examples" / "math"
CONFIG = "examples/math/config.toml"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _run(*args: str) -> str:
    """Run ``python ARGS`` in the repository root; its stdout and stderr together."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _rows(name: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in (MATH / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``--size tiny`` model folder of make_model.py."""
    out = tmp_path_factory.mktemp("math") / "model"
    assert "wrote a random llama model" in _run(str(MATH / "make_model.py"), "--size", "tiny", "--out", str(out))
    return out


def test_data_files_are_what_make_data_writes(tmp_path: Path) -> None:
    _run(str(MATH / "make_data.py"), "--out", str(tmp_path))
    for name in ("train", "eval", "sft_tool"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (MATH / f"{name}.jsonl").read_bytes(), name
    train, held_out = _rows("train"), _rows("eval")
    assert (len(train), len(held_out)) == (400, 100)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert all(set(r) == {"question", "answer"} and r["answer"].isdigit() for r in train + held_out)
    assert train[0] == {"question": "Max has 4 coins. Max gets 18 more. How many coins does Max have now?", "answer": "22"}


def test_tool_conversations_call_python_with_a_program_that_prints_the_answer() -> None:
    from verl_core.agent import HermesToolParser, python_tool

    conversations = [json.loads(line) for line in (MATH / "sft_tool.jsonl").read_text().splitlines()]
    train = _rows("train")
    assert len(conversations) == len(train) == 400
    parser = HermesToolParser()
    programs = []
    for row, conv in zip(train, conversations):
        user, call, result, final = conv["messages"]
        assert user == {"role": "user", "content": row["question"]}
        assert call["role"] == "assistant" and [c.name for c in parser.parse(call["content"]).calls] == ["python"]
        code = parser.parse(call["content"]).calls[0].arguments["code"]
        assert code.startswith("print(") and set(code[6:-1]) <= set("0123456789+-*/"), code
        assert result == {"role": "tool", "content": row["answer"] + "\n"}
        assert final == {"role": "assistant", "content": row["answer"]}
        programs.append(code)
    tool = python_tool()  # the sandboxed tool the episodes run: what it returns is the tool message
    for code, row in list(zip(programs, train))[:5]:  # one of each kind of problem
        assert tool.fn(code=code) == row["answer"] + "\n"


def test_reward_scores_the_last_number_of_the_completion() -> None:
    reward = load_function("examples/math/rewards.py:numeric_answer", base_dir=ROOT)
    cases = [  # (completion, answer) -> reward
        (("Tom has 12 apples now.", "12"), 1.0),
        (("5 + 7 = 12", "12"), 1.0),
        (("12", "12"), 1.0),
        (("1,200 stamps", "1200"), 1.0),
        (("so -3", "-3"), 1.0),
        (("12 apples, not 13", "12"), 0.0),  # the last number counts
        (("twelve", "12"), 0.0),  # no number
        (("", "12"), 0.0),
        (("The answer is 72.", "Natalia sold 48 + 24 = 72 clips. #### 72"), 1.0),  # GSM8K-style answers
    ]
    got = reward(completions=[c for (c, _), _ in cases], answer=[a for (_, a), _ in cases], prompts=[""] * len(cases))
    assert got == [want for _, want in cases]
    with pytest.raises(ValueError, match=r"the answer 'none' of sample 0 holds no number"):
        reward(completions=["1"], answer=["none"])


def test_make_model_writes_a_folder_with_a_chat_template(tiny: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    question = _rows("eval")[0]["question"]
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    assert text == f"<user> {question} <assistant> "
    assert tok.unk_token_id not in tok.encode(text, add_special_tokens=False)  # every character is known
    assert AutoConfig.from_pretrained(tiny).model_type == "llama"


def test_the_chat_template_lists_tools_and_renders_tool_turns(tiny: Path) -> None:
    from transformers import AutoTokenizer

    from verl_core.agent import python_tool
    from verl_core.trainer.inputs.tiny_model import char_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    conversation = json.loads((MATH / "sft_tool.jsonl").read_text().splitlines()[0])["messages"]
    question = conversation[0]["content"]
    text = tok.apply_chat_template(conversation, tools=[python_tool().schema], tokenize=False)
    assert text == (f"<system> tools: python(code) <user> {question} <assistant> {conversation[1]['content']}<eos> "
                    "<tool> 22\n <assistant> 22<eos> ")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids  # braces and the newline are in the vocabulary
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<eos>", "")
    # the built-in characters keep their ids: the braces and the newline take the first extra ids
    plain = char_tokenizer(96)
    assert {k: v for k, v in tok.get_vocab().items() if not k.startswith("<extra_")} == {
        **{k: v for k, v in plain.get_vocab().items() if not k.startswith("<extra_")},
        "{": plain.convert_tokens_to_ids("<extra_0>"), "}": plain.convert_tokens_to_ids("<extra_1>"),
        "\n": plain.convert_tokens_to_ids("<extra_2>")}
    with pytest.raises(ValueError, match=r"extra_chars 'a\{' holds characters the tokenizer already has \('a'\)"):
        char_tokenizer(96, "a{")
    with pytest.raises(ValueError, match=r"extra_chars '\{\{' repeats a character"):
        char_tokenizer(96, "{{")
    with pytest.raises(ValueError, match=r"vocab_size must be >= 91, got 90"):
        char_tokenizer(90, "{}\n")


def test_the_example_runs_on_cpu_with_tensorboard_and_eval(tiny: Path, tmp_path: Path) -> None:
    shipped = load_config(ROOT / CONFIG)  # the GPU settings the docs describe
    assert (shipped.model.device, shipped.model.dtype) == ("cuda", "bfloat16")
    assert "tensorboard" in shipped.logging.sinks and shipped.data.chat_template

    out = tmp_path / "run"
    printed = _run(
        "-m", "verl_core.cli", "train", CONFIG, f"model.path={json.dumps(str(tiny))}",
        "model.device=cpu", "model.dtype=float32", "steps=2", f"output_dir={json.dumps(str(out))}",
        "rollout.n=2", "batch.prompts_per_step=2", "rollout.max_new_tokens=8", "data.eval_every=1",
    )
    # the prompts went through the chat template: the longest question plus the template's 20 characters
    longest = max(len(r["question"]) for r in _rows("train"))
    assert f"data.train: 400 prompts from examples/math/train.jsonl (longest {longest + 20} tokens)" in printed

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0.0 <= m["reward/numeric_answer/mean"] <= 1.0 and m["reward/mean"] == m["reward/numeric_answer/mean"]
        assert 0.0 <= m["eval/reward/numeric_answer/mean"] <= 1.0 and m["eval/response/length_mean"] > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/numeric_answer/mean")] == [1, 2]
    assert [(e.step, e.value) for e in events.Scalars("eval/reward/numeric_answer/mean")] == [
        (m["step"], pytest.approx(m["eval/reward/numeric_answer/mean"])) for m in metrics]
    assert len(events.Scalars("time/step")) == 2


def test_gpu_script_is_valid_bash() -> None:
    script = ROOT / "benchmarks" / "gpu" / "run_math_example.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert f"CONFIG={CONFIG}" in text and 'verl train "$CONFIG"' in text
    assert "verl sft examples/math/sft_tool.toml" in text and "CONFIG=examples/math/config_tool.toml" in text
    tool = load_config(MATH / "config_tool.toml")  # everything but the tool's keys as in config.toml
    shipped = load_config(ROOT / CONFIG)
    assert tool.agent.tools == ["verl_core.agent.sandbox:python_tool"] and tool.agent.max_turns == 3
    assert (tool.rollout, tool.batch, tool.optim, tool.reward, tool.algorithm, tool.model.dtype, tool.model.device) == (
        shipped.rollout, shipped.batch, shipped.optim, shipped.reward, shipped.algorithm, shipped.model.dtype,
        shipped.model.device)
