"""Log-probs and entropy from logits: the whole-tensor reference against the chunked ``token_log_probs``.

The reference is what the engines computed before: ``tempered_log_probs(logits, T)`` (a float32
log-softmax over all ``[tokens, vocab]`` logits), gathered at the targets, and the entropy
``-(exp(logp) * logp).sum(-1)``. The chunked function is ``verl_core.enginekit.token_stats.
token_log_probs``, with each chunk's passes eager and fused (one compiled function per chunk for
the forward and one for the backward; the default on CUDA). For each, the table gives the median
time and the peak memory above the inputs of

* a training step's part: forward of the log-probs and entropy, then backward of a weighted sum of
  both into the logits (whose gradient, in the logits' dtype, both must allocate);
* a no-grad forward (the old / reference log-probs of a batch);

with ratios against the reference measured in the same run (repetitions interleaved, so a loaded
machine slows both alike), and the largest error of the log-probs and of the gradient against the
same computation in float64.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs`` before each measurement, after returning freed
memory to the OS; the median of three), since torch's CPU allocator keeps no statistics and ``tracemalloc`` does not see
tensor memory.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_logprobs.py                 # CPU, 2 x 256 tokens
    .venv/bin/python benchmarks/bench_logprobs.py --device cuda                     # 8 x 1024 tokens
    .venv/bin/python benchmarks/bench_logprobs.py --device cuda --vocab 151936 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from verl_core.enginekit.sampling import tempered_log_probs
from verl_core.enginekit.token_stats import default_chunk_tokens, fuses_log_probs, token_log_probs

Impl = Callable[[Tensor, Tensor, float, bool], tuple[Tensor, Tensor | None]]


def reference(logits: Tensor, targets: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The whole-tensor computation the engines used before ``token_log_probs``."""
    logp = tempered_log_probs(logits, temperature)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, (-(logp.exp() * logp).sum(-1) if entropy else None)


def chunked(chunk_tokens: int | None, fused: bool) -> Impl:
    def run(logits: Tensor, targets: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, Tensor | None]:
        return token_log_probs(logits, targets, temperature=temperature, entropy=entropy, chunk_tokens=chunk_tokens,
                               fused=fused)
    return run


class Memory:
    """Peak memory of one call above what was in use before it, in bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.proc = Path("/proc/self/status")
        try:
            self.libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None
        if self.libc is not None and device.type == "cpu":
            # M_MMAP_THRESHOLD = 128 KiB, fixed: every large tensor gets its own mapping, returned to
            # the OS when freed (glibc otherwise raises the threshold after the first free, and later
            # tensors of that size land in the heap, where the resident set does not follow them)
            self.libc.mallopt(-3, 128 * 1024)

    def _status(self, key: str) -> int:
        m = re.search(rf"^{key}:\s+(\d+) kB", self.proc.read_text(), re.M)
        return int(m.group(1)) * 1024 if m else 0

    def start(self) -> int:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        if self.libc is not None:
            self.libc.malloc_trim(0)  # return freed tensors to the OS so the peak counts new allocations
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        except OSError:
            return -1
        return self._status("VmRSS")

    def peak(self, base: int) -> float:
        """Peak bytes above ``base`` since :meth:`start` (NaN where not measurable)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device) - base)
        return float(self._status("VmHWM") - base) if base >= 0 else float("nan")


