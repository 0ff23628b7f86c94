"""TensorBatch overhead against a plain dict of tensors, and token-budget micro-batching utilisation.

Run: .venv/bin/python benchmarks/bench_batch.py [--repeat N]

Prints, for each op, the median time of TensorBatch and of the same work on a dict of tensors at
1k and 1M elements per field, and the overhead per field in microseconds (it should not grow with
tensor size: validation checks shapes and dtypes, never values). Then utilisation (real tokens /
sum over micro-batches of size x longest sequence) of token-budget micro-batching against fixed-size
micro-batches of the same average token count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from verl_core import BatchMeta, TensorBatch, partition_by_token_budget

FLOAT_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "returns")


def make_fields(batch: int, width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r_len = torch.randint(1, width + 1, (batch,), generator=g)
    rmask = torch.arange(width).unsqueeze(0) < r_len.unsqueeze(1)
    p_len = torch.randint(1, width + 1, (batch,), generator=g)
    pmask = torch.arange(width).unsqueeze(0) >= (width - p_len).unsqueeze(1)
    fields = {
        "prompt_ids": torch.randint(2, 100, (batch, width), generator=g) * pmask,
        "prompt_mask": pmask,
        "response_ids": torch.randint(2, 100, (batch, width), generator=g) * rmask,
        "response_mask": rmask,
        "group_ids": torch.arange(batch) // 4,
    }
    for name in FLOAT_FIELDS:
        fields[name] = torch.randn(batch, width, generator=g) * rmask
    return fields


def median_us(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def ops(fields: dict[str, torch.Tensor]) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    b = TensorBatch(fields, meta=BatchMeta())
    d = dict(fields)
    n = b.batch_size
    idx = torch.randperm(n)
    extra = torch.zeros_like(fields["old_log_probs"])
    half = n // 2
    return {
        "construct": (lambda: TensorBatch(fields), lambda: dict(fields)),
        "select(4)": (lambda: b.select("prompt_ids", "prompt_mask", "response_ids", "response_mask"),
                      lambda: {k: d[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}),
        "update(1)": (lambda: b.update(values=extra), lambda: {**d, "values": extra}),
        "index(perm)": (lambda: b.index(idx), lambda: {k: v.index_select(0, idx) for k, v in d.items()}),
        "chunk(4)": (lambda: b.chunk(4), lambda: [{k: v[i : i + n // 4] for k, v in d.items()} for i in range(0, n, n // 4)]),
        "concat(2)": (lambda: TensorBatch.concat([b.index(slice(0, half)), b.index(slice(half, None))]),
                      lambda: {k: torch.cat([v[:half], v[half:]]) for k, v in d.items()}),
        "repeat_interleave(2)": (lambda: b.repeat_interleave(2),
                                 lambda: {k: v.repeat_interleave(2, 0) for k, v in d.items()}),
        "pad_to_multiple(7)": (lambda: b.pad_to_multiple(7),
                               lambda: {k: torch.cat([v, v[-1:].expand(-n % 7, *v.shape[1:])]) for k, v in d.items()}),
        "check (boundary)": (lambda: b.check(), lambda: [bool(torch.isfinite(d[k]).all()) for k in FLOAT_FIELDS]),
    }


def bench_ops(repeat: int) -> None:
    sizes = {"1k": (8, 128), "1M": (1024, 1024)}
    rows: dict[str, dict[str, tuple[float, float]]] = {}
    for label, (batch, width) in sizes.items():
        fields = make_fields(batch, width)
        for name, (fb, fd) in ops(fields).items():
            rows.setdefault(name, {})[label] = (median_us(fb, repeat), median_us(fd, repeat))
    nf = len(make_fields(2, 2))
    print(f"TensorBatch vs dict of tensors ({nf} fields; median of {repeat}; microseconds)")
    head = f"{'op':<22}" + "".join(f"{'batch ' + s:>12}{'dict ' + s:>12}{'ovh/field ' + s:>16}" for s in sizes)
    print(head)
    print("-" * len(head))
    for name, per in rows.items():
        line = f"{name:<22}"
        for s in sizes:
            tb, td = per[s]
            line += f"{tb:>12.1f}{td:>12.1f}{(tb - td) / nf:>16.2f}"
        print(line)
    print("(check scans values, so it grows with size by design; it runs only at protocol boundaries)")


def bench_micro_batching() -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 4097, (4096,), generator=g).tolist()
    budget = 16384

    def utilisation(groups: list[list[int]]) -> tuple[float, int]:
        cost = sum(len(gr) * max(lens[i] for i in gr) for gr in groups)
        return sum(lens) / cost, len(groups)

    t0 = time.perf_counter()
    budget_groups = partition_by_token_budget(lens, budget)
    t_part = (time.perf_counter() - t0) * 1e3
    avg_tokens = sum(lens) / len(budget_groups)
    fixed_size = max(1, round(avg_tokens / (sum(lens) / len(lens))))
    fixed_groups = [list(range(i, min(i + fixed_size, len(lens)))) for i in range(0, len(lens), fixed_size)]
    ub, nb = utilisation(budget_groups)
    uf, nfixed = utilisation(fixed_groups)
    print()
    print("Micro-batching 4096 sequences, lengths uniform in 64..4096, seed 0")
    print(f"{'scheme':<34}{'micro-batches':>14}{'utilisation':>13}")
    print(f"{'token budget 16384':<34}{nb:>14}{ub:>12.1%}")
    print(f"{f'fixed size {fixed_size} (same avg tokens)':<34}{nfixed:>14}{uf:>12.1%}")
    print(f"ratio budget/fixed: {ub / uf:.2f}x; partition time {t_part:.1f} ms; target >= 95%: "
          f"{'met' if ub >= 0.95 else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_ops(args.repeat)
    bench_micro_batching()


if __name__ == "__main__":
    main()
