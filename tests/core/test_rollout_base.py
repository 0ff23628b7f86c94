"""The rollout engine facade (verl_core.enginekit.rollout_base) on a small real engine: a bigram
table sampled with the engine kit's TokenSampler."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch
from torch import Tensor

from verl_core import (
    BatchMeta,
    BatchValidationError,
    ConfigError,
    EngineAsleepError,
    EngineSpec,
    RequestTooLargeError,
    RolloutCapabilities,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    TensorInfo,
    VerlError,
    WeightManifest,
    WeightMessage,
    WeightSyncError,
    apply_weight_stream,
    stream_weights,
)
from verl_core.enginekit.byo import in_memory_spec
from verl_core.enginekit.rollout_base import GenerateLimits, Responses, RolloutEngineBase
from verl_core.enginekit.sampling import TokenSampler, sample_seed, uniform_table

VOCAB, PAD, EOS = 16, 0, 1


class CharTokenizer:
    """Token i is the character chr(ord('a') + i)."""

    eos_token_id = EOS
    pad_token_id = PAD
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class BigramRollout(RolloutEngineBase):
    """The next token's logits are a row of a [vocab, vocab] table, picked by the last token."""

    def __init__(self, spec: EngineSpec, *, min_temperature: float | None = None) -> None:
        self._spec = spec
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))
        self.table[:, EOS] -= 4.0  # responses rarely stop at once
        self.min_temperature = min_temperature
        self.sampled: list[tuple[TensorBatch, list[int]]] = []

    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        return RolloutCapabilities()

    @property
    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer()

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float32

    def log_probs_exact(self, params: SamplingParams) -> bool:
        return True

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        staged: dict[str, Tensor] = {}
        with self._writing_weights():
            manifest = apply_weight_stream(stream, {"table": TensorInfo((VOCAB, VOCAB), torch.float32)},
                                           staged.update)
            self.table = staged["table"].clone()
            self._commit_weights(manifest.version)

    def sleep(self) -> None:
        self._asleep = True

    def wake(self) -> None:
        self._asleep = False

    def _generate_limits(self) -> GenerateLimits:
        return GenerateLimits(vocab_size=VOCAB, device=torch.device("cpu"), logits_vocab=VOCAB,
                              min_temperature=self.min_temperature, temperature_reason="the table's floor")

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        self.sampled.append((rows, seeds))
        uniforms = None if params.greedy else uniform_table(seeds, params.max_new_tokens)
        sampler = TokenSampler(params, PAD, torch.tensor([EOS, *params.stop_token_ids]), uniforms)
        last = rows["prompt_ids"][:, -1]
        alive = torch.ones(rows.batch_size, dtype=torch.bool)
        toks, masks, lps = [], [], []
        for t in range(params.max_new_tokens):
            tok, lp, stopped = sampler.step(self.table[last], t, alive)
            toks.append(tok)
            masks.append(alive.clone())
            lps.append(lp)
            last = tok
            alive = alive & ~stopped
            if not bool(alive.any()):
                break
        return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(lps, 1).float(), alive.clone()


def engine(**kw: float) -> BigramRollout:
    return BigramRollout(in_memory_spec(dtype=torch.float32, device="cpu", max_prompt_len=6, max_response_len=8), **kw)


def prompts(*texts: str, groups: Sequence[int] | None = None) -> TensorBatch:
    tok = CharTokenizer()
    width = max(len(t) for t in texts)
    ids = torch.full((len(texts), width), PAD, dtype=torch.int64)
    mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for i, t in enumerate(texts):
        ids[i, width - len(t):] = torch.tensor(tok.encode(t))
        mask[i, width - len(t):] = True
    gids = torch.tensor(list(groups) if groups is not None else range(len(texts)), dtype=torch.int64)
    return TensorBatch({"prompt_ids": ids, "prompt_mask": mask, "group_ids": gids}, meta=BatchMeta(step=5))


def sync(e: BigramRollout, table: Tensor, version: int) -> list[WeightMessage]:
    manifest = WeightManifest(version, {"table": TensorInfo((VOCAB, VOCAB), torch.float32)})
    return list(stream_weights([("table", table)], manifest, bucket_bytes=1 << 20))


def test_n_expansion_meta_and_response_fields() -> None:
    e = engine()
    batch = prompts("cde", "fg", groups=[7, 3])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, n=3, max_new_tokens=6, seed=11)
    out = e.generate(batch, params)
    assert out.batch_size == 6
    assert out["group_ids"].tolist() == [7, 7, 7, 3, 3, 3]
    assert out["sample_index"].tolist() == [0, 1, 2, 0, 1, 2]
    assert torch.equal(out["prompt_ids"], batch["prompt_ids"].repeat_interleave(3, 0))
    meta = out.meta
    assert (meta.temperature, meta.top_p, meta.top_k, meta.pad_token_id, meta.weight_version, meta.step) == (
        0.7, 0.9, 5, PAD, 0, 5)
    assert out["response_ids"].dtype == torch.int64 and out["rollout_log_probs"].dtype == torch.float32
    assert out["truncated"].shape == (6,)
    # the hook saw the expanded rows and one seed per row from (seed, group id, sample index)
    rows, seeds = e.sampled[-1]
    assert rows.batch_size == 6
    assert seeds == [sample_seed(11, g, i) for g, i in zip([7, 7, 7, 3, 3, 3], [0, 1, 2, 0, 1, 2], strict=True)]


