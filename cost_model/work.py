"""What one op does on one device for one micro-batch: FLOPs, bytes read and written forward and backward, its
GEMM shapes and attention call, autocast's casts (`op_work` -> `OpWork`, which `cost_model.compute` prices).

The graph's per-op figures are for `graph.batch_size` samples at the traced dtype; `op_work` re-prices them for a
micro-batch at the plan's precision and for the op's share of the work over the tp axis: GEMMs as the (M, N, K)
each op has after tp sharding (`op_gemms`; backward the operands' gradients, `backward_gemms`), an elementwise
op's backward per input that needs a gradient (`elementwise_backward_bytes`), a norm's as its two kernels, other
memory-bound ops' as twice their forward bytes; `reshape`-kind ops that copy (`OpNode.copies`) move their bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cost_model.kernels import PRECISION_BYTES, Attn, Gemm
from cost_model.ops import call_name
from planner.graph import OpNode, TensorMeta, dtype_bytes

GEMM_KINDS = frozenset({"linear", "matmul", "conv"})
"""Op kinds that are GEMMs (conv as an implicit GEMM), priced by shape."""
FREE_KINDS = frozenset({"reshape"})
"""Op kinds that are views: no kernel, no time."""
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
"""Dtypes re-priced at the plan's activation precision (integer ids and bool masks keep their size)."""
BWD_BYTES_FACTOR = 2.0
"""Backward of a memory-bound op reads the output gradient and the saved input and writes the input gradient:
about twice the forward's traffic (first-principles byte count: 3 tensors vs forward's 2, plus parameter grads).
Elementwise ops are counted per input gradient instead (`elementwise_backward_bytes`)."""
PASS_THROUGH = frozenset({"add", "iadd", "sub", "isub"})
"""Elementwise calls whose input gradient is the output gradient itself (autograd passes it on, no kernel; `sub`'s
second operand negates it)."""
PRODUCTS = frozenset({"mul", "imul", "multiply", "div", "idiv", "truediv", "itruediv", "true_divide", "divide"})
"""Elementwise calls whose gradient for one operand is the output gradient times (or over) the other operand."""
UNARY_PASSES = {"neg": 2, "pow": 7, "rsqrt": 7, "sqrt": 5, "reciprocal": 8}
"""Tensor passes (one read or write of the input's size each) of a one-tensor elementwise op's backward, from
PyTorch's derivative formulas (tools/autograd/derivatives.yaml): neg negates the gradient (read, write); pow and
rsqrt run three kernels, `exponent * self.pow(exponent - 1)` or `result.pow(3)` (read, write), a scalar multiply
(read, write) and the product with the gradient (read two, write); four kernels per pow in the H100 trace of Llama
1B (2026-11-26: a copy, a scalar multiply, a product, and the gradient sum into the shared input); sqrt divides the
gradient by `2 * result` (2 + 3 passes), reciprocal multiplies it by `-(result * result)` (3 + 2 + 3). Other
one-tensor ops (silu, gelu, tanh, exp, dropout, ...) read the gradient and one saved tensor and write the input's
gradient: 3 passes."""


def floating(meta: TensorMeta) -> bool:
    """Whether a tensor is floating point (re-priced at the plan's precision, cast by autocast; ids and masks keep
    their dtype)."""
    return meta.dtype.removeprefix("torch.") in FLOAT_DTYPES


def elem_bytes(meta: TensorMeta, precision: str) -> float:
    """Bytes per element of a tensor at the plan's precision (floats re-priced; ints and bools unchanged)."""
    if floating(meta):
        return PRECISION_BYTES[precision]
    return dtype_bytes(meta.dtype)


