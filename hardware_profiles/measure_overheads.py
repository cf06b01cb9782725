"""Host-side costs of eager PyTorch timed inside one rank of `plan profile`, and compute-bound elementwise kernels:
per-op dispatch (plain and DTensor), nn.Linear's whole call, AdamW per tensor, FSDP2's and DDP's own work, a DTensor
redistribution beyond its all-gather, and seconds per element of elementwise kernels. One-element tensors where the
kernel must vanish, so what is left is the cost of dispatching the op.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from hardware_profiles.measure import MeasurePlan, device_seconds, expected, time_calls
from hardware_profiles.measure_collectives import all_gather_fn, reduce_scatter_fn

CHAIN_OPS = 64
"""Length of the chain of tiny ops timed for the per-op overhead."""
KERNEL_ELEMS = 256 * 512
"""Elements of the activation-sized tensor the elementwise kernels are timed on (a GPT MLP activation of 256 tokens
x 512 features: 512 KiB in fp32, past L1, inside L2)."""
ADAMW_GPU_ELEMS = 2 ** 26
"""Elements of the one parameter the per-element AdamW cost is timed on with CUDA: 256 MiB in fp32 (1 GiB with its
gradient and states), far past the L2, as a model's parameters are."""
ADAM_TENSORS = 64
"""Tiny parameter tensors one timed AdamW step updates (its per-tensor cost is the time / this)."""


def _chain_times(x0: torch.Tensor, sync: Callable[[], None], plan: MeasurePlan,
                 op: Callable[[torch.Tensor], torch.Tensor] = lambda y: y + 1.0) -> tuple[float, float]:
    """(forward, backward) seconds per op of a chain of CHAIN_OPS tiny `op`s (default: adds) on `x0` (which
    requires grad)."""
    def fwd():
        y = x0
        for _ in range(CHAIN_OPS):
            y = op(y)
        return y

    t_f = expected(time_calls(fwd, sync, plan.warmup, plan.repeats, plan.budget_s))
    t_fb = expected(time_calls(lambda: fwd().sum().backward(), sync, plan.warmup, plan.repeats,
                                        plan.budget_s))
    # the backward call also pays one sum op and its node; a chain's length makes those negligible
    return t_f / CHAIN_OPS, max(t_fb - t_f, 0.0) / CHAIN_OPS


def adamw(params: list) -> torch.optim.Optimizer:
    """The AdamW the executor builds by default (`executor.runner.default_optimizer`): torch's default on CPU
    (foreach), the fused kernel on CUDA (one pass per parameter tensor, as torchtitan's default)."""
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if params[0].is_cuda else {}))


def _adam_time(params: list, sync: Callable[[], None], plan: MeasurePlan) -> float:
    """Seconds per parameter tensor of one step of the executor's default AdamW over `params` (grads set)."""
    for p in params:
        p.grad = torch.ones_like(p)
    opt = adamw(params)
    return expected(time_calls(opt.step, sync, plan.warmup, plan.repeats, plan.budget_s)) / len(params)


LINEAR_CHAIN = 16
"""Tiny linears chained per timed call for the per-linear overhead (amortises the backward call's start-up)."""


def _linear_overhead(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, sync: Callable[[], None],
                     plan: MeasurePlan) -> tuple[float, float]:
    """(forward, backward) seconds per tiny F.linear in a chain of LINEAR_CHAIN of them (all its dispatches: the
    weight's transpose, addmm, views; in backward its nodes and the gradient accumulations of weight and bias)."""
    def fwd():
        y = x
        for _ in range(LINEAR_CHAIN):
            y = torch.nn.functional.linear(y, w, b)
        return y
    g = torch.ones_like(fwd()).detach()
    f = expected(time_calls(fwd, sync, plan.warmup, plan.repeats, plan.budget_s))
    fb = expected(time_calls(lambda: fwd().backward(g), sync, plan.warmup, plan.repeats, plan.budget_s))
    return f / LINEAR_CHAIN, max(fb - f, 0.0) / LINEAR_CHAIN


