"""Compute cost of one op's work on one device: GEMMs by shape, fused attention, memory-bound kernels, launch and host costs.

- GEMM kinds (linear, matmul, conv as an implicit GEMM) are priced per GEMM by `cost_model.kernels` (tile and wave
  quantization on the profile's SMs, the bytes roofline, the kernel floor), from the (M, N, K) each op has on this
  device after tp sharding and micro-batch scaling (`op_gemms`). Backward is the two GEMMs of the operands'
  gradients, (M, K, N) and (K, N, M) (a linear's weight: (N, K, M)). Measured shapes (`DeviceSpec.matmul_shapes`)
  take precedence, each GEMM looked up in its own operand layout (`backward_gemms`).
- Attention (SDPA) uses the profile's fused-attention efficiency on the work the kernel does (causal: about half
  the dense FLOPs); explicit-matmul attention is priced by its parts (batched GEMMs, memory-bound softmax, masking
  and dropout over the s x s scores).
- Memory-bound kinds (norm, softmax, elementwise, embedding as a gather, loss, pool, other) use the bytes term;
  an elementwise op's backward counts the kernels each input's gradient takes (`elementwise_backward_bytes`), a
  norm's its two kernels, others move twice their forward bytes. Autocast's widening casts cost at least the
  profile's `widen` rate.
  `reshape`-kind ops that copy (`OpNode.copies`: cat, repeat, contiguous of a transposed tensor) read and write
  their bytes; views launch no kernel.
- Every kernel costs at least `DeviceSpec.kernel_floor`.

Host side: `op_overhead` gives seconds per op in forward, per autograd node in backward, plus one node per
parameter read (gradient accumulation). With tp > 1 ops run on DTensors (the executor makes parameters and
activations DTensors on the tp mesh, views and residual adds included) and pay the DTensor figures. A linear, several
dispatches, pays the measured overhead of a whole tiny F.linear call where the profile has it, a matmul that of a
tiny 2-D matmul. (Modules the plan leaves wholly replicated run on plain tensors: `cost_model.layers`.)
On CPU ranks host and kernel time add up; where `DeviceSpec.async_host` (GPUs) the host dispatches run ahead of
the kernels, so a sequence of ops costs max(sum of kernels, sum of host) (`combine`; the layer sums both).

Two measured CPU terms refine this where the profile has them (written by `plan profile` on CPU ranks):
`kernel_costs` (elementwise kernels that are compute-bound on CPUs: max(bytes term, elements x seconds per
element)) and `linear_efficiency` / `linear_backward_efficiency` (nn.Linear's own fp32 rates); at bf16 the same
measured at bf16 (`DeviceSpec.by_precision`: linears, square matmuls, causal SDPA, bf16 elementwise kernels and
the widening cast), which on CPUs run far from the fp32 rates (without bf16 instructions all of them; with AMX the
SDPA backward, 3-8x slower than fp32's).

What each op does on the device (FLOPs, bytes, GEMM shapes, casts) comes from `cost_model.work.op_work`.
"""
from __future__ import annotations

import math

from cost_model import kernels
from cost_model.kernels import PRECISION_BYTES, Attn, Gemm, interp_log, peak_flops  # noqa: F401 (re-exported)
from cost_model.work import FREE_KINDS, OpWork, backward_gemms
from hardware_profiles.schema import UNFUSED_ATTENTION, DeviceSpec

MATMUL_KINDS = frozenset({"linear", "matmul", "attention", "conv"})
"""Op kinds priced by the FLOPs term of the roofline (and the bytes term when it is larger)."""


