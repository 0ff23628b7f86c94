"""Numerics: log-probs, entropy, values, losses and gradients against the float64 reference."""

from __future__ import annotations

from functools import partial
from typing import Final

from verl_conformance.checks._registry import check
from verl_conformance.harness import SUITE_OPTIM, Harness, exported_weights, recover_grads
from verl_conformance.losses import (
    VALUE_MSE,
    NamedLoss,
    SuiteLoss,
    registered_critic_loss,
    suite_losses,
)
from verl_conformance.reference import ReferenceModel, cached_outputs
from verl_conformance.testkit import VALUE_HEAD_BIAS
from verl_core import (
    ConfigError,
    GlobalBatchStats,
    LossFn,
    RolloutEngine,
    SamplingParams,
    TensorBatch,
    TrainingEngine,
)

PERTURBED_FAMILIES: Final = (  # (suite folder, model_type, the tensors that a random folder holds at their initial value)
    ("qwen2-perturbed", "qwen2", "its q/k/v biases no longer zeros, its RMSNorm weights no longer ones"),
    ("qwen3-tied-perturbed", "qwen3", "its RMSNorm weights, the q/k norms' too, no longer ones"),
    ("llama-perturbed-a", "llama", "its RMSNorm weights no longer ones"),
)
"""A causal-LM folder of each family with every tensor moved (``testkit.perturbed_model``). The test
kit's random folders keep transformers' initialisation, where Qwen2's q/k/v biases are zeros and
every RMSNorm weight (Qwen3's q/k norms too) is one, so a forward that leaves them out computes
those folders exactly. The Qwen folders move every norm weight too, so the Llama one is needed only
where both Qwen families are refused (it costs a rollout engine)."""

TIED_QWEN2: Final = ("qwen2-tied-perturbed", "qwen2", "its q/k/v biases and RMSNorm weights moved, its lm_head tied "
                     "to the embedding as Qwen2.5's smaller models have it")
"""(folder, model_type, description) of the tied Qwen2 folder of :func:`check_loss_and_grads_match_reference`:
the other Qwen2 folders are untied and the tied Qwen3 is another family, so an engine that reads
``tie_word_embeddings`` for some families only (an lm_head of its own, copied from the embedding: the
forward is right, the gradients are not) passes everything else."""

_ARCH_MODELS = ("llama", "llama-tied", "qwen2-perturbed", "qwen3-tied-perturbed")
_TEMPERATURES = (1.0, 0.7)


def _folder(model: str) -> str:
    """``model`` for messages, with what its tensors hold where it is one of :data:`PERTURBED_FAMILIES`."""
    moved = {m: f"{m} ({t} with every tensor moved: {d})" for m, t, d in (*PERTURBED_FAMILIES, TIED_QWEN2)}
    return moved.get(model, model)


def family_rollouts(h: Harness) -> tuple[list[tuple[str, str, RolloutEngine]], list[str]]:
    """The subject's (cached) rollout engines on :data:`PERTURBED_FAMILIES` as ``(folder, description,
    engine)``, and the Qwen model_types it refuses with a ConfigError naming them: the perturbed Qwen2
    and Qwen3 folders, and the perturbed Llama where both are refused (the norm weights are then
    compared nowhere else).

    Fails on a refusal that does not name the model_type (any of the Llama), or another error."""
    engines: list[tuple[str, str, RolloutEngine]] = []
    refused: list[str] = []
    for model, model_type, _ in PERTURBED_FAMILIES:
        if model_type == "llama" and engines:
            continue
        what = _folder(model)
        engine = h.unless_refused(partial(h.rollout, model), kind="rollout", what=what, model_type=model_type)
        if engine is not None:
            engines.append((model, what, engine))
        elif model_type == "llama":
            h.fail(f"the rollout engine refused the folder {what}, a Llama like the suite's")
        else:
            refused.append(model_type)
    return engines, refused


@check("numerics", gates=("training.log_probs",))
def check_log_probs_match_reference(h: Harness) -> None:
    """log_probs equal the float64 reference for Llama (tied and untied), Qwen2 and tied Qwen3 at T=1 and T=0.7, the Qwen folders with every tensor moved (q/k/v biases and norm weights other than zeros and ones)."""
    if not h.training().capabilities.log_probs:
        h.skip("backend declares log_probs=False")
    for model in _ARCH_MODELS:
        engine = h.training(model=model)
        for temp in _TEMPERATURES:
            batch = h.batch(seed=10, temperature=temp)
            got = engine.forward(batch, ["log_probs"])["log_probs"]
            ref = cached_outputs(h.model_path(model), batch)["log_probs"]
            h.close_to(got, ref, "log_probs", f"log_probs of {_folder(model)} at temperature {temp} vs float64 reference",
                       mask=batch["response_mask"])