def tensor_bytes(meta: TensorMeta, precision: str) -> float:
    """Bytes of a tensor at the plan's precision (floats re-priced; ints and bools unchanged)."""
    return meta.numel * elem_bytes(meta, precision)


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
    kernel_precision: str = "fp32"
    """The precision the op's kernel runs in (its output's under autocast: fp32 for norms, softmax, losses and ops
    with an fp32 input), which picks the measured `kernel_costs` (`DeviceSpec.kernel_cost`)."""
    params: int = 0
    """Parameter tensors the op reads (each adds a gradient-accumulation node in backward)."""
    dtensor: bool = False
    """Whether the op runs on DTensors (every op of a tp > 1 plan), paying the DTensor dispatch overhead."""
    nd_input: bool = False
    """A linear whose input has more than 2 dims ((batch, sequence, features)): F.linear flattens and restores the
    leading dims, two dispatches more (`OpOverhead.linear_nd_*`)."""
    gemms: tuple[Gemm, ...] = ()
    """The op's forward GEMMs on this device, (batch, M, N, K) each (GEMM kinds; empty otherwise)."""
    norm: tuple[int, int, int, str] | None = None
    """A layer / RMS norm on this device: (rows, width, parameters, function), as `norm_shapes` rows are keyed."""
    gemm_layout: str = "nn"
    """How the forward GEMMs read their operands (`GEMM_LAYOUTS`): "nt" for F.linear (its weight stored [N, K]),
    "nn" otherwise; the backward GEMMs' layouts follow (`backward_gemms`)."""
    attn: Attn | None = None
    """The fused attention call on this device (kind `attention` with 4-D q, k, v), or None."""
    copy: bool = False
    """A `reshape`-kind op that copies (`OpNode.copies`): memory-bound, not a free view."""
    dropout: bool = False
    """An attention call with a dropout probability above 0 (its unfused form runs a dropout pass)."""
    cast_bytes: tuple[float, ...] = ()
    """Bytes (read + written) of each cast autocast runs before the op (an fp32 input of a linear, a bf16 input of
    a norm: cost_model.dtypes), one kernel each, forward and backward alike."""
    cast_widens: tuple[bool, ...] = ()
    """Per cast, whether its forward widens to fp32 (a norm's bf16 input); its backward then narrows the gradient,
    and a linear's narrowing cast widens its gradient in backward (`ComputeModel.cast_time`)."""
    bias_grad: tuple[int, int] | None = None
    """A linear with a bias that needs a gradient: (rows, width) of the output gradient its backward sums over the
    rows (addmm's backward: `grad.sum(0)`, a reduction kernel of its own; the forward adds the bias in the GEMM's
    epilogue), as `reduce_shapes` rows are keyed; None otherwise."""


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


def kernel_family(op: OpNode) -> str | None:
    """The `kernel_costs` family pricing an op: gelu, tanh (other transcendentals), softmax (softmax, log-softmax,
    cross-entropy losses), layer_norm (norms), add (other elementwise), or None (matmuls, views, gathers)."""
    name = call_name(op)  # `aten.gelu.default` and `F.gelu` alike: gelu
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


def kernel_elems(op: OpNode, acts: list[int], scale: float, div: int) -> float:
    """Elements of the op's elementwise kernel on one device (see `OpWork.elems`)."""
    if op.kind == "attention" and len(acts) >= 2:
        q, k = op.input_meta[acts[0]].shape, op.input_meta[acts[1]].shape
        if len(q) >= 2 and len(k) >= 2:
            return math.prod(q[:-1]) * k[-2] * scale / div
    if op.kind == "loss" and acts:
        return op.input_meta[acts[0]].numel * scale / div
    return sum(m.numel for m in op.output_meta[:1]) * scale / div


def _linear_gemm(op: OpNode, acts: list[int], par: list[int], p_pl: list[str], tp: int, scale: float,
                 div: int) -> Gemm | None:
    """(1, M, N, K) of a linear: M tokens (all but the last input dim), weight (N, K) or (K, N) (an addmm); the
    weight's sharded dim divides N (colwise) or K (rowwise), else a split op divides M."""
    x = op.input_meta[acts[0]].shape
    weights = [op.input_meta[i].shape for i in par if len(op.input_meta[i].shape) == 2]  # not the bias
    if not x or not weights or x[-1] not in weights[0]:
        return None
    w, k = weights[0], x[-1]
    kdim = 1 if w[1] == k else 0
    n = w[1 - kdim]
    m = math.prod(x[:-1]) * scale
    j = next((j for j, p in enumerate(op.params) if p.shape == w), 0)
    pl = p_pl[j] if j < len(p_pl) else "R"
    if tp > 1 and pl == f"S({kdim})":
        k /= tp
    elif tp > 1 and pl == f"S({1 - kdim})":
        n /= tp
    else:
        m /= div
    return (1, m, n, k)


