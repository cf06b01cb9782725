"""Where a column-parallel Linear's output shard flows, and which ops would compute something else on it.

Each tp rank holds a contiguous block of a colwise Linear's output along its last dim. An op downstream acts the same
on every block as on the whole tensor only if it does not mix positions along that dim. These do:

- splitting, chunking, narrowing, slicing, selecting or unbinding along the sharded dim — `gate, up =
  gate_up(x).chunk(2, dim=-1)` would give rank 0 only gate rows and rank 1 only up rows; nanoGPT's `c_attn(x).split(n,
  dim=2)` is the same;
- concatenating along it, or reducing over it (softmax, norm, sum, mean, max);
- a `view` that factors the sharded dim into an outer factor tp does not divide (`[.., 3h] -> [.., 3, heads,
  head_dim]`: each rank would hold a mix of q, k and v);
- attention reading a tensor sharded anywhere but the heads dim (1), a matmul contracting over it.

The DTensor executor computes all of these correctly, but only by all-gathering the shard (DTensor redistributes to
Replicate), which the cost model does not price. So the search uses this as a pruning filter: a Linear whose colwise
output reaches such an op is not offered colwise (`colwise_refusals`), and a plan that still has one is refused
(`planner.strategies.plan_tp_problems`).

`split_problems` walks the graph from each given colwise Linear, following the sharded dim through views,
transposes and elementwise ops, and names each such op; the walk ends at a consuming Linear, an embedding or the
loss. It reads plain data (an OpGraph and module paths).
"""
from __future__ import annotations

from typing import Iterable, Sequence

SPLITS = frozenset({"split", "split_with_sizes", "chunk", "tensor_split", "narrow", "slice", "select", "unbind",
                    "getitem", "index_select", "hsplit", "vsplit", "dsplit", "gather", "take_along_dim"})
"""Calls that take part of a tensor along a dim (`getitem` on a tensor: indexing; on a tuple: picking an output)."""
JOINS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack"})
"""Calls that join tensors along a dim."""
REDUCES = frozenset({"softmax", "log_softmax", "safe_softmax", "softmin", "sum", "mean", "amax", "amin", "max", "min",
                     "prod", "var", "std", "logsumexp", "cumsum", "cumprod", "norm", "argmax", "argmin", "topk",
                     "sort", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "normalize"})
"""Calls whose result at one position depends on the whole of a dim."""
VIEWS = frozenset({"view", "reshape", "unsafe_view", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view"})
"""Shape changes that keep element order (the sharded dim is followed by prefix products)."""
PERMUTES = frozenset({"transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis"})
"""Dim reorders (followed through their arguments)."""


def callee(target: str) -> str:
    """The bare name of what an op calls: `aten.split.Tensor` -> split, `Tensor.chunk` -> chunk."""
    parts = target.split(".")
    name = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]
    return name.strip("_") or name


def _norm_dim(d, rank: int) -> int | None:
    return d + rank if isinstance(d, int) and not isinstance(d, bool) and d < 0 else \
        d if isinstance(d, int) and not isinstance(d, bool) else None


def _arg(args: tuple, pos: int, name: str, default=None):
    """Argument `name` of an op: keyword pair if given, else positional `pos` (after the tensor), else default."""
    for a in args:
        if isinstance(a, tuple) and len(a) == 2 and a[0] == name:
            return a[1]
    plain = [a for a in args if not (isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str)
                                     and a[0].isidentifier() and a[0] != "slice")]
    return plain[pos] if pos < len(plain) else default


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _through_view(ins: tuple[int, ...], out: tuple[int, ...], d: int, tp: int) -> int | str | None:
    """The output dim holding input dim `d`'s shard after a view, a problem text, or None if not followable (the
    sharded dim merged into an outer dim: batch-like from then on, e.g. `[b, heads, s, hd] -> [b*heads, s, hd]`)."""
    before = _prod(ins[:d])
    for j in range(len(out)):
        at = _prod(out[:j])
        if at > before:
            break
        if at != before or (out[j] == 1 and ins[d] != 1):
            continue
        if out[j] >= ins[d]:
            return j  # the same size, or merged with inner dims: the shard is the outer part
        if out[j] % tp:
            return (f"views the sharded dim (size {ins[d]}) as an outer factor of {out[j]} that tp={tp} does "
                    "not divide, so each rank would hold a mix of the factors")
        return j
    return None


