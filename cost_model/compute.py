"""Compute cost of one op on one device: a roofline with the profile's measured efficiency curves.

    t = max(FLOPs / (peak[dtype] * matmul_eff(FLOPs)),  bytes / (memory_bandwidth * memory_eff(bytes)))

for matmul-like kinds (linear, matmul, attention, conv); memory-bound kinds (norm, softmax, elementwise, embedding
as a gather, loss, pool, other) use only the bytes term. Views (`reshape`) launch no kernel. Efficiency curves are
interpolated linearly in log(size) and clamped at their ends (`interp_log`).

Two measured terms from the profile refine this where it has them (CPU profiles written by `plan profile`):
- `kernel_costs`: elementwise kernels that are compute-bound on the device (a tanh per element of GELU, an exp per
  element of softmax / log-softmax in the loss, normalisation) cost max(bytes term, elements x the measured seconds
  per element of their kernel family); attention adds a softmax over its score matrix to its matmul time.
- `linear_efficiency` / `linear_backward_efficiency`: linears are priced from the measured rates of nn.Linear
  itself (forward, and backward with its transposed operands and bias gradient) instead of square matmuls, at
  fp32 (the dtype they are measured in).
- `op_overhead`: every traced op (views included: each is a dispatcher call and an autograd node) adds the
  measured host-side seconds per op in forward and per autograd node in backward, plus one node per parameter it
  reads (gradient accumulation); DTensor operands (tensor-parallel modules) pay the DTensor figures instead. A
  linear, several dispatches (transpose, addmm, views) and nodes, pays the measured overhead of a whole tiny
  F.linear call (plain or column-parallel DTensor) where the profile has it.

The graph's per-op figures are for `graph.batch_size` samples at the traced dtype; `OpScaler` re-prices them for a
micro-batch at the plan's precision and for the op's share of the work over the tp axis.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

from hardware_profiles.schema import DeviceSpec
from planner.graph import OpNode, TensorMeta, dtype_bytes

MATMUL_KINDS = frozenset({"linear", "matmul", "attention", "conv"})
"""Op kinds priced by the FLOPs term of the roofline (and the bytes term when it is larger)."""
FREE_KINDS = frozenset({"reshape"})
"""Op kinds that are views: no kernel, no time."""
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
"""Dtypes re-priced at the plan's activation precision (integer ids and bool masks keep their size)."""
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per float element at each training precision."""
PRECISION_PEAK_KEYS = {"bf16": ("bf16", "fp16", "fp32"), "fp16": ("fp16", "bf16", "fp32"), "fp32": ("fp32",)}
"""Which `DeviceSpec.peak_flops` entry prices matmuls at each precision, in order of preference. fp32 uses the
plain fp32 peak: PyTorch leaves TF32 matmuls off by default (torch.backends.cuda.matmul.allow_tf32 = False since
1.12, PyTorch CUDA semantics docs)."""
BWD_BYTES_FACTOR = 2.0
"""Backward of a memory-bound op reads the output gradient and the saved input and writes the input gradient:
about twice the forward's traffic (first-principles byte count: 3 tensors vs forward's 2, plus parameter grads)."""


def interp_log(curve: Sequence[tuple[float, float]], x: float) -> float:
    """Value of a [size, value] curve at size x, linear in log(size), clamped to the end values."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    i = bisect.bisect_right([p[0] for p in curve], x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def peak_flops(device: DeviceSpec, precision: str) -> float:
    """Dense peak FLOP/s for matmuls at a training precision (falls back to the fp32 peak if not listed)."""
    for key in PRECISION_PEAK_KEYS[precision]:
        if key in device.peak_flops:
            return device.peak_flops[key]
    return max(device.peak_flops.values())


def tensor_bytes(meta: TensorMeta, precision: str) -> float:
    """Bytes of a tensor at the plan's precision (floats re-priced; ints and bools unchanged)."""
    if meta.dtype.removeprefix("torch.") in FLOAT_DTYPES:
        return meta.numel * PRECISION_BYTES[precision]
    return meta.numel * dtype_bytes(meta.dtype)


@dataclass(frozen=True)
class OpWork:
    """What one device does for one op in one micro-batch: FLOPs, bytes and kernel elements, forward and
    backward."""

    fwd_flops: float
    """Forward FLOPs on this device."""
    bwd_flops: float
    """Backward FLOPs on this device."""
    fwd_bytes: float
    """Bytes read and written in forward on this device."""
    bwd_bytes: float
    """Bytes read and written in backward on this device."""
    elems: float = 0.0
    """Elements the op's elementwise kernel runs over on this device (its output; for a loss, its logits; for
    attention, the score matrix batch x heads x s_q x s_k)."""
    kernel: str | None = None
    """Kernel family priced by the profile's `kernel_costs` (see `kernel_family`), or None."""
    params: int = 0
    """Parameter tensors the op reads (each adds a gradient-accumulation node in backward)."""
    dtensor: bool = False
    """Whether the op runs on DTensors (a tensor-parallel module), paying the DTensor dispatch overhead."""


