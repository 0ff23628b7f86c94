"""Token sampling shared by rollout engines: per-sample seeds, uniform tables, one decode step,
and the static decode loop.

A sample's random stream is fixed by (seed, group id, sample index) (:func:`sample_seed`), so it
does not depend on the other samples of a batch or their order. Its uniforms are the first draws
of its own generator (:func:`uniform_table`), and a token is the inverse CDF of the top-k /
nucleus-restricted distribution at that uniform (:func:`kept_probs`, :func:`inverse_cdf`).
:class:`TokenSampler` runs one decode step without any host synchronisation, so a whole decode
step can be captured in a CUDA graph; :class:`StaticDecodeLoop` is that loop, with an engine's
model calls left to a subclass, steps that attend over growing windows of the cache
(:func:`cache_windows`) and a CUDA graph per window; :class:`GraphCaptures` keeps an engine's
record of which shapes capture and which fell back to eager steps, and :class:`StaticDecoders`
keeps an engine's decoder for reuse.
:func:`eager_decode` is the loop of engines that decode step by step on the host, over a
generator of the engine's logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from typing import Any, Final, Generic, TypeVar

import torch
from torch import Tensor

from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.rollout import SamplingParams
from verl_core.kernel.schema import FIELDS

__all__ = [
    "PROMPT_WIDTH_MULTIPLE",
    "CompiledOrEager",
    "GraphCaptures",
    "StaticDecodeLoop",
    "StaticDecoders",
    "MAX_CACHE_WINDOWS",
    "TokenSampler",
    "cache_windows",
    "compiled_sampling_step",
    "cuda_graph_capture",
    "eager_decode",
    "expand_prompts",
    "inverse_cdf",
    "kept_probs",
    "mark_window_dynamic",
    "sample_seed",
    "sampling_step",
    "slow_path_notes",
    "static_prompt_width",
    "tempered_log_probs",
    "uniform_table",
]

_MASK63: Final = (1 << 63) - 1

PROMPT_WIDTH_MULTIPLE: Final = 32
"""Static decoders left-pad prompts to a multiple of this, so a few shapes serve every batch."""


def static_prompt_width(width: int) -> int:
    """``width`` rounded up to :data:`PROMPT_WIDTH_MULTIPLE` (at least one multiple)."""
    return max(1, -(-width // PROMPT_WIDTH_MULTIPLE)) * PROMPT_WIDTH_MULTIPLE


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """The 63-bit seed of one sample's random stream: a BLAKE2b hash of (seed, group id, sample index)."""
    digest = hashlib.blake2b(f"{seed}:{group_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def uniform_table(seeds: Sequence[int], steps: int, device: torch.device | str = "cpu") -> Tensor:
    """[len(seeds), steps] float64 uniforms: row r holds the first draws of sample r's own generator.

    The values one draw per decode step would give, drawn once so no step waits for the host.
    """
    draws = [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    return torch.stack(draws).to(device) if draws else torch.zeros(0, steps, dtype=torch.float64, device=device)


def expand_prompts(
    prompts: TensorBatch, params: SamplingParams, *, pad_token_id: int, weight_version: int
) -> tuple[TensorBatch, BatchMeta]:
    """The rows a generate call fills, and the meta of its output.

    Each prompt is repeated ``params.n`` times (its samples adjacent, sharing its group id and
    extras), without any response field the input carried. The meta records what the log-probs
    are of (temperature, top-p, top-k), the pad id and the weight version that generated them.
    """
    base = prompts.drop(*[n for n, f in FIELDS.items() if "response" in f.dims or n == "truncated"])
    meta = dataclasses.replace(
        prompts.meta, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        pad_token_id=pad_token_id, weight_version=weight_version,
    )
    return base.repeat_interleave(params.n), meta


def tempered_log_probs(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / T)`` over the last dimension, in float32 (T = 1 skips the division).

    The log-probs and entropy of the batch layout are of this distribution (docs/architecture.md,
    "Batch layout"); every engine computes them here.
    """
    z = logits.float()
    return torch.log_softmax(z / temperature if temperature != 1.0 else z, -1)


def kept_probs(scaled: Tensor, top_k: int, top_p: float, *, ranking: Tensor | None = None) -> Tensor:
    """softmax(scaled) with the tokens outside the top-k / nucleus set zeroed (not renormalised).

    Tokens are ranked by ``ranking`` (default: ``scaled``) from the largest value down, equal
    values by token id, lowest first: the order in which ``torch.argmax`` finds the first
    maximum, so the first token of the ranking is always greedy's. Top-k keeps exactly the first
    ``top_k`` tokens of the ranking, even where more tokens tie with the k-th (bfloat16 logits tie
    often); the nucleus is the shortest prefix of the ranking (after top-k) whose mass reaches
    ``top_p``, so a tie at its boundary keeps the lower ids. The first token of the ranking always
    stays. :class:`TokenSampler` passes the float32 logits as ``ranking``: dividing by the
    temperature can round two distinct logits to one value, and then the tie rule would part
    from greedy's argmax over the logits.

    Args:
        scaled: Tempered logits (or log-probs) ``[..., vocab]``; their softmax is what is kept.
        top_k: Tokens kept (0, or at least the vocabulary: all).
        top_p: Nucleus mass (1.0: all).
        ranking: Values that rank the tokens (a monotone function of ``scaled``), same shape.
    """
    probs = torch.softmax(scaled, -1)
    rank_by = scaled if ranking is None else ranking
    vocab = scaled.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if top_p >= 1.0:
        if k < vocab:
            kth = torch.topk(rank_by, k, dim=-1).values[..., -1:]
            above = rank_by > kth
            tied = rank_by == kth
            room = k - above.sum(-1, keepdim=True)  # how many of the tokens tied with the k-th stay
            probs = torch.where(above | (tied & (tied.cumsum(-1) <= room)), probs, 0.0)
        return probs
    # A stable descending sort keeps equal values in token-id order: the ranking, in one pass.
    order = torch.sort(rank_by, dim=-1, descending=True, stable=True).indices
    sorted_p = probs.gather(-1, order)
    if k < vocab:
        sorted_p[..., k:] = 0.0
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked before each one
    keep_sorted = before < top_p * sorted_p.sum(-1, keepdim=True)  # the first token: 0 < top_p * mass
    return torch.zeros_like(probs).scatter(-1, order, torch.where(keep_sorted, sorted_p, 0.0))


_CDF_BLOCK: Final = 256
"""Tokens per block of :func:`inverse_cdf`'s two-level float64 CDF."""


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids where each row's (unnormalised, vocabulary-order) CDF first exceeds ``uniforms`` x its total.

    The CDF is float64 and summed in two levels: within blocks of :data:`_CDF_BLOCK` tokens, then
    over the block totals. The block holding the target comes from the running block totals, the
    token from the block's own running sums, so one decode step scans short rows in parallel
    instead of the whole vocabulary in one sequential pass (on an H200 at 128 x 32,000: about 4x
    less time than a full-row float64 cumsum). Zero-probability tokens are never chosen, except
    where float64 rounding puts the target within one ulp of a row's total.

    Where the target lies is counted (how many running sums are at most the target: sums of
    non-negative terms never decrease, so the count is the index of the first sum above it,
    ``searchsorted(..., right=True)``), a comparison and a sum that ``torch.compile`` fuses into
    the scans (inductor cannot lower ``searchsorted`` over these views).
    """
    rows, vocab = probs.shape
    block = _CDF_BLOCK
    p = probs.double()
    if vocab % block:
        p = torch.nn.functional.pad(p, (0, block - vocab % block))
    sums = p.view(rows, -1, block).cumsum(-1)  # [rows, blocks, block]: running sums within each block
    ends = sums[..., -1].cumsum(-1)  # [rows, blocks]: the CDF at each block's last token
    target = (uniforms.double() * ends[:, -1]).unsqueeze(-1)
    b = (ends <= target).sum(-1, keepdim=True).clamp_max(ends.shape[1] - 1)
    before = torch.where(b > 0, ends.gather(-1, (b - 1).clamp_min(0)), 0.0)
    within = sums.gather(1, b.unsqueeze(-1).expand(rows, 1, block)).squeeze(1)
    i = (within <= target - before).sum(-1, keepdim=True).clamp_max(block - 1)
    return (b * block + i).squeeze(-1).clamp_max(vocab - 1)


class TokenSampler:
    """One decode step's sampling: token, log-prob and stop flag per row from float32 logits.

    Pure tensor code with no host synchronisation (it runs inside a CUDA graph too): uniforms come
    from a precomputed [rows, steps] table (:func:`uniform_table`; None samples greedily), the step
    index may be a device tensor. Greedy takes ``argmax(logits)`` (ties: the lowest id), and top-k /
    the nucleus rank tokens by the same logits with the same tie rule (:func:`kept_probs`), so
    ``top_k=1`` samples exactly the greedy token, in bfloat16 too.

    With ``compiled``, a step whose index is a device tensor (a static decode loop's steps, the
    ones a CUDA graph replays) runs through one ``torch.compile`` of the step shared by every
    sampler of the process (:func:`compiled_sampling_step`; eager where it fails to compile):
    inductor fuses the log-softmax, the softmax, the kept set and the CDF's scans into a few
    kernels instead of about twenty (on an H100 at 128 x 32,000 logits 0.059 ms a step against
    0.145 ms: ``benchmarks/gpu/profile_decode.py``'s sampling rows). The compiled step's
    log-probs equal the eager step's up to float32 rounding, and its CDF sums in another order,
    so where a uniform lands within float64 rounding of a token's boundary the two may pick
    neighbours; nowhere else do their tokens differ.

    Args:
        params: The sampling parameters.
        pad: Token id written where a row is no longer alive.
        stops: Stop token ids (1-D, on the logits' device).
        uniforms: The uniform table, or None for greedy decoding.
        compiled: Run device-indexed steps through :func:`compiled_sampling_step`.
    """

    def __init__(self, params: SamplingParams, pad: int, stops: Tensor, uniforms: Tensor | None, *,
                 compiled: bool = False) -> None:
        self.params = params
        self.pad = pad
        self.stops = stops
        self.uniforms = uniforms
        self.compiled = compiled

    def step(self, logits: Tensor, t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Token (pad where not alive), log-prob (0 where not alive) and "stopped now" of step ``t``."""
        if self.compiled and isinstance(t, Tensor):
            out: tuple[Tensor, Tensor, Tensor] = compiled_sampling_step()(
                self.params, self.pad, self.stops, self.uniforms, logits, t, alive)
            return out
        return sampling_step(self.params, self.pad, self.stops, self.uniforms, logits, t, alive)


class CompiledOrEager:
    """``torch.compile`` of ``fn`` that runs ``fn`` itself once compiling has failed.

    A decode step that runs eagerly may still fail to compile on some device or library version
    (inductor cannot lower every operator everywhere). The first failure warns once, naming the
    error, and from then on every call runs ``fn`` eagerly (the same values up to float rounding,
    more kernels); :attr:`error` keeps the error, for an engine's ``decode_mode``. The failing call
    itself is run again eagerly: the compiled code may have run up to a graph break before the
    failure, so ``fn``'s side effects must be idempotent (a decode step writes its cache slot; a
    sampling step has none). Errors other than dynamo's and inductor's propagate.

    The default compile specialises to the first shape it meets; the first call in which a size
    differs (the rows, a prompt's width) compiles once more with that size symbolic, and later
    calls reuse those graphs whatever that size (dynamo's automatic dynamic shapes). A decode loop
    that always runs one shape (a GRPO step's batch) keeps kernels specialised to it; one whose
    shapes keep changing (the turns of multi-turn episodes: other rows, longer prompts) compiles a
    few times in all, not once per shape.

    Args:
        fn: The function or module.
        name: Who compiles, for the warning.
        compiled: ``fn``'s compiled version (default ``torch.compile(fn)``, as above).
    """

    def __init__(self, fn: Callable[..., Any], name: str, compiled: Callable[..., Any] | None = None) -> None:
        self.fn = fn
        self.name = name
        self.compiled = compiled if compiled is not None else torch.compile(fn)
        self.error: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``compiled(*args, **kwargs)``, or ``fn``'s where compiling has failed."""
        if self.error is None:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                text = str(e).splitlines()
                self.error = f"{type(e).__name__}: {text[0] if text else ''}"
                warnings.warn(f"{self.name}: torch.compile failed ({self.error}); this and every later call "
                              "runs eagerly (the same values, more kernels)", RuntimeWarning, stacklevel=2)
        return self.fn(*args, **kwargs)


def sampling_step(params: SamplingParams, pad: int, stops: Tensor, uniforms: Tensor | None, logits: Tensor,
                  t: int | Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:meth:`TokenSampler.step` as a free function of the sampler's fields (one compile serves every sampler)."""
    logp = tempered_log_probs(logits, params.temperature)
    if params.greedy or uniforms is None:
        tok = torch.argmax(logits, -1)
    else:
        u = uniforms[:, t] if isinstance(t, int) else uniforms.index_select(1, t).squeeze(1)
        # softmax(logp) = softmax(logits / T); ranked by the logits themselves, as greedy's argmax
        tok = inverse_cdf(kept_probs(logp, params.top_k, params.top_p, ranking=logits), u)
    tok = torch.where(alive, tok, pad)
    lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    # A broadcast compare, not torch.isin: isin may sort (a host sync) for larger stop sets.
    stopped = alive & (tok.unsqueeze(-1) == stops).any(-1)
    return tok, torch.where(alive, lp, 0.0), stopped


@functools.cache
def compiled_sampling_step() -> CompiledOrEager:
    """``torch.compile`` of :func:`sampling_step`, made once per process; where it fails to compile,
    every sampler of the process samples eagerly (:class:`CompiledOrEager`).

    It specialises to each sampling configuration it meets, and to the first number of rows (a
    second number compiles a graph for any number: :class:`CompiledOrEager`); a static decode loop
    compiles it during its warm-up steps, before a CUDA graph captures it.
    """
    return CompiledOrEager(sampling_step, "token sampling")


def cuda_graph_capture(step: Callable[[], None], pool: Any) -> Any:
    """Capture ``step`` in a new CUDA graph (recorded, not run), allocating from ``pool`` when given.

    The default capture of :class:`GraphCaptures`: ``pool`` is the memory pool of a graph captured
    earlier by the same decoder, so its graphs (one per cache window, replayed one after the other,
    never concurrently) share their temporaries. The capture is thread-local: an update running in
    another thread meanwhile (asynchronous training, where the rollout runs in a producer thread)
    may synchronise or allocate without invalidating it.

    A capture that fails leaves the device's default random generator marked as capturing (PyTorch
    ends its graph state only in a capture that succeeds), after which every random operation of
    the process on that device raises "Offset increment outside graph capture encountered
    unexpectedly"; the generator's state is therefore replaced by a fresh one at the same seed and
    offset (:func:`release_generator_after_failed_capture`) before the error is raised.
    """
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            step()
    except BaseException:
        device = torch.cuda.current_device()
        release_generator_after_failed_capture(torch.cuda.default_generators[device],
                                               lambda: torch.Generator(device=f"cuda:{device}"))
        raise
    return graph


def release_generator_after_failed_capture(generator: Any, fresh: Callable[[], Any]) -> None:
    """Give ``generator`` a new graph-safe state at its seed and offset (``fresh()``: a new generator of its device).

    The random stream goes on where it was: the same seed, the same Philox offset, so later draws
    are the ones the process would have made without the failed capture.
    """
    seed, offset = generator.initial_seed(), generator.get_offset()
    state = fresh()
    state.manual_seed(seed)
    state.set_offset(offset)
    generator.graphsafe_set_state(state.graphsafe_get_state())


GraphKey = Hashable
"""What a capture is of: a decoder's shape and sampling configuration, and the cache window."""


class GraphCaptures:
    """An engine's CUDA-graph captures, and what happens to a shape whose capture fails.

    A failed capture affects only its shape (a decoder's shape and sampling configuration, and the
    cache window of its steps): the steps of that shape in this call run eagerly, the next call of
    the shape tries again, and after ``attempts`` failures that shape decodes eagerly for the rest
    of the engine's life. Every other shape keeps capturing and replaying its graphs. Each failure
    warns and is counted (:attr:`failures`, :meth:`metrics`); :attr:`eager_shapes` lists the
    shapes given up on, with their last error.

    Lives in the engine, not in a decoder: decoders are rebuilt on sleep, wake and new shapes, the
    record of which shapes fail is kept across them.

    Args:
        name: Who captures, for the warnings.
        attempts: Failed captures after which a shape stays eager (>= 1).
        capture: Captures one step: ``capture(step, pool)`` returns an object whose ``replay()``
            runs the step again, or raises (default: :func:`cuda_graph_capture`). Tests inject one.
    """

    def __init__(self, name: str, *, attempts: int = 2,
                 capture: Callable[[Callable[[], None], Any], Any] | None = None) -> None:
        if attempts < 1:
            raise ValueError(f"GraphCaptures(attempts={attempts}) needs at least one attempt")
        self.name = name
        self.attempts = attempts
        self._capture = capture or cuda_graph_capture
        self._failed: dict[GraphKey, int] = {}
        self.errors: dict[GraphKey, str] = {}
        self.captured = 0
        self.failures = 0

    def allowed(self, key: GraphKey) -> bool:
        """Whether ``key`` may still be captured (it has failed fewer than ``attempts`` times)."""
        return self._failed.get(key, 0) < self.attempts

    def capture(self, key: GraphKey, step: Callable[[], None], pool: Any = None) -> Any | None:
        """A captured graph of ``step`` for shape ``key``, or None (counted and warned) when capture fails."""
        try:
            graph = self._capture(step, pool)
        except Exception as e:  # a kernel or library call that cannot be captured: this shape decodes eagerly
            n = self._failed[key] = self._failed.get(key, 0) + 1
            self.failures += 1
            self.errors[key] = f"{type(e).__name__}: {e}"
            then = ("the next call of this shape tries again" if n < self.attempts
                    else f"after {n} failures this shape decodes eagerly from now on")
            warnings.warn(f"{self.name}: CUDA graph capture failed for shape {key} ({self.errors[key]}); its "
                          f"steps run eagerly in this call, {then}; other shapes keep their graphs",
                          RuntimeWarning, stacklevel=3)
            return None
        self.captured += 1
        return graph

    @property
    def eager_shapes(self) -> dict[GraphKey, str]:
        """Shapes that failed ``attempts`` captures and now always decode eagerly, with their last error."""
        return {k: self.errors[k] for k, n in self._failed.items() if n >= self.attempts}

    def metrics(self) -> dict[str, float]:
        """Graphs captured, captures failed, and shapes given up on (decoding eagerly)."""
        return {"graph_captures": float(self.captured), "graph_capture_failures": float(self.failures),
                "graph_eager_shapes": float(len(self.eager_shapes))}


def slow_path_notes(graphs: GraphCaptures | None, compiled: CompiledOrEager | None) -> str:
    """What an engine's ``decode_mode`` appends for the slow paths its decode took ('' for none):
    the shapes that decode eagerly after failed CUDA-graph captures (``graphs``, None where graphs
    are off) and the error after which the decode step runs uncompiled (``compiled``)."""
    notes = ""
    eager = graphs.eager_shapes if graphs is not None else {}
    if eager:
        last = next(reversed(eager.values()))
        notes += f" ({len(eager)} shape(s) decode eagerly after failed CUDA graph captures; last error: {last})"
    if compiled is not None and compiled.error is not None:
        notes += f" (the decode step runs uncompiled after torch.compile failed: {compiled.error})"
    return notes


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[None]:
    """Run the block on a side CUDA stream ordered after and before the current one (nothing off CUDA).

    Where a graph's warm-up steps run: the library's lazy set-up happens outside the capture.
    """
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


MAX_CACHE_WINDOWS: Final = 16
"""Most cache windows of one static decode (see :func:`cache_windows`): a capture each, and steps of
more slots past it."""


def cache_windows(filled: int, length: int, smallest: int) -> tuple[int, ...]:
    """The attention windows of a static decode over a cache of ``length`` slots, ``filled`` by the prompts.

    Multiples of a step, below ``length``, then ``length`` itself: the step is ``smallest``, or the
    smallest multiple of it that keeps the windows to :data:`MAX_CACHE_WINDOWS`. A step therefore
    reads at most a step's worth of unwritten slots (on average half of one), whatever the length.
    Windows too small for the first decode step (``filled + 1`` slots) are left out, and so is a
    window within a tenth of ``length`` (one graph more for almost no less reading). ``smallest``
    0: one window, the whole cache.
    """
    if smallest <= 0:
        return (length,)
    step = smallest * -(-length // (smallest * MAX_CACHE_WINDOWS))
    windows = [w for w in range(step, math.ceil(length * 0.9), step) if w > filled]
    return (*windows, length)


def mark_window_dynamic(tensor: Tensor, dim: int, window: int, windows: Sequence[int]) -> Tensor:
    """Mark ``tensor``'s ``dim`` (``window`` slots wide) as a dynamic size for ``torch.compile``
    when ``window`` is narrower than the whole cache (the last of ``windows``); returns ``tensor``.

    A compiled decode step then compiles once for every window below the whole cache, with the
    window a symbolic size, and once for the whole cache (whose read is a contiguous tensor, another
    graph), instead of once per window. The mark is a hint
    (``maybe_mark_dynamic``): where the traced code fixes the size (a window as wide as another
    dimension of the step, say), that window compiles on its own instead of failing. Outside
    ``torch.compile`` the mark does nothing.
    """
    if windows and window < windows[-1]:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


class StaticDecodeLoop:
    """A decode loop at one shape: output columns, step counters, cache windows and CUDA-graph replay.

    Every piece of state lives in a preallocated device tensor that a step updates in place (the
    token to feed, the step index, the finished flags, the output columns, and whatever positions
    the engine keeps), so one step can be captured in a CUDA graph and replayed. An engine
    subclasses it with its model calls: :meth:`_prefill` (reset the engine's state, run the
    prompts, return the first logits) and :meth:`_advance` (feed :attr:`tok`, advance the engine's
    own positions in place, return the next logits), both without host synchronisation.

    Cache windows: an engine whose KV cache holds ``filled`` prompt slots and room for the new
    tokens may give ascending ``windows`` (the last one the whole cache, see :func:`cache_windows`).
    Each step then runs at the smallest window holding every slot it reads, set in
    :attr:`window` before :meth:`_advance` is called, which attends over the first
    :attr:`window` slots only. The window of a step is known on the host from the step count, so
    nothing waits for the device; each window is its own shape, with its own CUDA graph (a compiled
    step compiles once for the windows below the whole cache: :func:`mark_window_dynamic`).

    Args:
        rows: Sequences decoded together.
        max_new: Most new tokens.
        sampler: The step's sampling; its uniform table (if any) is refilled by :meth:`start`.
        device: Where the state lives.
        model: The module whose parameters a captured graph addresses (see :meth:`reusable`).
        name: Who decodes.
        windows: Ascending cache windows (empty: one shape, :attr:`window` 0).
        filled: Cache slots the prompts fill before the first decode step.
    """

    def __init__(self, rows: int, max_new: int, sampler: TokenSampler, device: torch.device,
                 model: torch.nn.Module, name: str, *, windows: Sequence[int] = (), filled: int = 0) -> None:
        self.model = model
        self.sampler = sampler
        self.max_new = max_new
        self.name = name
        self.windows = tuple(windows)
        self.filled = filled
        self.window = self.windows[-1] if self.windows else 0  # the cache window of the step being run
        self.out_tok = torch.full((rows, max_new), sampler.pad, dtype=torch.int64, device=device)
        self.out_mask = torch.zeros(rows, max_new, dtype=torch.bool, device=device)
        self.out_lp = torch.zeros(rows, max_new, dtype=torch.float32, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.tok = torch.zeros(rows, dtype=torch.int64, device=device)
        self.t = torch.ones(1, dtype=torch.int64, device=device)
        self.done = 1  # steps whose tokens are in the output columns
        self.shape: GraphKey = None  # the shape and sampling configuration (set by StaticDecoders)
        self.graphs: dict[int, Any] = {}  # window -> its captured step, replayed by later calls
        self._pool: Any = None  # the memory pool the graphs share
        self._params = self._param_ptrs()

    # ------------------------------------------------------------------ the engine's part
    def _prefill(self, chunk: TensorBatch) -> Tensor:
        """Reset the engine's state, run ``chunk``'s prompts; float32 logits [rows, vocab] of the first token."""
        raise NotImplementedError

    def _advance(self) -> Tensor:
        """Feed :attr:`tok` over the first :attr:`window` cache slots, advance the engine's positions in
        place; float32 logits [rows, vocab]."""
        raise NotImplementedError

    def step_attends(self, valid: Tensor, slots: Tensor, slot: Tensor, seen: int) -> Tensor:
        """The boolean mask ``[rows, seen]`` of a decode step (True = attend) over the first ``seen`` cache slots.

        A live row attends its real slots written so far (``valid`` and not past ``slot``, the slot
        this step writes); a finished row attends only ``slot``. A finished row's output is never
        read, so it needs no keys but its own: an attention that reads only the slots a mask
        attends (the fused decode kernel, :mod:`verl_core.enginekit.decode_attention`) then reads
        one block of a finished row's cache instead of all it wrote, and a batch whose responses
        end at different lengths reads the cache of its live rows only. Live rows attend what
        they did before, so they draw the same tokens.

        Args:
            valid: ``[rows, slots]``, False at the prompts' padding.
            slots: The slot indices ``0 .. slots - 1``.
            slot: ``[1]``, the slot this step writes.
            seen: Slots the step's attention reads (the cache window, or the whole cache).
        """
        slots = slots[:seen]
        written = valid[:, :seen] & (slots <= slot)
        return written & ((slots == slot) | ~self.finished[:, None])

    # ------------------------------------------------------------------ the loop
    def _param_ptrs(self) -> list[int]:
        return [p.data_ptr() for p in self.model.parameters()]

    @property
    def graph(self) -> Any:
        """The captured step of the smallest window captured so far (None: no graph)."""
        return self.graphs[min(self.graphs)] if self.graphs else None

    def reusable(self, model: torch.nn.Module) -> bool:
        """Whether the buffers (and captured graphs) still address ``model``'s live parameters."""
        return model is self.model and self._param_ptrs() == self._params

    def start(self, chunk: TensorBatch, uniforms: Tensor | None) -> None:
        """Prefill ``chunk``'s prompts and sample the first token; resets every buffer in place."""
        if uniforms is not None:
            assert self.sampler.uniforms is not None
            self.sampler.uniforms.copy_(uniforms)
        logits = self._prefill(chunk)
        self.out_tok.fill_(self.sampler.pad)
        self.out_mask.zero_()
        self.out_lp.zero_()
        self.finished.zero_()
        self.t.fill_(1)
        self.done = 1
        self.tok.copy_(self._sample(logits, 0))

    def _sample(self, logits: Tensor, t: int | Tensor) -> Tensor:
        alive = ~self.finished
        tok, lp, stopped = self.sampler.step(logits, t, alive)
        if isinstance(t, int):
            self.out_tok[:, t] = tok
            self.out_mask[:, t] = alive
            self.out_lp[:, t] = lp
        else:
            self.out_tok.index_copy_(1, t, tok.unsqueeze(1))
            self.out_mask.index_copy_(1, t, alive.unsqueeze(1))
            self.out_lp.index_copy_(1, t, lp.unsqueeze(1))
        self.finished |= stopped
        return tok

    def step(self) -> None:
        """Feed the last token, sample the next one, advance every counter (all in place)."""
        self.tok.copy_(self._sample(self._advance(), self.t))
        self.t.add_(1)

    def _all_finished(self) -> bool:
        return bool(self.finished.all())

    def window_at(self, done: int) -> int:
        """The cache window of the step run when ``done`` tokens are drawn: the smallest holding the
        ``filled + done`` slots it reads (0 without windows)."""
        need = self.filled + done
        return next((w for w in self.windows if w >= need), self.windows[-1] if self.windows else 0)

    def _window_end(self, window: int) -> int:
        """The step count at which ``window`` no longer holds what a step reads (``max_new`` at the last)."""
        if not self.windows or window == self.windows[-1]:
            return self.max_new
        return min(self.max_new, window - self.filled + 1)

    def run(self, check_every: int = 1, *, graphs: GraphCaptures | None = None, warmup: int = 2) -> None:
        """Steps until every row finished (asked every ``check_every`` steps, each ask a host
        synchronisation) or max_new tokens were drawn, window by window.

        With ``graphs``, the steps of each window replay a CUDA graph: captured (through
        ``graphs``, as shape ``(self.shape, window)``) after ``warmup`` eager steps the first time the
        window is reached, reused by later calls. A window whose capture fails, or that ``graphs``
        no longer captures, runs its steps eagerly; the others keep their graphs. Steps run after
        the last row finished only add all-padding columns (trimmed).
        """
        while self.done < self.max_new:
            self.window = window = self.window_at(self.done)
            end = self._window_end(window)
            advance: Callable[[], None] = self.step
            if graphs is not None:
                graph = self.graphs.get(window)
                key = (self.shape, window)
                if graph is None and graphs.allowed(key) and end - self.done > warmup:
                    graph = self._capture(graphs, key, warmup)
                if graph is not None:
                    advance = graph.replay
            if self._loop(advance, check_every, end):
                return

    def _loop(self, advance: Callable[[], None], check_every: int, end: int) -> bool:
        """Call ``advance`` (one step) until ``end`` steps are done; True when, checked every
        ``check_every`` steps, every row finished first."""
        while self.done < end:
            if self.done % check_every == 0 and self._all_finished():
                return True
            advance()
            self.done += 1
        return False

    def _capture(self, graphs: GraphCaptures, key: GraphKey, warmup: int) -> Any | None:
        """Run ``warmup`` real steps (on a side stream), then capture one step of :attr:`window`."""
        with _side_stream(self.out_tok.device):
            # Warm-up steps are real steps (lazy set-up and compilation happen outside capture).
            for _ in range(warmup):
                self.step()
                self.done += 1
        if self._all_finished():
            return None
        graph = graphs.capture(key, self.step, self._pool)  # recorded, not run: the replays run it
        if graph is not None:
            self.graphs[self.window] = graph
            pool = getattr(graph, "pool", None)
            if self._pool is None and callable(pool):
                self._pool = pool()
        return graph

    def close(self) -> None:
        """Drop the captured graphs (an engine's subclass also frees what it attached to the model)."""
        self.graphs.clear()
        self._pool = None

    def result(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Output columns trimmed to the steps where any row was alive, and truncated flags."""
        width = max(1, int(self.out_mask.any(0).sum()))
        # Copies: the buffers are reused by the next call with the same shapes.
        return (self.out_tok[:, :width].clone(), self.out_mask[:, :width].clone(),
                self.out_lp[:, :width].clone(), ~self.finished)


DecoderT = TypeVar("DecoderT", bound=StaticDecodeLoop)


class StaticDecoders(Generic[DecoderT]):
    """An engine's static decoder of the last shape and sampling configuration, reused while they repeat.

    Reuse keeps the preallocated caches, the buffers and a captured CUDA graph. The decoder is
    rebuilt when the shape or the sampling configuration changes and whenever the model's
    parameters no longer live where they did (a graph addresses them directly); the old one is
    closed first, so its memory is free before the new one allocates.
    """

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._decoder: DecoderT | None = None

    @property
    def current(self) -> DecoderT | None:
        """The kept decoder, if any."""
        return self._decoder

    def get(self, model: torch.nn.Module, rows: int, width: int, params: SamplingParams, stop_ids: Sequence[int],
            uniforms: Tensor | None, pad: int, device: torch.device,
            build: Callable[[TokenSampler], DecoderT], *, compile_sampling: bool = False) -> DecoderT:
        """The decoder for ``rows`` prompts of ``width`` columns sampled with ``params``.

        Args:
            model: The module the decoder runs (see :meth:`StaticDecodeLoop.reusable`).
            rows: Sequences decoded together.
            width: Prompt width.
            params: The sampling configuration.
            stop_ids: Token ids that end a response.
            uniforms: This call's uniform table (None for greedy decoding); only its shape is
                used here, :meth:`StaticDecodeLoop.start` copies the values.
            pad: The padding id.
            device: Where the decoder's state lives.
            build: Makes a new decoder around a :class:`TokenSampler` whose uniform table
                :meth:`StaticDecodeLoop.start` refills.
            compile_sampling: The sampler runs the loop's steps compiled (``TokenSampler(compiled=True)``).
        """
        key = (rows, width, params.max_new_tokens, params.temperature, params.top_k, params.top_p, params.greedy,
               tuple(stop_ids), uniforms is None)
        if self._decoder is not None and self._key == key and self._decoder.reusable(model):
            return self._decoder
        self.clear()
        table = None if uniforms is None else torch.empty_like(uniforms)
        stops = torch.tensor(list(stop_ids), dtype=torch.int64, device=device)
        decoder = build(TokenSampler(params, pad, stops, table, compiled=compile_sampling))
        decoder.shape = key
        self._key, self._decoder = key, decoder
        return decoder

    def clear(self) -> None:
        """Close and drop the kept decoder (on sleep, offload or close)."""
        if self._decoder is not None:
            self._decoder.close()
        self._key, self._decoder = None, None


def eager_decode(steps: Generator[Tensor, Tensor, None], sampler: TokenSampler, rows: int, max_new: int,
                 device: torch.device, check_every: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sample from ``steps`` (a generator that yields each step's float32 logits ``[rows, vocab]``
    and is sent the sampled tokens) until every row finished (asked every ``check_every`` steps,
    each ask a host synchronisation) or ``max_new`` tokens were drawn.

    The first logits are taken with ``next(steps)`` (those after the prompts: a KV-cache engine
    prefills before its first ``yield``); each later step sends the tokens just drawn (``[rows]``
    int64, the pad id in finished rows) and takes the logits the generator yields next, so it
    yields at most ``max_new`` times. The generator is closed when the loop ends, so code after
    its last resumed ``yield`` may never run.

    Returns:
        Response ids, mask, log-probs [rows, steps] and truncated [rows].
    """
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    out_ids, out_mask, out_lp = [], [], []
    logits = next(steps)
    for t in range(max_new):
        alive = ~finished
        tok, lp, stopped = sampler.step(logits, t, alive)
        out_ids.append(tok)
        out_mask.append(alive)
        out_lp.append(lp)
        finished = finished | stopped
        if t + 1 == max_new or ((t + 1) % check_every == 0 and bool(finished.all())):
            break
        logits = steps.send(tok)
    steps.close()
    mask = torch.stack(out_mask, 1)
    # Steps taken after the last row finished hold padding only: trim them.
    width = max(1, int(mask.any(0).sum()))
    return (torch.stack(out_ids, 1)[:, :width], mask[:, :width], torch.stack(out_lp, 1)[:, :width],
            ~finished)
