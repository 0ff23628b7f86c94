"""Weight sync: export streams are well formed; rollout engines apply complete streams and reject bad ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from safetensors.torch import load_file
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.harness import BFLOAT16_RUN, Harness, collect_stream, messages_kinds
from verl_conformance.losses import TOKEN_MEAN_PG
from verl_conformance.reference import cached_outputs
from verl_core import (
    GlobalBatchStats,
    RolloutEngine,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    TensorInfo,
    TrainingEngine,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSync,
    WeightSyncError,
    stream_weights,
)
from verl_core.enginekit.weight_stream import fusion_group


def folder_weights(path: str) -> dict[str, Tensor]:
    """The tensors of a test-kit folder by transformers name."""
    return load_file(f"{path}/model.safetensors")


def folder_stream(path: str, version: int, *, dtype: torch.dtype = torch.float32,
                  tied: bool = False) -> Iterator[WeightMessage]:
    """A canonical weight stream of a folder's tensors (what a correct trainer would send)."""
    tensors = folder_weights(path)
    if tied:
        tensors.pop("lm_head.weight", None)
    manifest = WeightManifest(version, {n: TensorInfo(tuple(t.shape), dtype) for n, t in tensors.items()}, tied)
    return stream_weights(sorted(tensors.items(), key=lambda kv: fusion_group(kv[0])), manifest,
                          bucket_bytes=64 * 1024, dtype=dtype)


