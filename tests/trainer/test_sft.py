"""`verl sft`: supervised fine-tuning of a tiny hf model on prompt/response pairs, then RL from its export.

The loss is the mean NLL of the response tokens (prompt positions never count), independent of the
micro-batch split; a checkpoint plus ``--resume`` equals an uninterrupted run bit for bit (weights,
optimizer, data order); the exported ``model-sft`` folder loads with transformers, holds the
trained weights and is a ``model.path`` that ``verl train`` runs from.
"""

from __future__ import annotations

import json
import random
import re
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from verl_core import CheckpointError, ConfigError, TensorBatch
from verl_core.cli import main
from verl_core.kernel.training import GlobalBatchStats
from verl_core.trainer import Trainer, latest_checkpoint, load_config
from verl_core.trainer.config import RunConfig, config_from_dict
from verl_core.trainer.sft.trainer import SFT_MODEL_DIR, SFTLoss, SFTTrainer


def write_data(path: Path, rows: int, *, seed: int = 0) -> Path:
    """``rows`` copy examples as JSONL: prompt ``c123=``, response ``123``."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(rows):
            n = rng.randrange(1000)
            fh.write(json.dumps({"prompt": f"c{n}=", "response": str(n)}) + "\n")
    return path


def sft_config(out: Path, data: Path, *extra: str) -> RunConfig:
    return load_config(None, [
        f"data.train={json.dumps(str(data))}", f"output_dir={json.dumps(str(out))}", "steps=20",
        "batch.prompts_per_step=16", "optim.lr=3e-3", "logging.progress=false", *extra,
    ])


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_data(tmp_path_factory.mktemp("data") / "train.jsonl", 64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Iterator[SFTTrainer]:
    """A finished 20-step run with an evaluation set (kept open: its actor holds the final weights)."""
    root = tmp_path_factory.mktemp("sft")
    held_out = write_data(root / "eval.jsonl", 16, seed=1)
    cfg = sft_config(root / "run", data, f"data.eval={json.dumps(str(held_out))}", "checkpoint.every=10")
    with SFTTrainer(cfg) as trainer:
        trainer.train()
        yield trainer


def test_the_loss_decreases_and_the_held_out_loss_follows(trained: SFTTrainer) -> None:
    losses = [m["train/loss"] for m in trained.history]
    assert len(losses) == 20 and all(m["update/nonfinite_skips"] == 0 for m in trained.history)
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses
    evals = [(m["step"], m["eval/loss"]) for m in trained.history if "eval/loss" in m]
    assert [s for s, _ in evals] == [10, 20] and evals[1][1] < evals[0][1]
    logged = [json.loads(line) for line in (trained.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/loss"] for m in logged] == losses


def test_loss_fn_is_the_response_token_mean_nll_and_splits_exactly() -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])
    log_probs = (-torch.rand(3, 4) * 3).masked_fill(~mask, 0.0).requires_grad_()
    batch = TensorBatch({
        "prompt_ids": torch.ones(3, 2, dtype=torch.int64), "prompt_mask": torch.ones(3, 2, dtype=torch.bool),
        "response_ids": torch.ones(3, 4, dtype=torch.int64), "response_mask": mask,
    })
    stats = GlobalBatchStats.of(batch)
    out = SFTLoss()(batch.update(log_probs=log_probs), stats)
    hand = -log_probs[mask].sum() / 4
    assert torch.allclose(out.loss, hand) and float(out.metrics["tokens"]) == 4
    out.loss.backward()  # type: ignore[no-untyped-call]
    assert log_probs.grad is not None
    assert torch.equal(log_probs.grad, torch.where(mask, -0.25, 0.0))
    parts = [SFTLoss()(b.update(log_probs=lp), stats).loss
             for b, lp in ((batch.index([0]), log_probs[:1]), (batch.index([1, 2]), log_probs[1:]))]
    assert torch.allclose(parts[0] + parts[1], hand)  # shares of the global mean: a split sums to the whole


def test_batches_put_the_response_and_eos_after_the_prompt(trained: SFTTrainer) -> None:
    tok = trained.actor.tokenizer
    batch = trained.train_data.batch([0, 1, 2])
    assert batch.meta.temperature == 1.0
    for i in range(3):
        prompt = tok.decode(batch["prompt_ids"][i][batch["prompt_mask"][i]].tolist())
        response = batch["response_ids"][i][batch["response_mask"][i]].tolist()
        assert prompt.startswith("c") and prompt.endswith("=") and response[-1] == tok.eos_token_id
        assert tok.decode(response) == prompt[1:-1]  # the copy, EOS dropped by decode
        assert batch["prompt_mask"][i, -1] and batch["response_mask"][i, 0]  # left / right padding


def test_the_engine_loss_is_the_hand_computed_nll_of_response_log_probs(tmp_path: Path, data: Path) -> None:
    """forward_backward with SFTLoss reports -mean of forward()'s response log-probs: prompts do not count."""
    with SFTTrainer(sft_config(tmp_path / "run", data)) as trainer:
        trainer.setup()
        batch = trainer.train_data.batch(list(range(8)))
        log_probs = trainer.actor.forward(batch, SFTLoss().needs)["log_probs"]
        mask = batch["response_mask"]
        hand = float(-(log_probs * mask).sum() / mask.sum())
        loss = trainer.actor.forward_backward(batch, SFTLoss(), GlobalBatchStats.of(batch))["loss"]
        assert loss == pytest.approx(hand, rel=1e-5)
        # a longer prompt changes the log-probs it conditions, but only response positions are counted
        assert log_probs.shape == mask.shape and batch.prompt_len > 0