_REFERENCE_MODELS = ("llama", "qwen2-perturbed", "qwen3-tied-perturbed")
"""Folders of :func:`check_reference_role_log_probs_match_reference`: the Llama, and the Qwen folders with every
tensor moved (a reference engine of its own that leaves out Qwen2's q/k/v biases or the norm weights computes
the random Qwen folders exactly)."""


@check("numerics", gates=("training.log_probs",))
def check_reference_role_log_probs_match_reference(h: Harness) -> None:
    """The reference role's log_probs equal the float64 reference at T=1 and T=0.7, as the actor's do (the KL penalty and kl_loss read them, at the batch's temperature), on Llama and on Qwen2 and tied Qwen3 folders with every tensor moved (q/k/v biases and norm weights other than zeros and ones); skipped where the backend provides no reference engine."""
    if not h.provides(h.subject, "reference"):
        h.skip(f"backend {h.subject.name!r} provides no reference engine")
    if not h.training("reference").capabilities.log_probs:
        h.skip("the reference engine declares log_probs=False")
    for model in _REFERENCE_MODELS:
        try:
            engine = h.training("reference", model)
        except ConfigError as e:
            h.fail(f"the reference engine refused the folder {_folder(model)}: {e}; the reference role computes "
                   "the log-probs of the actor's folder, and the actor loads this one (log_probs_match_reference)")
        for temp in _TEMPERATURES:
            batch = h.batch(seed=13, temperature=temp)
            got = engine.forward(batch, ["log_probs"])["log_probs"]
            ref = cached_outputs(h.model_path(model), batch)["log_probs"]
            h.close_to(got, ref, "log_probs", f"the reference role's log_probs of {_folder(model)} at temperature "
                       f"{temp} vs the float64 reference", mask=batch["response_mask"])


@check("numerics", gates=("training.entropy",))
def check_entropy_matches_reference(h: Harness) -> None:
    """entropy equals the float64 reference (same tempered distribution as the log-probs)."""
    engine = h.training()
    if not engine.capabilities.entropy:
        h.skip("backend declares entropy=False")
    for temp in _TEMPERATURES:
        batch = h.batch(seed=11, temperature=temp)
        got = engine.forward(batch, ["entropy"])["entropy"]
        ref = cached_outputs(h.model_path("llama"), batch, ("entropy",))["entropy"]
        h.close_to(got, ref, "entropy", f"entropy at temperature {temp} vs float64 reference", mask=batch["response_mask"])


@check("numerics", gates=("training.values",))
def check_values_match_reference(h: Harness) -> None:
    """A critic's values equal the float64 reference of the value-head folder with a nonzero score.bias (0.5; a random folder's is 0), at T=1 and T=0.7: values do not depend on the sampling temperature; and on Qwen2 and Qwen3 value-head folders with every tensor moved (q/k/v biases, norm weights, Qwen3's q/k norms), a family refused with a ConfigError naming its model_type listed as refused."""
    # on the value-head folder (score.bias 0) a critic that never loads the bias computes its values
    critic = h.training("critic", "value-biased")
    if not critic.capabilities.values:
        h.skip("backend declares values=False (no value head)")
    for temp in _TEMPERATURES:
        batch = h.batch(seed=12, temperature=temp)
        got = critic.forward(batch, ["values"])["values"]
        ref = cached_outputs(h.model_path("value-biased"), batch, ("values",))["values"]
        h.close_to(got, ref, "values", f"critic values vs float64 reference of value-biased (the value-head folder "
                   f"with score.bias {VALUE_HEAD_BIAS}) at temperature {temp} (values do not depend on the sampling "
                   "temperature in the batch's meta)", mask=batch["response_mask"])
    batch = h.batch(seed=12)
    refused = []
    for model, model_type in VALUE_FAMILIES:
        what = f"{model} ({model_type} value-head folder with every tensor moved)"
        engine = h.unless_refused(partial(h.training, "critic", model, fresh=True), kind="training", what=what,
                                  model_type=model_type)
        if engine is None:
            refused.append(model_type)
            continue
        got = engine.forward(batch, ["values"])["values"]
        ref = cached_outputs(h.model_path(model), batch, ("values",))["values"]
        # each value is read after the whole perturbed network, as a reward model's score is: the
        # scores tier (the values tier is calibrated on the unperturbed value-head folders; the
        # megatron critic on CUDA in bfloat16 was 0.062 off on one of 25 values here)
        h.close_to(got, ref, "scores", f"critic values on {what} vs float64 reference", mask=batch["response_mask"])
        h.close_fresh()
    if refused:
        h.note(f"refused (ConfigError naming the model_type): {', '.join(refused)}")