def split_inputs(op: OpNode) -> tuple[list[int], list[int]]:
    """Indices of `op.input_meta` that are activations and that are parameters (matched by shape, in order)."""
    pending = [p.shape for p in op.params]
    acts, params = [], []
    for i, m in enumerate(op.input_meta):
        if m.shape in pending:
            pending.remove(m.shape)
            params.append(i)
        else:
            acts.append(i)
    return acts, params


TRANSCENDENTAL = frozenset({"silu", "sigmoid", "tanh", "exp", "erf", "softplus", "mish", "elu", "selu", "log",
                            "log1p", "sin", "cos", "pow", "hardswish"})
"""Elementwise functions that evaluate a special function per element (priced as the `tanh` kernel family)."""
DTENSOR_STRATEGIES = frozenset({"colwise", "rowwise", "vocab"})
"""Placement strategies the executor applies with DTensor parallel styles (their modules compute on DTensors);
`sequence` joins them under sequence parallelism (SequenceParallel norms)."""


def kernel_family(op: OpNode) -> str | None:
    """The `kernel_costs` family pricing an op: gelu, tanh (other transcendentals), softmax (softmax, log-softmax,
    cross-entropy losses), layer_norm (norms), add (other elementwise), or None (matmuls, views, gathers)."""
    name = op.target.rsplit(".", 1)[-1].strip("_").lower()
    if op.kind == "norm":
        return "layer_norm"
    if op.kind in ("softmax", "loss"):
        return "add" if name in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss") else "softmax"
    if op.kind == "elementwise":
        if name == "gelu":
            return "gelu"
        return "tanh" if name in TRANSCENDENTAL else "add"
    if op.kind == "attention":
        return "softmax"
    return None


def _kernel_elems(op: OpNode, acts: list[int], scale: float, div: int) -> float:
    """Elements of the op's elementwise kernel on one device (see `OpWork.elems`)."""
    if op.kind == "attention" and len(acts) >= 2:
        q, k = op.input_meta[acts[0]].shape, op.input_meta[acts[1]].shape
        if len(q) >= 2 and len(k) >= 2:
            return math.prod(q[:-1]) * k[-2] * scale / div
    if op.kind == "loss" and acts:
        return op.input_meta[acts[0]].numel * scale / div
    return sum(m.numel for m in op.output_meta[:1]) * scale / div


def _divisor(placement: str, tp: int) -> int:
    """How many ways a tensor with this placement is split over tp (S(d) -> tp; R and P -> 1)."""
    return tp if placement.startswith("S") else 1


def op_work(op: OpNode, placement, tp: int, scale: float, precision: str, sequence_parallel: bool = False) -> OpWork:
    """FLOPs and bytes of `op` on one tp rank for `scale` x the traced batch, at `precision`.

    `placement` is an `OpPlacement` or None (replicated: every tp rank does the whole op). An op with any sharded
    or partial placement does 1/tp of the FLOPs; each tensor's bytes are divided by tp where it is sharded.
    """
    acts, par = split_inputs(op)
    sharded = placement is not None and placement.strategy != "replicate" and tp > 1
    in_pl = list(placement.inputs) if placement is not None else []
    p_pl = list(placement.params) if placement is not None else []
    act_bytes = 0.0
    for j, i in enumerate(acts):
        pl = in_pl[j] if j < len(in_pl) else (in_pl[-1] if in_pl else "R")
        act_bytes += tensor_bytes(op.input_meta[i], precision) * scale / _divisor(pl, tp)
    par_bytes = 0.0
    for j, i in enumerate(par):
        pl = p_pl[j] if j < len(p_pl) else "R"
        par_bytes += tensor_bytes(op.input_meta[i], precision) / _divisor(pl, tp)
    out_pl = placement.output if placement is not None else "R"
    out_bytes = sum(tensor_bytes(m, precision) for m in op.output_meta) * scale / _divisor(out_pl, tp)
    if op.kind == "embedding":
        # a gather touches only the rows it reads (the output), not the whole table
        par_bytes = 0.0
        act_bytes += out_bytes
    div = tp if sharded else 1
    fwd_bytes = act_bytes + par_bytes + out_bytes
    strategies = DTENSOR_STRATEGIES | ({"sequence"} if sequence_parallel else set())
    dtensor = tp > 1 and placement is not None and placement.strategy in strategies
    elem_div = tp if sharded or (placement is not None and out_pl.startswith("S") and tp > 1) else 1
    return OpWork(fwd_flops=op.fwd_flops * scale / div, bwd_flops=op.bwd_flops * scale / div,
                  fwd_bytes=fwd_bytes, bwd_bytes=BWD_BYTES_FACTOR * fwd_bytes,
                  elems=_kernel_elems(op, acts, scale, elem_div), kernel=kernel_family(op), params=len(op.params),
                  dtensor=dtensor)