def test_micro_batch_size_does_not_change_the_result(tmp_path: Path, data: Path) -> None:
    results = {}
    for budget in (16, 4096):  # one sample per micro-batch, or the whole step in one
        with SFTTrainer(sft_config(tmp_path / str(budget), data, "steps=3", f"batch.micro_batch_tokens={budget}")) as t:
            history = t.train()
        weights = load_file(str(tmp_path / str(budget) / SFT_MODEL_DIR / "model.safetensors"))
        results[budget] = (history, weights)
    (small, w_small), (large, w_large) = results[16], results[4096]
    assert small[0]["scheduler/actor/micro_batches"] > 8 and large[0]["scheduler/actor/micro_batches"] == 1
    for a, b in zip(small, large):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    for name, w in w_small.items():
        torch.testing.assert_close(w, w_large[name], rtol=1e-4, atol=1e-5)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    # 6 of 16 rows a step, 2 optimizer steps each: the data order crosses an epoch after the resume
    data = write_data(tmp_path / "small.jsonl", 16)
    common = ("batch.prompts_per_step=6", "batch.mini_batch_size=3")
    with SFTTrainer(sft_config(tmp_path / "straight", data, "steps=5", *common)) as t:
        straight = t.train()
    with SFTTrainer(sft_config(tmp_path / "half", data, "steps=2", *common)) as t:
        t.train()
    changed = sft_config(tmp_path / "half", data, "steps=5", "optim.lr=1e-3", *common)
    with pytest.raises(ConfigError, match="optim.lr: 0.003 -> 0.001"), SFTTrainer(changed) as t:
        t.train(resume=True)
    with SFTTrainer(sft_config(tmp_path / "half", data, "steps=5", *common)) as t:
        resumed = t.train(resume=True)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert [m["train/loss"] for m in resumed] == [m["train/loss"] for m in straight]
    a, b = (latest_checkpoint(tmp_path / run) for run in ("straight", "half"))
    assert a is not None and b is not None and a.name == b.name == "step-000005"
    assert json.loads((a / "trainer_state.json").read_text())["data"] == {
        "epoch": 1, "index": 14, "size": 16, "seed": 0, "shuffle": True}
    for name in ("model.safetensors", "trainer_state.pt"):  # weights; optimizer and schedule
        x, y = next(a.rglob(name)), next(b.rglob(name))
        left = load_file(str(x)) if name.endswith("safetensors") else torch.load(x, weights_only=True)
        right = load_file(str(y)) if name.endswith("safetensors") else torch.load(y, weights_only=True)
        assert _flat(left).keys() == _flat(right).keys()
        assert all(torch.equal(v, _flat(right)[k]) for k, v in _flat(left).items()), name
    export = tmp_path / "half" / SFT_MODEL_DIR
    assert (export / "model.safetensors").read_bytes() == (tmp_path / "straight" / SFT_MODEL_DIR / "model.safetensors").read_bytes()
    assert [p.name for p in (tmp_path / "half").iterdir() if p.name.startswith(".")] == []


