"""What DTensor's own sharding propagation does with one op: the placements every candidate is checked against.

`propagate(op, inputs, params, tp)` rebuilds the op's call from the `OpNode` alone (its target, non-tensor
arguments and tensor shapes), makes every tensor argument a meta-device DTensor on a tp-sized mesh built without a
process group (`DeviceMesh(..., _init_backend=False)`), with the given placement, and runs the call through
DTensor's dispatcher, exactly as the executor runs it on real DTensors. The answer is what DTensor decided:

- `output`: the placement of the op's (first) tensor output, in the plan's shorthand `R`, `S(d)`, `P`;
- `redistributes`: the redistributions with communication DTensor would do before computing (its op strategy
  wants another placement of an input, a parameter or an intermediate of a composite op); `local`: producer-fed
  inputs it would re-place without communication (R -> S slice). A redistribution is recorded, not performed: the
  dispatcher's `redistribute_local_tensor` is swapped for one that returns an empty meta tensor of the target's
  local shape while `propagate` runs, so no collective is issued and no process group is needed.

Where the call comes from: fx `call_function` / `call_method` targets (`F.gelu`, `torch.cat`, `operator.add`,
`Tensor.view`) and torch.export's aten ops (`aten.mm.default`) are called as they are; built-in leaf modules as
their functional form with the module's parameters (`nn.Linear` -> `F.linear`, `nn.Embedding` -> `F.embedding`,
`nn.LayerNorm` -> `F.layer_norm`, `nn.RMSNorm` -> `F.rms_norm`, dropout and activation modules). Anything else (a
custom function or module, a module whose constructor arguments shapes cannot tell, an op DTensor has no sharding
rule for) gives None: the op cannot be checked, and `planner.strategies` keeps it replicated.

Which tensor gets which placement: the tensor producer k (`OpNode.inputs[k]`) feeds takes `inputs[k]` (which tensor
that is: `OpNode.input_sources`; where not recorded, the k-th activation tensor, i.e. tensor argument that is not a
parameter, in call order); a parameter takes `params[j]` (`OpNode.params` order). Tensors with no producer (model
inputs, buffers, constants) are replicated, as the executor holds them.

Results are cached by (target, kind, shapes, dtypes, arguments, producers and which tensors they feed, placements,
tp): repeated blocks cost one run per distinct op.
"""
from __future__ import annotations

import contextlib
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from planner.graph import OpNode, TensorMeta

_WEIGHTLESS_MODULES = {
    "Dropout": lambda x: F.dropout(x, 0.1, training=True),
    "Dropout1d": lambda x: F.dropout1d(x, 0.1, training=True),
    "Dropout2d": lambda x: F.dropout2d(x, 0.1, training=True),
    "Identity": lambda x: x,
    "Flatten": lambda x: torch.flatten(x, 1),
}
"""Parameterless built-in modules (the dropout probability does not change placements)."""

_ACTIVATIONS = frozenset({"ReLU", "ReLU6", "GELU", "SiLU", "Tanh", "Sigmoid", "Mish", "ELU", "SELU", "LeakyReLU",
                          "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softsign", "Tanhshrink", "CELU",
                          "GLU"})
"""Activation modules built with their defaults (pointwise: their arguments do not change placements)."""


@dataclass(frozen=True)
class Propagation:
    """What DTensor did with one op under given input and parameter placements."""

    output: str | None
    """Placement of the first tensor output (`R`, `S(d)`, `P`); None when the op returns no tensor or DTensor
    gave a placement the plan cannot state (a strided shard)."""
    redistributes: tuple[str, ...] = ()
    """One entry per redistribution DTensor would do with communication (from a shard or a partial sum) before
    computing, e.g. `input 0 S(1) -> R`; empty: the op runs on the placements as given, with no collective."""
    local: tuple[tuple[int, str], ...] = ()
    """(k, placement) per producer-fed input k stated R that DTensor slices locally to a shard before computing
    (no communication; its gradient is all-gathered in backward): the op runs, but reads that input sharded."""

    @property
    def runs_as_placed(self) -> bool:
        """DTensor computes the op on exactly these placements and gives a stateable output placement."""
        return not self.redistributes and self.output is not None


