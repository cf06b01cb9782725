"""Host costs timed inside one rank of `plan profile` in the thread's CPU time: activation checkpointing per op,
and the runner's per-step sub-mesh lookup.

torch's non-reentrant `checkpoint` packs and unpacks every tensor the checkpointed forward saves through Python
saved-tensor hooks and re-runs the forward in backward from a recorded frame; selective checkpointing
(`create_selective_checkpoint_contexts`, torchtitan's op-level SAC) also runs every op of the forward and of the
re-run through a Python TorchDispatchMode that asks the policy. Both are a fixed host cost per op, on
top of the ops' own dispatch, that no kernel measurement sees. Measured here on chains of tiny ops (kernel time
nil), per op of the checkpointed region, split by kind as the cost model prices dispatch: elementwise ops and
`F.linear` calls. Timed in the thread's CPU time: pure host work, which other processes on a shared machine would
otherwise inflate.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from hardware_profiles.measure import MeasurePlan, expected, time_calls

CKPT_CHAIN = 16
"""Ops per checkpointed call (about a transformer block's worth), so the call's own start-up is spread over ops as
in a model."""


def _sac_context() -> tuple:
    """Selective-checkpoint contexts whose policy keeps every other matmul and recomputes the rest, as the
    executor's (torchtitan's) policy does for a block's linears; tiny elementwise ops are all recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    count = [0]

    def policy(ctx, op, *args, **kwargs):
        if op in mm:
            count[0] += 1
            return CheckpointPolicy.MUST_SAVE if count[0] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _times(chain: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str, sync: Callable[[], None],
           plan: MeasurePlan) -> tuple[float, float]:
    """(forward, forward + backward) expected seconds of `chain(x)` plain (`mode` "plain"), under a full
    non-reentrant checkpoint ("full") or under selective checkpointing ("selective")."""
    from torch.utils.checkpoint import checkpoint
    if mode == "plain":
        run = chain
    elif mode == "full":
        def run(t):
            return checkpoint(chain, t, use_reentrant=False)
    else:
        def run(t):
            return checkpoint(chain, t, use_reentrant=False, context_fn=_sac_context)
    return _cpu_seconds(lambda: run(x), sync, plan), _cpu_seconds(lambda: run(x).sum().backward(), sync, plan)


def _cpu_seconds(fn: Callable[[], object], sync: Callable[[], None], plan: MeasurePlan) -> float:
    """Median CPU seconds of this thread per call of `fn` (host work only, so other processes sharing the cores
    do not inflate it as they do wall time; on an idle core the two agree)."""
    return expected(time_calls(fn, sync, plan.warmup, plan.repeats, plan.budget_s, clock=time.thread_time))


def checkpoint_overheads(device: torch.device, sync: Callable[[], None], plan: MeasurePlan) -> dict[str, float]:
    """Seconds per op of a checkpointed region beyond the op's own plain cost, for full (`checkpoint_*`) and
    selective (`sac_*`) recomputation: forward (`*_forward`: saved-tensor packing, the SAC mode's policy call)
    and backward (`*_backward`: unpacking, the re-run's frame and mode, beyond one plain re-run of every op, which
    the cost model prices as recomputation), for elementwise ops (a chain of tiny multiplications by a
    parameter, each saving its inputs) and for F.linear calls on a [batch, tokens, features] activation as models
    make them (`*_linear_*`: a view, the weight's transpose, addmm and a view, each through the SAC mode)."""
    w = torch.nn.Parameter(torch.ones(1, device=device))
    lw = torch.nn.Parameter(torch.ones(2, 2, device=device))
    lb = torch.nn.Parameter(torch.ones(2, device=device))

    def muls(t):
        for _ in range(CKPT_CHAIN):
            t = t * w
        return t

    def linears(t):
        for _ in range(CKPT_CHAIN):
            t = torch.nn.functional.linear(t, lw, lb)
        return t
    out: dict[str, float] = {}
    for kind, chain, x in (("", muls, torch.ones(1, device=device, requires_grad=True)),
                           ("linear_", linears, torch.ones(1, 2, 2, device=device, requires_grad=True))):
        f0, fb0 = _times(chain, x, "plain", sync, plan)
        for key, mode in (("checkpoint", "full"), ("sac", "selective")):
            f, fb = _times(chain, x, mode, sync, plan)
            out[f"{key}_{kind}forward"] = max(f - f0, 0.0) / CKPT_CHAIN
            # backward beyond the plain backward and one plain re-run of the forward
            out[f"{key}_{kind}backward"] = max((fb - f) - (fb0 - f0) - f0, 0.0) / CKPT_CHAIN
    out.update(_call_overheads(muls, device, sync, plan))
    return out


