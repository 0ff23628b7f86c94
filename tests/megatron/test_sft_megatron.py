"""`verl sft` with a Megatron actor (in-process, TP=1): the same runner, loss and export as with hf."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_core.trainer import load_config
from verl_core.trainer.config import RunConfig
from verl_core.trainer.sft.trainer import SFT_MODEL_DIR, SFTLoss, SFTTrainer

pytestmark = [pytest.mark.slow]

# Qwen2 with grouped queries and QKV bias, untied: the layouts Megatron fuses differently from transformers
MODEL = ["model.arch=qwen2", "model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "model.tied=false"]


def config(out: Path, data: Path, backend: str) -> RunConfig:
    return load_config(None, [
        *MODEL, f"backends.actor={backend}", f"data.train={json.dumps(str(data))}",
        f"output_dir={json.dumps(str(out))}", "steps=2", "batch.prompts_per_step=8", "optim.lr=1e-2",
        "logging.progress=false",
    ])


def test_megatron_sft_trains_exports_and_matches_hf(tmp_path: Path) -> None:
    rng = random.Random(0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"c{n}=", "response": str(n)}) + "\n"
                            for n in (rng.randrange(1000) for _ in range(16))))
    with SFTTrainer(config(tmp_path / "hf", data, "hf")) as hf:
        reference = hf.train()
    with SFTTrainer(config(tmp_path / "megatron", data, "megatron")) as trainer:
        history = trainer.train()
        batch = trainer.train_data.batch([0, 1, 2, 3])
        expected = trainer.actor.forward(batch, SFTLoss().needs)["log_probs"]
    # the same tiny model, data order and loss: the first step (before any update) agrees to float32 rounding
    assert history[0]["train/loss"] == pytest.approx(reference[0]["train/loss"], rel=1e-4)
    assert history[1]["train/loss"] < history[0]["train/loss"]

    out = tmp_path / "megatron" / SFT_MODEL_DIR
    assert trainer.model_dir == out
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()  # type: ignore[no-untyped-call]
    for i in range(batch.batch_size):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i]]
        response = batch["response_ids"][i][batch["response_mask"][i]]
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1]
        got = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
        torch.testing.assert_close(got, expected[i, : response.numel()], rtol=1e-4, atol=1e-4)