def propagate(op: OpNode, inputs: Sequence[str], params: Sequence[str], tp: int) -> Propagation | None:
    """DTensor's propagation for `op` with its producers' tensors placed `inputs` and its parameters `params` over
    a tp axis of size `tp` (see the module docstring); None when DTensor cannot run the op (no callable we can
    rebuild, no sharding rule, a custom op)."""
    key = (signature(op), tuple(inputs), tuple(params), tp)
    if key not in _CACHE:
        _CACHE[key] = _propagate(op, tuple(inputs), tuple(params), tp)
    return _CACHE[key]


_CACHE: dict[tuple, Propagation | None] = {}


def signature(op: OpNode) -> tuple:
    """Everything about `op` that decides its propagation (not its name or module path): a cache key."""
    return (op.target, op.kind, tuple((m.shape, m.dtype) for m in op.input_meta),
            tuple((p.shape, p.dtype) for p in op.params), op.args, len(op.inputs), op.input_sources)


def cache_size() -> int:
    """Entries in the propagation cache (for reports and tests)."""
    return len(_CACHE)


# ---- one run ----------------------------------------------------------------------------------------------------

def _propagate(op: OpNode, inputs: tuple[str, ...], params: tuple[str, ...], tp: int) -> Propagation | None:
    call = _call_of(op)
    if call is None:
        return None
    fn, n_tensors, build = call
    metas = op.input_meta
    if n_tensors != len(metas):
        return None
    roles = _roles(op)
    mesh = _mesh(tp)
    if mesh is None:
        return None
    tensors, owner = [], {}
    for i, meta in enumerate(metas):
        role, k = roles[i]
        text = (params[k] if k < len(params) else "R") if role == "param" else \
            (inputs[k] if role == "input" and k < len(inputs) else "R")
        t = _dtensor(meta, text, mesh)
        if t is None:
            return None
        tensors.append(t)
        owner[id(t._local_tensor)] = (role, k, i)
    moves: list[str] = []
    local: list[tuple[int, str]] = []
    try:
        with _recording(moves, local, owner), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.distributed.tensor.experimental import implicit_replication
            with implicit_replication():
                out = build(fn, tensors)
    except Exception:
        return None
    return Propagation(output=_output_placement(out), redistributes=tuple(moves), local=tuple(local))


def _roles(op: OpNode) -> list[tuple[str, int]]:
    """Per tensor of `op.input_meta`: ("param", j) for `op.params[j]`, ("input", k) for the tensor fed by producer
    k, or ("other", 0) for a tensor with no producer. Module calls list the module's parameters last; function
    calls read them in call order (matched by shape, first match first). Which tensor a producer feeds is
    `op.input_sources` where the tracer recorded it (a buffer or model input may come first, a keyword argument
    anywhere), else the k-th activation tensor is producer k's."""
    metas = op.input_meta
    n_par = len(op.params)
    if len(op.input_sources) == len(metas) and _module_class(op) is None:
        left = [(j, p.shape) for j, p in enumerate(op.params)]
        roles: list[tuple[str, int]] = []
        for m, k in zip(metas, op.input_sources):
            hit = next((x for x in left if x[1] == m.shape), None) if k < 0 else None
            if hit is not None:
                left.remove(hit)
            roles.append(("input", k) if k >= 0 else ("param", hit[0]) if hit is not None else ("other", 0))
        return roles
    roles: list[tuple[str, int]] = []
    if _module_class(op) is not None:
        acts = len(metas) - n_par
        roles = [("act", 0)] * acts + [("param", j) for j in range(n_par)]
    else:
        left = [(j, p.shape) for j, p in enumerate(op.params)]
        for m in metas:
            hit = next((x for x in left if x[1] == m.shape), None)
            if hit is not None:
                left.remove(hit)
                roles.append(("param", hit[0]))
            else:
                roles.append(("act", 0))
    n_prod = len(op.inputs)
    out, k = [], 0
    first_shape = None
    for role, j in roles:
        if role == "param":
            out.append((role, j))
            continue
        meta = metas[len(out)]
        if k < n_prod:
            out.append(("input", k))
            first_shape = meta.shape if k == 0 else first_shape
        elif n_prod == 1 and meta.shape == first_shape:
            out.append(("input", 0))  # the one producer's tensor read twice (x * x), or its tuple's parts
        else:
            out.append(("other", 0))
        k += 1
    return out


