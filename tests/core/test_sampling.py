"""verl_core.enginekit.sampling: per-sample seeds, uniform tables and one decode step's sampling."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from verl_core import BatchValidationError, SamplingParams, TensorBatch
from verl_core.enginekit.sampling import (
    CompiledOrEager,
    StaticDecodeLoop,
    StaticDecoders,
    TokenSampler,
    inverse_cdf,
    kept_probs,
    sample_seed,
    sampling_step,
    uniform_table,
)


def test_seeds_depend_on_seed_group_and_index_only() -> None:
    base = sample_seed(1, 2, 3)
    assert base == sample_seed(1, 2, 3) and 0 <= base < 2**63
    assert len({base, sample_seed(0, 2, 3), sample_seed(1, 3, 3), sample_seed(1, 2, 4)}) == 4


def test_uniform_table_rows_are_one_draw_per_step_of_each_sample_s_generator() -> None:
    seeds = [sample_seed(0, g, 0) for g in range(3)]
    table = uniform_table(seeds, 5)
    for row, s in zip(table, seeds, strict=True):
        g = torch.Generator().manual_seed(s)
        assert torch.equal(row, torch.stack([torch.rand((), generator=g, dtype=torch.float64) for _ in range(5)]))
    assert uniform_table([], 4).shape == (0, 4)


def test_kept_probs_and_inverse_cdf() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)
    assert torch.equal(kept_probs(logits, 0, 1.0), probs)
    assert (kept_probs(logits, 2, 1.0)[0, 2:] == 0).all() and (kept_probs(logits, 2, 1.0)[0, :2] > 0).all()
    nucleus = kept_probs(logits, 0, 0.5)  # the top token alone holds 64% of the mass
    assert (nucleus[0, 1:] == 0).all() and nucleus[0, 0] > 0
    cdf = probs.cumsum(-1)[0]
    for i, u in enumerate([0.0, float(cdf[0]) + 1e-6, float(cdf[1]) + 1e-6, 0.999999]):
        assert int(inverse_cdf(probs, torch.tensor([u]))) == i


def _tied_bf16_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """float32 logits with bfloat16's values: a narrow range, so many tokens tie exactly, at the top too."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 0.05 + 2.0).to(torch.bfloat16).float()


def _ranking(logits: torch.Tensor) -> torch.Tensor:
    """Token ids by logit, largest first, equal logits by id (the tie rule, computed one row at a time)."""
    return torch.stack([torch.tensor(sorted(range(len(r)), key=lambda i: (-float(r[i]), i))) for r in logits])


def test_top_k_keeps_exactly_k_tokens_with_ties_to_the_lowest_id_in_bfloat16() -> None:
    logits = _tied_bf16_logits(64, 100, seed=0)
    top = logits.max(-1, keepdim=True).values
    assert int(((logits == top).sum(-1) > 1).sum()) > 10  # the rows do tie at the top
    ranking = _ranking(logits)
    for k in (1, 2, 5, 37):
        kept = kept_probs(logits, k, 1.0) > 0
        assert kept.sum(-1).tolist() == [k] * 64, f"top_k={k} kept another count of tokens"
        want = torch.zeros_like(kept).scatter(-1, ranking[:, :k], True)
        assert torch.equal(kept, want), f"top_k={k}: the tokens tied with the k-th are not the lowest ids"
    # top_k=1 keeps the greedy token: torch.argmax takes the first (lowest) index among equal maxima
    assert torch.equal((kept_probs(logits, 1, 1.0) > 0).int().argmax(-1), torch.argmax(logits, -1))


def test_nucleus_boundary_inside_a_tie_keeps_the_lower_ids() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.3, 0.3, 0.3]]))  # three tokens tie; 0.5 ends inside the tie
    assert (kept_probs(logits, 0, 0.5) > 0).tolist() == [[False, True, True, False]]
    assert (kept_probs(logits, 0, 1e-6) > 0).tolist() == [[False, True, False, False]]
    assert (kept_probs(logits, 2, 0.99) > 0).tolist() == [[False, True, True, False]]  # top-k, then the nucleus
    logits = _tied_bf16_logits(64, 100, seed=1)
    ranking = _ranking(logits)
    for top_p in (1e-6, 0.05, 0.5):
        kept = kept_probs(logits, 0, top_p) > 0
        # the kept tokens are a prefix of the ranking, whatever the ties
        assert torch.equal(kept.gather(-1, ranking), torch.arange(100) < kept.sum(-1, keepdim=True)), top_p
    assert torch.equal(kept_probs(logits, 0, 1e-6).argmax(-1), torch.argmax(logits, -1))


