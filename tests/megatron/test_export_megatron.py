"""`verl export` of a run whose actor is Megatron (in-process, TP=1), loaded back by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_conformance.testkit import assert_close
from verl_core import SamplingParams, WeightChunk
from verl_core.trainer import Trainer, latest_checkpoint, load_config, prompt_batch
from verl_core.trainer.run.export import export_checkpoint

pytestmark = [pytest.mark.slow]

# Qwen2 with grouped queries (2 heads, 1 KV head) and QKV bias, untied: the layouts Megatron fuses
# and splits differently from transformers, and an lm_head of its own
RUN = [
    "steps=2", "task.name=copy", "task.digits=2", "task.reward=partial",
    "model.arch=qwen2", "model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64", "model.tied=false", "backends.actor=megatron",
    "rollout.n=8", "rollout.max_new_tokens=4", "batch.prompts_per_step=8",
    "optim.lr=1e-2", "logging.progress=false", "logging.plot=false",
]
TEXTS = ["c12=", "c90=", "r4=", "c5"]


def test_megatron_run_exports_to_transformers(tmp_path: Path) -> None:
    cfg = load_config(None, [*RUN, f"output_dir={json.dumps(str(tmp_path / 'run'))}"])
    with Trainer(cfg) as trainer:
        trainer.train()
    out = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False

    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None
    with Trainer(cfg) as trainer:
        trainer.load_checkpoint(ckpt)
        streamed = {n: t.clone() for msg in trainer.actor.export_weights() if isinstance(msg, WeightChunk)
                    for n, t in msg.tensors}
        prompts = prompt_batch(TEXTS, trainer.rollout.tokenizer, group_ids=list(range(len(TEXTS))))
        samples = trainer.rollout.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4, n=1))
        actor = trainer.actor.forward(samples, ("log_probs", "entropy"))

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    state = model.state_dict()
    assert state.keys() == streamed.keys() and "lm_head.weight" in state
    assert all(torch.equal(state[n], t) for n, t in streamed.items())

    temperature = samples.meta.temperature
    log_probs = torch.zeros_like(actor["log_probs"])
    entropy = torch.zeros_like(actor["entropy"])
    for i in range(samples.batch_size):
        prompt = samples["prompt_ids"][i][samples["prompt_mask"][i]]
        mask = samples["response_mask"][i]
        response = samples["response_ids"][i][mask]
        with torch.no_grad():
            generated = model.generate(prompt[None], max_new_tokens=4, do_sample=False)[0, prompt.numel():]
            logits = model(torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1]
        assert generated.tolist() == response.tolist(), TEXTS[i]
        logp = torch.log_softmax(logits.double() / temperature, -1)
        log_probs[i, : response.numel()] = logp.gather(-1, response[:, None])[:, 0].float()
        entropy[i, : response.numel()] = -(logp.exp() * logp).sum(-1).float()
    # the exported model's logits are Megatron's: log-probs and entropy agree to float32 rounding
    assert_close(log_probs, actor["log_probs"], dtype="float32", quantity="log_probs", what="log_probs")
    assert_close(entropy, actor["entropy"], dtype="float32", quantity="entropy", what="entropy")
