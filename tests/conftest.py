"""Shared test setup: examples/ importable, small thread counts (CI has 2 cores)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
torch.set_num_threads(1)


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