def _through_permute(name: str, args: tuple, rank: int, d: int) -> int | None:
    if name == "t":
        return 1 - d if rank == 2 else d
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (_norm_dim(_arg(args, i, n), rank) for i, n in ((0, "dim0"), (1, "dim1")))
        if a is None or b is None:
            return None
        return b if d == a else a if d == b else d
    if name == "permute":
        dims = _arg(args, 0, "dims")
        dims = dims if isinstance(dims, tuple) else tuple(a for a in args if isinstance(a, int))
        dims = tuple(_norm_dim(x, rank) for x in dims)
        return dims.index(d) if d in dims else None
    src, dst = _arg(args, 0, "source"), _arg(args, 1, "destination")
    if isinstance(src, int) and isinstance(dst, int):
        order = list(range(rank))
        s, t = _norm_dim(src, rank), _norm_dim(dst, rank)
        order.insert(t, order.pop(s))
        return order.index(d)
    return None


def _cut_dims(ins: tuple[int, ...], outs: Iterable[tuple[int, ...]]) -> set[int]:
    """Input dims a split-like op cuts or removes, read off its input and output shapes."""
    cut: set[int] = set()
    for out in outs:
        if len(out) == len(ins):
            cut |= {i for i, (a, b) in enumerate(zip(ins, out)) if a != b}
        elif len(out) < len(ins):
            k = len(ins) - len(out)
            cut |= {j for j in range(len(ins) - k + 1) if ins[:j] + ins[j + k:] == out for j in range(j, j + k)}
        else:
            cut |= set(range(len(ins)))
    return cut


def _step(op, src_shape: tuple[int, ...], d: int, tp: int, is_tuple_pick: bool, operand: int) -> int | str | None:
    """Follow the shard on dim `d` of input number `operand` through `op`: the output's sharded dim, a problem
    (str), or None when the shard ends here (a consuming Linear, the loss) or cannot be followed."""
    name = callee(op.target)
    out = op.output_meta[0].shape if op.output_meta else ()
    rank = len(src_shape)
    if op.kind in ("linear", "loss", "embedding"):
        return None
    if is_tuple_pick:
        return d
    if name in SPLITS:
        if len(out) > rank:
            return None
        cut = _cut_dims(src_shape, (m.shape for m in op.output_meta))
        if d in cut:
            return f"{name}s it along the sharded dim {d}, so each rank would {name} only its own shard"
        return d if len(out) == rank else d - sum(1 for c in cut if c < d)
    if name in JOINS:
        dim = _norm_dim(_arg(op.args, 0, "dim", 0), len(out) if name == "stack" else rank)
        if name not in ("stack",) and dim == d:
            return f"concatenates along the sharded dim {d}, so the ranks' shards would interleave"
        return d + (1 if name == "stack" and dim is not None and dim <= d else 0)
    if name in REDUCES or op.kind in ("norm", "softmax"):
        dim = _arg(op.args, 0, "dim")
        if op.kind == "norm":
            normed = max((len(p.shape) for p in op.params), default=1)
            hit = d >= rank - normed
        elif isinstance(dim, int):
            hit = _norm_dim(dim, rank) == d
        elif isinstance(dim, tuple):
            hit = d in {_norm_dim(x, rank) for x in dim if isinstance(x, int)}
        else:
            hit = name not in ("softmax", "log_softmax", "safe_softmax", "softmin") or d == rank - 1
        if hit:
            return f"reduces over the sharded dim {d} ({name}), so each rank would see only its own shard"
        return d if len(out) == rank else None
    if op.kind == "attention":
        if d != 1:
            return f"attends over a tensor sharded on dim {d}; only the heads dim (1) can be sharded"
        return 1
    if op.kind == "matmul" and rank >= 2:
        second = operand == 1
        if d == rank - (2 if second else 1):
            return f"contracts over the sharded dim {d}, so each rank would sum only its own shard's terms"
        return d if len(out) == rank else None
    if name in VIEWS:
        return _through_view(src_shape, out, d, tp)
    if name in PERMUTES:
        return _through_permute(name, op.args[1:], rank, d)
    if len(out) >= rank and out[len(out) - rank + d] == src_shape[d]:
        return d + len(out) - rank  # elementwise (broadcast aligns trailing dims), contiguous, clone, dropout
    return None


def split_problems(graph, colwise: Iterable[str], tp: int) -> list[tuple[str, str]]:
    """(module of the colwise Linear, problem) for each op that would compute a different function on the local
    shards of these colwise Linears' outputs (module paths), one entry per offending op."""
    return [(module, problem) for module, problem, _ in _walk(graph, colwise, tp)]