def op_gemms(op: OpNode, acts: list[int], par: list[int], p_pl: list[str], tp: int, scale: float,
             div: int) -> tuple[Gemm, ...]:
    """The forward GEMMs of a GEMM-kind op on one device: a linear (M tokens x K -> N), a batched matmul (the
    leading dims of both operands are the batch, split over tp when the op is), a conv as an implicit GEMM (M =
    output positions, N = output channels per group, K = input channels per group x kernel size, one GEMM per
    group). When the shape does not reproduce the op's counted FLOPs (within 5 %), a square GEMM of those FLOPs
    stands in."""
    flops = op.fwd_flops * scale / div
    if flops <= 0 or op.kind not in GEMM_KINDS:
        return ()
    g: Gemm | None = None
    shapes = [op.input_meta[i].shape for i in acts]
    if op.kind == "linear" and acts and par:
        g = _linear_gemm(op, acts, par, p_pl, tp, scale, div)
    elif op.kind == "matmul" and len(shapes) >= 2 and len(shapes[0]) >= 2 and len(shapes[1]) >= 2:
        a, b = shapes[0], shapes[1]
        batch = max(math.prod(a[:-2]), math.prod(b[:-2])) * scale / div
        g = (batch, a[-2], b[-1], a[-1])
    elif op.kind == "conv" and acts and par and op.output_meta and len(op.input_meta[par[0]].shape) >= 3:
        w, out = op.input_meta[par[0]].shape, op.output_meta[0]
        groups = max(1, shapes[0][1] // w[1]) if len(shapes[0]) > 1 else 1
        g = (groups, out.numel / w[0] * scale / div, w[0] / groups, math.prod(w[1:]))
    if g is None or abs(2.0 * math.prod(g) - flops) > 0.05 * flops:
        e = (flops / 2.0) ** (1.0 / 3.0)
        g = (1, e, e, e)
    return (tuple(max(1, round(x)) for x in g),)  # type: ignore[return-value]


def _attn_shape(op: OpNode, acts: list[int], scale: float, div: int) -> Attn | None:
    """(batch x heads, s_q, s_k, head dim, causal) of an SDPA call on one device (heads split over tp)."""
    if op.kind != "attention" or len(acts) < 2:
        return None
    q, k = op.input_meta[acts[0]].shape, op.input_meta[acts[1]].shape
    if len(q) != 4 or len(k) != 4:
        return None
    return (max(1, round(q[0] * q[1] * scale / div)), q[2], k[2], q[3], op.causal)


def attention_dropout(op: OpNode) -> bool:
    """Whether an SDPA call passes a dropout probability above 0 (`dropout_p`, keyword or fifth argument)."""
    if op.kind != "attention":
        return False
    for a in op.args:
        if isinstance(a, tuple) and len(a) == 2 and a[0] == "dropout_p":
            return isinstance(a[1], (int, float)) and a[1] > 0
    pos = [a for a in op.args if not (isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str))]
    return len(pos) > 4 and isinstance(pos[4], (int, float)) and not isinstance(pos[4], bool) and pos[4] > 0


def elementwise_backward_bytes(op: OpNode, sizes: Sequence[tuple[float, float]], out: tuple[float, float],
                               grads: Sequence[bool]) -> float | None:
    """Bytes an elementwise op's backward reads and writes, per input that needs a gradient (PyTorch's derivative
    formulas, tools/autograd/derivatives.yaml), or None where the op is not one counted here. `sizes` are the
    (elements, bytes per element) of each `input_meta` tensor as the kernel reads it on this device, `out` the
    output's, `grads` which inputs need a gradient. The gradient arrives in the output's dtype; an input of fewer
    elements (broadcast) gets it summed down to its shape (read the full gradient, write the input's size), and an
    input of another dtype gets it converted (read at the output's width, write at the input's): what the
    autograd engine runs for mixed-dtype and broadcast operands."""
    name = call_name(op)
    n_out, b_out = out
    tensors = [i for i, (n, _) in enumerate(sizes) if n > 0]
    if op.kind != "elementwise" or not tensors or len(tensors) > 2:
        return None
    if len(tensors) == 1:
        i = tensors[0]
        if not grads[i]:
            return 0.0
        n_in, b_in = sizes[i]
        if name in PASS_THROUGH:
            own = 0.0
        elif name in PRODUCTS:
            own = 2 * n_out * b_out  # gradient times (over) a scalar
        else:
            own = UNARY_PASSES.get(name, 3) * n_in * max(b_in, b_out)
        return own + _to_input(n_in, b_in, n_out, b_out)
    if name not in PASS_THROUGH and name not in PRODUCTS:
        return None
    total = 0.0
    for j, i in enumerate(tensors):
        if not grads[i]:
            continue
        n_in, b_in = sizes[i]
        if name in PRODUCTS:
            n_o, b_o = sizes[tensors[1 - j]]
            total += n_out * b_out + n_o * b_o + n_out * b_out
        elif name in ("sub", "isub") and j == 1:
            total += 2 * n_out * b_out
        total += _to_input(n_in, b_in, n_out, b_out)
    return total