def op_overheads(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                 mesh: object | None = None) -> dict[str, float]:
    """Host-side seconds per op (forward), per autograd node (backward) and per AdamW parameter tensor, on plain
    tensors and — where `mesh` (a 1-D DeviceMesh over the ranks) is given — on replicated DTensors (tensor
    parallelism's and FSDP2's operands; Replicate so that no op communicates). One-element tensors, so the kernel
    time is nil and what is left is the cost of dispatching the op."""
    out: dict[str, float] = {}
    x = torch.ones(1, device=device, requires_grad=True)
    out["forward"], out["backward"] = _chain_times(x, sync, plan)
    lin = [torch.ones(2, 2, device=device, requires_grad=True), torch.nn.Parameter(torch.ones(2, 2, device=device)),
           torch.nn.Parameter(torch.ones(2, device=device))]
    out["linear_forward"], out["linear_backward"] = _linear_overhead(*lin, sync, plan)
    # a model's linears read (batch, sequence, features): F.linear flattens the leading dims and restores them
    nd = [torch.ones(1, 2, 2, device=device, requires_grad=True), *lin[1:]]
    out["linear_nd_forward"], out["linear_nd_backward"] = _linear_overhead(*nd, sync, plan)
    out["optimizer"] = _adam_time([torch.nn.Parameter(torch.ones(1, device=device)) for _ in range(ADAM_TENSORS)],
                                  sync, plan)
    w = torch.nn.Parameter(torch.eye(2, device=device))
    out["matmul_forward"], out["matmul_backward"] = _chain_times(lin[0], sync, plan, lambda y: y @ w)
    if mesh is not None:
        from torch.distributed.tensor import Replicate, distribute_tensor
        # under tensor parallelism every op, and every op an autograd node runs in backward, dispatches through
        # DTensor: a chain of multiplications (whose backward nodes each run one multiplication) prices both
        xd = distribute_tensor(torch.ones(1, device=device), mesh, [Replicate()]).requires_grad_()
        out["dtensor_forward"], out["dtensor_backward"] = _chain_times(xd, sync, plan, lambda y: y * 1.0)
        xm = distribute_tensor(torch.ones(2, 2, device=device), mesh, [Replicate()]).requires_grad_()
        wd = torch.nn.Parameter(distribute_tensor(torch.eye(2, device=device), mesh, [Replicate()]))
        out["dtensor_matmul_forward"], out["dtensor_matmul_backward"] = _chain_times(xm, sync, plan,
                                                                                     lambda y: y @ wd)
        # a linear on DTensors: replicated square weight, so the chain composes and nothing communicates
        lin = [distribute_tensor(torch.ones(2, 2, device=device), mesh, [Replicate()]).requires_grad_(),
               torch.nn.Parameter(distribute_tensor(torch.ones(2, 2, device=device), mesh, [Replicate()])),
               torch.nn.Parameter(distribute_tensor(torch.ones(2, device=device), mesh, [Replicate()]))]
        out["dtensor_linear_forward"], out["dtensor_linear_backward"] = _linear_overhead(*lin, sync, plan)
        nd = [distribute_tensor(torch.ones(1, 2, 2, device=device), mesh, [Replicate()]).requires_grad_(), *lin[1:]]
        out["dtensor_linear_nd_forward"], out["dtensor_linear_nd_backward"] = _linear_overhead(*nd, sync, plan)
        ps = [torch.nn.Parameter(distribute_tensor(torch.ones(1, device=device), mesh, [Replicate()]))
              for _ in range(ADAM_TENSORS)]
        out["dtensor_optimizer"] = _adam_time(ps, sync, plan)
        out["dtensor_partial_optimizer"] = partial_grad_adam(device, sync, plan, mesh)
        out["dtensor_redistribute"] = redistribute_overhead(device, sync, plan, mesh)
        out["dtensor_local_call_forward"], out["dtensor_local_call_backward"] = local_call_overhead(device, sync,
                                                                                                   plan, mesh)
        out.update(fsdp_overheads(device, sync, plan, mesh))
    return out


def _fixed_times(fn: Callable[[], object], sync: Callable[[], None], plan: MeasurePlan,
                 alone: bool = False, group: dist.ProcessGroup | None = None) -> float:
    """Expected seconds per call of `fn` over a fixed number of calls: every rank makes the same calls (a time
    budget could differ between ranks, and these calls communicate). `alone`: each call is a collective over
    `group` (None: the default group) issued alone, after a barrier over it."""
    for _ in range(plan.warmup):
        fn()
    sync()
    samples = []
    for _ in range(plan.repeats):
        if alone:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return expected(samples)


