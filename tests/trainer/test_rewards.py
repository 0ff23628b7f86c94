"""User reward functions: loading by module or file path, aligned columns, weights, every error."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_conformance.testkit import TinyModelSpec, tiny_model
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.errors import ConfigError, RewardError
from verl_core.kernel.reward import RewardEngine
from verl_core.trainer.inputs.data import PromptDataset, PromptLoader
from verl_core.trainer.inputs.reward_functions import (
    exact_match,
    extract_answer,
    format_match,
    numeric_match,
    regex_reward,
)
from verl_core.trainer.inputs.rewards import (
    FunctionReward,
    RewardFunctions,
    RewardFunctionsConfig,
    load_function,
)
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

BUILTINS = "verl_core.trainer.inputs.reward_functions"


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return load_tokenizer(tiny_model(TinyModelSpec(vocab_size=96, tied=True)))


def with_responses(batch: TensorBatch, texts: Sequence[str], tok: HFTokenizer) -> TensorBatch:
    """``batch`` with right-padded responses: each text's ids then EOS."""
    encoded = [[*tok.encode(t), tok.eos_token_id] for t in texts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tok.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(encoded), width), dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = True
    return batch.update(response_ids=ids, response_mask=mask)


def scored_batch(tok: HFTokenizer, completions: Sequence[str], **columns: Sequence[Any]) -> TensorBatch:
    """One prompt per completion ("p<i>"), with the given columns as extras."""
    ds = PromptDataset([f"p{i}" for i in range(len(completions))], columns, tok)
    return with_responses(ds.to_batch(range(len(completions)), group_ids=range(len(completions))), completions, tok)


def test_columns_arrive_aligned_with_shuffled_prompts_and_n_samples(tok: HFTokenizer, tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "idx": i, "answer": f"a{i}"} for i in range(9)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loader = PromptLoader(PromptDataset.load(str(path), tok, cache_dir=str(tmp_path / "cache")), seed=5)
    loader.batch(0, 4)
    prompts = loader.batch(1, 4)  # rows 4..7 of the shuffled order
    n = 3
    samples = prompts.repeat_interleave(n)  # what the rollout facade does with n samples per prompt
    # each completion is derived from the decoded prompt text, not from the columns
    decoded = [tok.decode([t for t, m in zip(r, k) if m]) for r, k in
               zip(samples["prompt_ids"].tolist(), samples["prompt_mask"].tolist())]
    samples = with_responses(samples, [f"a{p[1:]}" if j % 2 == 0 else "wrong" for j, p in enumerate(decoded)], tok)
    seen: dict[str, Any] = {}

    def aligned(prompts: list[str], completions: list[str], idx: list[int], answer: list[str], **kwargs: Any) -> list[float]:
        seen.update(prompts=prompts, idx=idx, kwargs=kwargs)
        for p, c, i, a in zip(prompts, completions, idx, answer, strict=True):
            assert p == f"q{i}" and a == f"a{i}" and c in (a, "wrong")
        return [float(i) for i in idx]

    engine = RewardFunctions([aligned, f"{BUILTINS}:exact_match"], tok, weights=[0.5, 2.0])
    out = engine.score(samples)
    idx = list(samples.extras["idx"])
    assert seen["idx"] == idx and len(idx) == 4 * n
    assert idx[0] == idx[1] == idx[2] and idx != sorted(idx)  # n repeats, shuffled prompts
    assert set(seen["kwargs"]) == {"completion_ids", "truncated"}  # group ids and other tensors are not columns
    match = [1.0 if j % 2 == 0 else 0.0 for j in range(len(idx))]
    assert out["scores"].tolist() == pytest.approx([0.5 * i + 2.0 * m for i, m in zip(idx, match)])
    assert out.extras["reward/aligned"] == tuple(float(i) for i in idx)
    assert out.extras["reward/exact_match"] == tuple(match)
    metrics = RewardFunctions.metrics(out)
    assert metrics == {"reward/aligned/mean": pytest.approx(sum(idx) / len(idx)),
                       "reward/exact_match/mean": pytest.approx(sum(match) / len(match))}
    assert engine.names == ["aligned", "exact_match"]