def _to_input(n_in: float, b_in: float, n_out: float, b_out: float) -> float:
    """Bytes of bringing an output-shaped gradient (n_out elements of b_out bytes) to an input's shape and dtype:
    a sum over the broadcast dims, or a dtype conversion, or nothing."""
    if n_in < n_out:
        return n_out * b_out + n_in * b_in
    return n_in * (b_out + b_in) if b_in != b_out else 0.0


def _divisor(placement: str, tp: int) -> int:
    """How many ways a tensor with this placement is split over tp (S(d) -> tp; R and P -> 1)."""
    return tp if placement.startswith("S") else 1


def splits_work(placement) -> bool:
    """Whether a placement (an `OpPlacement`, None: replicated) splits the op's work over tp: something is sharded.
    An op reading and writing only partial sums and replicas (a `partial` add of two partial sums) computes whole
    tensors on every rank."""
    return placement is not None and placement.strategy != "replicate" and \
        any(x.startswith("S") for x in (*placement.inputs, placement.output, *placement.params))


def op_work(op: OpNode, placement, tp: int, scale: float, precision: str, dtensor: bool | None = None,
            dtypes=None, grads: Sequence[bool] | None = None) -> OpWork:
    """FLOPs and bytes of `op` on one tp rank for `scale` x the traced batch, at `precision`.

    `placement` is an `OpPlacement` or None (replicated: every tp rank does the whole op). An op with a sharded
    input, output or parameter does 1/tp of the FLOPs (`splits_work`); each tensor's bytes are divided by tp where
    it is sharded.
    `dtensor` says whether the op runs on DTensors (`cost_model.layers.runs_on_dtensors`); None: where tp > 1 and
    the op itself is placed (not replicated), the ops that run on DTensors whatever the rest of the plan.
    `dtypes` (a `cost_model.dtypes.OpDtypes`): each tensor's precision under autocast, instead of `precision` for
    all, and the casts autocast runs first.
    `grads`: per `input_meta` tensor, whether it needs a gradient (`cost_model.backward.input_grads`, from the
    graph's gradient flow); None: parameters and floating tensors made by a graph op do.
    """
    at = (lambda i: dtypes.inputs[i]) if dtypes is not None else (lambda i: precision)  # noqa: E731
    acts, par = split_inputs(op)
    sharded = splits_work(placement) and tp > 1
    in_pl = list(placement.inputs) if placement is not None else []
    p_pl = list(placement.params) if placement is not None else []
    sizes = [(0.0, 0.0)] * len(op.input_meta)  # (elements on this device, bytes each) per input tensor
    act_bytes = 0.0
    for j, i in enumerate(acts):
        pl = in_pl[j] if j < len(in_pl) else (in_pl[-1] if in_pl else "R")
        n = op.input_meta[i].numel * scale / _divisor(pl, tp)
        sizes[i] = (n, elem_bytes(op.input_meta[i], at(i)))
        act_bytes += n * sizes[i][1]
    par_bytes = 0.0
    for j, i in enumerate(par):
        pl = p_pl[j] if j < len(p_pl) else "R"
        n = op.input_meta[i].numel / _divisor(pl, tp)
        sizes[i] = (n, elem_bytes(op.input_meta[i], at(i)))
        par_bytes += n * sizes[i][1]
    out_pl = placement.output if placement is not None else "R"
    out_prec = dtypes.output if dtypes is not None else precision
    out_bytes = sum(tensor_bytes(m, out_prec) for m in op.output_meta) * scale / _divisor(out_pl, tp)
    casts, widens = [], []
    for i in (dtypes.casts if dtypes is not None else ()):
        j = acts.index(i)
        pl = in_pl[j] if j < len(in_pl) else (in_pl[-1] if in_pl else "R")
        numel = op.input_meta[i].numel * scale / _divisor(pl, tp)
        casts.append(numel * (PRECISION_BYTES[at(i)] + PRECISION_BYTES["fp32" if at(i) != "fp32" else precision]))
        widens.append(at(i) == "fp32")
    if op.kind == "embedding":
        # a gather touches only the rows it reads (the output), not the whole table
        par_bytes = 0.0
        act_bytes += out_bytes
    div = tp if sharded else 1
    fwd_bytes = act_bytes + par_bytes + out_bytes
    if dtensor is None:
        dtensor = tp > 1 and placement is not None and placement.strategy != "replicate"
    elem_div = tp if sharded or (placement is not None and out_pl.startswith("S") and tp > 1) else 1
    copy = op.kind in FREE_KINDS and op.copies
    bwd_bytes = (1.0 if copy else BWD_BYTES_FACTOR) * fwd_bytes
    if op.kind == "norm":
        # two kernels (PyTorch's layer_norm_backward_cuda; the H100 trace of GPT 124M on 2026-11-26 shows a
        # layer_norm_grad_input_kernel and a GammaBetaBackward kernel per norm): the input's gradient reads the
        # output's gradient, the input and the weight and writes the input's size; the weight and bias gradients
        # read the output's gradient and the input again and write the parameters' size
        bwd_bytes = out_bytes + 2 * act_bytes + par_bytes
        if op.params:
            bwd_bytes += out_bytes + act_bytes + par_bytes
    elif op.kind == "elementwise" and op.output_meta:
        if grads is None:
            src = op.input_sources or tuple(0 for _ in op.input_meta)
            grads = [i in par or (i < len(src) and src[i] >= 0 and floating(m)) for i, m in enumerate(op.input_meta)]
        n_out = op.output_meta[0].numel * scale / _divisor(out_pl, tp)
        counted = elementwise_backward_bytes(op, sizes, (n_out, elem_bytes(op.output_meta[0], out_prec)), grads)
        if counted is not None:
            bwd_bytes = counted
    nd_input = op.kind == "linear" and bool(acts) and len(op.input_meta[acts[0]].shape) > 2
    gemms = op_gemms(op, acts, par, p_pl, tp, scale, div)
    return OpWork(fwd_flops=op.fwd_flops * scale / div, bwd_flops=op.bwd_flops * scale / div,
                  fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes,
                  elems=kernel_elems(op, acts, scale, elem_div), kernel=kernel_family(op), kernel_precision=out_prec,
                  params=len(op.params),
                  dtensor=dtensor, nd_input=nd_input, gemms=gemms,
                  gemm_layout=gemm_layout(op), norm=norm_call(op, acts, scale, elem_div),
                  attn=_attn_shape(op, acts, scale, div), copy=copy, dropout=attention_dropout(op),
                  cast_bytes=tuple(casts), cast_widens=tuple(widens), bias_grad=_bias_grad(op, par, gemms, grads))


