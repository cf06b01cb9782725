"""Timed measurements made inside one rank of `plan profile`, and the alpha-beta fit of a ring all-reduce.

Every figure here is the expected time of one call (`expected`: the mean over repeats after warm-up, the slowest
5 % of samples dropped), not the median: a step's time is a sum of many calls, and a sum's expectation is the sum
of the means. On CPU ranks the two differ by far: a 4 KiB gloo all-reduce over loopback issued alone after a
barrier took 0.7 ms at the median and 1.1-2.3 ms on average (60 calls per figure, 2 ranks, measured here), so
medians priced every call at its fast mode. Collective timings take, for each repeat, the slowest rank (a
collective is done when its last rank is done), then the expected time over repeats. Sizes follow nccl-tests:
the whole array in bytes (all-gather: the gathered output; reduce-scatter: the input before scattering).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True, kw_only=True)
class MeasurePlan:
    """What one `plan profile` run measures, and how often."""

    matmul_sizes: dict[str, tuple[int, ...]]
    """dtype name -> square matmul sizes n (an n x n by n x n product, 2 n^3 FLOPs)."""
    copy_bytes: tuple[int, ...]
    """Sizes of the tensors copied to measure memory bandwidth (bytes moved = 2 x size: read + write)."""
    collective_bytes: tuple[int, ...]
    """Message sizes for the collective curves (whole array, nccl-tests convention)."""
    collectives: tuple[str, ...]
    """Collectives to time."""
    warmup: int
    """Untimed calls before each measurement."""
    repeats: int
    """Timed calls per measurement (their `expected` time is kept)."""
    budget_s: float
    """Stop repeating one measurement once it has taken this long (keeping at least 3 samples)."""
    collective_repeats: int = 0
    """Timed calls per collective and size (0: `repeats`). More on CPU ranks, where gloo's times are heavy-tailed and
    a mean needs more samples than a median."""

    def steps(self) -> list[str]:
        """Labels of the measurement steps, in order, for the progress bar."""
        out = [f"matmul {dt}" for dt in self.matmul_sizes] + ["memory copy", "op overheads"]
        return out + [f"{c}" for c in self.collectives]


def plan_for(quick: bool, cuda: bool) -> MeasurePlan:
    """The measurement plan: small and fast with `quick` (tests), thorough otherwise; GPU sizes are larger."""
    names = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
    if cuda:
        mm = tuple(2 ** k for k in range(8, 14))                       # 256 .. 8192
        return MeasurePlan(matmul_sizes={"bf16": mm, "fp16": mm, "tf32": mm, "fp32": mm},
                           copy_bytes=tuple(2 ** k for k in range(20, 31, 2)),        # 1 MiB .. 1 GiB
                           collective_bytes=tuple(2 ** k for k in range(12, 31, 2)),  # 4 KiB .. 1 GiB
                           collectives=names, warmup=5, repeats=20, budget_s=5.0)
    if quick:
        return MeasurePlan(matmul_sizes={"fp32": (32, 64, 128, 256), "bf16": (16, 32)},
                           copy_bytes=(64 * KIB, 1 * MIB, 8 * MIB),
                           collective_bytes=(4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB),
                           collectives=names, warmup=2, repeats=9, budget_s=0.5)
    # bf16 matmul runs at ~1 GFLOP/s on a CPU without bf16 instructions (measured here), so only small sizes.
    return MeasurePlan(matmul_sizes={"fp32": (32, 64, 128, 256, 512, 1024), "bf16": (16, 32, 64, 128)},
                       copy_bytes=tuple(2 ** k for k in range(16, 29, 2)),         # 64 KiB .. 256 MiB
                       collective_bytes=tuple(2 ** k for k in range(12, 25, 2)),   # 4 KiB .. 16 MiB
                       collectives=names, warmup=3, repeats=15, budget_s=1.0, collective_repeats=45)


DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Torch dtype used for each profiled dtype name (tf32 is fp32 with TF32 tensor cores allowed)."""


SLOWEST_DROPPED = 0.05
"""Fraction of the slowest samples `expected` drops: rare scheduler stalls (a call in twenty or fewer), which most
training steps do not meet."""


def expected(samples: Sequence[float]) -> float:
    """Expected seconds per call: the mean of `samples` without the slowest SLOWEST_DROPPED of them."""
    kept = sorted(samples)[:max(1, len(samples) - int(len(samples) * SLOWEST_DROPPED))]
    return sum(kept) / len(kept)