class _RecomputedSDPA(torch.autograd.Function):
    """executor.parallel's `_Recomputed` on one F.scaled_dot_product_attention(q, k, v, is_causal=True) call, step
    for step (this package imports none of ours): forward keeps q, k, v and the autocast state and runs the call with
    autograd off; backward re-runs it under that autocast and backpropagates through the re-run."""

    @staticmethod
    def forward(ctx, q, k, v):
        device = q.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(q, k, v)
        ctx.set_materialize_grads(False)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def backward(ctx, grad):
        ins = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = torch.nn.functional.scaled_dot_product_attention(*ins, is_causal=True)
        return torch.autograd.grad([out], ins, [grad], allow_unused=True)


def _call_overheads(muls: Callable[[torch.Tensor], torch.Tensor], device: torch.device, sync: Callable[[], None],
                    plan: MeasurePlan) -> dict[str, float]:
    """`recompute: attention`'s host costs (executor.parallel.checkpoint_attention): its re-run-in-backward call
    around one SDPA call (`checkpoint_call_*`: on a tiny causal q, k, v, beyond the plain call; backward beyond one
    plain re-run too), and a Python TorchFunctionMode that looks each call up in a set, as the executor's does to
    find the SDPA calls, per op it sees in a block's forward (`function_mode_op`, on `muls`, a chain of
    `CKPT_CHAIN` multiplications)."""
    from torch.overrides import TorchFunctionMode
    q = torch.ones(1, 1, 4, 8, device=device, requires_grad=True)
    watched = {torch.nn.functional.scaled_dot_product_attention}

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in watched:
                pass
            return func(*args, **(kwargs or {}))

    def plain(t):
        return torch.nn.functional.scaled_dot_product_attention(t, t, t, is_causal=True)

    def recomputed(t):
        return _RecomputedSDPA.apply(t, t, t)

    def moded(t):
        with Mode():
            return muls(t)
    times = {}
    for name, call in (("plain", plain), ("recomputed", recomputed)):
        times[name] = (_cpu_seconds(lambda: call(q), sync, plan),
                       _cpu_seconds(lambda: call(q).sum().backward(), sync, plan))
    (f0, fb0), (f, fb) = times["plain"], times["recomputed"]
    x = torch.ones(1, device=device, requires_grad=True)
    m0 = _cpu_seconds(lambda: muls(x), sync, plan)
    m = _cpu_seconds(lambda: moded(x), sync, plan)
    return {"checkpoint_call_forward": max(f - f0, 0.0),
            "checkpoint_call_backward": max((fb - f) - (fb0 - f0) - f0, 0.0),
            "function_mode_op": max(m - m0, 0.0) / CKPT_CHAIN}


def mesh_slice_seconds(device: torch.device, sync: Callable[[], None], plan: MeasurePlan) -> float:
    """CPU seconds of `mesh["dp"].get_local_rank()` on a (pp, dp, tp) = (1, world, 1) DeviceMesh named as the
    executor names its mesh (every rank must call this: building the mesh creates process groups)."""
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist
    mesh = init_device_mesh(device.type, (1, dist.get_world_size(), 1), mesh_dim_names=("pp", "dp", "tp"))
    return _cpu_seconds(lambda: mesh["dp"].get_local_rank(), sync, plan)
