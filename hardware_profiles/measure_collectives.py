"""Collective timings inside one rank of `plan profile`: samples per message size, their expected curve, and the
alpha-beta fit of a ring all-reduce. Each repeat takes the slowest rank (a collective is done when its last rank is
done), then the expected time over repeats (`measure.expected`). Sizes follow nccl-tests: the whole array in bytes
(all-gather: the gathered output; reduce-scatter: the input before scattering).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hardware_profiles.measure import KIB, MeasurePlan, expected


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
        gather = all_gather_fn()
        return lambda: gather(x, shard, group=group)
    if name == "reduce_scatter":
        out = torch.empty(numel // world, dtype=torch.float32, device=device)
        scatter = reduce_scatter_fn()
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


SYNC_WAIT_COMPUTE_S = (0.5e-3, 2e-3, 8e-3, 32e-3)
"""Seconds of compute each rank runs before the barrier `sync_wait_points` times: from a few ops' worth to a whole
pass's between two collectives."""


def matmul_seconds(a: torch.Tensor, windows: int = 5, per_window: int = 64,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one `a @ a`: the median over `windows` timings of `per_window` back-to-back calls, so that one
    window the scheduler slowed does not shrink every compute amount timed from it."""
    times = []
    for _ in range(windows):
        t0 = clock()
        for _ in range(per_window):
            torch.mm(a, a)
        times.append((clock() - t0) / per_window)
    return float(np.median(times))


def sync_wait_points(device: torch.device, plan: MeasurePlan,
                     group: dist.ProcessGroup | None = None) -> list[tuple[float, float]]:
    """[(seconds of compute since the ranks last met, seconds a blocking collective then waits beyond the same
    collective issued right after another)] for each SYNC_WAIT_COMPUTE_S, on CPU ranks. Ranks that share a
    host's cores reach a collective apart even after identical work: each rank's compute is stretched by whatever
    else the scheduler runs on its core (the peer's gloo threads, other processes), and the collective ends when
    the last one arrives. A step loses, per collective and averaged over ranks, E[max] - E[mean] of the ranks'
    arrival times; the collective curves, timed after a barrier, contain none of it.

    Every rank runs the same number of 128 x 128 matmuls (rank 0's count for each target time) and then a
    barrier; a sample is the ranks' mean barrier time, and the wait is its expected value (made non-decreasing in
    the compute, `expected_curve`) minus that of a barrier issued right after another. Measured here (2 ranks on
    2 cores, 2026-11-26): 0.4 ms after 0.4 ms of compute, 0.8 ms after 6.8 ms, 2.7 ms after 28 ms, against the
    1.3 ms a 256 KiB all-reduce takes after a barrier."""
    world = dist.get_world_size(group)
    a = torch.randn(128, 128, device=device)
    for _ in range(plan.warmup * 8):
        torch.mm(a, a)
    counts = torch.tensor([max(1, round(t / matmul_seconds(a))) for t in SYNC_WAIT_COMPUTE_S], dtype=torch.int64)
    dist.broadcast(counts, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    repeats = 2 * (plan.collective_repeats or plan.repeats)  # a mean of heavy-tailed waits: twice the samples

    def waits(n: int) -> tuple[float, list[float]]:
        """(mean compute seconds, rank-mean barrier seconds of each repeat) of `repeats` (n matmuls, barrier)."""
        dist.barrier(group=group)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                torch.mm(a, a)
            t1 = time.perf_counter()
            dist.barrier(group=group)
            ts.append((t1 - t0, time.perf_counter() - t1))
        both = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(both, group=group)
        both /= world
        return float(both[:, 0].mean()), both[:, 1].tolist()

    alone = expected(waits(0)[1])
    # more compute never means less waiting: where noise says otherwise, neighbours pool (as the curves do)
    curve = expected_curve(dict(waits(int(n)) for n in counts.tolist()))
    return [(compute, max(w - alone, 0.0)) for compute, w in curve]


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


def all_gather_fn() -> Callable[..., object]:
    """torch's flat all-gather (`all_gather_single`; `all_gather_into_tensor` before torch 2.13)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_fn() -> Callable[..., object]:
    """torch's flat reduce-scatter (`reduce_scatter_single`; `reduce_scatter_tensor` before torch 2.13)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
