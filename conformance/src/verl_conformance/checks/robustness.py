"""Robustness: ragged, empty and maximum-length responses, EOS first, a batch of one or of none, bad input, a failed call,
model folders whose special token ids (config.json, the tokenizer, generation_config.json) lie outside the vocabulary,
and what close() ends."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

import psutil
import torch

from verl_conformance.checks._registry import check
from verl_conformance.checks.numerics import one_update
from verl_conformance.checks.reward import SCORER_INPUTS
from verl_conformance.harness import (
    MAX_PROMPT,
    MAX_RESPONSE,
    Harness,
    exported_weights,
    weights_moved,
)
from verl_conformance.losses import TOKEN_MEAN_PG, VALUE_MSE, role_loss, role_output
from verl_conformance.reference import cached_outputs
from verl_conformance.testkit import (
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    TinyModelSpec,
    emptied,
    without_folders,
)
from verl_core import (
    BatchMeta,
    BatchValidationError,
    ConfigError,
    GlobalBatchStats,
    LossOutput,
    ModelOutput,
    OptimConfig,
    Role,
    SamplingParams,
    TensorBatch,
)
from verl_core.kernel.engine import ROLES

_EOS = 1
_PAD = 0

EMPTY_STEP_OPTIM: Final = OptimConfig(lr=0.01, weight_decay=0.1, grad_clip=0.0)
"""The optimizer of ``robustness::empty_responses_train``: weight decay on, so a step that is not dropped moves
every weight."""


def edge_batch() -> TensorBatch:
    """Four samples: an empty response, EOS as the first token, maximum lengths, and a ragged one."""
    p, r = MAX_PROMPT, MAX_RESPONSE
    g = torch.Generator().manual_seed(60)
    prompt_ids = torch.randint(4, 128, (4, p), generator=g)
    prompt_len = torch.tensor([3, 1, p, 5])
    prompt_mask = torch.arange(p).unsqueeze(0) >= (p - prompt_len).unsqueeze(1)
    response_ids = torch.randint(4, 128, (4, r), generator=g)
    resp_len = torch.tensor([0, 1, r, 4])
    response_mask = torch.arange(r).unsqueeze(0) < resp_len.unsqueeze(1)
    response_ids[1, 0] = _EOS
    response_ids[3, 3] = _EOS
    fields = {
        "prompt_ids": prompt_ids.masked_fill(~prompt_mask, _PAD),
        "prompt_mask": prompt_mask,
        "response_ids": response_ids.masked_fill(~response_mask, _PAD),
        "response_mask": response_mask,
        "group_ids": torch.arange(4),
        "truncated": torch.tensor([False, False, True, False]),
    }
    g2 = torch.Generator().manual_seed(61)
    m = response_mask.float()
    fields["old_log_probs"] = (torch.randn(4, r, generator=g2) * 0.5 - 2.0) * m
    fields["advantages"] = torch.randn(4, r, generator=g2) * m
    fields["returns"] = torch.randn(4, r, generator=g2) * m
    return TensorBatch(fields, meta=BatchMeta(pad_token_id=_PAD))


@check("robustness")
def check_edge_lengths(h: Harness) -> None:
    """Empty responses, EOS as first token and maximum prompt/response lengths give finite, exact outputs."""
    engine = h.training()
    batch = edge_batch()
    out = engine.forward(batch, ["log_probs"])["log_probs"]
    ref = cached_outputs(h.model_path("llama"), batch)["log_probs"]
    h.close_to(out, ref, "log_probs", "log_probs of [empty, EOS-first, max-length, ragged] responses",
               mask=batch["response_mask"])
    h.expect(bool((out[0] == 0).all()), "an empty response must have all-zero log_probs")


@check("robustness")
def check_empty_responses_train(h: Harness) -> None:
    """A mini-batch whose responses are all empty trains to loss 0 and grad norm 0 with no NaN, and its step changes no weight: under weight decay, after an update that left Adam momentum (the actor; a critic-only backend: the critic)."""
    role = h.trained_role()
    loss = role_loss(role)
    engine = h.training(role, fresh=True, micro_batch_size=2, optim=EMPTY_STEP_OPTIM)
    batch = edge_batch()
    empty = emptied(batch)
    m = engine.forward_backward(batch, loss, GlobalBatchStats.of(batch))
    engine.optimizer_step()
    before = exported_weights(engine)
    m = engine.forward_backward(empty, loss, GlobalBatchStats.of(empty))
    h.expect(m["loss"] == 0.0, f"an all-empty mini-batch must give loss 0, got {m['loss']} (never divide by zero)")
    s = engine.optimizer_step()
    h.expect(s.grad_norm == 0.0 and not s.skipped,
             f"an all-empty mini-batch must give grad norm 0 and no skip, got {s.grad_norm}, skipped={s.skipped}")
    moved = weights_moved(before, exported_weights(engine))
    h.expect(not moved, f"the step after an all-empty mini-batch (no loss token) must change no weight, but "
             f"{len(moved)} tensors moved (first: {', '.join(moved[:3])}) under weight_decay="
             f"{EMPTY_STEP_OPTIM.weight_decay} after one update: drop the call's gradients and step the schedule "
             "only; zero gradients through the model let AdamW decay and follow its momentum "
             "(TrainingEngine.optimizer_step)")
    m = engine.forward_backward(batch, loss, GlobalBatchStats.of(batch))
    s = engine.optimizer_step()
    h.expect(bool(torch.isfinite(torch.tensor([m["loss"], s.grad_norm])).all()),
             f"edge-length mini-batch gave loss {m['loss']}, grad norm {s.grad_norm}: must be finite")


@check("robustness")
def check_batch_of_one(h: Harness) -> None:
    """A batch of one sample works in every engine the backend provides: the actor's (or else the critic's) forward and forward_backward, the reward's score and the rollout's generate; skipped when it provides none of them."""
    batch = h.batch(seed=62, batch_size=1, empty=0, rl_fields=True)
    ran = []
    if h.provides(h.subject, "actor"):
        engine = h.training(fresh=True)
        lp = engine.forward(batch)["log_probs"]
        ref = cached_outputs(h.model_path("llama"), batch)["log_probs"]
        h.close_to(lp, ref, "log_probs", "log_probs of a batch of one", mask=batch["response_mask"])
        m = engine.forward_backward(batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
        h.expect(bool(torch.isfinite(torch.tensor(m["loss"]))), f"batch of one: loss {m['loss']} is not finite")
        ran.append("actor")
    elif h.provides(h.subject, "critic"):
        critic = h.training("critic", fresh=True)
        values = critic.forward(batch, ["values"])["values"]
        h.expect(tuple(values.shape) == tuple(batch["response_ids"].shape) and bool(torch.isfinite(values).all()),
                 f"critic forward of a batch of one gave values of shape {tuple(values.shape)} (finite: "
                 f"{bool(torch.isfinite(values).all())}); expected finite values shaped like response_ids")
        m = critic.forward_backward(batch, VALUE_MSE, GlobalBatchStats.of(batch))
        h.expect(bool(torch.isfinite(torch.tensor(m["loss"]))), f"critic, batch of one: loss {m['loss']} is not finite")
        ran.append("critic")
    if h.provides(h.subject, "reward"):
        scorer = h.reward()
        if scorer.capabilities.scores:
            scores = scorer.score(batch.select(*SCORER_INPUTS, "group_ids"))["scores"]
            h.expect(tuple(scores.shape) == (1,) and bool(torch.isfinite(scores).all()),
                     f"reward score of a batch of one gave {scores.tolist()}; expected one finite score")
            ran.append("reward")
    if h.provides(h.subject, "rollout"):
        r = h.rollout()
        out = r.generate(batch.select("prompt_ids", "prompt_mask", "group_ids"), SamplingParams(max_new_tokens=4, seed=0))
        h.expect(out.batch_size == 1, f"generate on one prompt returned {out.batch_size} samples")
        ran.append("rollout")
    if not ran:
        h.skip(f"backend {h.subject.name!r} provides no actor, critic, reward or rollout engine")


@check("robustness")
def check_batch_of_zero(h: Harness) -> None:
    """forward of a batch of 0 rows (the model's inputs and the RL fields, each shaped [0, width] with the padded prompt and response widths kept) returns every output the engine declares (the actor's and the reference's log_probs, and entropy where declared; the critic's values) as float32 of shape [0, response width], with the input fields kept, in every training engine the backend provides (actor, critic, reference), without an error; skipped when it provides none. TrainingEngineBase.forward answers it without the model code; an engine built without the base answers it itself (no reshape of 0 elements). The trainers skip a step with no samples, so forward_backward of 0 rows may be refused (TrainingEngineBase raises BatchValidationError)."""
    full = h.batch(seed=66, batch_size=3, empty=0, rl_fields=True)
    batch = full.index(slice(0, 0))
    width = full.response_len
    h.expect(batch.batch_size == 0 and batch.response_len == width,
             f"the 0-row batch has {batch.batch_size} rows and response width {batch.response_len}, "
             f"expected 0 and {width}")
    ran = []
    for role in ("actor", "reference", "critic"):
        if not h.provides(h.subject, role):
            continue
        engine = h.training(role)
        outputs: tuple[ModelOutput, ...] = (
            ("values",) if role == "critic" else ("log_probs", "entropy") if engine.capabilities.entropy
            else ("log_probs",))
        what = f"the {role} engine's forward of a batch of 0 rows (response width {width}) asked for {list(outputs)}"
        try:
            out = engine.forward(batch, outputs)
        except Exception as e:
            h.fail(f"{what} raised {type(e).__name__}: {str(e)[:300]}; expected each output shaped [0, {width}] "
                   "(TrainingEngineBase.forward answers 0 rows itself)")
        problems = []
        if not isinstance(out, TensorBatch) or out.batch_size != 0:
            problems.append(f"returned {type(out).__name__} of {getattr(out, 'batch_size', '?')} rows, "
                            "expected a TensorBatch of 0 rows")
        else:
            for name in outputs:
                if name not in out:
                    problems.append(f"has no {name!r}")
                    continue
                t = out[name]
                if tuple(t.shape) != (0, width) or t.dtype != torch.float32:
                    problems.append(f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}, expected (0, {width}) "
                                    "and torch.float32")
            kept = [k for k in ("prompt_ids", "response_ids", "response_mask", "advantages") if k not in out]
            if kept:
                problems.append(f"dropped the input fields {kept} (forward returns the input batch updated)")
        h.expect(not problems, f"{what}: " + "; ".join(problems))
        ran.append(role)
    if not ran:
        h.skip(f"backend {h.subject.name!r} provides no actor, reference or critic engine")


def _bad_training_inputs(batch: TensorBatch, role: str = "actor") -> dict[str, tuple[Callable[[], TensorBatch],
                                                                                     tuple[str, ...]]]:
    """Named bad inputs and the field names a clear error should mention (NaN in what ``role``'s loss reads:
    a critic's returns, else the advantages)."""
    t = dict(batch.items())
    target = "returns" if role == "critic" else "advantages"

    def raw(**changes: torch.Tensor) -> TensorBatch:
        # Built without validation, as a buggy caller could: the engine must still reject it.
        return TensorBatch._trusted({**t, **changes}, {}, batch.meta, batch.batch_size)

    adv = t[target].clone()
    adv[2, 0] = float("nan")
    right = t["prompt_mask"].flip(1)
    return {
        f"NaN in {target}": (lambda: batch.update({target: adv}), (target,)),
        "token id beyond the vocabulary": (
            lambda: batch.update(response_ids=t["response_ids"].masked_fill(t["response_mask"], 100000)),
            ("response_ids",)),
        "right-padded prompts": (lambda: batch.update(prompt_mask=right, prompt_ids=t["prompt_ids"].flip(1)),
                                 ("prompt_mask",)),
        "missing response_mask": (lambda: batch.drop("response_mask"), ("response_mask",)),
        "int32 response_ids": (lambda: raw(response_ids=t["response_ids"].int()), ("response_ids",)),
        "response_mask shorter than response_ids": (
            lambda: raw(response_mask=t["response_mask"][:, :-1]), ("response_mask", "response_ids")),
        "prompt longer than max_prompt_len": (lambda: _long_prompt(batch), ("prompt",)),
        "response longer than max_response_len": (lambda: _long_response(batch), ("response",)),
    }


def _long_prompt(batch: TensorBatch) -> TensorBatch:
    """``batch`` with sample 0's prompt grown to ``MAX_PROMPT + 4`` real tokens, correctly left-padded
    (so the length is the input's only fault: a prompt mask that is not left-padded would be refused
    for another reason)."""
    width = MAX_PROMPT + 4
    extra = width - batch.prompt_len
    ids = torch.cat([torch.full((batch.batch_size, extra), _PAD), batch["prompt_ids"]], 1)
    mask = torch.cat([torch.zeros(batch.batch_size, extra, dtype=torch.bool), batch["prompt_mask"]], 1)
    ids[0] = torch.where(mask[0], ids[0], torch.full_like(ids[0], 9))
    mask[0] = True
    return batch.update(prompt_ids=ids, prompt_mask=mask)


def _long_response(batch: TensorBatch) -> TensorBatch:
    """``batch`` with sample 0's response grown to ``MAX_RESPONSE + 4`` real tokens (right-padded, RL fields too)."""
    extra = MAX_RESPONSE + 4 - batch.response_len
    fields: dict[str, torch.Tensor] = {}
    for name, t in batch.items():
        if t.dim() == 2 and name not in ("prompt_ids", "prompt_mask"):
            fill = _PAD if name == "response_ids" else (False if t.dtype == torch.bool else 0)
            fields[name] = torch.cat([t, torch.full((batch.batch_size, extra), fill, dtype=t.dtype)], 1)
    fields["response_mask"][0] = True
    fields["response_ids"][0] = torch.where(fields["response_ids"][0] == _PAD, 9, fields["response_ids"][0])
    return batch.update(fields)


@check("robustness")
def check_bad_training_input_rejected(h: Harness) -> None:
    """forward and forward_backward reject NaN, bad ids, wrong padding, missing fields, wrong dtype, mismatched lengths and prompts or responses over the spec's limits with BatchValidationError, leaving no gradients (the actor; a critic-only backend: the critic)."""
    role = h.trained_role()
    loss = role_loss(role)
    engine = h.training(role, fresh=True)
    batch = h.batch(seed=63, rl_fields=True)
    for what, (make, names) in _bad_training_inputs(batch, role).items():
        bad = make()
        for call in ("forward", "forward_backward"):
            try:
                if call == "forward":
                    engine.forward(bad, [role_output(role)])
                else:
                    engine.forward_backward(bad, loss, GlobalBatchStats.of(batch))
            except BatchValidationError as e:
                msg = str(e)
                h.expect(any(n in msg for n in names),
                         f"{call}({what}) raised an unclear error {msg!r}: it should name {' or '.join(names)}")
            except Exception as e:
                h.fail(f"{call}({what}) raised {type(e).__name__}: {e}; expected a BatchValidationError")
            else:
                if call == "forward" and what.startswith("NaN in "):
                    continue  # forward does not read advantages or returns
                h.fail(f"{call}({what}) was accepted; bad input must raise BatchValidationError "
                       "before any model code runs")
    step = engine.optimizer_step()
    h.expect(step.grad_norm == 0.0,
             f"rejected inputs left gradients behind (grad norm {step.grad_norm}); the engine's state must "
             "be unchanged by a rejected call")


class _FailOnSecondMicroBatch:
    """The suite's loss of ``role`` (:func:`~verl_conformance.losses.role_loss`), raising on the second micro-batch it sees."""

    def __init__(self, role: str) -> None:
        self.calls = 0
        self.loss = role_loss(role)
        self.needs = self.loss.needs

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected failure in the second micro-batch")
        return self.loss(batch, stats)


@check("robustness")
def check_failed_call_leaves_no_gradients(h: Harness) -> None:
    """A forward_backward that raises mid-call leaves no gradients (running it again equals a clean update); a second call before optimizer_step is refused (the actor; a critic-only backend: the critic)."""
    batch = h.batch(seed=65, rl_fields=True)
    stats = GlobalBatchStats.of(batch)
    role = h.trained_role()
    clean_loss = role_loss(role)
    failing = h.training(role, fresh=True, micro_batch_size=2)
    loss = _FailOnSecondMicroBatch(role)
    try:
        failing.forward_backward(batch, loss, stats)
    except RuntimeError as e:
        h.expect("injected failure" in str(e), f"the loss's error was replaced by {type(e).__name__}: {e}")
    else:
        h.fail("forward_backward returned although its loss raised on the second micro-batch")
    h.expect(loss.calls == 2, f"the loss ran {loss.calls} times; the call must stop at the micro-batch that raised")
    got = one_update(h, failing, batch, clean_loss)
    want = one_update(h, h.training(role, fresh=True, micro_batch_size=2), batch, clean_loss)
    label = "after a failed call vs an engine that never failed (the failed call must leave no gradients)"
    h.scalar_close(got[0]["loss"], want[0]["loss"], "loss", f"loss {label}")
    h.scalar_close(got[1], want[1], "loss", f"grad norm {label}")
    for name, g in want[2].items():
        h.close_to(got[2][name], g, "grad", f"gradient of {name} {label}")  # type: ignore[arg-type]
    failing.forward_backward(batch, clean_loss, stats)
    try:
        failing.forward_backward(batch, clean_loss, stats)
    except ConfigError as e:
        h.expect("optimizer_step" in str(e), f"the refusal of a second call should say to call optimizer_step: {e}")
    except Exception as e:
        h.fail(f"a second forward_backward before optimizer_step raised {type(e).__name__}: {e}; expected ConfigError")
    else:
        h.fail("a second forward_backward before optimizer_step was accepted; one call takes the whole "
               "mini-batch of an optimizer step, so a second one must raise ConfigError")
    failing.optimizer_step()


@check("robustness", gates=("rollout.stop_token_ids",))
def check_generate_edge_cases(h: Harness) -> None:
    """A stop token first ends the response at length 1; hitting max_new_tokens sets truncated; a full-length prompt works."""
    engine = h.rollout()
    prompts = edge_batch().select("prompt_ids", "prompt_mask", "group_ids")
    one = prompts.index([2])  # the full-length prompt; the same batch twice, so greedy repeats exactly
    greedy = engine.generate(one, SamplingParams(greedy=True, max_new_tokens=4))
    first = int(greedy["response_ids"][0, 0])
    if engine.capabilities.stop_token_ids:
        out = engine.generate(one, SamplingParams(greedy=True, max_new_tokens=4, stop_token_ids=(first,)))
        n = int(out["response_mask"][0].sum())
        h.expect(n == 1 and int(out["response_ids"][0, 0]) == first and not bool(out["truncated"][0]),
                 f"greedy with stop_token_ids=({first},), its first token: expected a response of exactly that "
                 f"token (mask True, truncated False), got {out['response_ids'][0].tolist()} with "
                 f"{n} real tokens, truncated={bool(out['truncated'][0])}")
    long = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=MAX_RESPONSE, seed=3))
    lengths = long["response_mask"].sum(1)
    for b in range(long.batch_size):
        if int(lengths[b]) == MAX_RESPONSE and int(long["response_ids"][b, -1]) != engine.tokenizer.eos_token_id:
            h.expect(bool(long["truncated"][b]), f"sample {b} reached max_new_tokens without EOS but truncated=False")


