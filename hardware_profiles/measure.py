"""How `plan profile` times a call on one rank (the measurement plan, the expected-time statistic, cold weights),
and the device's compute rates: matmul, memory copy and nn.Linear by size. Collectives are timed in
`measure_collectives`, eager PyTorch's host costs in `measure_overheads`.

Every figure here is the expected time of one call (`expected`: the mean over repeats after warm-up, the slowest
5 % of samples dropped), not the median: a step's time is a sum of many calls, and a sum's expectation is the sum
of the means. On CPU ranks the two differ by far: a 4 KiB gloo all-reduce over loopback issued alone after a
barrier took 0.7 ms at the median and 1.1-2.3 ms on average (60 calls per figure, 2 ranks, measured here), so
medians priced every call at its fast mode.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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
    bf16_attention_lengths: tuple[int, ...] = ()
    """CPU ranks: sequence lengths of the causal SDPA calls timed at bf16 (`attention_rates`; empty: none)."""
    bf16_attention_head_dims: tuple[int, ...] = ()
    """CPU ranks: their head dims."""
    bf16_linear_sizes: tuple[int, ...] = ()
    """CPU ranks: nn.Linear(n, n) sizes timed at bf16 (`linear_rates`), for `PrecisionRates` (empty: none). Up to 256
    only: a bf16 linear of 2 x 256^3 FLOPs takes 33 ms at the ~1 GFLOP/s of a CPU without bf16 instructions."""

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
                           collectives=names, warmup=2, repeats=9, budget_s=0.5, bf16_linear_sizes=(16, 32),
                           bf16_attention_lengths=(16, 32), bf16_attention_head_dims=(16, 32))
    # bf16 matmul runs at ~1 GFLOP/s on a CPU without bf16 instructions (measured here), so only small sizes.
    return MeasurePlan(matmul_sizes={"fp32": (32, 64, 128, 256, 512, 1024), "bf16": (16, 32, 64, 128)},
                       copy_bytes=tuple(2 ** k for k in range(16, 29, 2)),         # 64 KiB .. 256 MiB
                       collective_bytes=tuple(2 ** k for k in range(12, 25, 2)),   # 4 KiB .. 16 MiB
                       collectives=names, warmup=3, repeats=15, budget_s=1.0, collective_repeats=45,
                       bf16_linear_sizes=(32, 64, 128, 256), bf16_attention_lengths=(32, 64, 128, 256),
                       bf16_attention_head_dims=ATTENTION_HEAD_DIMS)


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


SPIN_CLOCK_HZ = 2.0e9
"""Clock the spin kernel's cycles are counted at: the H100's and H200's top SM clock, 1.98 GHz (NVIDIA H100 Tensor
Core GPU datasheet); at a lower clock the spin only lasts longer, which is safe."""


def device_seconds(fn: Callable[[], object], device: torch.device, plan: MeasurePlan, batches: int = 3) -> float:
    """Expected device seconds of one call of `fn` on a CUDA device as a training step runs it: the host ahead of
    the GPU. `plan.repeats` calls are queued behind a spin kernel (`torch.cuda._sleep`) sized to twice the host's
    time to enqueue them, so the GPU never waits for a launch, and CUDA events bracket the whole batch; the expected
    value over `batches` such batches. (A sync after each call, or events around one call issued to an idle GPU,
    adds the host's launch latency of about 10 us to every kernel: measured on an H200, a 1024 x 768 x 768 bf16
    GEMM took 21.8 us that way, 55 TFLOP/s.)"""
    return device_and_host_seconds(fn, device, plan, batches)[0]


def device_and_host_seconds(fn: Callable[[], object], device: torch.device, plan: MeasurePlan, batches: int = 3
                            ) -> tuple[float, float]:
    """`device_seconds`, and the host's seconds to issue one call (the enqueueing batch it sizes the spin by, with
    no sync inside: the host's own time while the launch queue has room)."""
    for _ in range(plan.warmup):
        fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(plan.repeats):
        fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(min(2.0 * host_s + 1e-3, 2.0) * SPIN_CLOCK_HZ))
        start.record()
        for _ in range(plan.repeats):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / plan.repeats)
    return expected(samples), host_s / plan.repeats


def seconds_per_call(fn: Callable[[], object], device: torch.device, sync: Callable[[], None],
                     plan: MeasurePlan) -> float:
    """Expected seconds of one call: device time with the host ahead on GPUs (`device_seconds`), wall clock per call
    on CPUs (the host is the device)."""
    if device.type == "cuda":
        return device_seconds(fn, device, plan)
    return expected(time_calls(fn, sync, plan.warmup, plan.repeats, plan.budget_s))


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
            t = seconds_per_call(lambda: torch.mm(a, b), device, sync, plan)
            out.append((2.0 * n ** 3, 2.0 * n ** 3 / t))
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_was


