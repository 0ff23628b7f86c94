"""The time to score a rollout's samples with a reward function, against the per-element paths it replaced.

Run: .venv/bin/python benchmarks/bench_reward_inputs.py [--rows 256] [--response 512] [--repeat 15]

``RewardFunctions.score`` decodes every prompt and completion and hands the function its inputs; at
GRPO shapes that Python work is on the step's critical path (``time/reward``). Timed on the same
batch (the GRPO benchmark's character tokenizer, 32-token prompts, full-length responses, the
``exact_match`` function), interleaved, median of ``--repeat``:

- ``score``: the trainer's path (``HFTokenizer.decode`` hands a transformers tokenizer one array of
  ids; each row's masked tokens are gathered in one tensor operation);
- ``score, ids as lists``: the same with the tokenizer seen through a plain object, so
  ``HFTokenizer.decode`` passes a list of ints, which transformers checks element by element (the
  path every decode took before);
- the two ways of gathering the masked tokens alone: one boolean index of the whole batch (the
  trainer's ``_rows``), and a Python filter of each row (what it did before).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from verl_core import BatchMeta, HFTokenizer, TensorBatch
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.rewards import _rows as rows_by_index  # what score() gathers with
from verl_core.trainer.inputs.tiny_model import char_tokenizer

REWARD = "verl_core.trainer.inputs.reward_functions:exact_match"


class PlainTokenizer:
    """A transformers tokenizer behind an object that is not one (HFTokenizer's list path)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.eos_token_id, self.pad_token_id = inner.eos_token_id, inner.pad_token_id

    def __len__(self) -> int:
        return len(self._inner)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._inner.decode(ids, skip_special_tokens=skip_special_tokens))


def rows_by_filter(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [[t for t, m in zip(row, keep) if m] for row, keep in zip(ids.tolist(), mask.tolist())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        char_tokenizer(32000).save_pretrained(folder)
        from transformers import AutoTokenizer

        inner = AutoTokenizer.from_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    n, width = args.rows, args.response
    mask = torch.ones(n, width, dtype=torch.bool)
    mask[:, width - 4:] = False  # a few padding slots, as after an early EOS
    batch = TensorBatch({
        "prompt_ids": torch.randint(4, 100, (n, 32), generator=g), "prompt_mask": torch.ones(n, 32, dtype=torch.bool),
        "response_ids": torch.randint(4, 100, (n, width), generator=g), "response_mask": mask,
        "truncated": torch.ones(n, dtype=torch.bool)}, meta=BatchMeta(), extras={"answer": ["x"] * n})
    arrays = RewardFunctions([REWARD], HFTokenizer(inner), columns=["answer"])
    lists = RewardFunctions([REWARD], HFTokenizer(PlainTokenizer(inner)), columns=["answer"])
    assert arrays.score(batch).extras == lists.score(batch).extras  # the same scores
    ids = batch["response_ids"]
    assert rows_by_index(ids, mask) == rows_by_filter(ids, mask)
    cases: dict[str, Callable[[], object]] = {
        "score": lambda: arrays.score(batch),
        "score, ids as lists": lambda: lists.score(batch),
        "masked tokens: one boolean index": lambda: rows_by_index(ids, mask),
        "masked tokens: a Python filter per row": lambda: rows_by_filter(ids, mask),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.repeat):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{n} rows x {width} response tokens, 32-token prompts, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeat}")
    print("| what | ms | vs baseline |\n|---|---|---|")
    pairs = [("score", "score, ids as lists"),
             ("masked tokens: one boolean index", "masked tokens: a Python filter per row")]
    for new, old in pairs:
        print(f"| {old} (baseline) | {ms[old]:.2f} | 1.00x |")
        print(f"| {new} | {ms[new]:.2f} | {ms[old] / ms[new]:.2f}x |")


if __name__ == "__main__":
    main()