def test_top_k_one_and_a_tiny_nucleus_sample_the_greedy_token_in_bfloat16() -> None:
    logits = _tied_bf16_logits(32, 100, seed=2)
    alive = torch.ones(32, dtype=torch.bool)
    stops = torch.tensor([0])
    greedy, _, _ = TokenSampler(SamplingParams(greedy=True), 1, stops, None).step(logits, 0, alive)
    g = torch.Generator().manual_seed(3)
    for params in (SamplingParams(top_k=1, temperature=0.7), SamplingParams(top_p=1e-6),
                   SamplingParams(top_k=3, top_p=1e-6, temperature=1.3)):
        for _ in range(4):
            uniforms = torch.rand(32, 1, generator=g, dtype=torch.float64)
            tok, _, _ = TokenSampler(params, 1, stops, uniforms).step(logits, 0, alive)
            assert torch.equal(tok, greedy), params


def test_truncation_ranks_by_the_logits_where_the_temperature_rounds_them_together() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 1.5]])
    # at T = 1e30 the tempered log-probs of every token are equal; top-k still keeps the largest logit
    params = SamplingParams(top_k=1, temperature=1e30)
    tok, _, _ = TokenSampler(params, 0, torch.tensor([9]), torch.tensor([[0.0]], dtype=torch.float64)).step(
        logits, 0, torch.ones(1, dtype=torch.bool))
    assert int(tok) == 2
    logp = torch.log_softmax(logits / 1e30, -1)
    assert (kept_probs(logp, 2, 1.0, ranking=logits) > 0).tolist() == [[False, False, True, True]]


def test_token_sampler_pads_finished_rows_and_flags_stops() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [5.0, 0.0, 0.0]])
    sampler = TokenSampler(SamplingParams(greedy=True), pad=0, stops=torch.tensor([1]), uniforms=None)
    tok, lp, stopped = sampler.step(logits, 0, torch.tensor([True, False]))
    assert tok.tolist() == [1, 0] and stopped.tolist() == [True, False]
    assert float(lp[1]) == 0.0 and float(lp[0]) == float(torch.log_softmax(logits[0], -1)[1])


def test_static_prompt_width_rounds_up_and_pad_prompts_left_pads() -> None:
    from verl_core import BatchMeta, TensorBatch
    from verl_core.enginekit.sampling import PROMPT_WIDTH_MULTIPLE, static_prompt_width

    m = PROMPT_WIDTH_MULTIPLE
    assert [static_prompt_width(w) for w in (0, 1, m, m + 1)] == [m, m, m, 2 * m]
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = ids != 0
    b = TensorBatch({"prompt_ids": ids, "prompt_mask": mask, "group_ids": torch.arange(2)},
                    meta=BatchMeta(pad_token_id=0))
    wide = b.pad_prompts(6)
    assert wide["prompt_ids"].tolist() == [[0, 0, 0, 5, 6, 7], [0, 0, 0, 0, 8, 9]]
    assert wide["prompt_mask"].tolist() == [[False] * 3 + [True] * 3, [False] * 4 + [True] * 2]
    assert torch.equal(wide.trim()["prompt_ids"], ids) and b.pad_prompts(3) is b
    with pytest.raises(BatchValidationError, match="already 3 wide"):
        b.pad_prompts(2)


class _CountingLoop(StaticDecodeLoop):
    """A decode loop whose logits are the model's bias at every step; counts closes."""

    closed = 0

    def _prefill(self, chunk: TensorBatch) -> torch.Tensor:
        return self.model.bias.expand(self.out_tok.shape[0], -1).float()

    def _advance(self) -> torch.Tensor:
        return self.model.bias.expand(self.out_tok.shape[0], -1).float()

    def close(self) -> None:
        _CountingLoop.closed += 1
        super().close()