def _walk(graph, colwise: Iterable[str], tp: int):
    """Yield (module of the colwise Linear, problem, the offending OpNode) for `split_problems`."""
    users: dict[str, list] = {}
    for op in graph.ops:
        for s in op.inputs:
            users.setdefault(s, []).append(op)
    colwise = set(colwise)
    by_name = {op.name: op for op in graph.ops}
    for start in graph.ops:
        if start.kind != "linear" or start.module_path not in colwise or not start.output_meta:
            continue
        stack = [(start.name, len(start.output_meta[0].shape) - 1)]
        seen: set[str] = {start.name}
        while stack:
            name, d = stack.pop()
            src = by_name[name]
            for op in users.get(name, ()):
                if op.name in seen:
                    continue
                shape, pick = _input_shape(op, src)
                if shape is None or d >= len(shape):
                    continue
                res = _step(op, shape, d, tp, pick, op.inputs.index(name))
                if isinstance(res, str):
                    yield (start.module_path, f"op {op.name} ({op.target}) in {op.module_path or '<root>'} reads "
                                              f"the colwise output of {start.module_path} and {res}", op)
                elif res is not None:
                    seen.add(op.name)
                    stack.append((op.name, res))


def _input_shape(op, src) -> tuple[tuple[int, ...] | None, bool]:
    """The shape `op` reads from producer `src`, and whether `op` merely picks one output of a multi-output `src`
    (tuple indexing after split/chunk)."""
    outs = [m.shape for m in src.output_meta]
    if len(outs) > 1 and callee(op.target) == "getitem" and op.output_meta and op.output_meta[0].shape in outs:
        return op.output_meta[0].shape, True
    for m in op.input_meta:
        if m.shape in outs:
            return m.shape, False
    return (outs[0] if outs else None), False


def colwise_refusals(graph, tp: int) -> dict[str, tuple[str, str]]:
    """Module path of every Linear whose colwise output an op would misread at this tp -> (the first such problem,
    the module path of the op that misreads it). Each Linear is walked on its own (`split_problems`), so the answer
    for one does not depend on how the others are placed."""
    linears = {op.module_path for op in graph.ops if op.kind == "linear"}
    refused: dict[str, tuple[str, str]] = {}
    for module, problem, op in _walk(graph, linears, tp):
        refused.setdefault(module, (problem, op.module_path))
    return refused


PASS_PARTIAL = VIEWS | PERMUTES | SPLITS | frozenset({"contiguous", "clone", "alias", "detach"})
"""Calls a rowwise Linear's partial sums pass through unreduced (linear in their input): followed by
`partial_refusals`."""


def partial_refusals(graph) -> dict[str, tuple[str, str]]:
    """Module path of every Linear whose rowwise output (a partial sum over tp, `P`) reaches attention through
    views, transposes, splits and elementwise ops only (no Linear, norm or reduction between) -> (the problem, the
    module path of the attention op).

    The plan prices the reduction where the ILP put it (on the first op that wants R); under the executor the ops
    in between are not module calls, so DTensor decides where and how to reduce, and for attention it picks a
    reduce-scatter onto the batch dim the plan does not price (and views after it then see local shapes). Like
    `colwise_refusals`, a pruning filter: such a Linear is not offered rowwise (nanoGPT's fused `c_attn`)."""
    users: dict[str, list] = {}
    for op in graph.ops:
        for s in op.inputs:
            users.setdefault(s, []).append(op)
    refused: dict[str, tuple[str, str]] = {}
    for start in graph.ops:
        if start.kind != "linear" or start.module_path in refused:
            continue
        stack, seen = [start.name], {start.name}
        while stack:
            for op in users.get(stack.pop(), ()):
                if op.name in seen:
                    continue
                seen.add(op.name)
                if op.kind == "attention":
                    refused[start.module_path] = (
                        f"op {op.name} ({op.target}) in {op.module_path or '<root>'} reads the rowwise (partial-sum) "
                        f"output of {start.module_path} with no Linear or norm between, so DTensor would reduce it "
                        "there by its own choice, not as the plan prices it", op.module_path)
                    stack.clear()
                    break
                if callee(op.target) in PASS_PARTIAL or op.kind in ("elementwise", "dropout"):
                    stack.append(op.name)
    return refused
