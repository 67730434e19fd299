"""A CPU rank keeps the memory of its freed tensors (hybridflow/parallel/host.py): glibc's default
serves a large block with its own mmap, unmapped at free, so each allocation of it faults every
page in again; with the setting, large blocks come from the heap, which keeps freed memory
resident for the next allocation that fits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.parallel.spawn import spawn

BLOCK = 64 << 20  # bytes: above glibc's largest mmap threshold (32 MiB), as a [V, h] tensor is


def large_block_probe(block: int = BLOCK) -> dict:
    """Whether a fresh ``block``-byte tensor lies in the process's heap (brk) rather than in a
    mapping of its own, and the page faults of writing one, freeing it and writing a second."""
    import resource

    import torch

    def in_heap(ptr: int) -> bool:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return lo <= ptr < hi
        return False

    x = torch.empty(block, dtype=torch.uint8)
    heap = in_heap(x.data_ptr())
    x.fill_(1)
    del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = torch.empty(block, dtype=torch.uint8)
    y.fill_(1)
    del y
    return {"in_heap": heap, "refaults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            - before}


def _spawned_rank(rank, world_size):
    return large_block_probe()["in_heap"]


def _default_process() -> dict:
    """``large_block_probe`` in a fresh interpreter with glibc's defaults."""
    code = ("import json; from tests.unit.test_host import large_block_probe; "
            "print(json.dumps(large_block_probe()))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).parents[2]).stdout
    return json.loads(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_ranks_serve_large_blocks_from_the_heap():
    # glibc's default: a mapping of its own, and every page faults in again the second time
    default = _default_process()
    assert not default["in_heap"] and default["refaults"] > BLOCK // 4096 // 2
    # a rank spawn() starts (the tests' and demos' processes) calls cpu_rank_settings: the block
    # comes from the heap, whose freed memory stays resident for the next allocation that fits
    assert spawn(_spawned_rank, 1) == [True]