def test_functions_get_only_the_keywords_they_name(tok: HFTokenizer) -> None:
    got: list[set[str]] = []

    def few(completions: list[str], answer: list[str]) -> list[float]:
        got.append({"completions", "answer"})
        return [1.0] * len(completions)

    def kw_only(*, prompts: list[str], completions: list[str], **rest: Any) -> list[float]:
        got.append({"prompts", "completions", *rest})
        return [0.0] * len(completions)

    batch = scored_batch(tok, ["x", "y"], answer=["x", "z"], pattern=["x", "y"])
    RewardFunctions([few, kw_only], tok, columns=["answer", "pattern"]).score(batch)
    assert got == [{"completions", "answer"},
                   {"prompts", "completions", "completion_ids", "truncated", "answer", "pattern"}]


def test_functions_see_response_ids_and_truncation(tok: HFTokenizer) -> None:
    """The decoded completion drops EOS: completion_ids and truncated tell a finished "7" from a cut one."""
    seen: dict[str, Any] = {}

    def finished(completions: list[str], completion_ids: list[list[int]], truncated: list[bool]) -> list[float]:
        seen.update(completions=completions, completion_ids=completion_ids, truncated=truncated)
        return [0.0 if t else 1.0 for t in truncated]

    batch = scored_batch(tok, ["7", "7"])  # both responses end with EOS
    seven, eos = tok.encode("7")[0], tok.eos_token_id
    engine = RewardFunctions([finished], tok)
    assert engine.score(batch)["scores"].tolist() == [1.0, 1.0]  # no truncated field: EOS decides
    assert seen == {"completions": ["7", "7"], "completion_ids": [[seven, eos], [seven, eos]],
                    "truncated": [False, False]}
    cut = batch.update(response_mask=torch.tensor([[True, True], [True, False]]),
                       truncated=torch.tensor([False, True]))
    assert engine.score(cut)["scores"].tolist() == [1.0, 0.0]
    assert seen["completions"] == ["7", "7"] and seen["completion_ids"] == [[seven, eos], [seven]]


def test_by_module_path_and_by_file_path(tok: HFTokenizer, tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "from verl_core.trainer.inputs.reward_functions import regex_reward\n"
        "def length(prompts, completions, **kwargs):\n"
        "    return [len(c) for c in completions]\n"
        "x_number = regex_reward(r'x \\d+', name='x_number')\n"
    )
    batch = scored_batch(tok, ["12", "x 7"], answer=["12", "7"])
    cfg = RewardFunctionsConfig(
        functions=[f"{BUILTINS}:exact_match", f"{BUILTINS}:numeric_match", "my_rewards.py:length",
                   f"{tmp_path / 'my_rewards.py'}:x_number"],
        weights=[1.0, 10.0, 0.0, 100.0],
    )
    engine = RewardFunctions.from_config(cfg, tok, base_dir=tmp_path, columns=["answer"])
    out = engine.score(batch)
    assert out["scores"].tolist() == [11.0, 110.0]
    assert out.extras["reward/length"] == (2.0, 3.0)
    assert engine.names == ["exact_match", "numeric_match", "length", "x_number"]
    assert load_function("my_rewards.py:length", base_dir=tmp_path) is load_function(f"{tmp_path}/my_rewards.py:length")


def test_reward_model_scores_combine_by_weight(tok: HFTokenizer) -> None:
    # a rule-based engine as the extra score source: any RewardEngine is combined the same way
    model = FunctionReward(lambda prompt, response, extras: float(len(response)), tok)
    batch = scored_batch(tok, ["ab", "abcd"], answer=["ab", "x"])
    engine = RewardFunctions.from_config(
        RewardFunctionsConfig(functions=[f"{BUILTINS}:exact_match"], weights=[3.0], model_weight=0.5), tok, model=model
    )
    out = engine.score(batch)
    assert out["scores"].tolist() == [3.0 + 1.0, 0.0 + 2.0]
    assert RewardFunctions.metrics(out)["reward/model/mean"] == 3.0
    assert engine.names == ["exact_match", "model"]
    only_model = RewardFunctions([], tok, model=model, model_weight=2.0)
    assert only_model.score(batch)["scores"].tolist() == [4.0, 8.0]


