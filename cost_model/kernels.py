"""Seconds of one GEMM or one fused-attention kernel on one device, by shape.

GEMM (NVIDIA, "Matrix Multiplication Background User's Guide", sections on tile and wave quantization): a GEMM
C[M, N] = A[M, K] B[K, N] (times a batch) is computed as ceil(M/tm) x ceil(N/tn) output tiles, one thread block
each, and the blocks run in waves of one block per SM. The work the GPU does is that of waves x SMs full tiles,
of which b x M x N outputs are useful:

    quantization = b*M*N / (ceil(b*tiles / sms) * sms * tm * tn)        (best tile of the profile's list; an edge
                                                                         longer than M or N shrinks to it)
    t = max(2*b*M*N*K / (peak * best_efficiency * quantization * K/(K + k_overhead)),
            bytes(A, B, C) / memory roofline,  floor)

`best_efficiency` is the measured maximum achievable matmul fraction at large aligned shapes (a deep K);
`k_overhead` (measured, else 0) the K-elements' worth of time each tile spends filling its pipeline and writing
its output, which a shallow K does not amortise; the bytes term makes skinny GEMMs (small M, N or K) memory-bound.
Split-K: when the output tiles do not fill one wave (a weight gradient: small M x N, K = the tokens), the library
splits K into s slices so tiles x s work units fill the SMs (Osama et al., "Stream-K: Work-centric Parallel
Decomposition for Dense Matrix-Matrix Multiplication on the GPU", PPoPP 2023; CUTLASS's split-K GEMMs): each
slice's depth K/s pays the k_overhead, and the partial sums make one fp32 round trip (8 bytes per output element)
before the output is written; the s (up to SPLIT_K_MAX, each slice at least SPLIT_K_MIN_DEPTH deep) with the least
time is taken.
A GEMM with a dimension that is not a multiple of 16 bytes runs at the profile's measured `unaligned_efficiency`
instead, where it has one. Profiles without a `matmul` block price a GEMM by its FLOPs on the `matmul_efficiency`
curve (CPU ranks; at bf16 the curve measured at bf16 where the profile has one, `DeviceSpec.matmul_curve`).

Fused attention (FlashAttention-2/3, cuDNN): FLOPs as FlopCounterMode counts them (dense: 4*b*h*s_q*s_k*d forward,
2.5x that backward, the count of Dao 2023, "FlashAttention-2", Sec. 4.1), times the fraction of score blocks a
causal kernel computes, (n+1)/(2n) for n key blocks (half the dense work at long sequences); priced at the profile's
forward/backward attention efficiency (by head dim and sequence length where the profile lists them) with wave
quantization over batch x heads x query blocks, never below the bytes of q, k, v and the output. Published causal
throughputs count half the dense FLOPs, so a profile derives its efficiency from them through this same model
(presets: the efficiency that reproduces the published time at the benchmark shape).
"""
from __future__ import annotations

import math
from typing import Sequence

from hardware_profiles.schema import DeviceSpec, interp_log

PRECISION_PEAK_KEYS = {"bf16": ("bf16", "fp16", "fp32"), "fp16": ("fp16", "bf16", "fp32"), "fp32": ("fp32",)}
"""Which `DeviceSpec.peak_flops` entry prices matmuls at each precision, in order of preference. fp32 uses the
plain fp32 peak: PyTorch leaves TF32 matmuls off by default (torch.backends.cuda.matmul.allow_tf32 = False since
1.12, PyTorch CUDA semantics docs)."""
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per float element at each training precision."""

Gemm = tuple[int, int, int, int]
"""(batch, M, N, K) of one GEMM: C[M, N] = A[M, K] B[K, N], `batch` times."""
Attn = tuple[int, int, int, int, bool]
"""(batch x heads, query length, key length, head dim, causal) of one fused attention call."""


def peak_flops(device: DeviceSpec, precision: str) -> float:
    """Dense peak FLOP/s for matmuls at a training precision (falls back to the fp32 peak if not listed)."""
    for key in PRECISION_PEAK_KEYS[precision]:
        if key in device.peak_flops:
            return device.peak_flops[key]
    return max(device.peak_flops.values())


def memory_time(device: DeviceSpec, nbytes: float) -> float:
    """Seconds for a memory-bound kernel moving `nbytes` at the profile's efficiency for its size (no floor)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (device.memory_bandwidth * interp_log(device.memory_efficiency, nbytes))