def test_static_decoders_reuse_a_decoder_while_shape_sampling_and_parameters_repeat() -> None:
    model = torch.nn.Linear(1, 5)
    decoders: StaticDecoders[_CountingLoop] = StaticDecoders()
    built: list[_CountingLoop] = []

    def build(sampler: TokenSampler) -> _CountingLoop:
        built.append(_CountingLoop(2, 3, sampler, torch.device("cpu"), model, "test"))
        return built[-1]

    params = SamplingParams(max_new_tokens=3, seed=1)
    uniforms = uniform_table([1, 2], 3)

    def get(p: SamplingParams = params, rows: int = 2, width: int = 32) -> _CountingLoop:
        return decoders.get(model, rows, width, p, [4], uniforms, 0, torch.device("cpu"), build)

    first = get()
    assert get() is first and len(built) == 1
    assert first.sampler.uniforms is not None and first.sampler.uniforms is not uniforms  # start() refills a copy
    assert get(width=64) is not first and _CountingLoop.closed == 1  # the old one closed before the new one
    assert get(SamplingParams(max_new_tokens=3, seed=1, top_k=2)) is built[-1] and len(built) == 3
    again = get(SamplingParams(max_new_tokens=3, seed=1, top_k=2))
    assert again is built[-1] and len(built) == 3
    with torch.no_grad():
        model.weight.data = model.weight.data.clone()  # the parameters moved: a graph would read stale memory
    assert get(SamplingParams(max_new_tokens=3, seed=1, top_k=2)) is not again and len(built) == 4
    assert decoders.current is built[-1]
    decoders.clear()
    assert _CountingLoop.closed == 4 and decoders.current is None


@pytest.mark.parametrize("vocab", [5, 256, 300, 4099])
def test_inverse_cdf_in_blocks_picks_what_one_full_row_cdf_picks(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(3 * torch.randn(200, vocab, generator=g), -1)
    probs[:, 1::3] = 0.0  # zero-probability tokens (top-k / nucleus cut) are never chosen
    u = torch.rand(200, generator=g, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 0.5, 1.0 - 2**-40], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    got = inverse_cdf(probs, u)
    assert torch.equal(got, want)
    assert (probs.gather(-1, got.unsqueeze(-1)) > 0).all()


def _sampling_inputs(rows: int = 6, vocab: int = 700) -> tuple[SamplingParams, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=5, seed=0)
    logits = torch.randn(rows, vocab, generator=g) * 3
    uniforms = torch.rand(rows, 5, generator=g, dtype=torch.float64)
    alive = torch.tensor([True, True, False, True, True, True])[:rows]
    return params, logits, uniforms, alive, torch.tensor([5, 9])


def test_a_compiled_sampling_step_draws_what_the_eager_step_draws() -> None:
    """The compiled step (aot_eager here: inductor's CPU code generation takes minutes; the CUDA
    path is timed by benchmarks/gpu/profile_decode.py) traces the same operations the eager one runs."""
    params, logits, uniforms, alive, stops = _sampling_inputs()
    t = torch.tensor([2])
    compiled = torch.compile(sampling_step, dynamic=False, backend="aot_eager")
    got = compiled(params, 0, stops, uniforms, logits, t, alive)
    want = TokenSampler(params, 0, stops, uniforms).step(logits, 2, alive)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_step_that_fails_to_compile_runs_eagerly_after_one_warning() -> None:
    import torch._dynamo.exc as dynamo_exc

    calls: list[str] = []

    def cannot_compile(*args: object, **kwargs: object) -> None:
        calls.append("compiled")
        raise dynamo_exc.TorchDynamoException("inductor cannot lower this")

    params, logits, uniforms, alive, stops = _sampling_inputs()
    want = TokenSampler(params, 0, stops, uniforms).step(logits, 2, alive)
    step = CompiledOrEager(sampling_step, "token sampling", cannot_compile)
    t = torch.tensor([2])
    with pytest.warns(RuntimeWarning, match="token sampling: .*inductor cannot lower this.*runs eagerly"):
        got = step(params, 0, stops, uniforms, logits, t, alive)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert step.error == "TorchDynamoException: inductor cannot lower this"
    again = step(params, 0, stops, uniforms, logits, t, alive)  # no second try, no second warning
    assert calls == ["compiled"] and torch.equal(again[0], want[0])


def test_other_errors_of_a_compiled_step_propagate() -> None:
    def broken(*args: object) -> None:
        raise ValueError("a real bug")

    step = CompiledOrEager(sampling_step, "token sampling", broken)
    with pytest.raises(ValueError, match="a real bug"):
        step()
    assert step.error is None


def test_a_compiled_sampler_samples_through_the_process_wide_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_core.enginekit import sampling

    seen: list[object] = []

    def record(*args: object) -> tuple[Tensor, Tensor, Tensor]:
        seen.append(args[5])
        return sampling_step(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "compiled_sampling_step", lambda: record)
    params, logits, uniforms, alive, stops = _sampling_inputs()
    sampler = TokenSampler(params, 0, stops, uniforms, compiled=True)
    sampler.step(logits, 0, alive)  # a host step index (a prefill's first sample): eager
    t = torch.tensor([2])
    sampler.step(logits, t, alive)
    assert seen == [t]
