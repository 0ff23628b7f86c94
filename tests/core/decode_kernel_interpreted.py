"""Run in a subprocess by tests/core/test_decode_attention.py, with Triton's interpreter on its path
and ``TRITON_INTERPRET=1``: the fused decode-attention kernel on CPU tensors against float64
attention, never reading a slot its mask hides, and zeros for a row that attends nothing, with the
default launch and two others (block, stages).
Prints one line per case; exits non-zero on a mismatch."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from test_decode_attention import inputs, reference  # noqa: E402

from verl_core.enginekit import _triton_decode  # noqa: E402  (registers verl_core::decode_attention)

LAUNCHES = [None, _triton_decode.Launch(block=32, warps=4, stages=2), _triton_decode.Launch(block=64, warps=4, stages=3)]


def main() -> int:
    for how in LAUNCHES:
        if not run(how):
            return 1
    return 0


def run(how: _triton_decode.Launch | None) -> bool:
    def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        if how is None:
            return torch.ops.verl_core.decode_attention(query, key, value, mask, scale)
        return _triton_decode.launch(query, key, value, mask, scale, how)

    cases = [(1, 64, 1), (2, 128, 63), (2, 128, 130), (4, 32, 64), (3, 48, 65), (8, 96, 200)]
    for groups, dim, width in cases:
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 5e-3)):
            query, key, value, mask = inputs(5, 2, groups, 210, dim, width, dtype, seed=width + dim)
            mask[..., 0] = True  # every row attends somewhere (a hole after it where the row is left-padded)
            mask[3, ..., 1:] = False  # row 3 attends its first slot only: a span of one block
            got = kernel(query, key, value, mask, dim**-0.5)
            err = (got.double() - reference(query, key, value, mask, dim**-0.5)).abs().max().item()
            hidden = torch.ones(5, 210, dtype=torch.bool)
            hidden[:, :width] = ~mask[:, 0, 0]
            poisoned_k = key.masked_fill(hidden[:, None, :, None], float("nan"))
            poisoned_v = value.masked_fill(hidden[:, None, :, None], float("nan"))
            same = torch.equal(kernel(query, poisoned_k, poisoned_v, mask, dim**-0.5), got)
            print(f"{how}: groups={groups} dim={dim} width={width} {dtype}: max error {err:.2e}, hidden slots unread: {same}")
            if got.shape != (5, 1, 2 * groups, dim) or got.dtype != dtype or not err < tol or not same:
                return False
    query, key, value, mask = inputs(5, 2, 2, 210, 64, 150, torch.float16, seed=7)
    mask[2] = False  # row 2 attends nothing
    got = kernel(query, key, value, mask, 0.125)
    print(f"{how}: a row attending nothing gives zeros: {bool((got[2] == 0).all())}")
    return bool((got[2] == 0).all()) and bool(got.isfinite().all())


if __name__ == "__main__":
    sys.exit(main())