def _bias_grad(op: OpNode, par: list[int], gemms: tuple[Gemm, ...], grads: Sequence[bool] | None
               ) -> tuple[int, int] | None:
    """(rows, width) a linear's bias gradient sums: its GEMM's M x N on this device (a colwise split shards the
    bias with N; rowwise, each rank sums the whole replicated output gradient); None without a 1-D bias that needs
    a gradient."""
    if op.kind != "linear" or len(gemms) != 1:
        return None
    bias = [i for i in par if len(op.input_meta[i].shape) == 1]
    if not bias or (grads is not None and bias[0] < len(grads) and not grads[bias[0]]):
        return None
    _, m, n, _ = gemms[0]
    return int(m), int(n)


def norm_call(op: OpNode, acts: list[int], scale: float, div: int) -> tuple[int, int, int, str] | None:
    """(rows, width, parameters, function) of a layer / RMS norm over its input's last dim on one device (rows:
    the output's elements over the width, times the micro-batch scale, over the split `div`); None for other ops."""
    target = op.target.lower().replace("_", "")
    fn = "layer_norm" if "layernorm" in target else "rms_norm" if "rmsnorm" in target else None
    if op.kind != "norm" or fn is None or not acts or not op.output_meta or not op.input_meta[acts[0]].shape:
        return None
    width = op.input_meta[acts[0]].shape[-1]
    rows = max(1, round(op.output_meta[0].numel * scale / div / width))
    return rows, width, min(len(op.params), 2), fn


