"""LoRA runs (model.lora): the reference is the actor's base, resume is exact, export writes merged
weights or a PEFT adapter folder, and the config refuses bad LoRA keys when it loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_core import ConfigError, LoraSpec, SamplingParams, WeightChunk
from verl_core.enginekit.lora import read_adapter_folder, write_adapter_folder
from verl_core.trainer import Trainer, latest_checkpoint, load_config, prompt_batch
from verl_core.trainer.config import config_from_dict
from verl_core.trainer.rl.engines import BaseModelReference
from verl_core.trainer.run.export import export_checkpoint
from verl_core.trainer.run.model import lora_sync

pytestmark = [pytest.mark.slow]

RUN = [
    "task.name=copy", "task.digits=1", "task.reward=partial",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1",
    "rollout.n=8", "rollout.max_new_tokens=3", "batch.prompts_per_step=8",
    "optim.lr=2e-2", "logging.progress=false", "logging.plot=false",
    "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
]
TEXTS = ["c0=", "c9=", "r4=", "c5", "7"]


def _config(out: Path, *extra: str) -> object:
    return load_config(None, [*RUN, f"output_dir={json.dumps(str(out))}", *extra])


def _train(out: Path, *extra: str) -> list[dict[str, object]]:
    with Trainer(_config(out, *extra)) as trainer:  # type: ignore[arg-type]
        return trainer.train()


def test_the_reference_is_the_actors_base_and_no_reference_engine_is_built(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run", "steps=4", "algorithm.options.kl_loss_coef=0.1", "algorithm.use_reference=true",
                  "model.lora.sync=adapter")
    with Trainer(cfg) as trainer:  # type: ignore[arg-type]
        history = trainer.train()
        assert isinstance(trainer.reference, BaseModelReference)
        assert trainer.rollout.spec.lora is not None  # the hf rollout takes adapter streams
        # one copy of the frozen base: the rollout took the actor's at set-up, before any rollout
        assert trainer.rollout.shares_base  # type: ignore[attr-defined]
        rollout_params = dict(trainer.rollout.model.named_parameters())  # type: ignore[attr-defined]
        assert all(rollout_params[n] is p for n, p in trainer.actor.model.named_parameters()  # type: ignore[attr-defined]
                   if not p.requires_grad)
        batch = prompt_batch(TEXTS, trainer.rollout.tokenizer, group_ids=list(range(len(TEXTS))))
        samples = trainer.rollout.generate(batch, SamplingParams(max_new_tokens=3, seed=1))
        ref = trainer.reference.forward(samples)["log_probs"]
        assert torch.equal(ref, trainer.actor.base_forward(samples)["log_probs"])
        assert not torch.equal(ref, trainer.actor.forward(samples)["log_probs"])  # the adapter trained
    # step 1 starts from B = 0: the policy is the reference, so their KL is 0 at the first update
    assert history[0]["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    # once an update moved the adapter (a step whose groups' rewards differ), the policy leaves the reference
    assert max(float(m["actor/kl_ref"]) for m in history[1:]) > 1e-6


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Merged-weight sync (the default): the rollout decodes plain weights, the actor trains the adapter."""
    straight = tmp_path / "straight"
    _train(straight, "steps=3", "checkpoint.every=1")
    resumed = tmp_path / "resumed"
    _train(resumed, "steps=2", "checkpoint.every=1")
    with Trainer(_config(resumed, "steps=3", "checkpoint.every=1")) as trainer:  # type: ignore[arg-type]
        trainer.train(resume=True)
    for run in (straight, resumed):
        assert (latest_checkpoint(run) or Path()).name == "step-000003"

    def adapter(run: Path) -> dict[str, torch.Tensor]:
        cfg = config_from_dict(json.loads((run / "config.json").read_text()))
        with Trainer(cfg) as trainer:
            trainer.load_checkpoint(latest_checkpoint(run))  # type: ignore[arg-type]
            return {n: t.clone() for m in trainer.actor.export_adapter() if isinstance(m, WeightChunk)
                    for n, t in m.tensors}

    a, b = adapter(straight), adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(float(t.abs().max()) > 0 for n, t in a.items() if n.endswith("lora_B.weight"))
    changed = _config(resumed, "steps=4", "model.lora.rank=8")
    with Trainer(changed) as trainer, pytest.raises(ConfigError, match="model.lora.rank"):  # type: ignore[arg-type]
        trainer.train(resume=True)


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_the_first_rollout_samples_from_the_init_path_adapter(tmp_path: Path, sync: str) -> None:
    """model.lora.init_path: step 1's rollout samples the actor's policy (base + that adapter), not the base."""
    first = tmp_path / "first"
    _train(first, "steps=1")
    spec = LoraSpec(rank=4, alpha=8.0)
    trained = read_adapter_folder(export_checkpoint(first, tmp_path / "trained", adapter_only=True), spec)
    g = torch.Generator().manual_seed(0)
    far = {n: 0.3 * torch.randn(t.shape, generator=g) for n, t in trained.items()}  # far from the base
    init = tmp_path / "init"
    init.mkdir()
    write_adapter_folder(init, spec, far, base_model=str(first / "model"))
    cfg = _config(tmp_path / "run", "steps=1", f"model.path={json.dumps(str(first / 'model'))}",
                  f"model.lora.init_path={json.dumps(str(init))}", f"model.lora.sync={sync}")
    with Trainer(cfg) as trainer:  # type: ignore[arg-type]
        trainer.setup()
        prompts = prompt_batch(TEXTS, trainer.rollout.tokenizer, group_ids=list(range(len(TEXTS))))
        samples = trainer.rollout.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
        actor = trainer.actor.forward(samples)["log_probs"]
        base = trainer.actor.base_forward(samples)["log_probs"]
    mask = samples["response_mask"]
    assert float((actor - base).abs()[mask].max()) > 0.1  # the adapter moves the policy
    assert torch.allclose(samples["rollout_log_probs"][mask], actor[mask], atol=1e-5), (
        f"{sync} sync: the first rollout does not sample from the actor's starting policy")


