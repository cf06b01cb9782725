"""Shared test setup: examples/ importable, small thread counts (CI has 2 cores), the longest files first."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
torch.set_num_threads(1)

LONGEST_FIRST = ("test_zoo.py", "test_dry_run.py", "test_executor.py", "test_end_to_end.py", "test_cli_summary.py")
"""Files that launch gloo ranks for a minute or more, longest first: the README runs the suite on two xdist workers
one file at a time (`-n 2 --dist loadfile`), and a long file handed out last would run alone at the end."""


def pytest_collection_modifyitems(items):
    """Move LONGEST_FIRST's tests to the front, in that order; the rest keep theirs."""
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A 1-D DeviceMesh over a one-rank gloo group in this process (started here unless one already runs)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()
