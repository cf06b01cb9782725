"""executor.tp's shared redistribution (q, k and v gather one norm output once) must not keep tensors alive: a
cached entry lives only while its input does, so a step's activations are freed after its backward."""
import gc

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from executor import tp


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def _entries() -> int:
    return 0 if tp._GATHERED is None else sum(len(v) for v in tp._GATHERED.values())


def test_a_redistribution_with_nothing_to_do_is_not_cached(mesh):
    before = _entries()
    for _ in range(3):  # three steps' activations
        t = DTensor.from_local(torch.randn(4, 4, requires_grad=True), mesh, [Replicate()])
        assert tp._shared_redistribute(t, "R", mesh, "x") is t
    assert _entries() == before


def test_a_cached_redistribution_is_shared_then_dies_with_its_input(mesh):
    gc.collect()
    before = _entries()
    t = DTensor.from_local(torch.randn(4, 4, requires_grad=True), mesh, [Shard(0)])
    a = tp._shared_redistribute(t, "R", mesh, "q input")
    b = tp._shared_redistribute(t, "R", mesh, "k input")
    assert a is b and a is not t and a.placements == (Replicate(),)
    (a.to_local().sum() + b.to_local().sum()).backward()
    del t, a, b
    gc.collect()
    assert _entries() == before