def test_export_merged_and_adapter_only_generate_like_the_rollout(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, "steps=2")
    merged = export_checkpoint(run, tmp_path / "merged")
    adapter = export_checkpoint(run, tmp_path / "adapter", adapter_only=True)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["base_model_name_or_path"] == str((run / "model").resolve())

    cfg = config_from_dict(json.loads((run / "config.json").read_text()))
    with Trainer(cfg) as trainer:
        trainer.load_checkpoint(latest_checkpoint(run))  # type: ignore[arg-type]
        prompts = prompt_batch(TEXTS, trainer.rollout.tokenizer, group_ids=list(range(len(TEXTS))))
        samples = trainer.rollout.generate(prompts, SamplingParams(greedy=True, max_new_tokens=3))
    tokenizer = AutoTokenizer.from_pretrained(merged)
    full = AutoModelForCausalLM.from_pretrained(merged).eval()  # type: ignore[no-untyped-call]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "model"), adapter)
    peft.eval()
    base = AutoModelForCausalLM.from_pretrained(run / "model").eval()  # type: ignore[no-untyped-call]
    differs = False
    for i, text in enumerate(TEXTS):
        prompt = samples["prompt_ids"][i][samples["prompt_mask"][i]]
        assert tokenizer(text, add_special_tokens=False).input_ids == prompt.tolist()
        expected = samples["response_ids"][i][samples["response_mask"][i]].tolist()
        with torch.no_grad():
            for model in (full, peft):
                out = model.generate(input_ids=prompt[None], max_new_tokens=samples.response_len, do_sample=False)
                assert out[0, prompt.numel():].tolist() == expected, (text, type(model).__name__)
            logits = full(prompt[None]).logits
            assert torch.allclose(peft(prompt[None]).logits, logits, atol=1e-5)
            differs |= not torch.allclose(base(prompt[None]).logits, logits, atol=1e-4)
    assert differs, "the exported weights are the base's: training changed nothing"


def test_export_adapter_only_of_a_full_weight_run_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, "steps=1", "model.lora.enabled=false")
    with pytest.raises(ConfigError, match="needs a run that trained a LoRA adapter, but its model.lora.enabled is false"):
        export_checkpoint(run, tmp_path / "adapter", adapter_only=True)


def test_lora_config_keys_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match=r"config key 'model.lora.rank' = 0 is out of range; allowed: >= 1"):
        load_config(None, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"config key 'model.lora.dropout' = 1.0 is out of range; allowed: in \[0, 1\)"):
        load_config(None, ["model.lora.dropout=1.0"])
    with pytest.raises(ConfigError, match="'model.lora.sync' = 'adapter' needs 'executor' = 'local'"):
        load_config(None, ["model.lora.enabled=true", "model.lora.sync=adapter", "executor=ray"])
    assert lora_sync(load_config(None, ["model.lora.enabled=true"])) == "merged"
    assert lora_sync(load_config(None, ["model.lora.enabled=true", "model.lora.sync=adapter"])) == "adapter"
    assert lora_sync(load_config(None)) is None
    with pytest.raises(ConfigError, match=r"config key 'model.lora.sync': 'auto' is not valid; choices: 'merged', 'adapter'"):
        load_config(None, ["model.lora.sync=auto"])


def test_a_target_pattern_matching_nothing_fails_before_any_step(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run", "steps=1", 'model.lora.targets=["q_proj", "attn_out"]')
    with Trainer(cfg) as trainer, pytest.raises(ConfigError, match="pattern 'attn_out' matches no linear module"):  # type: ignore[arg-type]
        trainer.train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or (tmp_path / "run" / "metrics.jsonl").read_text() == ""