def exact(logits: Tensor, targets: Tensor, w: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, Tensor]:
    """The log-probs and the gradient of :func:`train_step`'s loss in float64: the yardstick of both."""
    x = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(x / temperature, -1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = (lp * w).sum() + ((-(logp.exp() * logp).sum(-1) * w.flip(0)).sum() if entropy else 0.0)
    loss.backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None
    return lp.detach(), x.grad


def train_step(impl: Impl, logits: Tensor, targets: Tensor, w: Tensor, temperature: float, entropy: bool) -> Tensor:
    """Forward and backward of the log-probs (and entropy) into a fresh leaf; returns the gradient."""
    x = logits.detach().requires_grad_(True)
    lp, ent = impl(x, targets, temperature, entropy)
    loss = (lp * w).sum() + ((ent * w.flip(0)).sum() if ent is not None else 0.0)
    loss.backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None
    return x.grad


def no_grad_forward(impl: Impl, logits: Tensor, targets: Tensor, temperature: float, entropy: bool) -> Tensor:
    with torch.no_grad():
        return impl(logits, targets, temperature, entropy)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 8 on cuda, 2 on cpu)")
    ap.add_argument("--seq", type=int, default=None, help="response tokens per sequence (default 1024 on cuda, 256 on cpu)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--no-entropy", action="store_true", help="log-probs only")
    ap.add_argument("--chunks", default=None,
                    help="chunk sizes in tokens to time, comma-separated; 'auto' is the default size "
                         "(default: auto,64,512 on cpu, auto,128,2048 on cuda)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch = args.batch or (8 if cuda else 2)
    seq = args.seq or (1024 if cuda else 256)
    dtype = getattr(torch, args.dtype)
    entropy = not args.no_entropy
    g = torch.Generator(device).manual_seed(0)
    logits = (torch.randn(batch, seq, args.vocab, generator=g, device=device) * 3).to(dtype)
    targets = torch.randint(0, args.vocab, (batch, seq), generator=g, device=device)
    w = torch.randn(batch, seq, generator=g, device=device)
    temperature = args.temperature

    impls: dict[str, Impl] = {"reference": reference}
    for c in (args.chunks or ("auto,128,2048" if cuda else "auto,64,512")).split(","):
        size = None if c == "auto" else int(c)
        shown = default_chunk_tokens(args.vocab, device) if size is None else size
        for fused in (False, True):
            default = size is None and fused == fuses_log_probs(device)
            impls[f"chunked {shown}{', fused' if fused else ''}" + (" (default)" if default else "")] = chunked(size, fused)

    exact_lp, exact_grad = exact(logits, targets, w, temperature, entropy)
    errors: dict[str, tuple[float, float]] = {}
    for name, impl in impls.items():  # warm-up, and the errors against float64
        grad = train_step(impl, logits, targets, w, temperature, entropy)
        lp = no_grad_forward(impl, logits, targets, temperature, entropy)
        errors[name] = (float((lp.double() - exact_lp).abs().max()) if lp.numel() else 0.0,
                        float((grad.double() - exact_grad).abs().max()) if grad.numel() else 0.0)
        del grad, lp
    del exact_lp, exact_grad

    times: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], float] = {}
    runs: dict[tuple[str, str], Callable[[], Tensor]] = {}
    for name, impl in impls.items():
        runs[(name, "train")] = functools.partial(train_step, impl, logits, targets, w, temperature, entropy)
        runs[(name, "fwd")] = functools.partial(no_grad_forward, impl, logits, targets, temperature, entropy)
    for _ in range(args.repeats):
        for key, fn in runs.items():
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.setdefault(key, []).append(time.perf_counter() - t0)
            del out
    mem = Memory(device)  # after the timings: on CPU it changes how memory is allocated
    for key, fn in runs.items():
        measured = []
        for _ in range(3):  # the median: a page or an arena of the C allocator can shift one reading
            base = mem.start()
            out = fn()
            measured.append(mem.peak(base))
            del out
        peaks[key] = statistics.median(measured)

    tokens = batch * seq
    gpu = f" ({torch.cuda.get_device_name(device)})" if cuda else f" ({torch.get_num_threads()} threads)"
    print(f"log-probs{' + entropy' if entropy else ''}: {batch} x {seq} tokens x {args.vocab} vocab, "
          f"{args.dtype} logits, T={temperature}, on {device}{gpu}; median of {args.repeats}")
    print(f"one float32 [tokens, vocab] tensor: {tokens * args.vocab * 4 / 2**20:.0f} MiB; "
          f"logits: {logits.numel() * logits.element_size() / 2**20:.0f} MiB\n")
    print("| implementation | fwd+bwd ms | x ref | peak MiB | x ref | no-grad fwd ms | x ref | peak MiB | x ref "
          "| logp error | grad error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in impls:
        row = [name]
        for mode in ("train", "fwd"):
            t, r = med[(name, mode)], med[("reference", mode)]
            p, pr = peaks[(name, mode)], peaks[("reference", mode)]
            row += [f"{t * 1e3:.1f}", f"{t / r:.2f}", f"{p / 2**20:.0f}", f"{p / pr:.3f}" if pr > 0 else "n/a"]
        row += [f"{errors[name][0]:.1e}", f"{errors[name][1]:.1e}"]
        print("| " + " | ".join(row) + " |")
    print("\nx ref: time or peak memory divided by the reference's (< 1: less). error: largest absolute "
          "difference from the same computation in float64.")


if __name__ == "__main__":
    main()
