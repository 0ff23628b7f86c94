"""The reward model of a run: its folder (``reward_model``), a tokenizer other than the policy's, and
its metrics and weight when it is the whole reward.

The policy is the trainer's tiny model (char tokenizer of 96 ids); the reward models are test-kit
sequence-classification folders scored by the real hf reward engine, or the installed ``toy``
backend's reward engine (response length plus ``bonus``), which has no tokenizer.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_conformance.testkit import TinyModelSpec, tiny_model
from verl_core import ConfigError, EngineSpec, TensorBatch
from verl_core.cli import main
from verl_core.enginekit.retokenize import retokenize
from verl_core.trainer import Trainer
from verl_core.trainer.config import RunConfig, load_config
from verl_core.trainer.inputs.tiny_model import SPECIAL_TOKENS, build_tiny_model, char_tokenizer
from verl_hf.reward import HFRewardEngine
from verl_hf.tokenizer import load_tokenizer

# a one-step run small enough to build every engine in a few seconds (the policy: 96 ids, tied)
TINY = ("task.name=copy", "task.digits=1", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_heads=1", "model.num_kv_heads=1", "model.num_layers=1", "rollout.n=2",
        "rollout.max_new_tokens=3", "batch.prompts_per_step=2", "batch.micro_batch_tokens=64",
        "logging.plot=false", "steps=1")
VOCAB = 96
LINE = "its tokenizer's vocabulary is not the rollout's"


def _config(tmp_path: Path, name: str, *overrides: str) -> RunConfig:
    return load_config(None, [*TINY, *overrides, f"output_dir={json.dumps(str(tmp_path / name))}"])


def _reward_folder(tmp_path: Path, *, permuted: bool) -> Path:
    """A reward model (random score head, saved) for the policy's 96 ids: with the policy's char
    tokenizer, or with one that gives every character another id (specials keep theirs)."""
    if not permuted:
        return tiny_model(TinyModelSpec(head="reward", vocab_size=VOCAB, tied=True))
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_tokenizer(VOCAB).get_vocab()
    others = sorted((t for t in vocab if t not in SPECIAL_TOKENS), key=vocab.__getitem__)
    table = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *reversed(others)])}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        padding_side="left")
    return build_tiny_model(tmp_path / "reward-permuted", TinyModelSpec(head="reward", vocab_size=VOCAB, tied=True),
                            tokenizer=hf_tok)


def _samples(trainer: Trainer) -> TensorBatch:
    """The first step's prompts and the rollout's responses, as the reward stage gets them."""
    return trainer.rollout.generate(trainer.prompts(0), trainer.sampling_params())


def _engine(folder: Path) -> HFRewardEngine:
    return HFRewardEngine(EngineSpec(model_path=str(folder), role="reward", max_prompt_len=64,
                                     max_response_len=64))


# ---------------------------------------------------------------------------- the key and its checks
def test_reward_model_is_a_top_level_key_beside_critic_model() -> None:
    assert RunConfig().reward_model == ""
    assert "reward_model: Folder of the reward model (empty = the policy model)" in (RunConfig.__doc__ or "")
    with pytest.raises(ConfigError, match=r"config key 'reward_model' = 'rm' names a reward model, but "
                                          r"'backends.reward' = 'rule' builds no reward-model engine"):
        load_config(None, ["reward_model=rm"])
    assert load_config(None, ["reward_model=rm", "backends.reward=hf"]).reward_model == "rm"


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_reward_model_that_is_no_folder_is_refused_before_the_folder_is_claimed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    path = tmp_path / "rm"
    if what == "file":
        path.write_text("not a model")
    out = tmp_path / "run"
    expected = "is a file, not a folder" if what == "file" else "does not exist"
    code = main(["train", *TINY, "backends.reward=hf", f"reward_model={json.dumps(str(path))}", "--check",
                 "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"config key 'reward_model' = {str(path)!r} {expected}; expected the folder of the reward model" in err, err
    # the Python API refuses it as verl train does, before it writes anything
    cfg = _config(tmp_path, "run", "backends.reward=hf", f"reward_model={json.dumps(str(path))}")
    with Trainer(cfg) as trainer, pytest.raises(ConfigError, match=f"config key 'reward_model' = .* {expected}"):
        trainer.setup()
    assert not out.exists()


def test_hf_on_the_policy_folder_is_refused_naming_reward_model(tmp_path: Path) -> None:
    """Without reward_model the hf reward engine is given the policy's causal LM: refused, not a random head."""
    with Trainer(_config(tmp_path, "run", "backends.reward=hf")) as trainer, pytest.raises(
            ConfigError, match=r"has architectures \['LlamaForCausalLM'\].*set the config key reward_model"):
        trainer.setup()