MMA_GRANULE = 16
"""A tile edge longer than a GEMM's dimension shrinks to that dimension rounded up to this: the M of the Ampere
Tensor Core instruction for 16-bit inputs (PTX ISA, mma.sync.m16n8k16: 16 rows x 8 columns), used for both edges
(Hopper's wgmma works on 64-row warpgroup tiles, so small M wastes more there)."""


def _edges(m: int, n: int, tile: tuple[int, int]) -> tuple[int, int]:
    """The tile's edges on an M x N output: an edge longer than its dimension shrinks to it (MMA_GRANULE)."""
    tm, tn = (min(t, MMA_GRANULE * math.ceil(d / MMA_GRANULE)) for t, d in zip(tile, (m, n)))
    return tm, tn


def tile_count(batch: int, m: int, n: int, tile: tuple[int, int]) -> int:
    """Output tiles of a (batched) GEMM with M x N outputs."""
    tm, tn = _edges(m, n, tile)
    return batch * math.ceil(m / tm) * math.ceil(n / tn)


def quantization(batch: int, m: int, n: int, tile: tuple[int, int], sms: int, splits: int = 1) -> float:
    """Useful fraction of the work units x waves a (batched) GEMM with M x N outputs occupies (1 without SMs):
    each output tile is one unit, or `splits` units of a split K."""
    tm, tn = _edges(m, n, tile)
    units = tile_count(batch, m, n, tile) * splits
    if sms <= 0:
        return batch * m * n * splits / (units * tm * tn)
    waves = math.ceil(units / sms)
    return batch * m * n * splits / (waves * sms * tm * tn)


ALIGN_BYTES = 16
"""A GEMM dimension is aligned when its rows start on 16-byte boundaries (8 bf16/fp16 elements, 4 fp32): what
cuBLAS's Tensor Core kernels need (NVIDIA, "Matrix Multiplication Background User's Guide", Tensor Core
requirements)."""


