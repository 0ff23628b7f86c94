"""EOS, stop tokens and truncation: what a response looks like when it ends, on a model that ends where told.

A random tiny model almost never emits EOS, so these checks generate with the test kit's EOS model
(:func:`verl_conformance.testkit.eos_model`), whose continuation of each prompt is known: EOS after
three tokens, EOS first, never EOS, EOS exactly as the last allowed token, and the limit one token
before EOS; with stop tokens, a stop token first, mid-response and as the last allowed token. On a
copy of it (and of the tiny Llama) whose ``config.json`` and ``generation_config.json`` list further
EOS ids and set sampling defaults, a rollout follows the tokenizer's EOS and ``SamplingParams`` alone.
"""

from __future__ import annotations

import torch

from verl_conformance.checks._registry import check
from verl_conformance.checks.schema import _valid
from verl_conformance.harness import Harness
from verl_conformance.reference import cached_outputs
from verl_conformance.testkit import eos_model_continuation
from verl_conformance.testkit.crafted import (
    EOS_AFTER_3,
    EOS_FIRST,
    EOS_LADDER_END,
    EOS_LADDER_START,
    FOLDER_EOS_LISTS,
    GENERATION_DEFAULTS,
    NEVER_EOS,
)
from verl_core import BatchMeta, SamplingParams, TensorBatch

_LIMIT = 6  # max_new_tokens of every call
_LAST_TOKENS = (
    EOS_AFTER_3,                    # EOS as token 3
    EOS_FIRST,                      # EOS as token 1
    NEVER_EOS,                      # the limit, no EOS: truncated
    EOS_LADDER_END + 1 - _LIMIT,    # EOS as token 6, the last allowed one: not truncated
    EOS_LADDER_END - _LIMIT,        # 6 tokens, EOS would be the 7th: truncated
)


_STOPS = (11, 46)  # stop tokens that are not EOS
_STOP_LAST_TOKENS = (
    EOS_AFTER_3,                    # the stop token 11 as token 1
    EOS_FIRST,                      # EOS as token 1: EOS still ends a response when stop tokens are given
    EOS_LADDER_START,               # 41 .. 46: the stop token 46 as token 6, the last allowed one: not truncated
    EOS_LADDER_START + 3,           # 44, 45, 46: the stop token mid-way
    EOS_LADDER_END - 4,             # 57 .. 60, EOS: EOS as token 5, with stop tokens given
    NEVER_EOS,                      # the limit, no EOS or stop token: truncated
)


def _prompts(last_tokens: tuple[int, ...] = _LAST_TOKENS) -> TensorBatch:
    """Prompts ending in ``last_tokens``, of different lengths (left-padded)."""
    g = torch.Generator().manual_seed(80)
    lengths = [3, 1, 7, 5, 2, 4][: len(last_tokens)]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, (n, last) in enumerate(zip(lengths, last_tokens, strict=True)):
        row = torch.randint(4, 128, (n,), generator=g)
        row[-1] = last
        ids[i, width - n:] = row
        mask[i, width - n:] = True
    return TensorBatch({"prompt_ids": ids, "prompt_mask": mask, "group_ids": torch.arange(len(lengths))},
                       meta=BatchMeta(pad_token_id=0))


def _generations(h: Harness) -> list[tuple[str, TensorBatch, int]]:
    """(label, output, samples per prompt) of greedy and of seeded sampling (n=2) on the EOS model."""
    engine = h.rollout("eos")
    eos = engine.tokenizer.eos_token_id
    if eos != 1:
        h.fail(f"the EOS model's tokenizer has EOS id 1; the engine's tokenizer says {eos}")
    prompts = _prompts()
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=_LIMIT))
    sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=_LIMIT, n=2, seed=3))
    return [("greedy", greedy, 1), ("sampling at T=1, n=2", sampled, 2)]


def _row(out: TensorBatch, b: int) -> str:
    return (f"response_ids {out['response_ids'][b].tolist()}, response_mask "
            f"{out['response_mask'][b].int().tolist()}, truncated {bool(out['truncated'][b])}")