VALUE_FAMILIES: Final = (("value-qwen2-perturbed", "qwen2"), ("value-qwen3-perturbed", "qwen3"))
"""The Qwen value-head folders of :func:`check_values_match_reference` (the other critic checks build on the
Llama ones), with every tensor moved as in :data:`PERTURBED_FAMILIES`."""


def one_update(h: Harness, engine: TrainingEngine, batch: TensorBatch, loss: LossFn, *,
               max_tokens: int | None = None) -> tuple[dict[str, float], float, dict[str, object]]:
    """Run forward_backward (under the call's token budget ``max_tokens``) + optimizer_step.

    Returns:
        The call's metrics, the grad norm and the gradients recovered from the step.
    """
    before = exported_weights(engine)
    metrics = engine.forward_backward(batch, loss, GlobalBatchStats.of(batch), max_tokens=max_tokens)
    step = engine.optimizer_step()
    after = exported_weights(engine)
    h.expect(set(after) == set(before), "export_weights names changed after a step")
    return metrics, step.grad_norm, recover_grads(before, after, engine.spec.optim)  # type: ignore[return-value]


def compare_update(h: Harness, loss: SuiteLoss | NamedLoss, model: str, batch: TensorBatch,
                   engine: TrainingEngine | None = None, **spec_kw: object) -> None:
    """One update of a fresh actor (``engine``, else one built on ``model``) vs the float64 reference:
    loss, grad norm, every gradient."""
    if engine is None:
        engine = h.training(model=model, fresh=True, **spec_kw)  # type: ignore[arg-type]
    metrics, grad_norm, grads = one_update(h, engine, batch, loss)
    ref = ReferenceModel(h.model_path(model), SUITE_OPTIM).loss_and_grads(batch, loss, GlobalBatchStats.of(batch))
    label = (f"{loss.name} on {_folder(model)} "
             f"({', '.join(f'{k}={v}' for k, v in spec_kw.items()) or 'one micro-batch'})")
    h.scalar_close(metrics["loss"], ref.loss, "loss", f"loss of {label} vs float64 reference")
    missing = sorted(set(ref.grads) - set(grads))
    h.expect(not missing, f"exported weights lack parameters of the reference: {missing[:4]}")
    for name, g in ref.grads.items():  # each tensor before their norm: a failure names the tensor
        h.close_to(grads[name], g, "grad", f"gradient of {name} under {label} vs float64 reference "  # type: ignore[arg-type]
                   "(recovered from the first AdamW step)")
    h.scalar_close(grad_norm, ref.grad_norm, "loss", f"grad norm of {label} vs float64 reference")


@check("numerics", gates=("training.entropy",))
def check_loss_and_grads_match_reference(h: Harness) -> None:
    """For each policy loss: one update's loss, grad norm and gradients equal the float64 reference (micro-batches of 2); one update on the tied Qwen3 and on a tied Qwen2 with every tensor moved too (the tied embedding's gradient holds both its uses; a Qwen2 refused with a ConfigError naming qwen2 is listed as refused)."""
    batch = h.batch(seed=13, rl_fields=True)
    for loss in suite_losses():
        if "entropy" in loss.needs and not h.training().capabilities.entropy:
            continue
        compare_update(h, loss, "llama", batch, micro_batch_size=2)
    compare_update(h, suite_losses()[0], "qwen3-tied", batch)
    model, model_type, _ = TIED_QWEN2
    tied = h.unless_refused(partial(h.training, model=model, fresh=True), kind="training", what=_folder(model),
                            model_type=model_type)
    if tied is None:
        h.note(f"refused (ConfigError naming the model_type): {model_type}")
    else:
        compare_update(h, suite_losses()[0], model, batch, engine=tied)


@check("numerics")
def check_pad_token_as_real_token_update(h: Harness) -> None:
    """One update on a batch whose responses hold the pad id as a real token (a sampled pad, or a pad id equal to EOS) equals the float64 reference: transformers' embedding has padding_idx=pad_token_id, so the pad row gets no gradient from the lookup (a tied model's lm_head share of the row stays); the actor's on Llama and tied Qwen3, and a critic's value-loss update where the backend provides one declaring values."""
    batch = h.batch(seed=17, rl_fields=True)
    pad = batch.meta.pad_token_id
    ids, mask = batch["response_ids"].clone(), batch["response_mask"]
    lengths = mask.sum(1)
    rows = (lengths >= 3).nonzero().squeeze(1)
    ids[rows, 1] = pad  # a real token, inside the response
    batch = batch.update(response_ids=ids)
    for model in ("llama", "qwen3-tied"):
        compare_update(h, suite_losses()[0], model, batch)
    if h.provides(h.subject, "critic") and h.training("critic").capabilities.values:
        compare_critic_update(h, h.training("critic", fresh=True), batch, VALUE_MSE,
                              "critic value_mse with the pad id as a real response token")