def time_calls(fn: Callable[[], object], sync: Callable[[], None], warmup: int, repeats: int,
               budget_s: float, clock: Callable[[], float] = time.perf_counter,
               before: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of `fn` for up to `repeats` calls after `warmup` untimed calls (within `budget_s` of wall
    time once 3 are taken), on `clock` (wall time; `time.thread_time` for this thread's CPU time). `before`, when
    given, runs untimed before each timed call (e.g. `cold_weights`)."""
    for _ in range(warmup):
        fn()
    sync()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() - start < budget_s):
        if before is not None:
            before()
            sync()
        t0 = clock()
        fn()
        sync()
        samples.append(clock() - t0)
    return samples


COLD_CACHE_BYTES = {"cpu": 32 * MIB, "cuda": 256 * 1000 ** 2}
"""Bytes written between timed calls to evict a layer's weights from the caches: on CPUs more than a core's
private L2 (1-2 MiB on current Xeons, several MiB on other parts); on GPUs 256 MB, the buffer triton.testing.do_bench
zeroes before each timed call to clear the L2."""


def cold_weights(device: torch.device, *hot: torch.Tensor) -> Callable[[], None]:
    """A `time_calls(before=...)` that evicts the caches, then reads `hot` back in: in a training step a layer's
    weights were last touched a whole pass ago, while its input is the output of the op just before it. Measured
    here: a 512 x 128 x 128 nn.Linear forward took 111 us with everything cached and 159 us with only its input
    cached (+43 %; +16 % at 256, ~0 at 512 wide), so small linears timed hot under-price a step's. Only
    `linear_rates` uses it: a bare matmul's operands may both be activations (attention's q k^T)."""
    junk = torch.empty(COLD_CACHE_BYTES.get(device.type, COLD_CACHE_BYTES["cpu"]) // 4, device=device)

    def flush() -> None:
        junk.zero_()
        for t in hot:
            t.detach().sum()
    return flush


def matmul_rates(dtype: str, sizes: Sequence[int], device: torch.device, sync: Callable[[], None],
                 plan: MeasurePlan) -> list[tuple[float, float]]:
    """[(FLOPs of one n x n x n matmul, FLOP/s at its expected time)] for each size."""
    tf32_was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        out = []
        for n in sizes:
            a = torch.randn(n, n, device=device).to(DTYPES[dtype])
            b = torch.randn(n, n, device=device).to(DTYPES[dtype])
            t = expected(time_calls(lambda: torch.mm(a, b), sync, plan.warmup, plan.repeats,
                                             plan.budget_s))
            out.append((2.0 * n ** 3, 2.0 * n ** 3 / t))
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_was


def copy_rates(sizes: Sequence[int], device: torch.device, sync: Callable[[], None],
               plan: MeasurePlan) -> list[tuple[float, float]]:
    """[(bytes moved by one copy = 2 x size, bytes/s at its expected time)] for tensor copies of each size."""
    out = []
    for size in sizes:
        src = torch.ones(size // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        t = expected(time_calls(lambda: dst.copy_(src), sync, plan.warmup, plan.repeats, plan.budget_s))
        out.append((2.0 * size, 2.0 * size / t))
    return out


def _collective_fn(name: str, size: int, world: int, rank: int, device: torch.device,
                   group: dist.ProcessGroup | None) -> Callable[[], object] | None:
    """A closure running one `name` collective of `size` bytes, or None where this rank takes no part."""
    numel = max(size // 4, world)
    numel -= numel % world
    x = torch.ones(numel, dtype=torch.float32, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if name == "all_gather":
        shard = torch.ones(numel // world, dtype=torch.float32, device=device)
        gather = _all_gather()
        return lambda: gather(x, shard, group=group)
    if name == "reduce_scatter":
        out = torch.empty(numel // world, dtype=torch.float32, device=device)
        scatter = _reduce_scatter()
        return lambda: scatter(out, x, group=group)
    if name == "broadcast":
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.broadcast(x, src=src, group=group)
    if name == "send_recv":  # pairs (0,1), (2,3), ... exchange one message at once; an odd last rank idles
        peer = rank ^ 1
        if peer >= world:
            return None
        peer_g = dist.get_global_rank(group, peer) if group is not None else peer
        return (lambda: dist.send(x, peer_g, group=group)) if rank % 2 == 0 else \
            (lambda: dist.recv(x, peer_g, group=group))
    raise ValueError(f"unknown collective {name!r}")


def calls_per_sample(size: int, cuda: bool = True) -> int:
    """Back-to-back calls timed together for one sample. On GPUs several for small messages (as nccl-tests times a
    loop of iterations), so one sample is not a single scheduler-sized hiccup; one call from 128 KiB up. On CPU
    ranks (gloo) always one: back-to-back small gloo collectives over loopback TCP take 4-6x as long per call as
    one issued alone (measured here: 1.9 ms vs 0.34 ms for a 4 KiB all-reduce on 2 ranks), and in training a
    collective is issued alone, between ops."""
    if not cuda:
        return 1
    return max(1, min(8, (128 * KIB) // max(size, 1)))


def collective_samples(name: str, sizes: Sequence[int], device: torch.device, sync: Callable[[], None],
                       plan: MeasurePlan, group: dist.ProcessGroup | None = None) -> dict[int, list[float]]:
    """{size: seconds per call for each repeat (the slowest rank's)} for one collective on `group`.

    Every rank runs the same fixed number of calls (a time budget could differ between ranks and deadlock).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: dict[int, list[float]] = {}
    for size in sizes:
        fn = _collective_fn(name, size, world, rank, device, group)
        k = calls_per_sample(size, device.type == "cuda")
        for _ in range(plan.warmup):
            if fn is not None:
                fn()
        sync()
        samples = []
        for _ in range(plan.collective_repeats or plan.repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(k if fn is not None else 0):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / k)
        slowest = torch.tensor(samples, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        out[size] = slowest.cpu().tolist()
    return out


def expected_curve(samples: dict[int, list[float]]) -> list[tuple[int, float]]:
    """[(size, expected seconds)] in increasing size, made non-decreasing (a larger message never takes less time:
    where noise says otherwise, the neighbouring sizes share their samples' pooled mean, pool-adjacent-violators
    isotonic regression weighted by sample counts)."""
    sizes = sorted(samples)
    blocks: list[list[float]] = []  # [pooled mean, weight, sizes in the block]
    for size in sizes:
        blocks.append([expected(samples[size]), float(len(samples[size])), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    means = [m for m, _, n in blocks for _ in range(int(n))]
    return list(zip(sizes, means))


def fit_ring_allreduce(points: Sequence[tuple[float, float]], n: int) -> tuple[float, float]:
    """Per-device bandwidth B (bytes/s) and per-step latency alpha (s) of a ring all-reduce fitted to points.

    Model (Thakur, Rabenseifner & Gropp 2005; nccl-tests PERFORMANCE.md): t = 2(n-1)/n * S/B + 2(n-1) * alpha,
    linear in S; least squares on relative error so small and large messages weigh alike. Where the fit gives
    a non-positive latency or bandwidth (noise at one end), the largest message sets B and the smallest alpha.
    """
    if n < 2 or len(points) < 2:
        raise ValueError("the fit needs at least 2 ranks and 2 message sizes")
    s = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / t
    design = np.stack([s * w, w], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    steps = 2 * (n - 1)
    if slope <= 0:
        slope = t[-1] / s[-1]
    if intercept <= 0:
        intercept = max(t[0] - slope * s[0], t[0] * 0.01)
    bandwidth = steps / n / slope
    return float(bandwidth), float(intercept / steps)


# ---- host-side overheads and compute-bound elementwise kernels (eager PyTorch on CPU) ----------------------------

CHAIN_OPS = 64
"""Length of the chain of tiny ops timed for the per-op overhead."""
KERNEL_ELEMS = 256 * 512
"""Elements of the activation-sized tensor the elementwise kernels are timed on (a GPT MLP activation of 256 tokens
x 512 features: 512 KiB in fp32, past L1, inside L2)."""
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


def _adam_time(params: list, sync: Callable[[], None], plan: MeasurePlan) -> float:
    """Seconds per parameter tensor of one default torch.optim.AdamW step over `params` (grads set)."""
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
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
        ps = [torch.nn.Parameter(distribute_tensor(torch.ones(1, device=device), mesh, [Replicate()]))
              for _ in range(ADAM_TENSORS)]
        out["dtensor_optimizer"] = _adam_time(ps, sync, plan)
        out["dtensor_partial_optimizer"] = partial_grad_adam(device, sync, plan, mesh)
        out["dtensor_redistribute"] = redistribute_overhead(device, sync, plan, mesh)
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
    gather = _all_gather()
    scatter = _reduce_scatter()

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


def _all_gather() -> Callable[..., object]:
    """torch's flat all-gather (`all_gather_single`; `all_gather_into_tensor` before torch 2.13)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter() -> Callable[..., object]:
    """torch's flat reduce-scatter (`reduce_scatter_single`; `reduce_scatter_tensor` before torch 2.13)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


REDISTRIBUTE_CHAIN = 8
"""Matmul + redistribution pairs per timed call of `redistribute_overhead`."""


def redistribute_overhead(device: torch.device, sync: Callable[[], None], plan: MeasurePlan, mesh: object) -> float:
    """Seconds per DTensor redistribution (a sequence-sharded activation all-gathered, as tensor parallelism's
    PrepareModuleInput does) beyond its all-gather timed alone after a barrier: functional collective issue and
    wait (on gloo a hand-off to its worker thread), DTensor's copies, and the ranks arriving apart after compute.
    A chain of REDISTRIBUTE_CHAIN (matmul, redistribution) pairs against the same matmuls with a plain add in its
    place (paired repeats), per redistribution, minus the all-gather alone."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    world, group = mesh.size(), mesh.get_group()
    a = torch.randn(256, 256, device=device)
    local = torch.ones(4, 16, 128, device=device)  # gathers to [4, 16 x world, 128]: an activation-sized message
    x = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    plan = replace(plan, repeats=2 * plan.repeats)  # a difference of noisy times: twice the samples

    def chain(redistribute: bool) -> None:
        for _ in range(REDISTRIBUTE_CHAIN):
            torch.mm(a, a)
            if redistribute:
                x.redistribute(mesh, [Replicate()]).to_local().add_(0.0)  # add_ waits for the gather
            else:
                local.add(0.0)
    extra = _paired_extra(lambda: chain(False), lambda: chain(True), sync, plan, group) / REDISTRIBUTE_CHAIN
    full = torch.ones(local.numel() * world, device=device)
    gather = _all_gather()
    alone = _fixed_times(lambda: gather(full, local.reshape(-1), group=group), sync, plan, alone=True, group=group)
    return max(extra - alone, 0.0)


def partial_grad_adam(device: torch.device, sync: Callable[[], None], plan: MeasurePlan, mesh: object,
                      tensors: int = 8) -> float:
    """Seconds per parameter tensor of one default AdamW step over replicated DTensor parameters whose gradients
    are Partial (sequence-parallel norms' weights: each optimizer op that reads such a gradient all-reduces it)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    ps = [torch.nn.Parameter(distribute_tensor(torch.ones(1, device=device), mesh, [Replicate()]))
          for _ in range(tensors)]
    for p in ps:
        p.grad = DTensor.from_local(torch.ones(1, device=device), mesh, [Partial()])
    opt = torch.optim.AdamW(ps, lr=1e-4)
    return _fixed_times(opt.step, sync, plan) / tensors


def linear_rates(sizes: Sequence[int], device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                 overhead: dict[str, float]) -> list[tuple[float, float, float]]:
    """[(forward FLOPs 2n^3, forward FLOP/s, backward FLOP/s)] of an nn.Linear(n, n) with bias on a (4, n/4, n)
    input, for each n: the module as models call it (addmm on a view, the backward's two matmuls on transposed
    operands, the bias gradient's sum), its weights out of cache and its input (and output gradient) in, as in a
    step (`cold_weights`). The per-op overheads the cost model charges a linear separately (one op
    forward; its node and one per parameter backward) are taken out of the times."""
    out = []
    for n in sizes:
        lin = torch.nn.Linear(n, n, device=device)
        x = torch.randn(4, max(n // 4, 1), n, device=device, requires_grad=True)
        dy = torch.randn(4, max(n // 4, 1), n, device=device)
        flops = 2.0 * x.shape[0] * x.shape[1] * n * n

        def fb():
            lin(x).backward(dy)
            lin.weight.grad = lin.bias.grad = x.grad = None
        f = expected(time_calls(lambda: lin(x), sync, plan.warmup, plan.repeats, plan.budget_s,
                                before=cold_weights(device, x)))
        t = expected(time_calls(fb, sync, plan.warmup, plan.repeats, plan.budget_s, before=cold_weights(device, x, dy)))
        f_k = max(f - overhead.get("forward", 0.0), f * 0.05)
        b_k = max(t - f - 3 * overhead.get("backward", 0.0), (t - f) * 0.05, 1e-9)
        out.append((flops, flops / f_k, 2 * flops / b_k))
    return out


def kernel_costs(device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                 elems: int = KERNEL_ELEMS) -> dict[str, tuple[float, float]]:
    """Kernel family -> (forward, backward) seconds per element on an fp32 tensor of `elems` elements: add, gelu
    (tanh approximation, GPT-2's), tanh, softmax (log-softmax over rows of 512) and layer_norm (rows of 128).
    Backward is (forward + backward) - forward; both include one op's dispatch, small at this size. `adamw` is
    one default AdamW step per parameter element (its second number is 0)."""
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
        t = t0.clone().requires_grad_()
        g = torch.ones_like(t0)
        f = expected(time_calls(lambda: fn(t), sync, plan.warmup, plan.repeats, plan.budget_s))
        fb = expected(time_calls(lambda: fn(t).backward(g), sync, plan.warmup, plan.repeats,
                                          plan.budget_s))
        out[name] = (f / elems, max(fb - f, 0.0) / elems)
    return out