FSDP_MODULES = 6
"""Sharded modules (plus the root, as the executor wraps a model) in the stack timed for FSDP2's per-module cost."""
FSDP_TENSORS = (1, 16)
"""Parameter tensors per module in the two stacks, to separate the per-module from the per-tensor cost."""


FSDP_MATMUL = 128
"""Side of the square matmul each `_Tiny` module runs in forward (and twice in backward): compute between FSDP2's
collectives, as a model's blocks have, so that the ranks reach each collective apart as they do in training."""


class _Tiny(torch.nn.Module):
    """A module with `n` tiny parameters whose forward adds each to its input and runs one FSDP_MATMUL matmul
    (a little compute between units, no parameter in it)."""

    def __init__(self, n: int, numel: int, device: torch.device, inner: list | None = None):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(numel, device=device)) for _ in range(n))
        self.inner = torch.nn.ModuleList(inner or [])
        self.register_buffer("a", torch.full((FSDP_MATMUL, FSDP_MATMUL), 1.0 / FSDP_MATMUL, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.ps:
            x = x + p
        x = x + (self.a * x[0]).mm(self.a).sum() * 0.0
        for m in self.inner:
            x = m(x)
        return x


def _fsdp_stack(n: int, reshard: bool | None, device: torch.device, mesh: object) -> Callable[[], None]:
    """One forward + backward of a root `_Tiny` holding FSDP_MODULES `_Tiny` blocks of `n` parameters each, under
    FSDP2 `fully_shard` per block and on the root (as the executor applies it), or plain when `reshard` is None."""
    numel = 4 * mesh.size()
    root = _Tiny(n, numel, device, [_Tiny(n, numel, device) for _ in range(FSDP_MODULES)])
    if reshard is not None:
        from torch.distributed.fsdp import fully_shard
        for m in root.inner:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(root, mesh=mesh, reshard_after_forward=reshard)
    x = torch.ones(numel, device=device)

    def step():
        root(x).sum().backward()
        for p in root.parameters():
            p.grad = None
    return step


def _fsdp_comm_time(n: int, reshard: bool, device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                    mesh: object) -> float:
    """Seconds of the collectives one `_fsdp_stack` module issues, each timed on its own after a barrier (as
    FSDP2 issues them, between other work): its all-gather of the `n` parameters (twice when resharding after
    forward) and its gradients' reduce-scatter, at the stack's sizes."""
    group, world = mesh.get_group(), mesh.size()
    full = torch.ones(n * 4 * world, device=device)
    shard = torch.ones(n * 4, device=device)
    gather = all_gather_fn()
    scatter = reduce_scatter_fn()

    gathers = _fixed_times(lambda: gather(full, shard, group=group), sync, plan, alone=True, group=group)
    return (2 if reshard else 1) * gathers + \
        _fixed_times(lambda: scatter(shard, full, group=group), sync, plan, alone=True, group=group)


def fsdp_overheads(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                   mesh: object) -> dict[str, float]:
    """FSDP2's own seconds per forward + backward of one `fully_shard`ed module (its pre/post forward and
    backward hooks, all-gather copy-in/copy-out, the gradient reduce-scatter's copies), with and without
    resharding after forward (ZeRO-3 / ZeRO-1,2), split into a part per module and a part per parameter tensor
    from stacks of FSDP_TENSORS tensors per module: the stack's time under FSDP2 minus the same stack unsharded
    (paired repeats; a small matmul per module puts compute between the collectives), over its FSDP_MODULES + 1
    modules, minus the module's collectives timed on their own (the cost model prices
    each unit's all-gather and reduce-scatter at its real size from the collective curves)."""
    out: dict[str, float] = {}
    (n0, n1), mods = FSDP_TENSORS, FSDP_MODULES + 1
    plan = replace(plan, repeats=2 * plan.repeats)  # differences of noisy times: twice the samples
    for key, reshard in (("fsdp_module", False), ("fsdp_module_reshard", True)):
        per = [_paired_extra(_fsdp_stack(n, None, device, mesh), _fsdp_stack(n, reshard, device, mesh), sync,
                             plan, mesh.get_group()) / mods
               - _fsdp_comm_time(n, reshard, device, sync, plan, mesh) for n in (n0, n1)]
        per_tensor = max((per[1] - per[0]) / (n1 - n0), 0.0)
        out[key] = max(per[0] - n0 * per_tensor, 0.0)
        out[key.replace("module", "tensor")] = per_tensor
    return out


DDP_STACKS = ((8, 32), (32, 32), (8, 256))
"""(linears, width) of the nn.Linear stacks timed under DDP: 16 and 64 parameter tensors with little gradient
(per-tensor cost), and 16 tensors holding 2.1 MB of gradient (per-byte cost)."""
DDP_FIRST_BUCKET = 2**20
"""DDP's first bucket cap (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES); later buckets close at 25 MiB."""


def _ddp_buckets(params: list, cap: int = 25 * 2**20) -> list[int]:
    """Bytes of each DDP gradient bucket: parameters in reverse order, a bucket closing once it reaches its cap
    (the first DDP_FIRST_BUCKET), as torch's _compute_bucket_assignment_by_size does for one dtype."""
    out, acc = [], 0
    for p in reversed(params):
        acc += p.numel() * p.element_size()
        if acc >= (cap if out else DDP_FIRST_BUCKET):
            out.append(acc)
            acc = 0
    return out + ([acc] if acc else [])


def _paired_extra(base: Callable[[], object], other: Callable[[], object], sync: Callable[[], None],
                  plan: MeasurePlan, group: dist.ProcessGroup | None) -> float:
    """Expected value over repeats of (seconds of `other` - seconds of `base`), the two timed back to back in each
    repeat after a barrier, so that load from other processes hits both alike (every rank makes the same calls)."""
    for _ in range(plan.warmup):
        base()
        other()
    diffs = []
    for _ in range(plan.repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        base()
        sync()
        t1 = time.perf_counter()
        other()
        sync()
        diffs.append((time.perf_counter() - t1) - (t1 - t0))
    return expected(diffs)


def ddp_overheads(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                  group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """DDP's own seconds per synchronised forward + backward (`ddp_call`), per parameter tensor (`ddp_tensor`) and
    per gradient byte (`ddp_byte`): for each DDP_STACKS stack, its step under DDP (default buckets, as the
    executor wraps a model) minus the same stack unwrapped (paired repeats), minus its buckets' all-reduces each
    timed alone; three stacks, three unknowns. `ddp_extra_*` / `ddp_allreduce_*` keep the raw figures (seconds
    per step under DDP beyond plain, and of its buckets' all-reduces alone) so their overlap can be read off."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    plan = replace(plan, repeats=2 * plan.repeats)  # differences of noisy times: twice the samples
    rows, extra, comm = [], [], []
    for n, w in DDP_STACKS:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(*[torch.nn.Linear(w, w, device=device) for _ in range(n)])
        wrapped = DDP(torch.nn.Sequential(*[torch.nn.Linear(w, w, device=device) for _ in range(n)]),
                      process_group=group, device_ids=[device.index] if device.type == "cuda" else None)
        x = torch.ones(4, w, device=device)

        def step(m: torch.nn.Module) -> None:
            m(x).sum().backward()
            for p in m.parameters():
                p.grad = None
        extra.append(_paired_extra(lambda: step(plain), lambda: step(wrapped), sync, plan, group))
        params = list(plain.parameters())
        bufs = [torch.ones(b // 4, device=device) for b in _ddp_buckets(params)]
        comm.append(sum(_fixed_times(lambda b=b: dist.all_reduce(b, group=group), sync, plan, alone=True, group=group)
                        for b in bufs))
        rows.append((1.0, float(len(params)), float(sum(p.numel() * p.element_size() for p in params))))
    own = np.array([e - c for e, c in zip(extra, comm)])
    call, per_tensor, per_byte = np.linalg.solve(np.array(rows), own)
    out = {"ddp_call": max(float(call), 0.0), "ddp_tensor": max(float(per_tensor), 0.0),
           "ddp_byte": max(float(per_byte), 0.0)}
    for (n, w), e, c in zip(DDP_STACKS, extra, comm):
        out[f"ddp_extra_{n}x{w}"], out[f"ddp_allreduce_{n}x{w}"] = e, c
    return out


REDISTRIBUTE_CHAIN = 8
"""Matmul + redistribution pairs per timed call of `redistribute_overhead`."""


def redistribute_overhead(device: torch.device, sync: Callable[[], None], plan: MeasurePlan, mesh: object) -> float:
    """Seconds per DTensor redistribution (a sequence-sharded activation all-gathered, as tensor parallelism's
    PrepareModuleInput does) beyond its all-gather timed alone after a barrier: functional collective issue and
    wait (on gloo a hand-off to its worker thread) and DTensor's copies. A chain of REDISTRIBUTE_CHAIN (matmul,
    barrier, redistribution) triples against the same with a plain add in its place (paired repeats), per
    redistribution, minus the all-gather alone. The barrier lines the ranks up, so the ranks' arriving apart after
    compute is left to `sync_wait` (measure_collectives.sync_wait_points), which prices it by the compute."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    world, group = mesh.size(), mesh.get_group()
    a = torch.randn(256, 256, device=device)
    local = torch.ones(4, 16, 128, device=device)  # gathers to [4, 16 x world, 128]: an activation-sized message
    x = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    plan = replace(plan, repeats=2 * plan.repeats)  # a difference of noisy times: twice the samples

    def chain(redistribute: bool) -> None:
        for _ in range(REDISTRIBUTE_CHAIN):
            torch.mm(a, a)
            dist.barrier(group=group)
            if redistribute:
                x.redistribute(mesh, [Replicate()]).to_local().add_(0.0)  # add_ waits for the gather
            else:
                local.add(0.0)
    extra = _paired_extra(lambda: chain(False), lambda: chain(True), sync, plan, group) / REDISTRIBUTE_CHAIN
    full = torch.ones(local.numel() * world, device=device)
    gather = all_gather_fn()
    alone = _fixed_times(lambda: gather(full, local.reshape(-1), group=group), sync, plan, alone=True, group=group)
    return max(extra - alone, 0.0)


LOCAL_CHAIN = 16
"""Tiny modules chained per timed call for the per-call cost of a module run on local tensors."""


def local_call_overhead(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                        mesh: object) -> tuple[float, float]:
    """(forward, backward) seconds per call of a module that tensor parallelism leaves replicated, called on a
    replicated DTensor: a forward pre-hook unwraps its DTensor inputs (`to_local`) and a forward hook wraps its
    outputs back as Replicate DTensors (`DTensor.from_local`), through torch.utils._pytree.tree_map, so that it runs
    on plain tensors (what a plan's wholly replicated module costs around its own ops). A chain of LOCAL_CHAIN tiny
    nn.Linear modules so hooked, against the same chain on plain tensors without hooks."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.utils._pytree import tree_map

    def pre(module, args):
        return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, args)

    def post(module, args, output):
        return tree_map(lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, output)

    def chain(hooked: bool):
        mods = [torch.nn.Linear(2, 2, device=device) for _ in range(LOCAL_CHAIN)]
        if hooked:
            for m in mods:
                m.register_forward_pre_hook(pre)
                m.register_forward_hook(post)
            x = distribute_tensor(torch.ones(1, 2, device=device), mesh, [Replicate()]).requires_grad_()
        else:
            x = torch.ones(1, 2, device=device, requires_grad=True)

        def fwd():
            y = x
            for m in mods:
                y = m(y)
            return y
        g = torch.ones_like(fwd()).detach()
        f = expected(time_calls(fwd, sync, plan.warmup, plan.repeats, plan.budget_s))
        fb = expected(time_calls(lambda: fwd().backward(g), sync, plan.warmup, plan.repeats, plan.budget_s))
        return f, fb - f
    (pf, pb), (hf, hb) = chain(False), chain(True)
    return max(hf - pf, 0.0) / LOCAL_CHAIN, max(hb - pb, 0.0) / LOCAL_CHAIN


def partial_grad_adam(device: torch.device, sync: Callable[[], None], plan: MeasurePlan, mesh: object,
                      tensors: int = 8) -> float:
    """Seconds per parameter tensor of one default AdamW step over replicated DTensor parameters whose gradients
    are Partial (sequence-parallel norms' weights: each optimizer op that reads such a gradient all-reduces it)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    ps = [torch.nn.Parameter(distribute_tensor(torch.ones(1, device=device), mesh, [Replicate()]))
          for _ in range(tensors)]
    for p in ps:
        p.grad = DTensor.from_local(torch.ones(1, device=device), mesh, [Partial()])
    opt = adamw(ps)
    return _fixed_times(opt.step, sync, plan) / tensors


BF16_KERNELS = ("add", "gelu", "tanh")
"""Kernel families timed at bf16 on CPU ranks (`bf16_kernel_costs`): those autocast runs in bf16 on a linear's bf16
output. Norms, softmax and losses run in fp32 under autocast, and AdamW on the fp32 master weights."""


def bf16_kernel_costs(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                      elems: int = KERNEL_ELEMS) -> dict[str, tuple[float, float]]:
    """CPU ranks: (forward, backward) seconds per element of the BF16_KERNELS on a bf16 tensor of `elems` elements,
    as `kernel_costs` times them in fp32, and `widen`, one bf16 -> fp32 conversion (`Tensor.float()`, autocast's
    cast up; the same both ways)."""
    x = torch.randn(elems // 512, 512, device=device, dtype=torch.bfloat16)
    fns = {"add": lambda t: t + t, "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
           "tanh": torch.tanh}
    out = {}
    for name in BF16_KERNELS:
        out[name] = _per_element(fns[name], x, sync, plan, elems)
    widen = expected(time_calls(x.float, sync, plan.warmup, plan.repeats, plan.budget_s)) / elems
    out["widen"] = (widen, widen)
    return out


def _per_element(fn: Callable[[torch.Tensor], torch.Tensor], t0: torch.Tensor, sync: Callable[[], None],
                 plan: MeasurePlan, elems: int) -> tuple[float, float]:
    """(forward, backward) seconds per element of `fn` on `t0`: backward is (forward + backward) - forward."""
    t = t0.clone().requires_grad_()
    g = torch.ones_like(t0)
    f = expected(time_calls(lambda: fn(t), sync, plan.warmup, plan.repeats, plan.budget_s))
    fb = expected(time_calls(lambda: fn(t).backward(g), sync, plan.warmup, plan.repeats, plan.budget_s))
    return f / elems, max(fb - f, 0.0) / elems


def kernel_costs(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                 elems: int = KERNEL_ELEMS) -> dict[str, tuple[float, float]]:
    """Kernel family -> (forward, backward) seconds per element on an fp32 tensor of `elems` elements: add, gelu
    (tanh approximation, GPT-2's), tanh, softmax (log-softmax over rows of 512) and layer_norm (rows of 128).
    Backward is (forward + backward) - forward; both include one op's dispatch, small at this size. `adamw` is
    one step of the executor's default AdamW per parameter element (its second number is 0).

    On CUDA only `adamw` and `widen`, each timed on ADAMW_GPU_ELEMS elements (device time,
    `measure.device_seconds`): elementwise kernels there are memory-bound, priced by bytes over the measured
    bandwidth, and at this size a kernel's time is its launch (an add on 131k elements "cost" 1.1e-10 s per
    element on an H200, 25x its bytes' time on a 12M-element activation). `widen` is one bf16 -> fp32 conversion
    (`Tensor.float()`: autocast's cast up, and the gradient of its cast down) per element, forward and backward
    alike: torch's CUDA copy vectorizes only the narrowing direction, so this one runs below the copy rate the
    memory curve gives."""
    if device.type == "cuda":
        p = torch.nn.Parameter(torch.randn(ADAMW_GPU_ELEMS, device=device))
        p.grad = torch.randn_like(p)
        opt = adamw([p])
        out = {"adamw": (device_seconds(opt.step, device, plan) / ADAMW_GPU_ELEMS, 0.0)}
        del opt, p
        half = torch.randn(ADAMW_GPU_ELEMS, device=device, dtype=torch.bfloat16)
        widen = device_seconds(half.float, device, plan) / ADAMW_GPU_ELEMS
        out["widen"] = (widen, widen)
        return out
    x = torch.randn(elems // 512, 512, device=device)
    xn = torch.randn(elems // 128, 128, device=device)
    w, b = torch.ones(128, device=device), torch.zeros(128, device=device)
    fns = {"add": (x, lambda t: t + t),
           "gelu": (x, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
           "tanh": (x, torch.tanh),
           "softmax": (x, lambda t: torch.log_softmax(t, dim=-1)),
           "layer_norm": (xn, lambda t: torch.nn.functional.layer_norm(t, (128,), w, b))}
    out = {"adamw": (_adam_time([torch.nn.Parameter(x.clone())], sync, plan) / x.numel(), 0.0)}
    for name, (t0, fn) in fns.items():
        out[name] = _per_element(fn, t0, sync, plan, elems)
    return out