def copy_rates(sizes: Sequence[int], device: torch.device, sync: Callable[[], None],
               plan: MeasurePlan) -> list[tuple[float, float]]:
    """[(bytes moved by one copy = 2 x size, bytes/s at its expected time)] for tensor copies of each size. On GPUs
    each call copies the next of enough (source, destination) pairs to span COLD_CACHE_BYTES, so that calls queued
    back to back read memory, not the L2 the previous call filled (one pair copied over and over measured 5.14 TB/s
    on an H200, over the 4.8 TB/s of its HBM3e datasheet)."""
    out = []
    for size in sizes:
        pairs = max(1, -(-COLD_CACHE_BYTES["cuda"] // (2 * size))) if device.type == "cuda" else 1
        srcs = [torch.ones(size // 4, dtype=torch.float32, device=device) for _ in range(pairs)]
        dsts = [torch.empty_like(s) for s in srcs]
        turn = itertools.cycle(range(pairs))

        def rotate() -> None:
            i = next(turn)
            dsts[i].copy_(srcs[i])
        src, dst = srcs[0], dsts[0]
        t = seconds_per_call(rotate if pairs > 1 else (lambda: dst.copy_(src)), device, sync, plan)
        out.append((2.0 * size, 2.0 * size / t))
    return out


def _then(first: Callable[[], None], second: Callable[[], object]) -> Callable[[], None]:
    """`first`, then `second`."""
    def both() -> None:
        first()
        second()
    return both


def linear_rates(sizes: Sequence[int], device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                 overhead: dict[str, float], dtype: str = "fp32") -> list[tuple[float, float, float]]:
    """[(forward FLOPs 2n^3, forward FLOP/s, backward FLOP/s)] of an nn.Linear(n, n) with bias on a (4, n/4, n)
    input, for each n: the module as models call it (addmm on a view, the backward's two matmuls on transposed
    operands, the bias gradient's sum), its weights out of cache and its input (and output gradient) in, as in a
    step (`cold_weights`). The per-op overheads the cost model charges a linear separately (one op
    forward; its node and one per parameter backward) are taken out of the times. `dtype` "bf16": weights, input
    and gradient in bf16, the kernels autocast runs (its casts are priced apart), each timed call after another
    bf16 linear: with AMX the matrix unit slows down once idle for a few ms (measured here 2026-11-27, 256-wide
    forward: 328 GFLOP/s back to back, 24.5 after the cache flush alone, 173 after the flush and another linear,
    112 after a 3 ms busy wait), and in a step the op before a linear is rarely that long."""
    out = []
    dt = DTYPES[dtype]
    for n in sizes:
        lin = torch.nn.Linear(n, n, device=device, dtype=dt)
        x = torch.randn(4, max(n // 4, 1), n, device=device, dtype=dt, requires_grad=True)
        dy = torch.randn(4, max(n // 4, 1), n, device=device, dtype=dt)
        flops = 2.0 * x.shape[0] * x.shape[1] * n * n

        def fb():
            lin(x).backward(dy)
            lin.weight.grad = lin.bias.grad = x.grad = None
        cold_f, cold_b = cold_weights(device, x), cold_weights(device, x, dy)
        if dtype != "fp32":  # then one other linear of the same shape, as the op before it in a step runs one
            other = torch.nn.Linear(n, n, device=device, dtype=dt)
            xo = torch.randn_like(x, requires_grad=False)
            cold_f, cold_b = _then(cold_f, lambda: other(xo)), _then(cold_b, lambda: other(xo))
        f = expected(time_calls(lambda: lin(x), sync, plan.warmup, plan.repeats, plan.budget_s, before=cold_f))
        t = expected(time_calls(fb, sync, plan.warmup, plan.repeats, plan.budget_s, before=cold_b))
        f_k = max(f - overhead.get("forward", 0.0), f * 0.05)
        b_k = max(t - f - 3 * overhead.get("backward", 0.0), (t - f) * 0.05, 1e-9)
        out.append((flops, flops / f_k, 2 * flops / b_k))
    return out


ATTENTION_HEADS = 8
"""Batch x heads of the SDPA calls `attention_rates` times."""
ATTENTION_HEAD_DIMS = (32, 64, 128)
"""Head dims of the SDPA calls `attention_rates` times (GPT-2 and the small examples 64 and 32, Llama 128): on CPUs
the bf16 kernel's rate depends on it (measured 2026-11-27, s = 64: backward 3.8 GFLOP/s at d = 32, 6.6 at 64)."""


def attention_rates(lengths: Sequence[int], device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                    overhead: dict[str, float], dtype: str = "bf16", head_dims: Sequence[int] = ATTENTION_HEAD_DIMS
                    ) -> list[tuple[int, float, float, float]]:
    """[(head dim d, dense forward FLOPs 4 b s^2 d, forward FLOP/s, backward FLOP/s over 2.5x those FLOPs)] of a
    causal scaled_dot_product_attention on (1, ATTENTION_HEADS, s, d) q, k, v for each head dim and length s, the
    per-op overheads taken out (one op forward, one autograd node backward). On CPUs the bf16 kernel's backward
    runs far below fp32's (measured here 2026-11-27, s = 64, d = 64: 6.6 against 23.8 GFLOP/s), which GEMM rates
    do not show."""
    dt = DTYPES[dtype]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for d in head_dims:
        for s in lengths:
            q, k, v = (torch.randn(1, ATTENTION_HEADS, s, d, device=device, dtype=dt, requires_grad=True)
                       for _ in range(3))
            dy = torch.randn(1, ATTENTION_HEADS, s, d, device=device, dtype=dt)
            flops = 4.0 * ATTENTION_HEADS * s * s * d

            def fb():
                sdpa(q, k, v, is_causal=True).backward(dy)
                q.grad = k.grad = v.grad = None
            f = expected(time_calls(lambda: sdpa(q, k, v, is_causal=True), sync, plan.warmup, plan.repeats,
                                    plan.budget_s))
            t = expected(time_calls(fb, sync, plan.warmup, plan.repeats, plan.budget_s))
            f_k = max(f - overhead.get("forward", 0.0), f * 0.05)
            b_k = max(t - f - overhead.get("backward", 0.0), (t - f) * 0.05, 1e-9)
            out.append((d, flops, flops / f_k, 2.5 * flops / b_k))
    return out