class ComputeModel:
    """Prices `OpWork` on one device of a profile."""

    def __init__(self, device: DeviceSpec):
        """Keep the device's peaks, bandwidth and efficiency curves."""
        self.device = device

    def matmul_time(self, flops: float, precision: str) -> float:
        """Seconds for one matmul-like kernel of `flops` FLOPs at the measured efficiency for its size."""
        if flops <= 0:
            return 0.0
        eff = interp_log(self.device.matmul_efficiency, flops)
        return flops / (peak_flops(self.device, precision) * eff)

    def memory_time(self, nbytes: float) -> float:
        """Seconds for a memory-bound kernel moving `nbytes` at the measured efficiency for its size."""
        if nbytes <= 0:
            return 0.0
        eff = interp_log(self.device.memory_efficiency, nbytes)
        return nbytes / (self.device.memory_bandwidth * eff)

    def kernel_time(self, work: OpWork, backward: bool) -> float:
        """Seconds of the op's elementwise kernel from the profile's measured per-element cost (0 when the profile
        has none for its family)."""
        cost = self.device.kernel_costs.get(work.kernel) if work.kernel else None
        return work.elems * cost[1 if backward else 0] if cost else 0.0

    def overhead(self, kind: str, work: OpWork) -> tuple[float, float]:
        """Host-side (forward, backward) seconds of one op: the profile's per-op and per-autograd-node overheads
        (DTensor figures for DTensor ops), one node per parameter read for its gradient accumulation."""
        ov = self.device.op_overhead
        if kind == "linear":  # a linear is several dispatches: its measured whole-call overhead where known
            lf, lb = (ov.dtensor_linear_forward, ov.dtensor_linear_backward) if work.dtensor else \
                (ov.linear_forward, ov.linear_backward)
            if lf and lb:
                return lf, lb
        f, b = (ov.dtensor_forward, ov.dtensor_backward) if work.dtensor else (ov.forward, ov.backward)
        return f, b + work.params * ov.backward

    def op_times(self, kind: str, work: OpWork, precision: str) -> tuple[float, float]:
        """(forward, backward) seconds of one op from its work: roofline for matmul kinds, bytes otherwise (or the
        measured kernel cost where larger), plus the per-op overhead."""
        f, b = self._kernel_times(kind, work, precision)
        of, ob = self.overhead(kind, work)
        return f + of, b + ob

    def _kernel_times(self, kind: str, work: OpWork, precision: str) -> tuple[float, float]:
        if kind in FREE_KINDS:
            return 0.0, 0.0
        fwd_mem = self.memory_time(work.fwd_bytes)
        bwd_mem = self.memory_time(work.bwd_bytes)
        if kind == "linear" and precision == "fp32" and self.device.linear_backward_efficiency:
            # measured in fp32 (`plan profile` on CPU ranks); other precisions use the matmul curve
            return self._linear_times(work, precision, fwd_mem, bwd_mem)
        if kind in MATMUL_KINDS:
            fwd = max(self.matmul_time(work.fwd_flops, precision), fwd_mem)
            # the backward of a matmul is two matmuls of the forward's size (input and weight gradients)
            half = work.bwd_flops / 2
            bwd = max(2 * self.matmul_time(half, precision), bwd_mem) if work.bwd_flops > 0 else bwd_mem
            # attention's softmax over the score matrix runs between its matmuls
            return fwd + self.kernel_time(work, False), bwd + self.kernel_time(work, True)
        fwd_k, bwd_k = self.kernel_time(work, False), self.kernel_time(work, True)
        if work.fwd_flops > 0 and kind not in ("embedding",):
            # FLOPs of non-matmul kernels (norms, softmax) run on vector units; the bytes term dominates at
            # realistic sizes, but never price an op below its FLOPs at fp32 vector peak
            vec = peak_flops(self.device, "fp32")
            return max(fwd_mem, work.fwd_flops / vec, fwd_k), max(bwd_mem, work.bwd_flops / vec, bwd_k)
        return max(fwd_mem, fwd_k), max(bwd_mem, bwd_k)

    def _linear_times(self, work: OpWork, precision: str, fwd_mem: float, bwd_mem: float) -> tuple[float, float]:
        """(forward, backward) kernel seconds of an nn.Linear from the profile's measured nn.Linear rates by
        forward FLOPs (the module's own matmul layouts, transposes and bias gradient)."""
        pk = peak_flops(self.device, precision)
        f = work.fwd_flops
        if f <= 0:
            return fwd_mem, bwd_mem
        fwd = f / (pk * interp_log(self.device.linear_efficiency, f))
        bwd = work.bwd_flops / (pk * interp_log(self.device.linear_backward_efficiency, f))
        return max(fwd, fwd_mem), max(bwd, bwd_mem)