def test_seeded_samples_do_not_depend_on_the_batch() -> None:
    e = engine()
    params = SamplingParams(n=2, max_new_tokens=8, seed=3)
    both = e.generate(prompts("cde", "fg", groups=[7, 3]), params)
    alone = e.generate(prompts("fg", groups=[3]), params)
    width = alone.response_len
    assert torch.equal(both["response_ids"][2:, :width], alone["response_ids"])
    unseeded = e.generate(prompts("fg", groups=[3]), SamplingParams(n=2, max_new_tokens=8))
    assert unseeded.batch_size == 2


def test_response_fields_of_the_input_are_replaced() -> None:
    e = engine()
    first = e.generate(prompts("cde"), SamplingParams(max_new_tokens=4, seed=0))
    again = e.generate(first, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert again.batch_size == 2 and "response_ids" in again
    assert torch.equal(again["response_ids"], e.generate(prompts("cde"), SamplingParams(n=2, max_new_tokens=4,
                                                                                        seed=1))["response_ids"])


def test_empty_batch_never_reaches_the_hook() -> None:
    e = engine()
    out = e.generate(prompts("c").index(slice(0, 0)), SamplingParams(n=4, max_new_tokens=3))
    assert out.batch_size == 0 and out["response_ids"].shape == (0, 0) and out["truncated"].shape == (0,)
    assert out["rollout_log_probs"].dtype == torch.float32 and out["response_mask"].dtype == torch.bool
    assert e.sampled == []


@pytest.mark.parametrize(
    ("make", "params", "error", "match"),
    [
        (lambda: prompts("cde").drop("group_ids"), SamplingParams(), BatchValidationError, "group_ids"),
        (lambda: prompts("cdefghi"), SamplingParams(), BatchValidationError,
         r"prompt of sample 0 has 7 tokens, more than max_prompt_len=6"),
        (lambda: prompts("cde").update(prompt_ids=torch.full((1, 3), VOCAB)), SamplingParams(),
         BatchValidationError, r"ids in \[16, 16\]"),
        (lambda: prompts("cde"), SamplingParams(max_new_tokens=9), ConfigError,
         "max_new_tokens=9 exceeds the engine's max_response_len=8"),
        (lambda: prompts("cde"), SamplingParams(max_new_tokens=2, stop_token_ids=(VOCAB,)), ConfigError,
         r"stop token id 16 is outside the vocabulary \[0, 16\)"),
        (lambda: prompts("cde").index(torch.zeros(2**18, dtype=torch.int64)), SamplingParams(n=65536, max_new_tokens=8),
         RequestTooLargeError, r"262144 prompts x n=65536"),
        (lambda: {"prompt_ids": torch.zeros(1, 1)}, SamplingParams(), BatchValidationError, "must be a TensorBatch"),
        (lambda: prompts("cde"), {"n": 2}, ConfigError, "must be a SamplingParams"),
    ],
    ids=["missing-field", "long-prompt", "id-outside-vocab", "max-new-tokens", "stop-id", "too-large",
         "not-a-batch", "not-params"],
)
def test_bad_requests_are_refused_naming_the_engine(
    make: Callable[[], object], params: object, error: type[Exception], match: str
) -> None:
    e = engine()
    with pytest.raises(error, match=match) as info:
        e.generate(make(), params)  # type: ignore[arg-type]
    assert "BigramRollout.generate" in str(info.value)
    assert e.sampled == []


def test_an_engine_temperature_floor_applies_to_sampling_only() -> None:
    e = engine(min_temperature=0.5)
    with pytest.raises(ConfigError, match=r"the table's floor"):
        e.generate(prompts("cde"), SamplingParams(temperature=0.2, max_new_tokens=2))
    out = e.generate(prompts("cde"), SamplingParams(temperature=0.2, greedy=True, max_new_tokens=2))
    assert out.meta.temperature == 0.2


def test_sleeping_and_closed_engines_refuse() -> None:
    e = engine()
    e.sleep()
    with pytest.raises(EngineAsleepError, match=r"BigramRollout.generate: the engine is asleep; call wake\(\) first"):
        e.generate(prompts("cde"), SamplingParams(max_new_tokens=2))
    assert issubclass(EngineAsleepError, ConfigError) and issubclass(EngineAsleepError, RuntimeError)
    e.wake()
    e.generate(prompts("cde"), SamplingParams(max_new_tokens=2))
    e.close()
    with pytest.raises(VerlError, match="was closed"):
        e.generate(prompts("cde"), SamplingParams(max_new_tokens=2))


def test_a_failed_sync_leaves_the_engine_stale_until_a_complete_one() -> None:
    e = engine()
    new = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5))
    msgs = sync(e, new, 4)
    with pytest.raises(WeightSyncError):
        e.update_weights(msgs[:-1])  # no commit
    assert e.stale and e.weight_version == 0
    with pytest.raises(StaleWeightsError, match=r"BigramRollout.generate: .*the last weight sync failed: .*update_weights"):
        e.generate(prompts("cde"), SamplingParams(max_new_tokens=2))
    e.update_weights(msgs)
    assert (e.stale, e.weight_version) == (False, 4)
    out = e.generate(prompts("cde"), SamplingParams(greedy=True, max_new_tokens=1))
    assert out.meta.weight_version == 4
    assert int(out["response_ids"][0, 0]) == int(new[CharTokenizer().encode("e")[0]].argmax())


