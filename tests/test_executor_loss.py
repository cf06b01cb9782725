"""The runner's loss over a column-parallel head's vocabulary-sharded logits, in one process (a one-rank gloo mesh):
cross-entropy runs vocabulary-parallel under `loss_parallel`, other losses (and a loss function that cannot take
a DTensor) read the gathered logits; every path gives the single-device value and gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from executor.runner import Runner


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def _runner(loss_fn) -> Runner:
    from types import SimpleNamespace
    r = Runner.__new__(Runner)  # only the loss path: a tp plan's mesh, no model
    r.plan = SimpleNamespace(mesh=SimpleNamespace(tp=2))
    r.gather_logits, r.vocab_parallel_loss, r.loss_fn, r.out_spec, r.notes = False, False, loss_fn, None, []
    return r


def _head(mesh):
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 16, bias=False)
    sharded = torch.nn.Linear(8, 16, bias=False)
    sharded.load_state_dict(plain.state_dict())
    parallelize_module(sharded, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    return plain, sharded


def _mse(out, tgt):
    return F.mse_loss(out, tgt)


def _ce(out, tgt):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _needs_plain(out, tgt):
    if isinstance(out, DTensor):
        raise TypeError("this loss wants a plain tensor")
    return _ce(out, tgt)


@pytest.mark.parametrize("loss_fn,target", [
    (_ce, lambda: torch.randint(0, 16, (2, 3))),  # vocabulary-parallel
    (_mse, lambda: torch.randn(2, 3, 16)),  # float targets: gathered
    (_needs_plain, lambda: torch.randint(0, 16, (2, 3))),  # fails on the DTensor: gathered from then on
])
def test_loss_matches_a_single_device(mesh, loss_fn, target):
    from torch.distributed.tensor.parallel import loss_parallel
    plain, sharded = _head(mesh)
    x, y = torch.randn(2, 3, 8), target()
    runner = _runner(loss_fn)
    out = sharded(x)
    assert isinstance(out, DTensor)
    with loss_parallel():  # as the runner wraps forward and backward
        loss = runner._loss(out, y)
        loss.backward()
    want = loss_fn(plain(x), y) if loss_fn is not _needs_plain else _ce(plain(x), y)
    want.backward()
    assert not isinstance(loss, DTensor) and loss.item() == pytest.approx(want.item(), rel=1e-6)
    grad = sharded.weight.grad.full_tensor() if isinstance(sharded.weight.grad, DTensor) else sharded.weight.grad
    assert torch.allclose(grad, plain.weight.grad, atol=1e-6)
    assert runner.gather_logits == (loss_fn is _needs_plain)
    assert any("logits are gathered over tp" in n for n in runner.notes) == (loss_fn is _needs_plain)
    assert runner.vocab_parallel_loss == (loss_fn is _ce)
