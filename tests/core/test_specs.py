"""Typed configs of verl-core reject bad values with messages naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_core import (
    ConfigError,
    EngineSpec,
    FunctionReward,
    GlobalBatchStats,
    OptimConfig,
    ParallelSizes,
    RewardError,
    SamplingParams,
    TensorBatch,
    dp_shard,
)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SamplingParams(temperature=0), r"SamplingParams.temperature must be a finite number >= 0.0001 .*got 0"),
        (lambda: SamplingParams(temperature=1e-40), r"temperature must be a finite number >= 0.0001 .*greedy=True"),
        (lambda: SamplingParams(top_p=1.5), r"SamplingParams.top_p must be a finite number in \(0, 1\]"),
        (lambda: SamplingParams(n=0), r"SamplingParams.n must be an integer in \[1, 65536\], got 0"),
        (lambda: SamplingParams(n=10**9), r"SamplingParams.n must be an integer in \[1, 65536\], got 1000000000"),
        (lambda: SamplingParams(n=True), r"SamplingParams.n must be an integer .*got True \(bool\)"),
        (lambda: SamplingParams(max_new_tokens=2**21), r"max_new_tokens must be an integer in \[1, 1048576\]"),
        (lambda: SamplingParams(seed="7"), r"SamplingParams.seed must be an integer .*or None, got '7' \(str\)"),
        (lambda: SamplingParams(greedy=1), r"SamplingParams.greedy must be True or False, got 1 \(int\)"),
        (lambda: SamplingParams(stop_token_ids=(3, -1)), r"SamplingParams.stop_token_ids\[1\] must be an integer in \[0,"),
        (lambda: SamplingParams(stop_token_ids="7"), r"SamplingParams.stop_token_ids must be a tuple of token ids"),
        (lambda: ParallelSizes(tp=0), "ParallelSizes.tp must be an integer >= 1"),
        (lambda: ParallelSizes(tp="2"), r"ParallelSizes.tp must be an integer >= 1, got '2' \(str\)"),
        (lambda: OptimConfig(lr=0), "OptimConfig.lr must be a finite number > 0"),
        (lambda: OptimConfig(betas=(0.9, 1.0)), r"OptimConfig.betas\[1\] must be a finite number in \[0, 1\)"),
        (lambda: OptimConfig(schedule="linear"), "OptimConfig.schedule must be one of constant, cosine, got 'linear'"),
        (lambda: EngineSpec(model_path="m", role="trainer"), "EngineSpec.role must be one of actor"),  # type: ignore[arg-type]
        (lambda: EngineSpec(model_path="m", role="actor", dtype="fp8"), "EngineSpec.dtype must be one of float32"),  # type: ignore[arg-type]
        (lambda: EngineSpec(model_path="m", role="actor", micro_batch_tokens=0),
         "EngineSpec.micro_batch_tokens must be an integer >= 1 or None, got 0"),
        (lambda: EngineSpec(model_path="m", role="actor", max_prompt_len="10"),  # type: ignore[arg-type]
         r"EngineSpec.max_prompt_len must be an integer >= 1, got '10' \(str\)"),
        (lambda: EngineSpec(model_path="m", role="actor", device="gpu"), "EngineSpec.device must be a torch device"),
        (lambda: EngineSpec(model_path="m", role="actor", seed=-1), r"EngineSpec.seed must be an integer in \[0, 4294967295\]"),
        (lambda: EngineSpec(model_path="m", role="actor", options=["x"]),  # type: ignore[arg-type]
         "EngineSpec.options must be a mapping with string keys"),
    ],
)
def test_invalid_configs(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()  # type: ignore[operator]


def test_specs_normalise_lists_and_paths() -> None:
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)  # type: ignore[arg-type]
    assert hash(SamplingParams(stop_token_ids=[5]))  # type: ignore[arg-type]
    assert OptimConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)  # type: ignore[arg-type]
    spec = EngineSpec(model_path=Path("/m"), role="actor", device=torch.device("cpu"))  # type: ignore[arg-type]
    assert (spec.model_path, spec.device) == ("/m", "cpu")


def test_lr_schedule_warmup_then_cosine() -> None:
    opt = OptimConfig(lr=1.0, warmup_steps=2, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    assert [opt.lr_at(0), opt.lr_at(1)] == [0.5, 1.0]
    assert opt.lr_at(2) == pytest.approx(1.0)
    assert opt.lr_at(7) == pytest.approx(0.55)
    assert opt.lr_at(12) == pytest.approx(0.1) and opt.lr_at(50) == pytest.approx(0.1)


def test_global_stats_count_only_non_empty_sequences() -> None:
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    stats = GlobalBatchStats.of(TensorBatch({"response_mask": mask}))
    assert (stats.num_samples, stats.num_sequences, stats.num_tokens, stats.max_response_len) == (3, 2, 3, 3)


def test_dp_shard_covers_the_batch() -> None:
    b = TensorBatch({"scores": torch.arange(5, dtype=torch.float32)})
    shards = [dp_shard(b, r, 2)["scores"].tolist() for r in range(2)]
    assert shards == [[0.0, 1.0, 2.0], [3.0, 4.0]]


class CharTok:
    eos_token_id = 1
    pad_token_id = 0
    vocab_size = 40

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 44 for c in text]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 44) for i in ids if i > 1)


def test_function_reward_scores_decoded_text_with_extras() -> None:
    tok = CharTok()
    batch = TensorBatch(
        {
            "prompt_ids": torch.tensor([[0, 5], [6, 7]]),
            "prompt_mask": torch.tensor([[False, True], [True, True]]),
            "response_ids": torch.tensor([[8, 9, 1], [8, 0, 0]]),
            "response_mask": torch.tensor([[True, True, True], [True, False, False]]),
        },
        {"answer": ["45", "4"]},
    )
    seen: list[tuple[str, str]] = []

    def exact(prompt: str, response: str, extras: dict[str, object]) -> float:
        seen.append((prompt, response))
        return float(response == extras["answer"])

    scored = FunctionReward(exact, tok).score(batch)  # type: ignore[arg-type]
    assert scored["scores"].tolist() == [1.0, 1.0]
    assert seen == [("1", "45"), ("23", "4")]
    with pytest.raises(RewardError, match="reward function '<lambda>' returned nan for sample 0"):
        FunctionReward(lambda p, r, e: float("nan"), tok).score(batch)