def _prompts(h: Harness) -> TensorBatch:
    return h.batch(seed=50, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")


def _serves(h: Harness, engine: RolloutEngine, model: str, what: str) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
    out = engine.generate(_prompts(h), params)
    if not engine.log_probs_exact(params):
        h.skip("rollout_log_probs are declared inexact at temperature 1; cannot tell which weights serve")
    ref = cached_outputs(h.model_path(model), out)["log_probs"]
    h.close_to(out["rollout_log_probs"], ref, "log_probs",
               f"{what}: rollout_log_probs vs the float64 reference of the weights that were sent "
               "(a sync that does not apply the weights leaves the old ones serving)",
               mask=out["response_mask"])


@check("weight_sync", gates=("training.dtypes",))
def check_bfloat16_export_after_update_is_the_rounded_model(h: Harness) -> None:
    """In bfloat16, after an update (float32 masters where the engine keeps them), export_weights() streams the model's bfloat16 tensors and export_weights(dtype=float32) the same values: what the rollout serves, never the float32 masters."""
    if h.dtype != "bfloat16":
        h.skip(f"a check of bfloat16 engines (their float32 masters must not be exported); this run builds {h.dtype} "
               f"(bfloat16: {BFLOAT16_RUN})")
    engine = h.training(fresh=True)
    batch = h.batch(seed=96, rl_fields=True)
    engine.forward_backward(batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    engine.optimizer_step()
    _, plain = collect_stream(engine.export_weights())
    _, wide = collect_stream(engine.export_weights(dtype=torch.float32))
    what = "export_weights of a bfloat16 engine after one update"
    wrong = sorted(n for n, t in plain.items() if t.dtype != torch.bfloat16)
    h.expect(not wrong, f"{what}, no dtype asked: {len(wrong)} tensors not in bfloat16 (e.g. {wrong[:1]} in "
             f"{plain[wrong[0]].dtype if wrong else ''}); stream the model's bfloat16 parameters (the masters as "
             "store() rounded them), not the optimizer's float32 masters")
    for name, t in wide.items():
        rounded = t.to(torch.bfloat16).float()
        h.expect(torch.equal(rounded, t.float()), f"{what}, dtype=float32: {name} holds values bfloat16 cannot "
                 f"represent (largest gap {float((rounded - t.float()).abs().max()):.3g}): the float32 masters were "
                 "streamed instead of the bfloat16 weights the model runs and the rollout serves")
        if name in plain:
            h.expect(torch.equal(plain[name].float(), t.float()),
                     f"{what}: {name} differs between export_weights() and export_weights(dtype=float32)")


@check("weight_sync")
def check_export_matches_folder(h: Harness) -> None:
    """export_weights streams manifest, chunks, commit in transformers naming, equal to the folder's tensors; export_weights(dtype=bfloat16) casts every tensor."""
    for model in ("llama", "llama-tied"):
        engine = h.training(model=model)
        msgs, tensors = collect_stream(engine.export_weights(bucket_bytes=64 * 1024))
        kinds = messages_kinds(msgs)
        h.expect(kinds[0] == "manifest" and kinds[-1] == "commit" and set(kinds[1:-1]) <= {"chunk"},
                 f"{model}: export stream must be manifest, chunks, commit; got {kinds}")
        manifest = msgs[0]
        assert isinstance(manifest, WeightManifest)
        commit = msgs[-1]
        h.expect(manifest.version == 0 and isinstance(commit, WeightCommit) and commit.version == 0,
                 f"{model}: an engine that never stepped exports version {manifest.version} (commit "
                 f"{getattr(commit, 'version', None)}); the version is the count of applied optimizer steps, 0 here")
        want = folder_weights(h.model_path(model))
        tied = model.endswith("tied")
        if tied:
            want.pop("lm_head.weight", None)
            h.expect(manifest.tied_embeddings, f"{model}: manifest.tied_embeddings must be True for a tied model")
        h.expect(set(tensors) == set(want),
                 f"{model}: exported names differ from the folder's transformers names: missing "
                 f"{sorted(set(want) - set(tensors))[:4]}, unexpected {sorted(set(tensors) - set(want))[:4]}")
        h.expect(set(manifest.tensors) == set(tensors), f"{model}: manifest names differ from the sent tensors")
        for name, t in want.items():
            h.close_to(tensors[name].float(), t, "weights", f"{model}: exported {name} vs the folder")
        groups: dict[str, int] = {}
        for i, msg in enumerate(msgs):
            if isinstance(msg, WeightChunk):
                for name, _ in msg.tensors:
                    g = groups.setdefault(fusion_group(name), i)
                    h.expect(g == i, f"{model}: fusion group {fusion_group(name)} is split across chunks "
                             "(q/k/v and gate/up must travel together)")
    # the receiver's dtype: every tensor cast to it, and the manifest says so
    msgs, tensors = collect_stream(h.training().export_weights(dtype=torch.bfloat16))
    manifest = msgs[0]
    assert isinstance(manifest, WeightManifest)
    wrong = sorted(n for n, t in tensors.items() if t.dtype != torch.bfloat16)
    h.expect(not wrong, f"export_weights(dtype=torch.bfloat16) sent {len(wrong)} tensors in another dtype (e.g. "
             f"{wrong[:1]} in {tensors[wrong[0]].dtype if wrong else ''}); cast every tensor to the dtype asked, the "
             "receiver's")
    undeclared = sorted(n for n, info in manifest.tensors.items() if info.dtype != torch.bfloat16)
    h.expect(not undeclared, f"export_weights(dtype=torch.bfloat16): the manifest declares {undeclared[:2]} in "
             "another dtype than bfloat16")
    want = folder_weights(h.model_path("llama"))
    for name, t in want.items():
        h.close_to(tensors[name].float(), t.to(torch.bfloat16).float(), "weights",
                   f"export_weights(dtype=torch.bfloat16): {name} vs the folder's tensor cast to bfloat16")


def synced_to_alt(h: Harness, version: int) -> RolloutEngine:
    """A fresh rollout engine given a complete stream of ``llama-alt`` as ``version`` (the check is
    skipped when the engine declares ``weight_update=False``)."""
    engine = h.rollout(fresh=True)
    if not engine.capabilities.weight_update:
        h.skip("backend declares weight_update=False")
    engine.update_weights(folder_stream(h.model_path("llama-alt"), version, dtype=engine.weight_dtype))
    return engine


@check("weight_sync", gates=("rollout.weight_update",))
def check_rollout_applies_stream(h: Harness) -> None:
    """After update_weights(a complete stream of other weights) the rollout engine serves them, at that version."""
    engine = synced_to_alt(h, 5)
    h.expect(engine.weight_version == 5, f"weight_version is {engine.weight_version} after a sync to version 5")
    _serves(h, engine, "llama-alt", "after update_weights(stream of llama-alt, version 5)")


def _bad_streams(path: str, dtype: torch.dtype) -> dict[str, Callable[[], Iterator[WeightMessage]]]:
    def no_commit() -> Iterator[WeightMessage]:
        for m in folder_stream(path, 9, dtype=dtype):
            if not isinstance(m, WeightCommit):
                yield m

    def half() -> Iterator[WeightMessage]:
        seen = 0
        for m in folder_stream(path, 9, dtype=dtype):
            if isinstance(m, WeightChunk):
                seen += 1
                if seen > 1:
                    continue
            yield m

    def wrong_shape() -> Iterator[WeightMessage]:
        tensors = folder_weights(path)
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name][:, :-1].contiguous()
        manifest = WeightManifest(9, {n: TensorInfo(tuple(t.shape), dtype) for n, t in tensors.items()})
        return stream_weights(sorted(tensors.items(), key=lambda kv: fusion_group(kv[0])), manifest,
                              bucket_bytes=1 << 30, dtype=dtype)

    def nan() -> Iterator[WeightMessage]:
        for m in folder_stream(path, 9, dtype=dtype):
            if isinstance(m, WeightChunk) and any(n == "model.norm.weight" for n, _ in m.tensors):
                m = WeightChunk(tuple((n, t.clone().fill_(float("nan")) if n == "model.norm.weight" else t)
                                      for n, t in m.tensors))
            yield m

    def chunk_first() -> Iterator[WeightMessage]:
        msgs = list(folder_stream(path, 9, dtype=dtype))
        yield msgs[1]
        yield msgs[0]
        yield from msgs[2:]

    return {"stream without commit": no_commit, "stream missing chunks": half,
            "tensor of the wrong shape": wrong_shape, "NaN weights": nan, "chunk before the manifest": chunk_first}


@check("weight_sync", gates=("rollout.weight_update",))
def check_bad_streams_rejected(h: Harness) -> None:
    """Partial or malformed streams raise WeightSyncError, leave the engine stale, and a full sync recovers it."""
    engine = h.rollout(fresh=True)
    if not engine.capabilities.weight_update:
        h.skip("backend declares weight_update=False")
    alt = h.model_path("llama-alt")
    for what, make in _bad_streams(alt, engine.weight_dtype).items():
        try:
            engine.update_weights(make())
        except WeightSyncError:
            pass
        except Exception as e:
            h.fail(f"update_weights({what}) raised {type(e).__name__}: {e}; expected WeightSyncError")
        else:
            h.fail(f"update_weights({what}) was accepted; it must raise WeightSyncError")
        try:
            engine.generate(_prompts(h), SamplingParams(max_new_tokens=2, seed=0))
        except StaleWeightsError:
            pass
        except Exception as e:
            h.fail(f"generate after a failed sync ({what}) raised {type(e).__name__}: {e}; expected StaleWeightsError")
        else:
            h.fail(f"generate after a failed sync ({what}) served; the engine must be stale "
                   "(raise StaleWeightsError) until a complete sync succeeds")
    engine.update_weights(folder_stream(alt, 10, dtype=engine.weight_dtype))
    _serves(h, engine, "llama-alt", "after failed syncs then a complete one")


@check("weight_sync")
def check_trainer_to_rollout_sync(h: Harness) -> None:
    """After a training step and a sync, rollout log-probs equal the trainer's log-probs of the same samples, through the stream and, where the pair registers one, through its direct sync (pairs with --verl-against for a missing role)."""
    src, dst = h.sync_pair()  # a backend with one of the two roles is paired with --verl-against's other
    actor = h.training(fresh=True, subject=src)
    batch = h.batch(seed=51, rl_fields=True)
    actor.forward_backward(batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    actor.optimizer_step()
    for sync in h.trainer_syncs(src, dst):  # the trainer's path first; the stream is the fallback's
        rollout = h.rollout(fresh=True, subject=dst)
        _synced_rollout_serves_trainer(h, actor, rollout, sync)


def _synced_rollout_serves_trainer(h: Harness, actor: TrainingEngine, rollout: RolloutEngine, sync: WeightSync) -> None:
    """:func:`check_trainer_to_rollout_sync` through ``sync``: version 1 sent, then the log-probs compared."""
    via = f"through {type(sync).__name__}"
    sync.sync(actor, rollout, version=1)
    h.expect(rollout.weight_version == 1,
             f"rollout weight_version is {rollout.weight_version} after sync(version=1) {via}")
    params = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=11)
    if not rollout.log_probs_exact(params):
        h.skip("rollout_log_probs are declared inexact at temperature 0.8")
    out = rollout.generate(_prompts(h), params)
    h.expect(out.meta.weight_version == 1,
             f"generated batch carries weight_version {out.meta.weight_version}, expected 1 ({via})")
    trainer = actor.forward(out)["log_probs"]
    before = cached_outputs(h.model_path("llama"), out)["log_probs"]
    m = out["response_mask"]
    h.expect(float((trainer.double() - before).abs()[m].max()) > 1e-3,
             "the training step did not change the trainer's log-probs; cannot test the sync")
    h.close_to(out["rollout_log_probs"], trainer, "log_probs",
               f"rollout_log_probs after a sync {via} vs the trainer's log_probs of the same samples "
               "(a sync that does not apply the weights leaves the old ones serving)", mask=m)