def aligned(g: Gemm, precision: str) -> bool:
    """Whether M, N and K are all multiples of ALIGN_BYTES worth of elements."""
    step = max(1, ALIGN_BYTES // int(PRECISION_BYTES.get(precision, 2)))
    return all(d % step == 0 for d in g[1:])


SPLIT_K_MAX = 16
"""Most K slices a split-K GEMM is priced with (CUTLASS's split-K GEMM example, 06_splitK_gemm, splits K into 16)."""
SPLIT_K_MIN_DEPTH = 128
"""Least K per slice: two 64-deep k-blocks, the bf16 mainloop step of Ampere's and Hopper's GEMM kernels."""
SPLIT_K_FIXUP_BYTES = 8
"""Bytes per output element of a split GEMM's partial sums: one fp32 write and read."""


def gemm_plan(device: DeviceSpec, g: Gemm, precision: str = "bf16") -> tuple[float, int, float]:
    """(compute seconds, K slices, achieved fraction of peak) of one GEMM by shape: the best of the profile's
    tiles, either orientation, and of the split-K slicings when the tiles do not fill one wave (the compute
    seconds include the slices' fixup); a GEMM with an unaligned dimension at the profile's measured
    `unaligned_efficiency`, where it has one. No roofline or floor (`gemm_time`). Remembered per device (a search
    prices the same shapes for every candidate)."""
    known = device.__dict__.setdefault("_shardwise_gemm_plans", {})  # DeviceSpec is frozen: its fields never change
    key = (g, precision)
    if key not in known:
        known[key] = _gemm_plan(device, g, precision)
    return known[key]


def _gemm_plan(device: DeviceSpec, g: Gemm, precision: str) -> tuple[float, int, float]:
    b, m, n, k = g
    flops = 2.0 * b * m * n * k
    if flops <= 0:
        return 0.0, 1, 0.0
    peak = peak_flops(device, precision)
    mm = device.matmul
    if mm is None:
        e = interp_log(device.matmul_curve(precision), flops)
        return flops / (peak * e), 1, e
    base = mm.unaligned_efficiency if mm.unaligned_efficiency is not None and not aligned(g, precision) \
        else mm.best_efficiency
    fixup = memory_time(device, b * m * n * (SPLIT_K_FIXUP_BYTES + PRECISION_BYTES[precision]))  # s > 1 only
    best: tuple[float, int, float] | None = None
    for tile in mm.tiles:
        for t in (tile, tile[::-1]):
            tiles = tile_count(b, m, n, t)
            most = 1 if not device.sms or tiles >= device.sms else max(1, min(SPLIT_K_MAX, k // SPLIT_K_MIN_DEPTH))
            for s in range(1, most + 1):
                depth = (k / s) / (k / s + mm.k_overhead)
                e = base * quantization(b, m, n, t, device.sms, splits=s) * depth
                seconds = flops / (peak * e) + (fixup if s > 1 else 0.0)
                if best is None or seconds < best[0]:
                    best = (seconds, s, e)
    return best


def gemm_efficiency(device: DeviceSpec, g: Gemm, precision: str = "bf16") -> float:
    """Achieved fraction of peak of one GEMM by shape, as `gemm_plan` runs it."""
    return gemm_plan(device, g, precision)[2]


def gemm_time(device: DeviceSpec, g: Gemm, precision: str) -> float:
    """Seconds of one GEMM (no measured table): max of the compute term (`gemm_plan`), the bytes roofline and the
    floor."""
    b, m, n, k = g
    if b * m * n * k <= 0:
        return 0.0
    nbytes = b * (m * k + k * n + m * n) * PRECISION_BYTES[precision]
    return max(gemm_plan(device, g, precision)[0], memory_time(device, nbytes), device.kernel_floor)


def causal_fraction(s_q: int, s_k: int, block_q: int, block_k: int | None = None) -> float:
    """Fraction of the dense score blocks a causal kernel computes when it skips key blocks wholly above the
    diagonal: (n+1)/(2n) for a square score matrix of n x n blocks (the diagonal blocks are computed whole), which
    tends to (s+1)/(2s) as the blocks shrink to 1; query blocks of `block_q` rows against key blocks of `block_k`
    (default the same) otherwise."""
    bk = block_k or block_q
    nq, nk = max(1, math.ceil(s_q / block_q)), max(1, math.ceil(s_k / bk))
    if bk == block_q and s_q == s_k:
        return (nk + 1) / (2 * nk)
    done = sum(min(nk, math.ceil(min((i + 1) * block_q, s_q) / bk)) for i in range(nq))
    return done / (nq * nk)


CPU_FLASH_KV_SPLIT = 512
"""Key block of PyTorch's CPU flash-attention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp:
cpu_flash_attention<..., q_split, 512>)."""


def cpu_flash_q_split(s_q: int) -> int:
    """Query block of PyTorch's CPU flash-attention kernel: 256 rows from 768 queries, 64 from 192, else 32 (same
    file)."""
    return 256 if s_q >= 768 else 64 if s_q >= 192 else 32


def attention_time(device: DeviceSpec, a: Attn, flops: float, precision: str, backward: bool) -> float:
    """Seconds of a fused attention kernel doing `flops` (dense count; the causal fraction is applied here)."""
    bh, s_q, s_k, d, causal = a
    att = device.attention
    if att is None or flops <= 0:
        return 0.0
    if causal:
        flops *= causal_fraction(s_q, s_k, att.block)
    # forward: each query block loops over the keys; backward (FlashAttention-2/3): each key block over the queries
    eff = att.efficiency(d, backward, s_q if backward else s_k)
    blocks = bh * math.ceil(s_q / att.block)
    wave = blocks / (math.ceil(blocks / device.sms) * device.sms) if device.sms else 1.0
    # q, k, v, output (+ their gradients and the output gradient in backward)
    nbytes = bh * (2 * s_q * d + 2 * s_k * d) * PRECISION_BYTES[precision] * (2 if backward else 1)
    return max(flops / (peak_flops(device, precision) * eff * wave), memory_time(device, nbytes),
               device.kernel_floor)


def nearest_row(rows: Sequence[tuple], key: tuple, free: Sequence[int]) -> tuple | None:
    """The measured row matching `key` exactly, else the one differing from it in a single position among `free`
    (nearest there in log scale); None when no row is that close. Rows start with the key's fields."""
    best, best_d = None, math.inf
    n = len(key)
    for r in rows:
        diff = [i for i in range(n) if r[i] != key[i]]
        if not diff:
            return r
        if len(diff) == 1 and diff[0] in free:
            d = abs(math.log(r[diff[0]] / key[diff[0]]))
            if d < best_d:
                best, best_d = r, d
    return best