class ComputeModel:
    """Prices `OpWork` on one device of a profile."""

    def __init__(self, device: DeviceSpec):
        """Keep the device's peaks, bandwidth, efficiency models and measured shape tables."""
        self.device = device

    def matmul_time(self, flops: float, precision: str) -> float:
        """Seconds for one matmul-like kernel of `flops` FLOPs on the matmul efficiency curve (no shape)."""
        if flops <= 0:
            return 0.0
        eff = interp_log(self.device.matmul_curve(precision), flops)
        return flops / (peak_flops(self.device, precision) * eff)

    def memory_time(self, nbytes: float) -> float:
        """Seconds for a memory-bound kernel moving `nbytes` at the measured efficiency for its size."""
        return kernels.memory_time(self.device, nbytes)

    def gemm_time(self, g: Gemm, precision: str, layout: str | None = None) -> float:
        """Seconds of one GEMM: a measured row at (or one dimension away from) its shape, of its `layout` where the
        profile has one, scaled by the shape model's ratio between the two shapes; else the shape model. Rows of
        older profiles carry no layout (contiguous operands) and also match exactly with M and N swapped: C^T = B^T A^T
        is the same GEMM, and those profiles timed a linear's weight gradient as (K, N, M), now (N, K, M)."""
        model = kernels.gemm_time(self.device, g, precision)
        rows = self.device.matmul_shapes
        own = [r for r in rows if r[6:7] == (layout,)] if layout else []
        row = kernels.nearest_row(own, (*g, precision), free=(0, 1, 2, 3)) if own else None
        row = row or kernels.nearest_row(rows, (*g, precision), free=(0, 1, 2, 3))
        if row is None:
            legacy = [r for r in rows if len(r) < 7]
            row = kernels.nearest_row(legacy, (g[0], g[2], g[1], g[3], precision), free=())
        if row is None:
            return model
        return row[5] * model / kernels.gemm_time(self.device, row[:4], precision)

    def attention_time(self, a: Attn, flops: float, precision: str, backward: bool) -> float:
        """Seconds of one fused attention call (forward or backward) doing `flops` (dense count): a measured row
        with the same lengths, head dim and causality, scaled by batch x heads through the model; else the
        model."""
        model = self._attention_model(a, flops, precision, backward)
        row = kernels.nearest_row(self.device.attention_shapes, (*a, precision), free=(0,))
        if row is None or model <= 0:
            return model
        ref = self._attention_model(row[:5], flops * row[0] / a[0], precision, backward)
        return row[7 if backward else 6] * model / ref

    @property
    def unfused_attention(self) -> bool:
        """Whether the profile's attention kernel is `unfused` (SDPA runs as separate kernels)."""
        return self.device.attention is not None and self.device.attention.kernel == UNFUSED_ATTENTION

    def unfused_attention_time(self, a: Attn, precision: str, backward: bool, dropout: bool) -> float:
        """Seconds of attention as separate kernels over the dense s_q x s_k scores (the causal mask is applied to
        computed scores, so nothing is skipped): forward, the batched GEMMs q k^T (writing the scores) and p v,
        one fused scale-mask-softmax pass (read the scores, write the probabilities) and, when the call has a
        dropout probability, the dropout pass (read, write, a 1-byte mask); backward, the four operand-gradient
        GEMMs, the dropout backward (gradient and mask in, gradient out) and the softmax backward (gradient and
        probabilities in, gradient out). Scores in the activation dtype, as Megatron-LM's fused softmax keeps
        them."""
        bh, s_q, s_k, d, _ = a
        e = PRECISION_BYTES[precision]
        scores = float(bh) * s_q * s_k
        qk, pv = (bh, s_q, s_k, d), (bh, s_q, d, s_k)
        if backward:
            gemms = sum(self.gemm_time(x, precision) for g in (qk, pv) for x, _ in backward_gemms(g))
            passes = [3 * e * scores]
        else:
            gemms = self.gemm_time(qk, precision) + self.gemm_time(pv, precision)
            passes = [2 * e * scores]
        if dropout:
            passes.append((2 * e + 1) * scores)
        return gemms + sum(self._floor(self.memory_time(b)) for b in passes)

    def _causal_fraction(self, s_q: int, s_k: int) -> float:
        """Work fraction of causal attention without a fused-attention model: PyTorch's CPU flash kernel's blocks
        on CPU ranks (no SMs), 128-row blocks on GPUs (FlashAttention-2's sm80 forward kernels for head dims 64 and
        128, csrc/flash_attn/src/flash_fwd_launch_template.h; Dao 2023, Sec. 3.3: {64, 128} x {64, 128} blocks)."""
        if self.device.sms:
            return kernels.causal_fraction(s_q, s_k, 128)
        return kernels.causal_fraction(s_q, s_k, kernels.cpu_flash_q_split(s_q), kernels.CPU_FLASH_KV_SPLIT)

    def _attention_model(self, a: Attn, flops: float, precision: str, backward: bool) -> float:
        """Attention seconds without measurements: the fused-attention model, else its two batched GEMMs (q k^T,
        scores v) at the causal fraction, scaled to `flops` (backward: 2.5x the forward's)."""
        if self.device.attention is not None:
            return kernels.attention_time(self.device, a, flops, precision, backward)
        bh, s_q, s_k, d, causal = a
        frac = self._causal_fraction(s_q, s_k) if causal else 1.0
        gemms = kernels.gemm_time(self.device, (bh, s_q, s_k, d), precision) + \
            kernels.gemm_time(self.device, (bh, s_q, d, s_k), precision)
        return frac * gemms * flops / (4.0 * bh * s_q * s_k * d)

    def kernel_time(self, work: OpWork, backward: bool) -> float:
        """Seconds of the op's elementwise kernel from the profile's measured per-element cost at the dtype it runs
        in (`DeviceSpec.kernel_cost`; 0 when the profile has none for its family)."""
        cost = self.device.kernel_cost(work.kernel, work.kernel_precision) if work.kernel else None
        return work.elems * cost[1 if backward else 0] if cost else 0.0

    def overhead(self, kind: str, work: OpWork) -> tuple[float, float]:
        """Host-side (forward, backward) seconds of one op: the profile's per-op and per-autograd-node overheads
        (DTensor figures for DTensor ops), one node per parameter read for its gradient accumulation."""
        ov = self.device.op_overhead
        if kind == "linear":  # a linear is several dispatches: its measured whole-call overhead where known
            lf, lb = (ov.dtensor_linear_forward, ov.dtensor_linear_backward) if work.dtensor else \
                (ov.linear_forward, ov.linear_backward)
            nf, nb = (ov.dtensor_linear_nd_forward, ov.dtensor_linear_nd_backward) if work.dtensor else \
                (ov.linear_nd_forward, ov.linear_nd_backward)
            if work.nd_input and nf and nb:  # a (batch, sequence, features) input: timed so where measured
                return nf, nb
            if lf and lb:
                return lf, lb
        if kind == "matmul":  # a 2-D matmul's dispatch and its backward node's two matmuls, where measured
            mf, mb = (ov.dtensor_matmul_forward, ov.dtensor_matmul_backward) if work.dtensor else \
                (ov.matmul_forward, ov.matmul_backward)
            if mf and mb:
                return mf, mb + max(0, work.params - 1) * ov.backward
        f, b = (ov.dtensor_forward, ov.dtensor_backward) if work.dtensor else (ov.forward, ov.backward)
        return f, b + work.params * ov.backward

    def combine(self, kernel: float, host: float) -> float:
        """Seconds of a sequence of ops with `kernel` seconds of kernels and `host` seconds of dispatch: their max
        where the host runs ahead of the device (`async_host`), else their sum."""
        return max(kernel, host) if self.device.async_host else kernel + host

    def added(self, kernel: float, host: float, more_kernel: float, more_host: float) -> float:
        """Seconds that `more_kernel` of kernels and `more_host` of dispatch add to a pass of `kernel` and `host`
        when they run inside it (a recomputation inside a backward): `combine` of the sums minus that of the pass."""
        return self.combine(kernel + more_kernel, host + more_host) - self.combine(kernel, host)

    def op_parts(self, kind: str, work: OpWork, precision: str) -> tuple[float, float, float, float]:
        """(forward kernel, backward kernel, forward host, backward host) seconds of one op (with autocast's
        casts before it, each a memory-bound kernel both ways)."""
        f, b = self._kernel_times(kind, work, precision)
        of, ob = self.overhead(kind, work)
        cf = sum(self._floor(self.cast_time(c, w, precision)) for c, w in zip(work.cast_bytes, work.cast_widens))
        cb = sum(self._floor(self.cast_time(c, not w, precision)) for c, w in zip(work.cast_bytes, work.cast_widens))
        if work.cast_bytes:  # a cast is one more op in forward and one more autograd node in backward
            ov = self.device.op_overhead
            of, ob = of + len(work.cast_bytes) * ov.forward, ob + len(work.cast_bytes) * ov.backward
        return f + cf, b + cb, of, ob

    def cast_time(self, nbytes: float, widening: bool, precision: str = "fp32") -> float:
        """Seconds of one 16-bit <-> fp32 conversion moving `nbytes` (6 per element): the bytes term, and for a
        widening one (16-bit to fp32) at least the profile's measured `widen` seconds per element (torch's CUDA
        copy vectorizes only fp32 -> bf16 / fp16; the widening copy runs its unrolled generic kernel). `precision`:
        the 16-bit side, whose measured `widen` (CPU ranks: `by_precision`) is taken first."""
        t = self.memory_time(nbytes)
        cost = self.device.kernel_cost("widen", precision) if widening else None
        return max(t, nbytes / 6.0 * cost[0]) if cost else t

    def op_times(self, kind: str, work: OpWork, precision: str) -> tuple[float, float]:
        """(forward, backward) seconds of one op on its own: kernels and host combined (`combine`)."""
        f, b, of, ob = self.op_parts(kind, work, precision)
        return self.combine(f, of), self.combine(b, ob)

    def norm_time(self, n: tuple[int, int, int, str], precision: str, backward: bool) -> float | None:
        """Seconds of a layer / RMS norm from the profile's `norm_shapes`: a row of its width, parameters and
        function, scaled by the bytes model between the two row counts; None without such a row."""
        row = kernels.nearest_row(self.device.norm_shapes, (*n, precision), free=(0,))
        if row is None:
            return None
        t = row[6] if backward else row[5]
        e = PRECISION_BYTES[precision]
        return t * self.memory_time(2 * e * n[0] * n[1]) / self.memory_time(2 * e * row[0] * row[1])

    def bias_grad_time(self, rows: int, width: int, precision: str) -> float:
        """Seconds of a linear's bias gradient, the output gradient [rows, width] summed over its rows (one
        reduction kernel): a `reduce_shapes` row of the same width scaled by the bytes model between the two row
        counts; else the bytes model (read the gradient, write the bias's), which a column reduction at narrow
        widths runs well below (see `DeviceSpec.reduce_shapes`)."""
        e = PRECISION_BYTES[precision]
        row = kernels.nearest_row(self.device.reduce_shapes, (rows, width, precision), free=(0,))
        model = self.memory_time(e * (rows + 1) * width)
        if row is None:
            return self._floor(model)
        return self._floor(row[3] * model / self.memory_time(e * (row[0] + 1) * row[1]))

    def _floor(self, t: float) -> float:
        """A kernel's seconds, never below the profile's per-kernel floor."""
        return max(t, self.device.kernel_floor)

    def _kernel_times(self, kind: str, work: OpWork, precision: str) -> tuple[float, float]:
        if kind in FREE_KINDS:
            if not work.copy:
                return 0.0, 0.0
            return self._floor(self.memory_time(work.fwd_bytes)), self._floor(self.memory_time(work.bwd_bytes))
        fwd_mem = self.memory_time(work.fwd_bytes)
        bwd_mem = self.memory_time(work.bwd_bytes)
        if kind == "attention" and work.attn is not None and self.unfused_attention:
            return (self.unfused_attention_time(work.attn, precision, False, work.dropout),
                    self.unfused_attention_time(work.attn, precision, True, work.dropout))
        measured = self.measured_attention(work, precision) if kind == "attention" else None
        if measured is not None:
            return max(measured[0], fwd_mem), max(measured[1], bwd_mem)
        if kind == "attention" and work.attn is not None and \
                (self.device.attention is not None or self.device.attention_shapes):
            return (self.attention_time(work.attn, work.fwd_flops, precision, False),
                    self.attention_time(work.attn, work.bwd_flops, precision, True))
        curves = self.linear_curves(precision) if kind == "linear" else None
        if curves:  # measured nn.Linear rates at this precision (`plan profile` on CPU ranks); else the GEMM model
            return self._linear_times(work, precision, fwd_mem, bwd_mem, *curves)
        if work.gemms:
            return self._gemm_times(work, precision)
        if kind == "norm" and work.norm is not None and self.device.norm_shapes:
            f, b = self.norm_time(work.norm, precision, False), self.norm_time(work.norm, precision, True)
            if f is not None and b is not None:
                return self._floor(f), self._floor(b)
        if kind in MATMUL_KINDS:
            return self._attention_as_gemms(work, precision, fwd_mem, bwd_mem)
        fwd_k, bwd_k = self.kernel_time(work, False), self.kernel_time(work, True)
        if work.fwd_flops > 0 and kind not in ("embedding",):
            # FLOPs of non-matmul kernels (norms, softmax) run on vector units; the bytes term dominates at
            # realistic sizes, but never price an op below its FLOPs at fp32 vector peak
            vec = peak_flops(self.device, "fp32")
            return self._floor(max(fwd_mem, work.fwd_flops / vec, fwd_k)), \
                self._floor(max(bwd_mem, work.bwd_flops / vec, bwd_k))
        bwd = max(bwd_mem, bwd_k)
        # an op whose gradients autograd only passes on (an add's) runs no backward kernel
        return self._floor(max(fwd_mem, fwd_k)), (self._floor(bwd) if bwd > 0 else 0.0)

    def _gemm_times(self, work: OpWork, precision: str) -> tuple[float, float]:
        """Forward GEMMs, and backward as the operands' gradient GEMMs (M, K, N) and (K, N, M), scaled to the
        op's counted backward FLOPs (an operand without gradient has none)."""
        fwd = sum(self.gemm_time(g, precision, work.gemm_layout) for g in work.gemms)
        bwd_g = [x for g in work.gemms for x in backward_gemms(g, work.gemm_layout)]
        g_flops = sum(2.0 * math.prod(g) for g, _ in bwd_g)
        if work.bwd_flops <= 0 or g_flops <= 0:
            return fwd, 0.0
        share = work.bwd_flops / g_flops
        bias = self.bias_grad_time(*work.bias_grad, precision) if work.bias_grad else 0.0
        return fwd, sum(self.gemm_time(g, precision, layout) for g, layout in bwd_g) * share + bias

    def _attention_as_gemms(self, work: OpWork, precision: str, fwd_mem: float,
                            bwd_mem: float) -> tuple[float, float]:
        """Attention without a fused-attention model: its two batched GEMMs (q k^T, scores v) at the causal
        fraction of the work, plus the softmax over the scores from `kernel_costs`; FLOPs alone without a shape."""
        a = work.attn
        if a is None:
            fwd = max(self.matmul_time(work.fwd_flops, precision), fwd_mem)
            half = work.bwd_flops / 2
            bwd = max(2 * self.matmul_time(half, precision), bwd_mem) if work.bwd_flops > 0 else bwd_mem
            return fwd + self.kernel_time(work, False), bwd + self.kernel_time(work, True)
        bh, s_q, s_k, d, causal = a
        frac = self._causal_fraction(s_q, s_k) if causal else 1.0
        fwd = frac * (self.gemm_time((bh, s_q, s_k, d), precision) + self.gemm_time((bh, s_q, d, s_k), precision))
        ratio = work.bwd_flops / work.fwd_flops if work.fwd_flops > 0 else 0.0
        return fwd + frac * self.kernel_time(work, False), ratio * fwd + frac * self.kernel_time(work, True)

    def measured_attention(self, work: OpWork, precision: str) -> tuple[float, float] | None:
        """(forward, backward) seconds of an SDPA call from the causal SDPA rates measured at `precision` by head dim
        and dense forward FLOPs (`PrecisionRates.attention_fraction`; a call without a causal mask does 1 / the causal
        fraction of that work); None where the profile has none, a fused-attention model, or the model's own
        calls timed at this precision (`attention_shapes`)."""
        dev, a = self.device, work.attn
        r = dev.rates(precision)
        if a is None or r is None or not r.attention_backward_efficiency or dev.attention is not None or \
                any(row[5] == precision for row in dev.attention_shapes) or work.fwd_flops <= 0:
            return None
        pk = peak_flops(dev, precision)
        more = 1.0 if a[4] else 1.0 / self._causal_fraction(a[1], a[2])
        fwd = work.fwd_flops / (pk * r.attention_fraction(a[3], work.fwd_flops, False))
        bwd = work.bwd_flops / (pk * r.attention_fraction(a[3], work.fwd_flops, True))
        return fwd * more, bwd * more

    def linear_curves(self, precision: str) -> tuple[tuple, tuple] | None:
        """The (forward, backward) nn.Linear efficiency curves measured at `precision` (fp32: the top-level ones;
        bf16 / fp16: `by_precision`'s), or None where the profile has none or times the model's own GEMMs at it
        (`matmul_shapes`)."""
        dev = self.device
        if precision == "fp32":
            ok = dev.linear_backward_efficiency and not dev.matmul_shapes
            return (dev.linear_efficiency, dev.linear_backward_efficiency) if ok else None
        r = dev.rates(precision)
        if r is None or not r.linear_backward_efficiency or any(row[4] == precision for row in dev.matmul_shapes):
            return None
        return r.linear_efficiency, r.linear_backward_efficiency

    def _linear_times(self, work: OpWork, precision: str, fwd_mem: float, bwd_mem: float,
                      fwd_curve: tuple, bwd_curve: tuple) -> tuple[float, float]:
        """(forward, backward) kernel seconds of an nn.Linear from the profile's measured nn.Linear rates by
        forward FLOPs (the module's own matmul layouts, transposes and bias gradient) at `precision`."""
        pk = peak_flops(self.device, precision)
        f = work.fwd_flops
        if f <= 0:
            return fwd_mem, bwd_mem
        fwd = f / (pk * interp_log(fwd_curve, f))
        bwd = work.bwd_flops / (pk * interp_log(bwd_curve, f))
        return max(fwd, fwd_mem), max(bwd, bwd_mem)
