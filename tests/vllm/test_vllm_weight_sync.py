"""Live weight sync into the vLLM rollout engine: parity after a sync, staleness after a bad one.

One engine (tiny Qwen2 with QKV bias, float32, built through the plugin registry) serves the module.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor
from vllm_testing import (
    KV_CACHE_BYTES,
    MAX_PROMPT,
    MAX_RESPONSE,
    load_state_dict,
    make_prompts,
    reference_log_probs,
    save_variant,
    weight_stream,
)

from verl_conformance.testkit import assert_close
from verl_core import (
    EngineSpec,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    TensorInfo,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSyncError,
    get_rollout_engine,
)
from verl_vllm.rollout import VllmRolloutEngine

PROMPTS = [[4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]
SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=5)
BUCKET = 16 * 1024  # small buckets: many chunks, each reloaded on its own
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def engine(qwen2_path: Path) -> Iterator[VllmRolloutEngine]:
    spec = EngineSpec(
        str(qwen2_path), "rollout", max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESPONSE,
        options={"kv_cache_bytes": KV_CACHE_BYTES, "max_num_seqs": 32},
    )
    eng = get_rollout_engine("vllm", spec)
    assert isinstance(eng, VllmRolloutEngine)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def original(qwen2_path: Path) -> dict[str, Tensor]:
    return load_state_dict(qwen2_path)


@pytest.fixture(scope="module")
def variant(original: dict[str, Tensor], qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Tensor], Path]:
    """Modified weights (every tensor perturbed) and a folder holding them for the reference."""
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    return state, save_variant(qwen2_path, tmp_path_factory.mktemp("variant"), state)


@pytest.fixture
def restore(engine: VllmRolloutEngine, original: dict[str, Tensor]) -> Iterator[None]:
    """Put the folder's weights back after the test, whatever it did."""
    yield
    engine.update_weights(weight_stream(original, next(_versions)))
    assert not engine.stale


@pytest.fixture(scope="module")
def prompts() -> TensorBatch:
    return make_prompts(PROMPTS, [0, 1, 2])


def _assert_matches(engine: VllmRolloutEngine, prompts: TensorBatch, folder: Path) -> TensorBatch:
    out = engine.generate(prompts, SAMPLE)
    assert_close(out["rollout_log_probs"], reference_log_probs(folder, out), dtype="float32",
                 quantity="log_probs", what=f"rollout_log_probs vs reference of {folder.name}")
    return out


@pytest.mark.usefixtures("restore")
def test_sync_makes_log_probs_follow_the_new_weights(
    engine: VllmRolloutEngine, prompts: TensorBatch, qwen2_path: Path, variant: tuple[dict[str, Tensor], Path]
) -> None:
    state, folder = variant
    before = engine.generate(prompts, SAMPLE)
    stream = list(weight_stream(state, version := next(_versions), bucket_bytes=BUCKET))
    assert sum(isinstance(m, WeightChunk) for m in stream) > 5
    engine.update_weights(iter(stream))
    assert engine.weight_version == version and not engine.stale
    out = _assert_matches(engine, prompts, folder)
    assert out.meta.weight_version == version
    # The new numbers are not the old model's: the same tokens score differently under it.
    old_ref = reference_log_probs(qwen2_path, out)
    assert float((out["rollout_log_probs"].double() - old_ref).abs().max()) > 1e-2
    assert not torch.equal(out["response_ids"], before["response_ids"])


def _drop_a_chunk(msgs: list[WeightMessage]) -> list[WeightMessage]:
    chunks = [i for i, m in enumerate(msgs) if isinstance(m, WeightChunk)]
    return msgs[: chunks[2]] + msgs[chunks[2] + 1 :]


def _bad_manifest_shape(msgs: list[WeightMessage]) -> list[WeightMessage]:
    man = msgs[0]
    assert isinstance(man, WeightManifest)
    tensors = dict(man.tensors)
    name = next(iter(tensors))
    tensors[name] = TensorInfo((3, 3), tensors[name].dtype)
    return [WeightManifest(man.version, tensors, man.tied_embeddings), *msgs[1:]]


def _extra_name(msgs: list[WeightMessage]) -> list[WeightMessage]:
    man = msgs[0]
    assert isinstance(man, WeightManifest)
    tensors = {**man.tensors, "model.layers.9.mlp.up_proj.weight": TensorInfo((4, 4), torch.float32)}
    return [WeightManifest(man.version, tensors, man.tied_embeddings), *msgs[1:]]