@check("schema")
def check_eos_ends_response(h: Harness) -> None:
    """On a model that emits EOS at known steps, the EOS is the response's last real token (mask True), even as the first token; after it only padding (mask False, pad id, log-prob 0)."""
    tok = h.rollout("eos").tokenizer
    pad, eos = tok.pad_token_id, tok.eos_token_id
    for label, out, n in _generations(h):
        _valid(h, out, f"generate ({label}) on the EOS model")
        mask, ids, lp = out["response_mask"], out["response_ids"], out["rollout_log_probs"]
        for b in range(out.batch_size):
            last = _LAST_TOKENS[b // n]
            want, _ = eos_model_continuation(last, _LIMIT)
            where = f"{label}, sample {b} (the EOS model continues its prompt with {want})"
            real = ids[b][mask[b]].tolist()
            if want[-1] == eos and real == want[:-1]:
                h.fail(f"{where}: the EOS that ends the response is left out of the response; it is a generated "
                       f"token and must be in response_ids with response_mask True (and trained on). "
                       f"Got {_row(out, b)}")
            h.expect(real == want and bool(mask[b, : len(want)].all()),
                     f"{where}: expected exactly those tokens as the real response, got {_row(out, b)}")
            rest = slice(len(want), None)
            h.expect(not bool(mask[b, rest].any()) and bool((ids[b, rest] == pad).all()),
                     f"{where}: after the response ends only padding may follow (mask False, pad id {pad}); "
                     f"got {_row(out, b)}")
            h.expect(bool((lp[b, rest] == 0).all()), f"{where}: rollout_log_probs must be 0 after the response ends")


@check("schema")
def check_truncated_flag(h: Harness) -> None:
    """truncated is True exactly when max_new_tokens is reached without EOS: EOS as the last allowed token is not truncated."""
    for label, out, n in _generations(h):
        for b in range(out.batch_size):
            want, want_trunc = eos_model_continuation(_LAST_TOKENS[b // n], _LIMIT)
            got = bool(out["truncated"][b])
            if got != want_trunc:
                why = ("it reached max_new_tokens without EOS" if want_trunc else
                       "its last allowed token is EOS, so it ended, it was not cut" if len(want) == _LIMIT else
                       "it ended with EOS before the limit")
                h.fail(f"{label}, sample {b}: truncated={got}, expected {want_trunc}: {why} "
                       f"(continuation {want}, max_new_tokens {_LIMIT}); got {_row(out, b)}")


@check("schema", gates=("rollout.stop_token_ids",))
def check_stop_tokens_end_response(h: Harness) -> None:
    """With stop_token_ids on the EOS model, a stop token ends the response as its last real token (mask True, truncated False), also first or as the last allowed token; EOS still ends it; a response cut at max_new_tokens has truncated=True and no stop token."""
    engine = h.rollout("eos")
    if not engine.capabilities.stop_token_ids:
        h.skip("backend declares stop_token_ids=False")
    pad = engine.tokenizer.pad_token_id
    prompts = _prompts(_STOP_LAST_TOKENS)
    runs = [("greedy", SamplingParams(greedy=True, max_new_tokens=_LIMIT, stop_token_ids=_STOPS), 1),
            ("sampling at T=1, n=2", SamplingParams(temperature=1.0, max_new_tokens=_LIMIT, n=2, seed=4,
                                                    stop_token_ids=_STOPS), 2)]
    for label, params, n in runs:
        out = engine.generate(prompts, params)
        where = f"generate ({label}, stop_token_ids={_STOPS}) on the EOS model"
        _valid(h, out, where)
        mask, ids = out["response_mask"], out["response_ids"]
        for b in range(out.batch_size):
            want, want_trunc = eos_model_continuation(_STOP_LAST_TOKENS[b // n], _LIMIT, _STOPS)
            at = f"{where}, sample {b} (the model continues its prompt with {want})"
            real = ids[b][mask[b]].tolist()
            h.expect(real == want and bool(mask[b, : len(want)].all()),
                     f"{at}: expected exactly those tokens as the real response (a stop token or EOS ends it and "
                     f"is its last real token, mask True; EOS ends it also when stop tokens are given), got "
                     f"{_row(out, b)}")
            rest = slice(len(want), None)
            h.expect(not bool(mask[b, rest].any()) and bool((ids[b, rest] == pad).all()),
                     f"{at}: after the response ends only padding may follow (mask False, pad id {pad}); got "
                     f"{_row(out, b)}")
            h.expect(bool(out["truncated"][b]) == want_trunc,
                     f"{at}: truncated={bool(out['truncated'][b])}, expected {want_trunc} ("
                     + ("max_new_tokens reached without EOS or a stop token" if want_trunc else
                        "it ended with a stop token or EOS, the last allowed one included") + f"); got {_row(out, b)}")


_LISTED_LAST_TOKENS = (
    NEVER_EOS,                      # 31, 30, 31, ...: config.json's listed 31 as token 1; truncated
    EOS_LADDER_START,               # 41 .. 46: generation_config.json's listed 43 as token 3; truncated
    EOS_LADDER_START + 2,           # 43 .. 48: the listed 43 as token 1
    EOS_AFTER_3,                    # 11, 12, EOS: the tokenizer's EOS still ends the response
)


def _first_apart(a: TensorBatch, b: TensorBatch, name: str) -> str:
    """Where ``a[name]`` and ``b[name]`` differ: their shapes, or the first differing row of each."""
    x, y = a[name].cpu(), b[name].cpu()
    if x.shape != y.shape:
        return f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
    row = next(i for i in range(x.shape[0]) if not torch.equal(x[i], y[i]))
    return f"sample {row}: {x[row].int().tolist()} vs {y[row].int().tolist()}"


@check("robustness", gates=("rollout.seeding",))
def check_folder_eos_list_and_generation_defaults_ignored(h: Harness) -> None:
    """A folder whose config.json and generation_config.json list further EOS ids (eos_token_id [1, 31] and [1, 43], ids the EOS model emits early) and whose generation_config.json sets sampling defaults (temperature 0.05, top_k 1, top_p 0.5, repetition_penalty 1.5, max_new_tokens 2) rolls out as if it had neither: on the EOS model, greedy and seeded sampling continue past 31 and 43 to EOS or max_new_tokens; on the tiny Llama, greedy and seeded sampling give the plain folder's tokens, masks, truncated flags and rollout_log_probs (an engine that declares seeding='none': its sampled rollout_log_probs equal the float64 reference at the temperature asked for). A rollout stops on the tokenizer's EOS and stop_token_ids only, and samples as SamplingParams say."""
    files = "; ".join(f"{f} eos_token_id {ids}" for f, ids in FOLDER_EOS_LISTS.items())
    listed = {i for ids in FOLDER_EOS_LISTS.values() for i in ids}
    defaults = ", ".join(f"{k} {v}" for k, v in GENERATION_DEFAULTS.items())
    short = int(str(GENERATION_DEFAULTS["max_new_tokens"]))
    engine = h.rollout("eos-folder-defaults")
    eos = engine.tokenizer.eos_token_id
    if eos != 1:
        h.fail(f"the folder eos-folder-defaults ({files}) has a tokenizer whose EOS id is 1 (tokenizer_config.json); "
               f"the engine's tokenizer says {eos}: the tokenizer's EOS is its own, not the first id a config lists")
    listed.discard(eos)
    prompts = _prompts(_LISTED_LAST_TOKENS)
    runs = [("greedy", SamplingParams(greedy=True, max_new_tokens=_LIMIT), 1),
            ("sampling at T=1, n=2", SamplingParams(temperature=1.0, max_new_tokens=_LIMIT, n=2, seed=3), 2)]
    for label, params, n in runs:
        out = engine.generate(prompts, params)
        where = f"generate ({label}, max_new_tokens {_LIMIT}, no stop_token_ids) on eos-folder-defaults ({files})"
        _valid(h, out, where)
        ids, mask = out["response_ids"], out["response_mask"]
        for i in range(out.batch_size):
            want, want_trunc = eos_model_continuation(_LISTED_LAST_TOKENS[i // n], _LIMIT)
            real = ids[i][mask[i]].tolist()
            got_trunc = bool(out["truncated"][i])
            if real == want and got_trunc == want_trunc:
                continue
            at = f"{where}, sample {i} (the model continues its prompt with {want})"
            if real and len(real) < len(want) and real == want[: len(real)] and real[-1] in listed:
                h.fail(f"{at}: the response ended at token {real[-1]}, an EOS id the folder lists but not the "
                       f"tokenizer's EOS ({eos}); a rollout stops on the tokenizer's EOS and stop_token_ids only "
                       f"(a caller who wants the folder's list passes it in stop_token_ids). Got {_row(out, i)}")
            if len(real) == short < len(want) and real == want[:short]:
                h.fail(f"{at}: the response was cut at {short} tokens, generation_config.json's max_new_tokens; "
                       f"SamplingParams.max_new_tokens ({_LIMIT}) is the limit, never the folder's defaults. "
                       f"Got {_row(out, i)}")
            h.fail(f"{at}: expected exactly those tokens as the real response, truncated {want_trunc}; got {_row(out, i)}")

    plain, crafted = h.rollout("llama"), h.rollout("llama-folder-defaults")
    prompts = h.batch(seed=34, batch_size=4).select("prompt_ids", "prompt_mask", "group_ids")
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5)
    seeded = crafted.capabilities.seeding != "none"
    cases = [("greedy", SamplingParams(greedy=True, max_new_tokens=8))]
    if seeded:
        cases.append(("sampling at T=1, n=2, seed 5", sampled))
    for label, params in cases:
        a, b = crafted.generate(prompts, params), plain.generate(prompts, params)
        what = (f"generate ({label}, max_new_tokens 8) on llama-folder-defaults (generation_config.json sets {defaults}) "
                f"vs on llama (the same weights and tokenizer, no such defaults)")
        for name in ("response_ids", "response_mask", "truncated"):
            if not torch.equal(a[name].cpu(), b[name].cpu()):
                h.fail(f"{what}: other {name} ({_first_apart(a, b, name)}); sampling follows SamplingParams alone, "
                       f"never the folder's generation_config.json")
        h.close_to(a["rollout_log_probs"], b["rollout_log_probs"], "log_probs",
                   f"{what}: rollout_log_probs (sampling follows SamplingParams alone, never the folder's "
                   f"generation_config.json)", mask=b["response_mask"])
    if seeded:
        return
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    if not crafted.log_probs_exact(unseeded):
        h.note("seeding='none' and inexact rollout_log_probs at T=1: only greedy decoding was compared")
        return
    out = crafted.generate(prompts, unseeded)
    ref = cached_outputs(h.model_path("llama"), out.with_meta(temperature=1.0))["log_probs"]
    h.close_to(out["rollout_log_probs"], ref, "log_probs",
               f"rollout_log_probs of sampling at T=1 on llama-folder-defaults (generation_config.json sets {defaults}) "
               f"vs the float64 reference of log softmax(logits / 1) (sampling follows SamplingParams alone)",
               mask=out["response_mask"])
