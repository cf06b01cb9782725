"""`plan profile --model`: time a model's own GEMM, fused-attention, norm and bias-gradient shapes on this rank's
device.

The shapes come from the caller (the planner traces the model; this package imports nothing of ours). Each GEMM
(batch, M, N, K, layout) runs as torch.bmm of [batch, M, K] x [batch, K, N] operands stored as its layout says (plain
mm at batch 1): F.linear reads its weight transposed, and at an unaligned dimension that runs another kernel;
each attention (batch x heads, s_q, s_k, head dim, causal) as F.scaled_dot_product_attention on [1, b*h, s, d]
tensors, forward alone and forward + backward (backward = the difference); each layer / RMS norm likewise, in fp32;
each linear's bias gradient as `sum(0)` of its output gradient.
On CUDA the kernels are timed with CUDA events around calls queued back to back (device time with the host ahead, as
a step runs: `measure.device_seconds`); on CPU with the wall clock, minus the measured per-op host overhead (the cost
model charges that separately), as `measure.linear_rates` does.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from hardware_profiles.measure import DTYPES, MeasurePlan, seconds_per_call

FLOOR_CHAIN = 64
"""Tiny back-to-back kernels timed for the per-kernel floor."""


def gemm_operands(b: int, m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, M, K] and [b, K, N] operands stored as `layout` says (`GEMM_LAYOUTS`): "nt" the second a transposed
    view of a contiguous [b, N, K] (F.linear's weight), "tn" the first a transposed view of [b, K, M]."""
    a = torch.randn(b, k, m, device=device).to(dtype).transpose(1, 2) if layout == "tn" else \
        torch.randn(b, m, k, device=device).to(dtype)
    w = torch.randn(b, n, k, device=device).to(dtype).transpose(1, 2) if layout == "nt" else \
        torch.randn(b, k, n, device=device).to(dtype)
    return a, w


def gemm_seconds(shapes: Sequence[tuple], precision: str, device: torch.device, sync: Callable[[], None],
                 plan: MeasurePlan, host_s: float = 0.0) -> list[tuple]:
    """[(batch, M, N, K, precision, seconds, layout)] for each GEMM (batch, M, N, K[, layout]) (layout "nn" where
    none is given), its operands stored as the layout says; `host_s` (CPU: the per-op overhead) is taken out,
    keeping at least 5 % of the time."""
    out = []
    for b, m, n, k, *rest in shapes:
        layout = rest[0] if rest else "nn"
        a, w = gemm_operands(b, m, n, k, layout, DTYPES[precision], device)
        fn = (lambda: torch.mm(a[0], w[0])) if b == 1 else (lambda: torch.bmm(a, w))
        t = seconds_per_call(fn, device, sync, plan)
        out.append((b, m, n, k, precision, max(t - host_s, 0.05 * t), layout))
    return out


GEMM_DEPTHS = (512, 1024, 2048, 4096, 8192, 16384)
"""K of the GEMM depth sweep (`gemm_depth_sweep`), from where the K loop, not the bytes, sets a GEMM's time (at
K = 512 the operands and output are ~0.6x the loop's time at HBM speed on an A100 or H100) to a loop deep enough to
hide what each tile costs beyond it."""


def depth_sweep_shape(sms: int) -> tuple[int, int]:
    """(M, N) of the depth sweep's GEMMs: M = 1024, N = 256 x sms, so 256 x 128, 128 x 256 and 128 x 128 output
    tiles all fill whole waves of `sms` thread blocks (8, 8 and 16 waves): no tile or wave quantization, only K
    varies."""
    return 1024, 256 * max(1, sms)


def gemm_depth_sweep(sms: int, device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                     depths: Sequence[int] = GEMM_DEPTHS) -> list[tuple[int, float]]:
    """[(K, seconds)] of bf16 GEMMs of `depth_sweep_shape(sms)` at each depth K, operands laid out as F.linear reads
    them (nt). Their times are a line in K whose intercept is what each output tile costs beyond its K loop
    (pipeline fill, epilogue): `fit.gemm_depth_model`."""
    m, n = depth_sweep_shape(sms)
    rows = gemm_seconds([(1, m, n, k, "nt") for k in depths], "bf16", device, sync, plan)
    return [(k, s) for (_, _, _, k, _, s, _) in rows]