_MESHES: dict[int, Any] = {}


MESH_DIM = "shardwise_propagation"
"""The dim name of the propagation meshes. Meshes of equal shape, device and dim names compare equal, and DTensor
caches its sharding decisions (which hold the mesh) by such equality: under a name no real mesh has, a decision
made here is never reused by a real (or dry-run) DTensor program in this process, which would then look for this
mesh's process groups."""


def _mesh(tp: int):
    """A 1-d CPU mesh of `tp` ranks seen from rank 0, with no process group behind it (None where this torch build
    has no torch.distributed: then nothing can be checked, and every op stays replicated)."""
    if tp not in _MESHES:
        import torch.distributed as dist
        if not dist.is_available():
            _MESHES[tp] = None
        else:
            from torch.distributed.device_mesh import DeviceMesh
            _MESHES[tp] = DeviceMesh("cpu", list(range(tp)), mesh_dim_names=(MESH_DIM,), _init_backend=False,
                                     _rank=0)
    return _MESHES[tp]


def _placement(text: str, ndim: int):
    from torch.distributed.tensor import Partial, Replicate, Shard
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S(") and text.endswith(")"):
        d = int(text[2:-1])
        d = d + ndim if d < 0 else d
        return Shard(d) if 0 <= d < ndim else None
    return None


def _dtensor(meta: TensorMeta, text: str, mesh):
    """A meta-device DTensor of this global shape and dtype with placement `text` (None for an invalid one)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as DTMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placement = _placement(text, len(meta.shape))
    if placement is None:
        return None
    dtype = getattr(torch, meta.dtype)
    full = torch.empty(meta.shape, dtype=dtype, device="meta")
    local_shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, [placement])
    local = torch.empty(local_shape, dtype=dtype, device="meta")
    spec = DTensorSpec(mesh, (placement,), tensor_meta=DTMeta(full.shape, full.stride(), dtype))
    return DTensor(local, spec, requires_grad=False)


def placement_text(p) -> str | None:
    """A DTensor placement in the plan's shorthand (`R`, `S(d)`, `P`); None for one it cannot state."""
    from torch.distributed.tensor import Replicate, Shard
    if isinstance(p, Replicate):
        return "R"
    if p.is_partial():
        return "P"
    if type(p) is Shard:
        return f"S({p.dim})"
    return None


def _output_placement(out: Any) -> str | None:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten
    for t in tree_flatten(out)[0]:
        if isinstance(t, DTensor):
            return placement_text(t.placements[0])
        if isinstance(t, torch.Tensor):
            return "R"  # a plain tensor: the executor treats it as replicated
    return None


@contextlib.contextmanager
def _recording(moves: list[str], local: list[tuple[int, str]], owner: dict[int, tuple[str, int, int]]):
    """While active, DTensor's input redistributions are recorded instead of performed (the result is an empty
    meta tensor of the target's local shape): one that communicates (from S or P) in `moves`; a local slice (R ->
    S) of a producer-fed input in `local`. Other local ones (from R) are how DTensor computes the op, not a change
    of the plan's placements (a rowwise Linear's bias R -> P, an embedding's ids under a vocabulary shard, a slice
    of a replicated buffer): not recorded."""
    from torch.distributed.tensor import _dispatch
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    real = _dispatch.redistribute_local_tensor

    def record(local_tensor, current, target, *args, **kwargs):
        role, k, _ = owner.get(id(local_tensor), ("intermediate", 0, 0))
        src, dst = placement_text(current.placements[0]), placement_text(target.placements[0])
        if src != "R":
            moves.append(f"{role} {k} {src} -> {dst}")
        elif role == "input" and dst is not None and dst.startswith("S("):
            local.append((k, dst))
        shape, _ = compute_local_shape_and_global_offset(target.shape, target.mesh, target.placements)
        return torch.empty(shape, dtype=local_tensor.dtype, device="meta")

    _dispatch.redistribute_local_tensor = record
    try:
        yield
    finally:
        _dispatch.redistribute_local_tensor = real


# ---- rebuilding the call ------------------------------------------------------------------------------------------