def gemm_layout(op: OpNode) -> str:
    """The layout of an op's forward GEMMs (`GEMM_LAYOUTS`): "nt" for F.linear / nn.Linear (x W^T with the weight
    stored [N, K]), "nn" for the rest (an addmm's weight is stored [K, N]; a matmul's operands as traced)."""
    target = op.target.lower()
    return "nt" if op.kind == "linear" and "linear" in target and "bilinear" not in target else "nn"


def backward_gemms(g: Gemm, layout: str = "nn") -> tuple[tuple[Gemm, str], tuple[Gemm, str]]:
    """The two GEMMs of a GEMM's backward with their layouts, as PyTorch's derivative formulas run them: the first
    operand's gradient (M, K, N), dY B^T; the second's A^T dY, (K, N, M) ("tn"), or for F.linear the weight's own
    dY^T x, (N, K, M) ("tn"), with the input's gradient dY W reading the weight as stored ("nn")."""
    b, m, n, k = g
    if layout == "nt":
        return ((b, m, k, n), "nn"), ((b, n, k, m), "tn")
    return ((b, m, k, n), "nt"), ((b, k, n, m), "tn")


def _distinct(graph, scales: Sequence[float], kind: str, field: str) -> list:
    """The distinct non-None `OpWork.<field>` of the graph's ops of `kind` on one device (no split) at each of
    `scales` x its traced batch, in order."""
    out: dict = {}
    for s in scales:
        for op in graph.ops:
            v = getattr(op_work(op, None, 1, s, "fp32"), field) if op.kind == kind else None
            if v is not None:
                out[v] = None
    return list(out)


def graph_norms(graph, scales: Sequence[float] = (1.0,)) -> list[tuple[int, int, int, str]]:
    """The distinct layer / RMS norms (rows, width, parameters, function) of a graph on one device (no split) at
    each of `scales` x its traced batch: what `plan profile --model` times as `norm_shapes`."""
    return _distinct(graph, scales, "norm", "norm")


def graph_bias_grads(graph, scales: Sequence[float] = (1.0,)) -> list[tuple[int, int]]:
    """The distinct bias gradients (rows, width) of a graph's linears, as `graph_norms`: what `plan profile
    --model` times as `reduce_shapes`."""
    return _distinct(graph, scales, "linear", "bias_grad")


def graph_shapes(graph, limit: int = 32, scales: Sequence[float] = (1.0,)
                 ) -> tuple[list[tuple[int, int, int, int, str]], list[Attn]]:
    """The distinct forward and backward GEMMs (batch, M, N, K, layout) and the fused-attention calls of a graph on
    one device (no tp split) at each of `scales` x its traced batch, largest work first, at most `limit` GEMMs per
    scale: what `plan profile --model` times. Several scales give the cost model a measured row near a plan's
    micro-batch, so that it scales a measured time by the shape model over a short step
    (`ComputeModel.gemm_time`): a GEMM of 1024 tokens runs at a fraction of the rate of the same GEMM on 16384."""
    gemms: list[tuple[int, int, int, int, str]] = []
    attns: dict[Attn, None] = {}
    for s in scales:
        work: dict[tuple[int, int, int, int, str], float] = {}
        for op in graph.ops:
            w = op_work(op, None, 1, s, "fp32")
            for g in w.gemms:
                for x, layout in ((g, w.gemm_layout), *backward_gemms(g, w.gemm_layout)):
                    work[(*x, layout)] = work.get((*x, layout), 0.0) + 2.0 * math.prod(x)
            if w.attn is not None and op.kind == "attention":
                attns[w.attn] = None
        gemms += [g for g in sorted(work, key=lambda x: -work[x])[:limit] if g not in gemms]
    return gemms, list(attns)
