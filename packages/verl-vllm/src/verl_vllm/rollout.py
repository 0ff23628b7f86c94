"""The vLLM rollout engine: generation with exact log-probs where vLLM can give them, and live
weight sync from the canonical weight stream.

The engine runs one ``vllm.LLM`` in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so weight chunks reach the model by reference. Importing this module without vLLM installed raises
an ImportError naming ``pip install 'verl-vllm[cuda]'`` and ``'verl-vllm[cpu]'``.

Log-probs: vLLM's ``logprobs_mode`` is an engine-wide setting, not a per-request one. The engine
is built with ``processed_logprobs`` by default, which reports log softmax(logits / T) after
top-k/top-p: that is the schema's quantity for every untruncated configuration (T = 1 and T != 1)
and not for truncated ones. Greedy requests are sampled by vLLM at temperature 0 and report
log softmax(logits), exact only when ``params.temperature == 1``. :meth:`VllmRolloutEngine.
log_probs_exact` says which case a SamplingParams falls in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import torch
from torch import Tensor

from verl_core import (
    ConfigError,
    EngineAsleepError,
    EngineSpec,
    RolloutCapabilities,
    SamplingParams,
    TensorBatch,
    VerlError,
    WeightManifest,
    WeightMessage,
    WeightSyncError,
    apply_weight_stream,
)
from verl_core.enginekit.gates import refuse_undeclared
from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.enginekit.rollout_base import GenerateLimits, Responses, RolloutEngineBase
from verl_vllm._import import import_vllm
from verl_vllm.config import VllmRolloutConfig
from verl_vllm.model_files import ModelFiles, read_model_files
from verl_vllm.plugin import ROLLOUT_CAPABILITIES

_vllm = import_vllm()

from verl_vllm.llm_process import (  # noqa: E402  (after the import check, which explains a missing vLLM)
    check_platform,
    refresh_tied_lm_head,
    shutdown_llm,
    start_llm,
)
from verl_vllm.requests import build_requests, responses, sample_seed  # noqa: E402

__all__ = ["EngineAsleepError", "VllmRolloutEngine", "build_rollout_engine", "sample_seed"]

# vLLM raises temperatures in (0, 0.01) to 0.01; sampling there would not follow the request.
_MIN_TEMPERATURE: Final = 1e-2
_OPEN_ENGINES: set[int] = set()
"""Keys of this process's open engines: in-process vLLM engines share one process-wide distributed
state, which a full shutdown tears down (see :meth:`VllmRolloutEngine.close`)."""
_ENGINE_KEYS = itertools.count()


def _release(llm: Any, key: int) -> None:
    """Shut an engine's vLLM down, its own parts only while other engines of this process are open:
    what ``close()`` runs, and the finalizer of an engine dropped without it (vLLM's own client
    finalizer would run the full shutdown when the LLM is collected, under the engines still open)."""
    _OPEN_ENGINES.discard(key)
    shutdown_llm(llm, others_open=bool(_OPEN_ENGINES))


def build_rollout_engine(spec: EngineSpec) -> VllmRolloutEngine:
    """Factory of the ``vllm`` backend's rollout role (options validated by VllmRolloutConfig)."""
    from verl_core.kernel.registry import parse_options

    config = parse_options(VllmRolloutConfig, spec.options, where="backend 'vllm' options")
    return VllmRolloutEngine(spec, config)


