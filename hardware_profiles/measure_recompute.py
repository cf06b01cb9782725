"""Host costs timed inside one rank of `plan profile`: activation checkpointing per op, and the runner's per-step
sub-mesh lookup.

torch's non-reentrant `checkpoint` packs and unpacks every tensor the checkpointed forward saves through Python
saved-tensor hooks and re-runs the forward in backward from a recorded frame; selective checkpointing
(`create_selective_checkpoint_contexts`, torchtitan's op-level SAC) also runs every op of the forward and of the
re-run through a Python TorchDispatchMode that asks the policy. Both are a fixed host cost per op, on
top of the ops' own dispatch, that no kernel measurement sees. Measured here on chains of tiny ops (kernel time
nil), per op of the checkpointed region, split by kind as the cost model prices dispatch: elementwise ops and
`F.linear` calls. On CPU ranks timed in the thread's CPU time: pure host work, which other processes on a shared
machine would otherwise inflate. On GPUs in wall time (`host_clock`): the autograd engine runs a CUDA backward on a
device thread of its own, whose CPU time the calling thread's clock never sees.
"""
from __future__ import annotations

import statistics
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
    return (_host_seconds(lambda: run(x), x.device, sync, plan),
            _host_seconds(lambda: run(x).sum().backward(), x.device, sync, plan))


def host_clock(device: torch.device) -> Callable[[], float]:
    """The clock host work is timed on: this thread's CPU time on CPU ranks (other processes sharing the cores do
    not inflate it as they do wall time; on an idle core the two agree), wall time on GPUs, where a backward's
    host work runs on the autograd engine's device thread (tiny kernels: the device never holds the host up)."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


def _host_seconds(fn: Callable[[], object], device: torch.device, sync: Callable[[], None],
                  plan: MeasurePlan) -> float:
    """Expected host seconds per call of `fn` on `host_clock`."""
    return expected(time_calls(fn, sync, plan.warmup, plan.repeats, plan.budget_s, clock=host_clock(device)))


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
    out.update(_call_overheads(device, sync, plan))
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


def _tiny_block(device: torch.device) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """A GPT block (Radford et al. 2019; nanoGPT's layout: pre-norm, fused qkv, causal SDPA, GELU MLP) at width 8,
    4 tokens, 2 heads, and an input for it: the calls a block's forward makes (21), each on tiny tensors, so
    timing it measures their host cost."""
    F = torch.nn.functional
    p = {n: torch.nn.Parameter(torch.full(s, 0.1, device=device)) for n, s in
         {"ln": (8,), "qkv": (24, 8), "qkv_b": (24,), "o": (8, 8), "o_b": (8,), "fc": (32, 8), "fc_b": (32,),
          "proj": (8, 32), "proj_b": (8,)}.items()}

    def block(x):
        q, k, v = F.linear(F.layer_norm(x, (8,), p["ln"], p["ln"]), p["qkv"], p["qkv_b"]).split(8, dim=2)
        q, k, v = (t.view(1, 4, 2, 4).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 4, 8)
        x = x + F.linear(y, p["o"], p["o_b"])
        h = F.gelu(F.linear(F.layer_norm(x, (8,), p["ln"], p["ln"]), p["fc"], p["fc_b"]), approximate="tanh")
        return x + F.linear(h, p["proj"], p["proj_b"])
    return block, torch.ones(1, 4, 8, device=device, requires_grad=True)


def _call_overheads(device: torch.device, sync: Callable[[], None], plan: MeasurePlan) -> dict[str, float]:
    """`recompute: attention`'s host costs (executor.parallel.checkpoint_attention), on a tiny GPT block
    (`_tiny_block`) as a model makes the calls: the Python TorchFunctionMode that sees each call of the block's
    forward to find the SDPA one (`function_mode_op`: the block under the mode beyond the plain block, per call
    the mode saw), and the call that re-runs the SDPA call in backward (`checkpoint_call_*`: the block with its
    SDPA call re-run beyond the block under the mode alone; backward beyond one plain re-run of the SDPA call
    too)."""
    from torch.overrides import TorchFunctionMode
    sdpa = torch.nn.functional.scaled_dot_product_attention
    block, x = _tiny_block(device)
    seen = [0]

    class Mode(TorchFunctionMode):
        def __init__(self, rerun: bool):
            super().__init__()
            self.rerun = rerun

        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen[0] += 1
            if func is sdpa and self.rerun:
                return _RecomputedSDPA.apply(*args)
            return func(*args, **(kwargs or {}))

    def moded(rerun: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(t):
            with Mode(rerun):
                return block(t)
        return run
    variants = {"plain": block, "mode": moded(False), "rerun": moded(True)}
    for run in variants.values():
        for _ in range(max(plan.warmup, 1)):
            run(x).sum().backward()
    sync()
    # the three interleaved, on the host clock: each difference comes from runs moments apart
    clock = host_clock(device)
    fwd: dict[str, list[float]] = {n: [] for n in variants}
    bwd: dict[str, list[float]] = {n: [] for n in variants}
    start = time.perf_counter()
    while len(fwd["plain"]) < 3 * plan.repeats and (len(fwd["plain"]) < 3 or
                                                     time.perf_counter() - start < 3 * plan.budget_s):
        for name, run in variants.items():
            t0 = clock()
            out = run(x).sum()
            t1 = clock()
            out.backward()
            sync()
            fwd[name].append(t1 - t0)
            bwd[name].append(clock() - t1)
    seen[0] = 0
    variants["mode"](x)
    q = torch.ones(1, 2, 4, 4, device=device, requires_grad=True)
    sdpa_f = _host_seconds(lambda: sdpa(q, q, q, is_causal=True), device, sync, plan)
    f0, fm, fr = (statistics.median(fwd[n]) for n in variants)
    bm, br = statistics.median(bwd["mode"]), statistics.median(bwd["rerun"])
    return {"checkpoint_call_forward": max(fr - fm, 0.0), "checkpoint_call_backward": max(br - bm - sdpa_f, 0.0),
            "function_mode_op": max(fm - f0, 0.0) / seen[0]}


def mesh_slice_seconds(device: torch.device, sync: Callable[[], None], plan: MeasurePlan) -> float:
    """Host seconds of `mesh["dp"].get_local_rank()` on a (pp, dp, tp) = (1, world, 1) DeviceMesh named as the
    executor names its mesh (every rank must call this: building the mesh creates process groups)."""
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist
    mesh = init_device_mesh(device.type, (1, dist.get_world_size(), 1), mesh_dim_names=("pp", "dp", "tp"))
    return _host_seconds(lambda: mesh["dp"].get_local_rank(), device, sync, plan)