class _DenseModel(RewardEngine):
    """A reward model giving a sequence score (the response length) and per-token scores (1 per real token)."""

    @property
    def capabilities(self) -> RewardCapabilities:
        return RewardCapabilities(token_scores=True)

    def score(self, batch: TensorBatch) -> TensorBatch:
        mask = batch["response_mask"]
        return batch.update(scores=mask.sum(1).float(), token_scores=mask.float())


class _NoDecode:
    """A tokenizer that refuses to decode: a reward model alone needs no text."""

    eos_token_id, pad_token_id, vocab_size = 1, 0, 96

    def encode(self, text: str) -> list[int]:
        raise AssertionError("nothing is encoded")

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        raise AssertionError("a reward model alone is scored without decoding")


def test_a_reward_model_alone_is_weighted_and_passes_its_token_scores_on(tok: HFTokenizer) -> None:
    batch = scored_batch(tok, ["ab", "abcd"], answer=["ab", "x"])
    lengths = [3.0, 5.0]  # the texts and EOS
    alone = RewardFunctions.from_config(RewardFunctionsConfig(model_weight=-0.5), _NoDecode(),
                                        model=_DenseModel())
    assert alone.capabilities.token_scores and not alone.capabilities.needs_text
    out = alone.score(batch)
    assert out["scores"].tolist() == [-0.5 * v for v in lengths]
    assert torch.equal(out["token_scores"], -0.5 * batch["response_mask"].float())
    assert RewardFunctions.metrics(out) == {"reward/model/mean": 4.0}  # the model's own score, before the weight
    # beside functions the sequence scores add up and the token scores are dropped
    both = RewardFunctions.from_config(RewardFunctionsConfig(functions=[f"{BUILTINS}:exact_match"], model_weight=2.0),
                                       tok, model=_DenseModel())
    scored = both.score(batch)
    assert scored["scores"].tolist() == [1.0 + 2 * 3.0, 2 * 5.0] and "token_scores" not in scored
    assert not both.capabilities.token_scores


@pytest.mark.parametrize(("returned", "message"), [
    ("raise", r"reward function 'bad' raised KeyError: 'nope' \(scoring 3 samples"),
    ([1.0, 2.0], r"reward function 'bad' returned 2 values for 3 completions"),
    ([1.0, math.nan, 0.0], r"reward function 'bad' returned nan for sample 1; rewards must be finite"),
    ([1.0, 0.0, math.inf], r"reward function 'bad' returned inf for sample 2"),
    ([1.0, "1", 0.0], r"reward function 'bad' returned '1' \(str\) for sample 1; expected a number"),
    ([None, 1.0, 0.0], r"reward function 'bad' returned None \(NoneType\) for sample 0"),
    (1.0, r"reward function 'bad' returned float; expected a list of 3 numbers"),
])
def test_bad_results_raise_reward_error_naming_function_and_sample(tok: HFTokenizer, returned: Any, message: str) -> None:
    def bad(prompts: list[str], completions: list[str], **kwargs: Any) -> Any:
        if returned == "raise":
            raise KeyError("nope")
        return returned

    with pytest.raises(RewardError, match=message):
        RewardFunctions([bad], tok).score(scored_batch(tok, ["a", "b", "c"]))


def test_tensor_results_and_overflowing_sums(tok: HFTokenizer) -> None:
    batch = scored_batch(tok, ["a", "b"])
    out = RewardFunctions([lambda completions, **kw: torch.tensor([1.0, 2.0])], tok).score(batch)
    assert out["scores"].tolist() == [1.0, 2.0]
    with pytest.raises(RewardError, match="the weighted reward of sample 0 is inf"):
        RewardFunctions([lambda completions, **kw: [1e308, 0.0]] * 2, tok, weights=[10.0, 10.0]).score(batch)