def compare_critic_update(h: Harness, engine: TrainingEngine, batch: TensorBatch, loss: SuiteLoss | NamedLoss,
                          label: str) -> None:
    """One update of a fresh critic on the value-head folder vs the float64 reference: loss, grad norm,
    every gradient."""
    metrics, grad_norm, grads = one_update(h, engine, batch, loss)
    ref = ReferenceModel(h.model_path("value"), SUITE_OPTIM).loss_and_grads(batch, loss, GlobalBatchStats.of(batch))
    h.scalar_close(metrics["loss"], ref.loss, "loss", f"{label} loss vs float64 reference")
    h.scalar_close(grad_norm, ref.grad_norm, "loss", f"{label} grad norm vs float64 reference")
    for name, g in ref.grads.items():
        h.expect(name in grads, f"critic export lacks {name}")
        h.close_to(grads[name], g, "grad", f"{label}: gradient of {name} vs float64 reference")  # type: ignore[arg-type]


@check("numerics", gates=("training.values",))
def check_value_loss_matches_reference(h: Harness) -> None:
    """A critic's value loss, grad norm and gradients equal the float64 reference."""
    critic = h.training("critic")
    if not critic.capabilities.values:
        h.skip("backend declares values=False (no value head)")
    batch = h.batch(seed=14, rl_fields=True)
    losses: list[SuiteLoss | NamedLoss] = [VALUE_MSE]
    registered = registered_critic_loss()
    if registered is not None:
        losses.append(registered)
    for loss in losses:
        compare_critic_update(h, h.training("critic", fresh=True, micro_batch_size=2), batch, loss,
                              f"critic {loss.name}")


@check("numerics", gates=("rollout.temperature", "rollout.top_k", "rollout.top_p", "rollout.exact_log_probs",
                           "rollout.exact_log_probs_truncated"))
def check_rollout_log_probs_match_reference(h: Harness) -> None:
    """rollout_log_probs equal the float64 reference of log softmax(logits / T) where the engine declares them exact, greedy decoding's too; on a Qwen2 and a tied Qwen3 folder with every tensor moved (q/k/v biases and norm weights other than zeros and ones), those of the first configuration declared exact; a Qwen folder refused with a ConfigError naming its model_type is listed as refused (where both are, the perturbed Llama is compared instead: its norm weights)."""
    engine = h.rollout()
    prompts = h.batch(seed=15, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")
    caps = engine.capabilities
    temperatures = _TEMPERATURES if caps.temperature else (1.0,)
    cases = [SamplingParams(temperature=t, max_new_tokens=6, n=2, seed=3) for t in temperatures]
    if caps.temperature and caps.top_k and caps.top_p:
        cases.append(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=6, n=2, seed=3))
    # greedy decoding takes the argmax, and its log-probs are still of softmax(logits / T)
    cases.append(SamplingParams(greedy=True, temperature=temperatures[-1], max_new_tokens=6))
    checked = 0
    for params in cases:
        if not engine.log_probs_exact(params):
            continue
        out = engine.generate(prompts, params)
        # the reference is of the temperature asked for: a wrong meta is schema::generate_layout's failure
        ref = cached_outputs(h.model_path("llama"), out.with_meta(temperature=params.temperature))["log_probs"]
        what = (f"rollout_log_probs {'of greedy decoding ' if params.greedy else ''}at temperature {params.temperature}"
                + (f", top_k {params.top_k}, top_p {params.top_p}" if params.truncates else ""))
        h.close_to(out["rollout_log_probs"], ref, "log_probs", f"{what} vs float64 reference of log softmax(logits/T)",
                   mask=out["response_mask"])
        checked += 1
    if not checked:
        h.skip("the engine declares its rollout_log_probs inexact for every sampling configuration")
    engines, refused = family_rollouts(h)
    for model, what, engine in engines:
        exact = next((p for p in cases if engine.log_probs_exact(p)), None)
        if exact is None:
            continue
        out = engine.generate(prompts, exact)
        ref = cached_outputs(h.model_path(model), out.with_meta(temperature=exact.temperature))["log_probs"]
        h.close_to(out["rollout_log_probs"], ref, "log_probs",
                   f"rollout_log_probs on {what}, {'greedy' if exact.greedy else 'sampled'} at temperature "
                   f"{exact.temperature}, vs float64 reference of log softmax(logits/T)", mask=out["response_mask"])
    h.note(f"compared on llama and {', '.join(m for m, _, _ in engines)}"
           + (f"; refused (ConfigError naming the model_type): {', '.join(refused)}" if refused else ""))
