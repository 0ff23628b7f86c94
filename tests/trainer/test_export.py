"""`verl export`: a checkpoint of a tiny hf run as a transformers folder, loaded back by transformers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_core import CheckpointError, ConfigError, SamplingParams, TensorBatch, WeightChunk
from verl_core.trainer import (
    Trainer,
    latest_checkpoint,
    load_config,
    prompt_batch,
    verify_checkpoint,
)
from verl_core.trainer.config import config_from_dict
from verl_core.trainer.run.checkpoints import write_manifest
from verl_core.trainer.run.export import export_checkpoint

pytestmark = [pytest.mark.slow]

# copy of 1 digit with partial credit: rewards differ within a group, so two steps change the weights
RUN = [
    "steps=2", "task.name=copy", "task.digits=1", "task.reward=partial",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1",
    "rollout.n=8", "rollout.max_new_tokens=3", "batch.prompts_per_step=8",
    "optim.lr=1e-2", "logging.progress=false", "logging.plot=false",
]
# prompts of several lengths, at most the task's 3 tokens (the rollout left-pads; transformers runs each alone)
TEXTS = ["c0=", "c9=", "r4=", "c5", "7"]


def train(out: Path, *extra: str) -> Path:
    """A two-step run into ``out`` (checkpoint.final on by default); returns ``out``."""
    with Trainer(load_config(None, [*RUN, f"output_dir={json.dumps(str(out))}", *extra])) as trainer:
        trainer.train()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("export") / "run")


@pytest.fixture(scope="module")
def exported(run: Path) -> Path:
    return export_checkpoint(run, run.parent / "hf")


def checkpoint_outputs(run: Path) -> tuple[dict[str, Tensor], TensorBatch]:
    """The actor's weight stream and the rollout's greedy samples of TEXTS after
    ``Trainer.load_checkpoint`` of the run's newest checkpoint."""
    cfg = config_from_dict(json.loads((run / "config.json").read_text()))
    with Trainer(cfg) as trainer:
        ckpt = latest_checkpoint(run)
        assert ckpt is not None
        trainer.load_checkpoint(ckpt)
        streamed = {n: t.clone() for msg in trainer.actor.export_weights() if isinstance(msg, WeightChunk)
                    for n, t in msg.tensors}
        prompts = prompt_batch(TEXTS, trainer.rollout.tokenizer, group_ids=list(range(len(TEXTS))))
        greedy = SamplingParams(greedy=True, max_new_tokens=cfg.rollout.max_new_tokens, n=1)
        samples = trainer.rollout.generate(prompts, greedy)
    return streamed, samples