def test_construction_errors_are_config_errors(tok: HFTokenizer, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "consts.py").write_text("THRESHOLD = 3\n")
    cases = {
        "no_such_module_xyz:fn": r"cannot import module 'no_such_module_xyz' \(ModuleNotFoundError",
        f"{BUILTINS}:nope": rf"'{BUILTINS}' has no attribute 'nope'; its public callables: .*exact_match",
        "missing.py:fn": r"the file '.*missing.py' does not exist",
        "broken.py:fn": r"running '.*broken.py' raised RuntimeError: boom at import",
        "consts.py:THRESHOLD": r"'consts.py:THRESHOLD' is a int, not a callable",
        "no-colon": r"is not 'package.module:attr' or 'path/to/file.py:attr'",
        "mod:": r"'mod:' is not 'package.module:attr'",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            RewardFunctions([spec], tok, base_dir=tmp_path)


def test_signatures_that_cannot_be_called_are_refused(tok: HFTokenizer) -> None:
    def positional_only(completions: list[str], /) -> list[float]:
        return []

    def no_completions(prompts: list[str]) -> list[float]:
        return []

    def needs_label(completions: list[str], label: list[str]) -> list[float]:
        return []

    with pytest.raises(ConfigError, match=r"'.*positional_only' has positional-only parameters \['completions'\]"):
        RewardFunctions([positional_only], tok)
    with pytest.raises(ConfigError, match=r"cannot take the keyword 'completions'; expected fn\(prompts, completions, \*\*columns\)"):
        RewardFunctions([no_completions], tok)
    with pytest.raises(ConfigError, match=r"requires \['label'\], which are neither .* dataset columns \(answer\)"):
        RewardFunctions([needs_label], tok, columns=["answer"])
    RewardFunctions([needs_label], tok, columns=["label"])  # fine when the dataset has the column
    with pytest.raises(ConfigError, match="3 reward weights for 1 reward functions"):
        RewardFunctions([needs_label], tok, weights=[1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="at least one reward function or a reward model"):
        RewardFunctions([], tok)
    with pytest.raises(ConfigError, match="not a callable"):
        RewardFunctions([42], tok)  # type: ignore[list-item]


def test_config_checks_weights_and_specs() -> None:
    assert RewardFunctionsConfig(functions=["a:b", "c.py:d"]).resolved_weights() == [1.0, 1.0]
    with pytest.raises(ConfigError, match="reward.weights has 1 values for 2 reward.functions"):
        RewardFunctionsConfig(functions=["a:b", "c:d"], weights=[1.0])
    with pytest.raises(ConfigError, match=r"config key 'reward.weights\[0\]': expected a finite number, got nan"):
        RewardFunctionsConfig(functions=["a:b"], weights=[math.nan])
    with pytest.raises(ConfigError, match="is not 'package.module:attr'"):
        RewardFunctionsConfig(functions=["ab"])


def test_duplicate_names_get_suffixes(tok: HFTokenizer) -> None:
    engine = RewardFunctions([f"{BUILTINS}:exact_match", exact_match, lambda completions, **kw: [0.0] * len(completions)], tok)
    assert engine.names == ["exact_match", "exact_match_2", "<lambda>"]


def test_builtin_functions() -> None:
    assert exact_match([" 42\n", "42.0"], answer=[42, "42"]) == [1.0, 0.0]
    completions = [
        "so the answer is \\boxed{1,234}.", "2 apples then 3", "\\boxed{\\frac{1}{2}} no", "x = 0.5", "3/4",
        "\\boxed{7} and finally 8", "no number",
    ]
    assert numeric_match(completions, answer=["1234", 3, "0.5", "#### 0.5", 0.75, "7", "1"]) == [
        1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0,
    ]
    assert extract_answer("\\boxed{a{b}c 12} 5") == 12.0
    assert extract_answer("-3.5 degrees") == -3.5
    assert format_match(["<t>x</t> 1", "1"], pattern=["<t>.*</t>.*", "<t>.*"]) == [1.0, 0.0]
    fmt = regex_reward(r"\d+", name="digits")
    assert fmt.__name__ == "digits" and fmt(completions=[" 12 ", "1a"]) == [1.0, 0.0]


def test_numeric_match_without_a_number_in_the_answer(tok: HFTokenizer) -> None:
    batch = scored_batch(tok, ["1", "2"], answer=["1", "n/a"])
    with pytest.raises(RewardError, match=r"'numeric_match' raised ValueError: the answer 'n/a' of sample 1 holds no number"):
        RewardFunctions([f"{BUILTINS}:numeric_match"], tok).score(batch)


def test_a_function_that_edits_its_inputs_changes_nothing_the_next_one_gets(tok: HFTokenizer) -> None:
    """Each function gets lists of its own: in-place edits of completions, ids or columns stay with it."""
    batch = scored_batch(tok, ["ab", "cd", "ab"], answer=["ab", "x", "y"], meta=[{"k": [1]}, {"k": [2]}, {"k": [3]}])
    seen: list[dict[str, Any]] = []

    def vandal(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
               answer: list[str], meta: list[dict[str, Any]], **kwargs: Any) -> list[float]:
        score = [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]
        completions[0] = "vandalised"
        completions.append("extra")
        prompts.clear()
        completion_ids[0].append(999)
        answer[:] = ["cd"] * len(answer)
        meta[1]["k"].append("x")
        return score

    def witness(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                answer: list[str], meta: list[dict[str, Any]], **kwargs: Any) -> list[float]:
        seen.append({"prompts": list(prompts), "completions": list(completions), "ids": [list(i) for i in completion_ids],
                     "answer": list(answer), "meta": [dict(m) for m in meta]})
        return exact_match(completions, answer)

    out = RewardFunctions([vandal, witness], tok).score(batch)
    assert seen == [{
        "prompts": ["p0", "p1", "p2"], "completions": ["ab", "cd", "ab"],
        "ids": [[*tok.encode(t), tok.eos_token_id] for t in ("ab", "cd", "ab")],
        "answer": ["ab", "x", "y"], "meta": [{"k": [1]}, {"k": [2]}, {"k": [3]}],
    }]
    assert list(out.extras["reward/vandal"]) == list(out.extras["reward/witness"]) == [1.0, 0.0, 0.0]
    assert out["scores"].tolist() == [2.0, 0.0, 0.0]
    assert list(batch.extras["answer"]) == ["ab", "x", "y"] and batch.extras["meta"][1] == {"k": [2]}  # the batch too


def test_completion_ids_are_the_masked_tokens_of_each_row_holes_included(tok: HFTokenizer) -> None:
    """A response mask with holes (a multi-turn episode's tool output) and rows with no token: each
    row's ``completion_ids`` and text are its tokens where the mask is True, in order."""
    batch = scored_batch(tok, ["abcd", "ef", "ghij"])
    ids, mask = batch["response_ids"], batch["response_mask"].clone()
    mask[0, 1] = False  # a hole
    mask[1, :] = False  # no token at all
    mask[2, 0] = False
    batch = batch.update(response_mask=mask, truncated=torch.tensor([True, True, True]))
    seen: dict[str, Any] = {}

    def record(completions: list[str], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        seen.update(ids=completion_ids, texts=completions)
        return [0.0] * len(completions)

    RewardFunctions([record], tok).score(batch)
    expected = [[int(t) for t, m in zip(r, k) if m] for r, k in zip(ids.tolist(), mask.tolist())]
    assert seen["ids"] == expected and expected[1] == [] and len(expected[0]) == int(mask[0].sum()) > 0
    assert seen["texts"] == [tok.decode(e) for e in expected] and seen["texts"][0] == "acd"