@check("robustness")
def check_bad_prompts_rejected(h: Harness) -> None:
    """generate rejects right-padded prompts, ids beyond the vocabulary, missing group_ids and over-long prompts."""
    engine = h.rollout()
    prompts = h.batch(seed=64, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")
    t = dict(prompts.items())
    cases = {
        "right-padded prompts": (prompts.update(prompt_mask=t["prompt_mask"].flip(1), prompt_ids=t["prompt_ids"].flip(1)), "prompt_mask"),
        "token id beyond the vocabulary": (prompts.update(prompt_ids=t["prompt_ids"].masked_fill(t["prompt_mask"], 100000)), "prompt_ids"),
        "missing group_ids": (prompts.drop("group_ids"), "group_ids"),
        "prompt longer than max_prompt_len": (_long_prompt(prompts), "prompt"),
    }
    for what, (bad, name) in cases.items():
        try:
            engine.generate(bad, SamplingParams(max_new_tokens=2, seed=0))
        except BatchValidationError as e:
            h.expect(name in str(e), f"generate({what}) raised an unclear error {str(e)!r}: it should name {name}")
        except Exception as e:
            h.fail(f"generate({what}) raised {type(e).__name__}: {e}; expected a BatchValidationError")
        else:
            h.fail(f"generate({what}) was accepted; bad prompts must raise BatchValidationError")


@check("robustness")
def check_special_token_ids_outside_vocab_refused(h: Harness) -> None:
    """An engine of each role the backend provides (actor, reference, critic, rollout, reward), built on a folder that sets a pad, EOS or BOS id outside [0, vocab_size) where a run reads it (config.json's pad_token_id = vocab_size, eos_token_id a list with one id past the vocabulary, or bos_token_id -1; the tokenizer's EOS, tokenizer_config.json's eos_token naming an added token with id vocab_size; generation_config.json's eos_token_id, a list with one id past the vocabulary), refuses at build with a ConfigError naming the file's key, instead of a bare AssertionError from nn.Embedding(padding_idx=...), a negative padding_idx read as the last row, or a rollout whose EOS can never be sampled."""
    roles = [r for r in ROLES if h.provides(h.subject, r)]
    if not roles:
        h.skip(f"backend {h.subject.name!r} provides no engine")
    vocab = TinyModelSpec().vocab_size
    # folder suffix -> (what it sets, the fragments a refusal names)
    folders: dict[str, tuple[str, list[str]]] = {
        **{key: (f"config.json {key} = {value!r}", [key]) for key, value in OUT_OF_VOCAB_IDS.items()},
        **{name: (f"{file} {key} = {value!r}", [file, key]) for name, (file, key, value) in OUT_OF_VOCAB_FILES.items()},
    }
    problems: list[str] = []
    for role in roles:
        for suffix, (sets, names) in folders.items():
            model = f"{'reward' if role == 'reward' else 'llama'}-oov-{suffix}"
            what = f"the {role} engine on the folder {model} ({sets}, vocab_size {vocab})"
            try:
                if role == "rollout":
                    h.rollout(model, fresh=True)
                elif role == "reward":
                    h.reward(model, fresh=True)
                else:
                    h.training(role, model, fresh=True, causal_folder=True)
            except ConfigError as e:
                missing = [n for n in names if n not in without_folders(str(e))]
                if missing:
                    problems.append(f"{what} raised a ConfigError that does not name {' and '.join(missing)}: "
                                    f"{str(e)[:300]}")
            except Exception as e:
                problems.append(f"{what} raised {type(e).__name__}: {str(e)[:300]}")
            else:
                problems.append(f"{what} built (no ConfigError)")
            finally:
                h.close_fresh()
    if problems:
        h.fail("; ".join(problems) + ". A folder whose pad, EOS or BOS id (an int or each id of a list) is not in "
               "[0, vocab_size) in config.json, generation_config.json or the tokenizer's files "
               "(tokenizer_config.json / special_tokens_map.json, the id from tokenizer.json) must be refused when "
               "the engine is built, with verl_core.ConfigError naming the file, the key, its value, the vocabulary "
               "size and the folder (verl_core.enginekit.model_folder.check_special_token_ids does it)")


# Process-wide helpers that outlive any one engine by design: multiprocessing's resource tracker and
# fork server (started on first use, shared by the whole process) and torch's compile workers.
_SHARED_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")
_CLOSE_GRACE_S = 10.0


def _running_children() -> dict[int, str]:
    """This process's live descendants (zombies and the shared helpers left out), pid -> command line."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())[:200]
        except psutil.Error:  # it ended while we looked
            continue
        if not any(marker in cmd for marker in _SHARED_PROCESSES):
            out[p.pid] = cmd
    return out


def _running_threads() -> dict[int, str]:
    """The live non-daemon threads (a process does not exit while one runs), ident -> name."""
    return {t.ident: t.name for t in threading.enumerate() if not t.daemon and t.ident is not None and t.is_alive()}


def _use_once(h: Harness, role: str, engine: Any) -> None:
    """One call of ``engine`` of ``role``: a generate, a score, or a forward."""
    if role == "rollout":
        prompts = h.batch(seed=67, batch_size=2).select("prompt_ids", "prompt_mask", "group_ids")
        engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=2))
    elif role == "reward":
        engine.score(h.batch(seed=67, batch_size=2).select(*SCORER_INPUTS))
    else:
        engine.forward(h.batch(seed=67, batch_size=2, rl_fields=True), ["values"] if role == "critic" else ["log_probs"])


def _build_use_and_drop(h: Harness, role: Role) -> None:
    """An engine of ``role`` built by the subject's factory (as ``h.training(fresh=True)`` and the others build it,
    but kept by neither the harness's cache nor its list of fresh engines) and used once; no reference to it is
    left when this returns."""
    model = {"critic": "value", "reward": "reward"}.get(role, "llama")
    spec = h.spec(role, model)
    if h.options:
        spec = replace(spec, options={**h.options, **spec.options})
    factory = {"rollout": h.subject.make_rollout, "reward": h.subject.make_reward}.get(role, h.subject.make_training)
    if factory is None:
        raise AssertionError(f"backend {h.subject.name!r} has no factory of role {role!r}")
    engine = factory(spec)
    _use_once(h, role, engine)


def _left_running(procs: dict[int, str], threads: dict[int, str], *,
                  collect: bool = False) -> tuple[dict[int, str], dict[int, str]]:
    """The child processes and non-daemon threads not in ``procs`` and ``threads`` still running
    :data:`_CLOSE_GRACE_S` later (or as soon as none is); ``collect``: a ``gc.collect()`` on each look."""
    deadline = time.monotonic() + _CLOSE_GRACE_S
    while True:
        if collect:
            gc.collect()
        left_procs = {pid: cmd for pid, cmd in _running_children().items() if pid not in procs}
        left_threads = {ident: name for ident, name in _running_threads().items() if ident not in threads}
        if not (left_procs or left_threads) or time.monotonic() > deadline:
            return left_procs, left_threads
        time.sleep(0.1)


def _left_problems(what: str, when: str, left_procs: dict[int, str], left_threads: dict[int, str]) -> list[str]:
    out = []
    if left_procs:
        out.append(f"{what} left {len(left_procs)} child process(es) running {_CLOSE_GRACE_S:.0f} s after {when}: "
                   + "; ".join(f"pid {pid}: {cmd!r}" for pid, cmd in sorted(left_procs.items())))
    if left_threads:
        out.append(f"{what} left {len(left_threads)} non-daemon thread(s) running {_CLOSE_GRACE_S:.0f} s after "
                   f"{when}: {sorted(left_threads.values())}")
    return out


@check("robustness")
def check_close_ends_what_the_engine_started(h: Harness) -> None:
    """close() of an engine of each role the backend provides (actor, reference, critic, rollout, reward), built for the check, used once (a forward, a generate, a score) and closed, ends within 10 s every child process and every non-daemon thread the engine started (a worker left running keeps the trainer's process alive after its run, or holds the device's memory for the next engine); a second close() raises nothing. So does dropping one without close(): an engine of each role built by the backend's factory, used once, every reference to it dropped and gc.collect() run, leaves within 10 s no child process or non-daemon thread it started (a user's script that stops early never calls close(): register a weakref.finalize on the engine that ends its worker, and let nothing the worker or a thread holds keep the engine alive). Process-wide helpers that outlive any engine by design (multiprocessing's resource tracker and fork server, torch's compile workers) are not counted; zombies (ended, not yet reaped) count as ended."""
    roles = [r for r in ROLES if h.provides(h.subject, r)]
    if not roles:
        h.skip(f"backend {h.subject.name!r} provides no engine")
    problems: list[str] = []
    dropped: list[str] = []
    for role in roles:
        procs, threads = _running_children(), _running_threads()
        what = f"the {role} engine"
        if role == "rollout":
            engine: Any = h.rollout(fresh=True)
        elif role == "reward":
            engine = h.reward(fresh=True)
        else:
            engine = h.training(role, fresh=True)
        _use_once(h, role, engine)
        try:
            engine.close()
        except Exception as e:
            problems.append(f"{what}'s close() raised {type(e).__name__}: {str(e)[:200]}")
            continue
        try:
            engine.close()
        except Exception as e:
            problems.append(f"{what}'s second close() raised {type(e).__name__}: {str(e)[:200]} (close() may come "
                            "twice: the trainer's error path and a user's script both close what they built)")
        problems += _left_problems(what, "close()", *_left_running(procs, threads))
        del engine
        procs, threads = _running_children(), _running_threads()
        _build_use_and_drop(h, role)
        left = _left_problems(f"{what}, dropped without close(),", "its last reference went and gc.collect() ran",
                              *_left_running(procs, threads, collect=True))
        problems += left
        dropped += [role] if left else []
    if problems:
        h.fail("; ".join(problems) + ". close() stops what the engine started (a worker: a stop message, a wait, "
               "then a kill; a thread: a stop flag and a join) and may be called twice"
               + (("; a weakref.finalize registered on the engine (its callback holding the worker, not the engine) "
                   "stops them when the engine is dropped without close()") if dropped else "")
               + "; docs/backend-rollout-engine.md, 'An engine in another process'")