def _no_commit(msgs: list[WeightMessage]) -> list[WeightMessage]:
    assert isinstance(msgs[-1], WeightCommit)
    return msgs[:-1]


def _late_chunk(transform: Callable[[Tensor], Tensor]) -> Callable[[list[WeightMessage]], list[WeightMessage]]:
    """Corrupt a chunk past the middle, after earlier chunks were already loaded into vLLM."""

    def apply(msgs: list[WeightMessage]) -> list[WeightMessage]:
        chunks = [i for i, m in enumerate(msgs) if isinstance(m, WeightChunk)]
        i = chunks[len(chunks) * 2 // 3]
        chunk = msgs[i]
        assert isinstance(chunk, WeightChunk)
        (name, t), *rest = chunk.tensors
        return [*msgs[:i], WeightChunk(((name, transform(t)), *rest)), *msgs[i + 1 :]]

    return apply


def _wrong_tied_flag(msgs: list[WeightMessage]) -> list[WeightMessage]:
    man = msgs[0]
    assert isinstance(man, WeightManifest)
    return [WeightManifest(man.version, man.tensors, True), *msgs[1:]]


def _sender_crash(msgs: list[WeightMessage]) -> Iterator[WeightMessage]:
    yield from msgs[: len(msgs) // 2]
    raise RuntimeError("sender died")


MALFORMED: dict[str, tuple[Callable[[list[WeightMessage]], object], str]] = {
    "missing_tensor": (_drop_a_chunk, "never sent"),
    "manifest_shape": (_bad_manifest_shape, "receiving model has"),
    "unexpected_name": (_extra_name, "unexpected"),
    "no_commit": (_no_commit, "without a WeightCommit"),
    "late_wrong_dtype": (_late_chunk(lambda t: t.double()), "chunk tensor is"),
    "late_wrong_shape": (_late_chunk(lambda t: t.flatten()), "chunk tensor is"),
    "late_nan": (_late_chunk(lambda t: torch.full_like(t, float("nan"))), "NaN"),
    "tied_flag": (_wrong_tied_flag, "tied_embeddings"),
    "sender_crash": (_sender_crash, "sender died"),
}


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_bad_stream_leaves_engine_stale_until_a_complete_sync(
    engine: VllmRolloutEngine,
    prompts: TensorBatch,
    variant: tuple[dict[str, Tensor], Path],
    kind: str,
) -> None:
    state, folder = variant
    corrupt, message = MALFORMED[kind]
    version_before = engine.weight_version
    msgs = list(weight_stream(state, next(_versions), bucket_bytes=BUCKET))
    with pytest.raises(WeightSyncError, match=message):
        engine.update_weights(corrupt(msgs))  # type: ignore[arg-type]
    assert engine.stale
    assert engine.weight_version == version_before
    with pytest.raises(StaleWeightsError, match="update_weights"):
        engine.generate(prompts, SAMPLE)
    with pytest.raises(StaleWeightsError):  # still refuses: nothing was synced since
        engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=2))
    engine.update_weights(weight_stream(state, version := next(_versions), bucket_bytes=BUCKET))
    assert not engine.stale and engine.weight_version == version
    _assert_matches(engine, prompts, folder)


@pytest.mark.usefixtures("restore")
def test_eos_as_the_first_token(
    engine: VllmRolloutEngine,
    prompts: TensorBatch,
    original: dict[str, Tensor],
    tmp_path: Path,
    qwen2_path: Path,
) -> None:
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    first = int(engine.generate(prompts.index([0]), greedy)["response_ids"][0, 0])
    eos = engine.tokenizer.eos_token_id
    state = dict(original)
    head = state["lm_head.weight"].clone()
    head[eos] = 4 * head[first]  # EOS now out-scores the greedy token wherever that token's logit is > 0
    state["lm_head.weight"] = head
    folder = save_variant(qwen2_path, tmp_path / "eos", state)
    engine.update_weights(weight_stream(state, next(_versions)))
    out = engine.generate(prompts.index([0]), greedy)
    assert out["response_ids"][0].tolist()[:1] == [eos]
    assert out["response_mask"][0].tolist() == [True]
    assert not bool(out["truncated"][0])
    assert_close(out["rollout_log_probs"], reference_log_probs(folder, out), dtype="float32",
                 quantity="log_probs")


def test_generation_after_restoring_matches_the_folder(
    engine: VllmRolloutEngine, prompts: TensorBatch, qwen2_path: Path
) -> None:
    assert not engine.stale
    _assert_matches(engine, prompts, qwen2_path)