# ---------------------------------------------------------------------------- the engine the trainer builds
def _scored_by_a_run(tmp_path: Path, folder: Path) -> tuple[TensorBatch, TensorBatch, str, Any, tuple[int, int]]:
    """A run's samples, its reward's scores of them with ``reward_model = folder``, what the run said,
    and its rollout's tokenizer and length limits."""
    stream = io.StringIO()
    with Trainer(_config(tmp_path, "run", "backends.reward=hf", f"reward_model={json.dumps(str(folder))}"),
                 stream=stream) as trainer:
        trainer.setup()
        samples = _samples(trainer)
        scored = trainer.reward.score(samples)
        limits = trainer.rollout.spec.max_prompt_len, trainer.rollout.spec.max_response_len
        return samples, scored, stream.getvalue(), trainer.rollout.tokenizer, limits


def test_the_reward_engine_is_built_on_reward_model(tmp_path: Path) -> None:
    folder = _reward_folder(tmp_path, permuted=False)
    samples, scored, said, _, _ = _scored_by_a_run(tmp_path, folder)
    want = _engine(folder).score(samples)["scores"]
    assert torch.equal(scored["scores"], want)
    assert list(scored.extras["reward/model"]) == want.tolist()
    assert LINE not in said  # the same vocabulary: ids pass as they are


def test_a_reward_model_of_another_vocabulary_scores_the_text(tmp_path: Path) -> None:
    """The reward model's ids mean other characters: the trainer decodes the samples with the rollout's
    tokenizer and encodes them with the reward model's, and says so once."""
    folder = _reward_folder(tmp_path, permuted=True)
    samples, scored, said, policy_tok, limits = _scored_by_a_run(tmp_path, folder)
    engine = _engine(folder)
    through_text = engine.score(retokenize(samples, policy_tok, load_tokenizer(folder)))["scores"]
    as_they_are = engine.score(samples)["scores"]
    assert torch.equal(scored["scores"], through_text)
    assert not torch.allclose(as_they_are, through_text), "the test's tokenizers must give the samples other ids"
    lines = [ln for ln in said.splitlines() if LINE in ln]
    # the limits count the reward model's tokens: the rollout's times the most bytes one of its ids decodes to
    # ("<extra_7>", 9 bytes) plus one, and one more response token for the EOS
    assert lines == [f"reward model {str(folder)!r} (backend 'hf'): {LINE}, so each sample is decoded with the "
                     "rollout's tokenizer and encoded with the reward model's before it is scored (its engine "
                     f"takes up to {limits[0] * 10} prompt and {limits[1] * 10 + 1} response tokens of its own)"], lines


def test_the_converting_reward_model_is_reported_with_the_progress_bar_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The line about decoding and re-encoding is a warning, so a run without the progress bar shows it too."""
    folder = _reward_folder(tmp_path, permuted=True)
    cfg = _config(tmp_path, "quiet", "backends.reward=hf", f"reward_model={json.dumps(str(folder))}",
                  "logging.progress=false")
    with caplog.at_level(logging.WARNING, logger="verl_core"), Trainer(cfg) as trainer:
        trainer.setup()
    assert [r.levelno for r in caplog.records if LINE in r.getMessage()] == [logging.WARNING]


# ---------------------------------------------------------------------------- the reward model alone
def test_the_reward_model_alone_logs_its_metrics_and_applies_its_weight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """reward.functions empty: reward/model/mean and eval/reward/model/mean are the model's own scores,
    reward/mean is model_weight times them; the toy engine has no tokenizer, so it gets the ids as they are."""
    rows = [{"prompt": p} for p in ("ab", "cde", "f", "gh")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path, "run", "backends.reward=toy", "backends.options.reward.bonus=0.5",
                  "reward.model_weight=-2.0", f"data.train=[{json.dumps(str(data))}]",
                  f"data.eval=[{json.dumps(str(data))}]", "logging.progress=false")
    with caplog.at_level(logging.INFO, logger="verl_core"), Trainer(cfg) as trainer:
        [m] = trainer.train()
    lengths = m["response/length_mean"]
    assert m["reward/model/mean"] == pytest.approx(lengths + 0.5)  # length + bonus: the toy engine's score
    assert m["reward/mean"] == pytest.approx(-2.0 * m["reward/model/mean"])
    assert m["eval/reward/model/mean"] == pytest.approx(m["eval/response/length_mean"] + 0.5)
    assert m["eval/reward/mean"] == pytest.approx(-2.0 * m["eval/reward/model/mean"])
    assert not [r for r in caplog.records if LINE in r.getMessage()]