def _module_class(op: OpNode) -> str | None:
    """The class name of a built-in module call (`torch.nn.Linear` -> `Linear`), else None."""
    t = op.target
    if t.startswith("torch.nn.") and "." not in t[len("torch.nn."):]:
        return t[len("torch.nn."):]
    return None


Build = Callable[[Callable[..., Any], list], Any]


def _call_of(op: OpNode) -> tuple[Callable[..., Any], int, Build] | None:
    """(callable, number of tensors it takes, how to call it with the DTensors) for `op`, or None."""
    cls = _module_class(op)
    if cls is not None:
        return _module_call(op, cls)
    fn = _function(op.target)
    if fn is None:
        return None
    args, kwargs = _split_args(op.args)
    n = _count_tensors((args, kwargs))
    method = op.target.startswith("Tensor.")

    def build(f, tensors):
        it = iter(tensors)
        a = _fill(args, it)
        k = {name: _fill(v, it) for name, v in kwargs}
        if method:
            return getattr(a[0], f)(*a[1:], **k)
        return f(*a, **k)
    return fn, n, build


def _module_call(op: OpNode, cls: str) -> tuple[Callable[..., Any], int, Build] | None:
    """Functional form of a built-in leaf module (one activation input, its parameters after it)."""
    n = len(op.input_meta)
    shapes = [p.shape for p in op.params]
    if n != 1 + len(shapes):
        return None
    if cls == "Linear" and len(shapes) in (1, 2):
        return F.linear, n, lambda f, t: f(*t)
    if cls == "Embedding" and len(shapes) == 1:
        return F.embedding, n, lambda f, t: f(*t)
    if cls == "LayerNorm":
        norm_shape = shapes[0] if shapes else None
        if norm_shape is None:
            return None
        return F.layer_norm, n, lambda f, t: f(t[0], norm_shape, *t[1:])
    if cls == "RMSNorm" and len(shapes) == 1:
        return F.rms_norm, n, lambda f, t: f(t[0], shapes[0], t[1])
    if not shapes and cls in _WEIGHTLESS_MODULES:
        fn = _WEIGHTLESS_MODULES[cls]
        return fn, n, lambda f, t: f(t[0])
    if not shapes and cls in _ACTIVATIONS:
        module = getattr(torch.nn, cls)()
        return module, n, lambda f, t: f(t[0])
    return None


def _function(target: str) -> Callable[..., Any] | str | None:
    """The callable a readable target names (`F.gelu`, `torch.cat`, `operator.add`, `aten.mm.default`), or the
    method name for `Tensor.view`; None for anything else (a custom function)."""
    head, _, rest = target.partition(".")
    if not rest:
        return None
    if head == "Tensor":
        return rest if hasattr(torch.Tensor, rest) else None
    if head == "F":
        return getattr(F, rest, None)
    if head == "operator":
        return getattr(operator, rest, None)
    if head == "torch" and "." not in rest:
        return getattr(torch, rest, None)
    if head == "aten":
        name, _, overload = rest.partition(".")
        packet = getattr(torch.ops.aten, name, None)
        return getattr(packet, overload or "default", None) if packet is not None else None
    return None


def _is_kwarg(a: Any) -> bool:
    return isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and a[0].isidentifier() \
        and a[0] not in ("T", "slice")


def _split_args(args: tuple) -> tuple[tuple, tuple]:
    """`OpNode.args` into (positional, keyword pairs): keyword pairs come last."""
    n = len(args)
    while n and _is_kwarg(args[n - 1]):
        n -= 1
    return args[:n], args[n:]


def _count_tensors(x: Any) -> int:
    if x == "T":
        return 1
    if isinstance(x, tuple):
        if len(x) == 4 and x[0] == "slice":
            return 0
        return sum(_count_tensors(v) for v in x)
    return 0


def _fill(x: Any, tensors) -> Any:
    """An `OpNode.args` value back as a call argument: `T` -> the next tensor, slices, Ellipsis and dtypes back."""
    if x == "T":
        return next(tensors)
    if x == "...":
        return Ellipsis
    if isinstance(x, str) and x.startswith("torch."):
        return getattr(torch, x[len("torch."):], x)
    if isinstance(x, tuple):
        if len(x) == 4 and x[0] == "slice":
            return slice(*(_fill(v, tensors) for v in x[1:]))
        return tuple(_fill(v, tensors) for v in x)
    return x
