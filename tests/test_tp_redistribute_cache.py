"""executor.tp's shared redistribution (q, k and v gather one norm output once) must not keep tensors alive past
the forward, nor depend on object lifetimes (every rank must issue the same collectives)."""
import gc
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from executor import tp
from shared import rank_program_end


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def test_a_redistribution_with_nothing_to_do_is_not_cached(mesh):
    tp.forget_gathered()
    for _ in range(3):  # three steps' activations
        t = DTensor.from_local(torch.randn(4, 4, requires_grad=True), mesh, [Replicate()])
        assert tp._shared_redistribute(t, "R", mesh, "x") is t
    assert tp._LAST is None


def test_consecutive_readers_share_it_until_the_forward_ends(mesh):
    tp.forget_gathered()
    t = DTensor.from_local(torch.randn(4, 4, requires_grad=True), mesh, [Shard(0)])
    a = tp._shared_redistribute(t, "R", mesh, "q input")
    b = tp._shared_redistribute(t, "R", mesh, "k input")
    assert a is b and a is not t and a.placements == (Replicate(),)
    other = DTensor.from_local(torch.randn(4, 4, requires_grad=True), mesh, [Shard(0)])
    tp._shared_redistribute(other, "R", mesh, "fc input")
    assert tp._shared_redistribute(t, "R", mesh, "late reader") is not a  # not consecutive: gathered again
    (a.to_local().sum() + b.to_local().sum()).backward()
    gone = weakref.ref(a)
    del t, a, b, other
    tp.forget_gathered()
    gc.collect()
    assert gone() is None and tp._LAST is None


KEEP_SHARDS_PROGRAM = """
import contextlib, gc, json, os, sys, weakref
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from executor import tp
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
x, w = torch.randn(2, 8, 16), torch.randn(6, 16)
out = {}
for keep in (False, True):
    t = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()  # a sequence-parallel norm output
    W = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()  # a column-parallel linear
    tp.forget_gathered()
    with tp.keep_shards() if keep else contextlib.nullcontext():
        g = tp._shared_redistribute(t, "R", mesh, "q input")
        loss = (F.linear(g, W) ** 2).sum().full_tensor()
    gathered = weakref.ref(g._local_tensor)
    del g
    tp.forget_gathered()
    gc.collect()
    alive = gathered() is not None  # held for backward, or not
    loss.backward()
    out[str(keep)] = {"alive": alive, "dx": t.grad.full_tensor().tolist(), "dw": W.grad.full_tensor().tolist()}
""" + rank_program_end("sys.argv[1]")


def test_sequence_parallel_gathers_are_saved_as_their_shard(tmp_path):
    """Under `keep_shards` (sequence parallelism) a tensor gathered from a sequence shard into a column-parallel
    linear is not held for backward: the linear's saved input is the shard, gathered again when backward reads it
    (Megatron-LM's way), and the gradients are the same as with the whole tensor saved. Two gloo ranks."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prog, out = tmp_path / "ranks.py", tmp_path / "out.json"
    prog.write_text(KEEP_SHARDS_PROGRAM)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(prog), str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["False"]["alive"] and not got["True"]["alive"]
    for key in ("dx", "dw"):
        assert torch.allclose(torch.tensor(got["True"][key]), torch.tensor(got["False"][key]), atol=1e-6), key


def test_an_fp32_input_of_a_linear_is_cast_once_before_it_moves(mesh):
    """Under autocast an fp32 activation read by linears (q, k, v) is cast to bf16 before its redistribution, once
    for the consecutive readers: the collective moves bf16, as the linear would have cast it anyway; ops autocast
    does not cast, and fp32 runs, keep fp32."""
    tp.forget_gathered()
    t = DTensor.from_local(torch.randn(4, 4, requires_grad=True), mesh, [Shard(0)])
    t.retain_grad()
    assert tp.autocast_dtype(t, lower=True) is None  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tp.autocast_dtype(t, lower=False) is None
        dtype = tp.autocast_dtype(t, lower=True)
        assert dtype == torch.bfloat16
        a = tp._shared_redistribute(t, "R", mesh, "q input", dtype)
        b = tp._shared_redistribute(t, "R", mesh, "k input", dtype)
    assert a is b and a.dtype == torch.bfloat16 and a.placements == (Replicate(),)
    a.to_local().float().sum().backward()
    assert t.grad is not None and t.grad.dtype == torch.float32  # the gradient comes back through the cast
    tp.forget_gathered()
