"""verl_core.enginekit.sampling: per-sample seeds, uniform tables and one decode step's sampling."""

from __future__ import annotations

import pytest
import torch

from verl_core import BatchValidationError, SamplingParams, TensorBatch
from verl_core.enginekit.sampling import (
    StaticDecodeLoop,
    StaticDecoders,
    TokenSampler,
    inverse_cdf,
    kept_probs,
    sample_seed,
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