def test_export_writes_a_transformers_folder(run: Path, exported: Path) -> None:
    assert exported == run.parent / "hf"
    assert sorted(p.name for p in exported.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    assert [p.name for p in run.parent.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    config = json.loads((exported / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]


def test_loaded_model_is_the_checkpoint_and_generates_like_the_rollout(run: Path, exported: Path) -> None:
    streamed, samples = checkpoint_outputs(run)
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    state = model.state_dict()
    # the tied lm_head is not streamed; transformers ties it to the embedding
    assert set(state) == set(streamed) | {"lm_head.weight"}
    for name, t in streamed.items():
        assert torch.equal(state[name], t), name
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    initial = load_file(str(run / "model" / "model.safetensors"))
    assert any(not torch.equal(initial[n], t) for n, t in streamed.items()), "training changed no weight"

    for i, text in enumerate(TEXTS):
        prompt = samples["prompt_ids"][i][samples["prompt_mask"][i]]
        assert tokenizer(text, add_special_tokens=False).input_ids == prompt.tolist()
        with torch.no_grad():
            out = model.generate(prompt[None], max_new_tokens=samples.response_len, do_sample=False)
        expected = samples["response_ids"][i][samples["response_mask"][i]]
        assert out[0, prompt.numel():].tolist() == expected.tolist(), text


def test_step_folder_shards_and_an_empty_out_folder(run: Path, exported: Path, tmp_path: Path) -> None:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    (tmp_path / "empty").mkdir()
    again = export_checkpoint(ckpt, tmp_path / "empty")
    assert (again / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()

    sharded = export_checkpoint(ckpt, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == files
    whole = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    split = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)


def _copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("hf"))
    ckpt = latest_checkpoint(dest)
    assert ckpt is not None
    return ckpt


def _edit_state(ckpt: Path, *, text: str | None = None, key: str = "", value: object = None) -> None:
    """Replace trainer_state.json by ``text``, or set the config's dotted ``key`` to ``value``; then
    rewrite the manifest, so only the content is wrong."""
    path = ckpt / "trainer_state.json"
    if text is None:
        state = json.loads(path.read_text())
        *parents, last = key.split(".")
        section = state["config"]
        for part in parents:
            section = section[part]
        section[last] = value
        text = json.dumps(state)
    path.write_text(text)
    write_manifest(ckpt)


def test_bad_inputs_raise_one_error_and_leave_nothing(run: Path, exported: Path, tmp_path: Path) -> None:
    before = (exported / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already exists and is not an empty folder"):
        export_checkpoint(run, exported)
    assert (exported / "model.safetensors").read_bytes() == before
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    with pytest.raises(CheckpointError, match="does not exist"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")

    ckpt = _copy_run(run, tmp_path / "corrupt")
    weights = next((ckpt / "actor").rglob("model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupted"):
        export_checkpoint(ckpt, tmp_path / "out")

    ckpt = _copy_run(run, tmp_path / "nobackend")
    _edit_state(ckpt, key="backends.actor", value="nosuch")
    with pytest.raises(ConfigError, match="actor backend 'nosuch'.*pip install verl-nosuch"):
        export_checkpoint(ckpt, tmp_path / "out")

    ckpt = _copy_run(run, tmp_path / "garbled")
    _edit_state(ckpt, text="{not json")
    with pytest.raises(CheckpointError, match="trainer_state.json is unreadable"):
        export_checkpoint(ckpt, tmp_path / "out")

    ckpt = _copy_run(run, tmp_path / "elsewhere")
    _edit_state(ckpt, key="model.device", value="cuda:99")
    with pytest.raises(ConfigError, match=r"device 'cuda:99'\) cannot be built here.*--device"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert (export_checkpoint(ckpt, tmp_path / "cpu", device="cpu") / "model.safetensors").is_file()

    ckpt = _copy_run(run, tmp_path / "nomodel")
    shutil.rmtree(tmp_path / "nomodel" / "model")
    with pytest.raises(ConfigError, match="tiny model folder.*has no config.json"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_verl_export_command(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verl_core.cli import main

    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert "exported" in capsys.readouterr().err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_bfloat16_untied_run(tmp_path: Path) -> None:
    """The weights keep the run's dtype, config.json says so, and an untied lm_head is exported."""
    run = train(tmp_path / "run", "model.dtype=bfloat16", "model.tied=false")
    out = export_checkpoint(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    streamed, _ = checkpoint_outputs(run)
    state = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" in state and state.keys() == streamed.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, streamed[n]) for n, t in state.items())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_export_into_a_checkpoint_or_a_run_folder_is_refused_before_writing(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writing into a checkpoint would leave files its manifest does not list, and --resume would then
    refuse the run's only checkpoint: such targets are refused, naming the folder and what to do."""
    from verl_core.cli import main

    ckpt = _copy_run(run, tmp_path / "run")
    own = tmp_path / "run"
    before = _tree(own)
    (tmp_path / "link").symlink_to(ckpt, target_is_directory=True)
    refused = {
        ckpt / "hf": f"lies inside the checkpoint {str(ckpt.resolve())!r}",
        ckpt / "actor" / "hf": f"lies inside the checkpoint {str(ckpt.resolve())!r}",
        tmp_path / "link" / "hf": f"lies inside the checkpoint {str(ckpt.resolve())!r}",
        own / "hf": f"lies inside the run folder {str(own.resolve())!r}",
        own / "checkpoints" / "hf": f"lies inside the run folder {str(own.resolve())!r}",
    }
    for out, where in refused.items():
        with pytest.raises(ConfigError, match=re.escape(where) + r".*Export to a folder outside the run, e\.g\. '.*run-hf'"):
            export_checkpoint(own, out)
        assert main(["export", str(own), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"export folder {str(out)!r}" in err and where in err, err
    assert _tree(own) == before, "a refused export wrote into the run folder"
    verify_checkpoint(ckpt)

    (tmp_path / "afile").write_text("not a folder")
    for out in (tmp_path / "afile" / "hf", tmp_path / "afile" / "sub" / "hf"):
        with pytest.raises(ConfigError, match=re.escape(f"{str(tmp_path / 'afile')!r} is a file, so no folder")):
            export_checkpoint(own, out)
    assert (tmp_path / "afile").read_text() == "not a folder"

    # the run's only checkpoint still resumes, and an export beside the run works
    cfg = config_from_dict({**json.loads((own / "config.json").read_text()), "output_dir": str(own), "steps": 3})
    with Trainer(cfg) as trainer:
        assert [m["step"] for m in trainer.train(resume=True)][-1] == 3
    assert (export_checkpoint(own, tmp_path / "run-hf") / "model.safetensors").is_file()