def _flat(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}/{k}"))
    return out


def test_the_export_holds_the_trained_weights_and_rl_starts_from_it(
    trained: SFTTrainer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert trained.model_dir == trained.out / SFT_MODEL_DIR
    model = AutoModelForCausalLM.from_pretrained(trained.model_dir)
    model.eval()  # type: ignore[no-untyped-call]
    batch = trained.train_data.batch([0, 1, 2, 3])
    expected = trained.actor.forward(batch, SFTLoss().needs)["log_probs"]
    for i in range(4):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i]]
        response = batch["response_ids"][i][batch["response_mask"][i]]
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1]
        got = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
        torch.testing.assert_close(got, expected[i, : response.numel()], rtol=1e-4, atol=1e-5)

    rl = tmp_path / "rl"
    code = main(["train", f"model.path={trained.model_dir}", f"output_dir={rl}", "steps=1",
                 "logging.progress=false", "logging.plot=false", "batch.prompts_per_step=4", "rollout.n=2"])
    assert code == 0, capsys.readouterr().err
    assert len((rl / "metrics.jsonl").read_text().splitlines()) == 1
    assert json.loads((rl / "config.json").read_text())["model"]["path"] == str(trained.model_dir)


def test_verl_sft_command_prints_the_model_path(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [f"data.train={data}", f"output_dir={tmp_path / 'run'}", "steps=2", "logging.progress=false"]
    assert main(["sft", *args, "--check"]) == 0
    assert "config is valid" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["sft", *args]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "run" / SFT_MODEL_DIR) and "loss" in err
    assert main(["sft", *args]) == 2  # a fresh run needs a new or empty folder, as for verl train
    assert "already holds a run" in capsys.readouterr().err
    assert main(["sft", *args, "steps=3", "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "checkpoints" / "step-000003" / "trainer_state.json").read_text())["step"] == 3


def test_relative_paths_of_an_sft_config_are_looked_up_next_to_it_as_for_verl_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    write_data(folder / "train.jsonl", 8)
    (folder / "sft.toml").write_text('steps = 1\n[data]\ntrain = "train.jsonl"\n[logging]\nprogress = false\n')
    monkeypatch.chdir(tmp_path)  # the working directory has no train.jsonl
    assert main(["sft", "project/sft.toml", "output_dir=run", "batch.prompts_per_step=4"]) == 0
    assert capsys.readouterr().out.strip() == str(Path("run") / SFT_MODEL_DIR)
    # the same config given as overrides only has no folder: the path is the working directory's
    assert main(["sft", "data.train=train.jsonl", "output_dir=run2", "steps=1"]) == 2
    assert "train.jsonl" in capsys.readouterr().err


def test_verl_train_refuses_to_resume_an_sft_run(tmp_path: Path, data: Path) -> None:
    with SFTTrainer(sft_config(tmp_path / "run", data, "steps=1")) as t:
        t.train()
    cfg = load_config(None, [f"output_dir={json.dumps(str(tmp_path / 'run'))}", "logging.progress=false", "steps=2"])
    with Trainer(cfg) as rl, pytest.raises(CheckpointError, match="written by `verl sft`.*cannot resume"):
        rl.train(resume=True)


BAD_DATA: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "no response column": (lambda tmp: ["data.response_key=answer"], r"has no column 'answer' \(the response column"),
    "no data.train": (lambda tmp: ["data.train=''"], "config key 'data.train' is empty"),
    "one column for both": (lambda tmp: ["data.response_key=prompt"], "'data.response_key' are both 'prompt'"),
    "a number as response": (lambda tmp: [f"data.train={_bad_rows(tmp)}"],
                             r"the response of the row with prompt 'c1=' is 7; .*must hold text"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_one_config_error_naming_it(case: str, tmp_path: Path, data: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A column found wrong once the tokenizer is loaded (after the folder was claimed, the tiny model and
    the actor built) is refused, the actor is closed, and the run gives the folder back: the corrected run
    starts in it."""
    from verl_hf.training import HFTrainingEngine

    closed: list[str] = []
    close = HFTrainingEngine.close

    def recording_close(engine: HFTrainingEngine) -> None:
        closed.append(engine.spec.role)
        close(engine)

    monkeypatch.setattr(HFTrainingEngine, "close", recording_close)
    overrides, match = BAD_DATA[case]
    with pytest.raises(ConfigError, match=match), SFTTrainer(sft_config(tmp_path / "run", data, *overrides(tmp_path))) as t:
        t.train()
    assert not (tmp_path / "run").exists(), "the failed run kept its claim on the folder"
    # the columns are read with the actor's tokenizer; the other cases are refused before any engine is built
    built = case in ("no response column", "a number as response")
    assert closed == (["actor"] if built else []), f"{case}: closed {closed}"
    if case == "no response column":
        with SFTTrainer(sft_config(tmp_path / "run", data, "steps=1")) as t:
            assert len(t.train()) == 1


def _bad_rows(tmp: Path) -> Path:
    path = tmp / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "c1=", "response": 7}) + "\n")
    return path


def test_bad_files_and_sink_folders_are_refused_before_the_model_is_built(tmp_path: Path, data: Path) -> None:
    """What needs no tokenizer (the data files' encoding and CSV header, the sink folders) is checked
    before the run folder is claimed and the model built."""
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "c1=", "response": "1"}\n{"prompt": "c\xe9=", "response": "2"}\n')
    (tmp_path / "twice.csv").write_text("prompt,response,response\nc1=,1,1\n")
    (tmp_path / "afile").write_text("a file")
    cases = {
        f"data.train={tmp_path / 'latin1.jsonl'}": "latin1.jsonl' is not UTF-8 text: line 2, byte 14 is 0xe9",
        f"data.eval={tmp_path / 'twice.csv'}": "data.eval: dataset '" + str(tmp_path / "twice.csv")
        + "' names the column(s) ['response'] more than once",
        f"logging.tensorboard_dir={tmp_path / 'afile' / 'tb'}": "config key 'logging.tensorboard_dir': the folder",
    }
    for override, message in cases.items():
        cfg = sft_config(tmp_path / "run", data, override, 'logging.sinks=["jsonl", "tensorboard"]')
        with pytest.raises(ConfigError) as info, SFTTrainer(cfg) as t:
            t.train()
        assert message in str(info.value)
        assert not (tmp_path / "run").exists(), "the run folder was claimed before the check"


def test_the_docs_page_config_is_an_sft_config() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "sft-then-rl.md"
    blocks = re.findall(r"```toml\n(.*?)```", page.read_text(), re.S)
    assert blocks, "docs/sft-then-rl.md has no TOML example any more; drop this test"
    for text in blocks:
        config = config_from_dict(tomllib.loads(text))
        assert SFTTrainer(config).config.data.train_paths  # its data section is accepted


def test_a_packing_actor_runs_fewer_micro_batches_with_the_same_losses(tmp_path: Path) -> None:
    # prompts of 1 to 25 characters: under one budget, a packing actor's micro-batches count real
    # tokens (the scheduler's plan follows the engine's capability), padded ones size x longest
    rng = random.Random(0)
    rows = [{"prompt": "c" + "x" * rng.randrange(25) + "=", "response": str(rng.randrange(100))} for _ in range(48)]
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    runs = {}
    for pack in (False, True):
        cfg = sft_config(tmp_path / str(pack), train, "steps=2", "batch.micro_batch_tokens=40",
                         f"backends.options.actor.pack_sequences={str(pack).lower()}",
                         f"data.eval={json.dumps(str(held_out))}")
        with SFTTrainer(cfg) as t:
            history = t.train()
            evaluation = t.evaluate()
            assert t.actor.capabilities.packed_sequences is pack
            runs[pack] = (history, evaluation, [len(d.groups) for d in t.scheduler.plan])
    (padded, ev_padded, plan_padded), (packed, ev_packed, plan_packed) = runs[False], runs[True]
    assert all(a < b for a, b in zip(plan_packed, plan_padded, strict=True)), (plan_packed, plan_padded)
    for a, b in zip(padded, packed, strict=True):
        assert b["scheduler/actor/micro_batches"] < a["scheduler/actor/micro_batches"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    assert ev_packed["eval/loss"] == pytest.approx(ev_padded["eval/loss"], rel=1e-5)
