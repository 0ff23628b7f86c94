"""Two ranks that see different free memory refuse a request together (run by torchrun from test_fuzz_api.py).

Rank 0 sees 1 GiB available, rank 1 sees 4 GiB; a 2 GiB request fits rank 1 only. Checked alone,
the ranks disagree (in an engine, rank 1 would enter a collective that rank 0 never joins);
checked with ``group=``, both refuse. Each rank reports what it decided both ways.
"""

from __future__ import annotations

import torch.distributed as dist

import verl_core.kernel.memory as memory_module
from verl_conformance.testkit import write_rank_result
from verl_core.kernel.errors import RequestTooLargeError

GIB = 2**30


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Each rank's own reading of its free memory (the probe is the only thing replaced here).
    memory_module.available_memory = lambda device: (1 + 3 * rank) * GIB
    decided: dict[str, str] = {}
    for name, group in (("alone", None), ("together", dist.group.WORLD)):
        try:
            memory_module.check_fits(2 * GIB, "cpu", "a 2 GiB request", group=group)
            decided[name] = "fits"
        except RequestTooLargeError as e:
            decided[name] = str(e)
    dist.barrier()  # every rank gets here: none is left waiting inside the check's collective
    write_rank_result(decided)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
