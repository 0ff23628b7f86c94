"""vLLM serves the folder `verl export` writes, with the greedy tokens of the project's rollout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_testing import KV_CACHE_BYTES

from verl_core import SamplingParams
from verl_core.trainer import Trainer, latest_checkpoint, load_config, prompt_batch
from verl_core.trainer.run.export import export_checkpoint
from verl_vllm.llm_process import LEAKED_ENV, restored_environ

pytestmark = [pytest.mark.slow]

RUN = [
    "steps=2", "task.name=copy", "task.digits=2", "task.reward=partial",
    "rollout.n=8", "rollout.max_new_tokens=4", "batch.prompts_per_step=8",
    "optim.lr=1e-2", "logging.progress=false", "logging.plot=false",
]
TEXTS = ["c12=", "c90=", "r4=", "c5", "7"]


def test_vllm_serves_the_export_like_the_rollout(tmp_path: Path) -> None:
    import vllm

    cfg = load_config(None, [*RUN, f"output_dir={json.dumps(str(tmp_path / 'run'))}"])
    with Trainer(cfg) as trainer:
        trainer.train()
    out = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None
    with Trainer(cfg) as trainer:
        trainer.load_checkpoint(ckpt)
        prompts = prompt_batch(TEXTS, trainer.rollout.tokenizer, group_ids=list(range(len(TEXTS))))
        samples = trainer.rollout.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4, n=1))

    # LLM() writes these into os.environ for worker processes; later tests must not inherit them
    with restored_environ(LEAKED_ENV):
        llm = vllm.LLM(model=str(out), dtype="float32", max_model_len=64, kv_cache_memory_bytes=KV_CACHE_BYTES,
                       enforce_eager=True, seed=0)
    try:
        # text prompts: vLLM tokenizes with the exported tokenizer and stops at its generation config's EOS
        results = llm.generate(TEXTS, vllm.SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    for i, result in enumerate(results):
        assert result.prompt_token_ids == samples["prompt_ids"][i][samples["prompt_mask"][i]].tolist(), TEXTS[i]
        expected = samples["response_ids"][i][samples["response_mask"][i]].tolist()
        assert list(result.outputs[0].token_ids) == expected, TEXTS[i]