class VllmRolloutEngine(RolloutEngineBase):
    """A RolloutEngine over an in-process ``vllm.LLM``.

    Args:
        spec: Model folder, dtype, device, seed and the longest prompt and response. The model's
            context is ``max_prompt_len + max_response_len`` tokens.
        config: vLLM options (KV cache bytes, logprobs mode, scheduler limits).

    Raises:
        ConfigError: the spec asks for something this engine does not do (another role,
            parallel sizes > 1, a device vLLM is not built for, a context longer than the model's).
    """

    def __init__(self, spec: EngineSpec, config: VllmRolloutConfig | None = None) -> None:
        if spec.role != "rollout":
            raise ConfigError(f"the vllm backend provides role 'rollout' only, got {spec.role!r}")
        if spec.parallel.world_size != 1:
            raise ConfigError(
                f"the vllm rollout engine runs one replica on one device; got parallel sizes "
                f"tp={spec.parallel.tp} pp={spec.parallel.pp} dp={spec.parallel.dp}. Use tp=pp=dp=1 "
                "and start one engine per replica"
            )
        refuse_undeclared(spec, ROLLOUT_CAPABILITIES, engine="the vllm rollout engine")
        self._spec = spec
        self._config = config or VllmRolloutConfig()
        self._files: ModelFiles = read_model_files(spec.model_path, spec.torch_dtype)
        max_model_len = spec.max_prompt_len + spec.max_response_len
        if self._files.max_positions is not None and max_model_len > self._files.max_positions:
            raise ConfigError(
                f"max_prompt_len + max_response_len = {max_model_len} exceeds the model's "
                f"max_position_embeddings {self._files.max_positions}; lower them in the EngineSpec"
            )
        self._on_gpu = check_platform(spec.device)
        self._llm = start_llm(spec, self._config, on_gpu=self._on_gpu, max_model_len=max_model_len)
        self._tokenizer = HFTokenizer(self._llm.get_tokenizer(), self._files.vocab_size)
        self._caps = dataclasses.replace(ROLLOUT_CAPABILITIES, sleep_frees_memory=self._on_gpu,
                                         prefix_continuation=self._config.enable_prefix_caching)
        key = next(_ENGINE_KEYS)
        _OPEN_ENGINES.add(key)
        # holds the LLM, not the engine: a dropped engine is collected, and this shuts its vLLM down
        self._shutdown = weakref.finalize(self, _release, self._llm, key)
        self.last_sync_seconds: Mapping[str, float] = {}
        """Wall time of the last update_weights: ``receive_apply`` and ``reset_cache`` seconds."""

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def config(self) -> VllmRolloutConfig:
        """The vLLM options the engine was built with."""
        return self._config

    @property
    def capabilities(self) -> RolloutCapabilities:
        """Declared capabilities (sleep frees memory on GPU only; prefix continuation with prefix caching)."""
        return self._caps

    @property
    def tokenizer(self) -> HFTokenizer:
        """Tokenizer of the model."""
        return self._tokenizer

    @property
    def weight_dtype(self) -> torch.dtype:
        """Dtype the engine wants weight streams in."""
        return self._spec.torch_dtype

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (for inspection; generation goes through :meth:`generate`)."""
        return self._llm

    # ------------------------------------------------------------------ generation
    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Whether ``rollout_log_probs`` equal log softmax(logits / T) under ``params``.

        Greedy: vLLM reports log softmax(logits), so exact iff T == 1. Sampling with top-k/top-p:
        never (vLLM reports the truncated distribution). Otherwise exact in ``processed_logprobs``
        mode at any T, and in ``raw_logprobs`` mode at T == 1 only.
        """
        if params.greedy:
            return params.temperature == 1.0
        if params.truncates:
            return False
        return self._config.logprobs_mode == "processed_logprobs" or params.temperature == 1.0

    def _generate_limits(self) -> GenerateLimits:
        # Outputs land on the host, and vLLM keeps its logits to itself.
        return GenerateLimits(vocab_size=self._tokenizer.vocab_size, device=torch.device("cpu"),
                              min_temperature=_MIN_TEMPERATURE,
                              temperature_reason="vLLM silently raises lower ones to 0.01")

    def _sample_seeds(self, rows: TensorBatch, params: SamplingParams) -> list[int]:
        """Each row's request seed from :func:`sample_seed`; none when unseeded (vLLM's own state)."""
        if params.seed is None:
            return []
        return [sample_seed(params.seed, group_id=g, sample_index=i)
                for g, i in zip(rows["group_ids"].tolist(), rows["sample_index"].tolist(), strict=True)]

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        """Send the rows to vLLM as token ids (left padding stripped, never re-tokenised).

        With a seed, every sample is its own request seeded by :func:`sample_seed`, so samples do
        not depend on batch order; without one, vLLM samples the ``n`` responses of a prompt in one
        request (greedy: one request per sample, as vLLM refuses n > 1 for greedy requests).
        """
        requests, sampling = build_requests(rows, params, seeds, self._tokenizer.eos_token_id)
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        completions: list[Any] = []
        for out in outputs:
            completions.extend(sorted(out.outputs, key=lambda c: c.index))
        if len(completions) != rows.batch_size:
            raise VerlError(
                f"vLLM returned {len(completions)} completions for {rows.batch_size // params.n} prompts x "
                f"n={params.n}; expected {rows.batch_size}"
            )
        return responses(completions, pad=self._tokenizer.pad_token_id)

    # ------------------------------------------------------------------ weights
    def _check_manifest(self, stream: Iterable[WeightMessage]) -> Iterator[WeightMessage]:
        for i, msg in enumerate(stream):
            if i == 0 and isinstance(msg, WeightManifest) and msg.tied_embeddings != self._files.tied_embeddings:
                raise WeightSyncError(
                    f"weight manifest says tied_embeddings={msg.tied_embeddings}, the receiving model "
                    f"has tied_embeddings={self._files.tied_embeddings}; sync from the same architecture"
                )
            yield msg

    def _reload(self, chunk: list[tuple[str, Tensor]]) -> None:
        # vLLM's in-place reload maps transformers names onto its fused parameters (q/k/v, gate/up
        # arrive in one chunk by the stream's contract) and re-runs the CPU backend's repacking.
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": chunk})

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream: check the manifest, reload chunk by chunk, reset the prefix cache.

        The engine is stale from the first message until the commit succeeds; on any failure it
        stays stale (``generate`` raises StaleWeightsError) until a complete sync succeeds.

        Raises:
            WeightSyncError: the stream is malformed or incomplete, or vLLM failed to load a chunk.
        """
        self._check_ready("update_weights")  # before the try: a refusal is not a failed sync
        t0 = time.perf_counter()
        try:
            with self._writing_weights():
                manifest = apply_weight_stream(
                    self._check_manifest(stream),
                    self._files.tensors,
                    self._reload,
                    optional=self._files.optional,
                )
                if self._files.tied_embeddings:
                    try:
                        self._llm.collective_rpc(refresh_tied_lm_head)
                    except Exception as e:
                        raise WeightSyncError(
                            f"weights loaded but re-packing the tied lm_head failed ({type(e).__name__}: {e}); "
                            "the engine is stale until a complete update_weights() succeeds"
                        ) from e
                t1 = time.perf_counter()
                self._llm.reset_prefix_cache()
                self.last_sync_seconds = {"receive_apply": t1 - t0, "reset_cache": time.perf_counter() - t1}
                self._commit_weights(manifest.version)
        except BaseException as e:
            # Already stale; a failure here changes nothing the next complete sync does not redo.
            with contextlib.suppress(Exception):
                self._llm.reset_prefix_cache()
            if isinstance(e, Exception) and not isinstance(e, WeightSyncError):
                raise WeightSyncError(
                    f"weight sync failed part-way ({type(e).__name__}: {e}); the engine is stale until a "
                    "complete update_weights() succeeds"
                ) from e
            raise

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """On GPU release weights and KV cache (vLLM sleep mode); on CPU only pause scheduling.

        With ``sleep_level=2`` the weights are discarded, so the engine is stale until the next
        complete weight sync.
        """
        self._check_ready("sleep")
        if self._on_gpu:
            self._llm.sleep(level=self._config.sleep_level)
            if self._config.sleep_level == 2:
                self._mark_stale("sleep(level=2) discarded the weights")
        else:
            self._llm.sleep(level=0)
        self._asleep = True

    def wake(self) -> None:
        """Restore what :meth:`sleep` released (a no-op when awake)."""
        if not self._asleep or self._closed:
            return
        if self._on_gpu:
            self._llm.wake_up()
        else:
            self._llm.wake_up(tags=["scheduling"])
        self._asleep = False

    def close(self) -> None:
        """Shut vLLM down and drop the model; the engine is unusable afterwards.

        vLLM's engine shutdown also destroys the process-wide distributed state (model-parallel
        groups) that every in-process engine uses, so while other engines of this process are
        open only this engine's own parts are shut down, and the last one to close does the rest.
        """
        if self._closed:
            return
        self._closed = True
        self._shutdown()  # runs _release once (a dropped engine's finalizer would otherwise)
        del self._llm
        gc.collect()