def attention_seconds(shapes: Sequence[tuple[int, int, int, int, bool]], precision: str, device: torch.device,
                      sync: Callable[[], None], plan: MeasurePlan, host_s: tuple[float, float] = (0.0, 0.0)
                      ) -> list[tuple]:
    """[(batch x heads, s_q, s_k, head dim, causal, precision, forward s, backward s)] for each attention call
    (SDPA as PyTorch dispatches it on this device); `host_s` (CPU: forward and backward per-op overheads) is taken
    out as in `gemm_seconds`."""
    out = []
    for bh, s_q, s_k, d, causal in shapes:
        dt = DTYPES[precision]
        q = torch.randn(1, bh, s_q, d, device=device, dtype=dt, requires_grad=True)
        k = torch.randn(1, bh, s_k, d, device=device, dtype=dt, requires_grad=True)
        v = torch.randn(1, bh, s_k, d, device=device, dtype=dt, requires_grad=True)
        g = torch.randn(1, bh, s_q, d, device=device, dtype=dt)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        t_f = seconds_per_call(fwd, device, sync, plan)
        # autograd.grad, not backward(): no gradient accumulation kernels into q/k/v.grad
        t_fb = seconds_per_call(lambda: torch.autograd.grad(fwd(), (q, k, v), g), device, sync, plan)
        t_b = max(t_fb - t_f, 0.0)
        out.append((bh, s_q, s_k, d, causal, precision, max(t_f - host_s[0], 0.05 * t_f),
                    max(t_b - host_s[1], 0.05 * t_b, 1e-9)))
    return out


def norm_seconds(norms: Sequence[tuple], device: torch.device, sync: Callable[[], None], plan: MeasurePlan,
                 host_s: tuple[float, float] = (0.0, 0.0)) -> list[tuple]:
    """[(rows, width, parameters, function, "fp32", forward s, backward s)] for each norm (rows, width,
    parameters, function): F.layer_norm / F.rms_norm over the last dim of a fp32 [rows, width] input with a weight
    (parameters >= 1) and a bias (2, layer_norm only), in fp32 as autocast runs norms; backward (the input's,
    weight's and bias's gradients) = forward + backward minus forward. `host_s` is taken out as in
    `attention_seconds`."""
    out = []
    for rows, width, params, fn in norms:
        x = torch.randn(rows, width, device=device, requires_grad=True)
        w = torch.ones(width, device=device, requires_grad=True) if params >= 1 else None
        b = torch.zeros(width, device=device, requires_grad=True) if params >= 2 and fn == "layer_norm" else None
        g = torch.randn(rows, width, device=device)
        inputs = tuple(t for t in (x, w, b) if t is not None)

        def fwd():
            if fn == "rms_norm":
                return F.rms_norm(x, (width,), w)
            return F.layer_norm(x, (width,), w, b)

        t_f = seconds_per_call(fwd, device, sync, plan)
        t_fb = seconds_per_call(lambda: torch.autograd.grad(fwd(), inputs, g), device, sync, plan)
        t_b = max(t_fb - t_f, 0.0)
        out.append((rows, width, params, fn, "fp32", max(t_f - host_s[0], 0.05 * t_f),
                    max(t_b - host_s[1], 0.05 * t_b, 1e-9)))
    return out


def reduce_seconds(shapes: Sequence[tuple[int, int]], precision: str, device: torch.device,
                   sync: Callable[[], None], plan: MeasurePlan, host_s: float = 0.0) -> list[tuple]:
    """[(rows, width, precision, seconds)] for each bias gradient (rows, width): `sum(0)` of a [rows, width]
    output gradient in `precision`, as addmm's backward computes a bias's gradient; `host_s` is taken out as in
    `gemm_seconds`."""
    out = []
    for rows, width in shapes:
        g = torch.randn(rows, width, device=device).to(DTYPES[precision])
        t = seconds_per_call(lambda: g.sum(0), device, sync, plan)
        out.append((rows, width, precision, max(t - host_s, 0.05 * t)))
    return out


def kernel_floor(device: torch.device, plan: MeasurePlan) -> float:
    """Device seconds per kernel of FLOOR_CHAIN one-element adds run back-to-back (CUDA only), replayed as one CUDA
    graph so that the host's launch rate (charged separately as op_overhead) does not set the pace; eager launches
    where capture fails."""
    x = torch.zeros(1, device=device)

    def chain():
        y = x
        for _ in range(FLOOR_CHAIN):
            y = y + 1.0
        return y

    fn: Callable[[], object] = chain
    try:  # warm up on a side stream, then capture (PyTorch CUDA semantics docs, "CUDA Graphs")
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                chain()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        fn = graph.replay
    except RuntimeError:
        pass
    return seconds_per_call(fn, device, lambda: torch.cuda.synchronize(device), plan) / FLOOR_CHAIN