def test_an_interrupted_write_is_stale_and_a_write_without_commit_stays_stale() -> None:
    e = engine()
    with pytest.raises(KeyboardInterrupt), e._writing_weights():
        raise KeyboardInterrupt
    with pytest.raises(StaleWeightsError, match="interrupted"):
        e.generate(prompts("cde"), SamplingParams(max_new_tokens=2))
    with e._writing_weights():
        pass
    assert e.stale
    e._commit_weights(2)
    assert (e.stale, e.weight_version) == (False, 2)


class GatedBigram(BigramRollout):
    """The bigram engine whose sampling waits for ``gate`` while it is set up (a generate call in flight)."""

    def __init__(self) -> None:
        super().__init__(in_memory_spec(dtype=torch.float32, device="cpu", max_prompt_len=6, max_response_len=8))
        self.entered = threading.Event()
        self.gate: threading.Event | None = None

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        gate, self.gate = self.gate, None
        if gate is not None:
            self.entered.set()
            assert gate.wait(30), "the test never opened the gate"
        return super()._sample(rows, params, seeds)


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def test_an_update_waits_for_the_generate_in_flight_and_goes_before_later_ones() -> None:
    e = GatedBigram()
    old, new = e.table.clone(), torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5))
    greedy = SamplingParams(greedy=True, max_new_tokens=1)
    gate = e.gate = threading.Event()
    results: dict[str, object] = {}

    def call(name: str, fn: Callable[[], object]) -> threading.Thread:
        t = threading.Thread(target=lambda: results.__setitem__(name, fn()), daemon=True)
        t.start()
        return t

    threads = [call("first", lambda: e.generate(prompts("cde"), greedy))]
    assert e.entered.wait(30)
    threads.append(call("update", lambda: e.update_weights(sync(e, new, 3))))
    _until(lambda: e._turns._writes_waiting == 1, "the update waits for its turn")
    threads.append(call("later", lambda: e.generate(prompts("cde"), greedy)))
    time.sleep(0.05)
    # the update waits for the call in flight, the later call for the update
    assert not e.stale and e.weight_version == 0 and set(results) == set()
    gate.set()
    for t in threads:
        t.join(30)
    first, later = results["first"], results["later"]
    assert isinstance(first, TensorBatch) and isinstance(later, TensorBatch)
    assert first.meta.weight_version == 0 and later.meta.weight_version == 3
    last = CharTokenizer().encode("e")[0]
    assert int(first["response_ids"][0, 0]) == int(old[last].argmax())  # sampled whole from version 0
    assert int(later["response_ids"][0, 0]) == int(new[last].argmax())


def test_weight_paths_nest_on_one_thread() -> None:
    """A weight path that falls back to another inside its own turn does not wait for itself."""
    e = engine()
    new = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5))
    with e._writing_weights():
        e.update_weights(sync(e, new, 2))
    assert not e.stale and e.weight_version == 2
    t = threading.Thread(target=e.generate, args=(prompts("cde"), SamplingParams(max_new_tokens=1)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "generate on another thread still waits after the nested writes ended"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0}, r"GenerateLimits.vocab_size must be an integer >= 1, got 0"),
        ({"device": "no-such-device"}, r"GenerateLimits.device must be a torch.device, got 'no-such-device'"),
        ({"logits_vocab": -1}, r"GenerateLimits.logits_vocab must be an integer >= 0"),
        ({"rows_at_once": 0}, r"GenerateLimits.rows_at_once must be an integer >= 1 or None"),
        ({"min_temperature": float("nan")}, r"GenerateLimits.min_temperature must be a finite number"),
    ],
)
def test_generate_limits_are_checked_when_built(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"vocab_size": VOCAB, "device": torch.device("cpu"), **kwargs}
    with pytest.raises(ConfigError, match=match):
        GenerateLimits(**args)  # type: ignore[arg-type]
