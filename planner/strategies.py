"""Candidate placements per op: the per-op half of the search space (FlexFlow's SOAP in DTensor placements).

Where a candidate comes from, and who has the last word:

1. The hand registry proposes: a rule registered per `OpNode.kind` with `@register(kind)` (autoparallel's
   `@register_rule` idiom) returns the `OpPlacement`s an op may take over a tensor-parallel axis of size `tp`.
2. For the kinds where DTensor runs more layouts than the registry names (`ENUMERATED_KINDS`: elementwise, dropout,
   views/transposes/splits, matmul, softmax; and reductions such as `mean`), every combination of input placements
   (R, or S(d) on a non-batch dim tp divides) is proposed as well.
3. DTensor decides (`planner.dtensor_rules.propagate`: DTensor's own sharding propagation run on meta DTensors):
   a candidate is kept only if DTensor computes the op on those placements without a redistribution that
   communicates; its output placement is DTensor's (a registry candidate whose stated output differs is corrected
   to DTensor's), and so is an input DTensor slices locally (R -> S: the edge then prices the backward all-gather).
   Enumerated candidates must read their inputs exactly as stated.
4. The registry prunes what DTensor would run but the search must not use: dim 0 (the batch, which dp shards)
   never sharded over tp, sharded sizes divisible by tp, partial (`P`) outputs only where the registry proposes
   them (rowwise Linear, vocabulary-parallel embedding), no enumeration for ops that read parameters.

An op DTensor cannot run on meta (a custom function or module, no sharding rule) gets `replicate` only, which is
always valid and always first. Placements use DTensor's shorthand with non-negative dims: `R`, `S(d)`, `P`.

Communication between ops is never hidden inside a strategy: each strategy states the layout it *requires* of each
activation input and the layout it *produces*, and the search prices every mismatch on a graph edge with the cost
model's `reshard_time`. So Megatron's sequence-parallel pair is expressed as edges: a `sequence` norm (output S(1))
feeding a `colwise` linear (input R) is an all-gather S(1)->R on that edge, and a `rowwise` linear (output P)
feeding a `sequence` norm (input S(1)) is a reduce-scatter P->S(1).

Registry rules by kind (each filtered by divisibility of the sharded size by tp):

- linear: replicate; colwise (weight S(0), bias S(0), input R, output S(last)); rowwise (weight S(1), bias R, input
  S(last), output P).
- embedding: replicate; vocab (weight S(0), input R, output P).
- norm: replicate; sequence (input/output S(1), parameters R).
- elementwise, dropout: replicate; sequence (S(1)); shard (follow the input: S(last) in, S(last) out).
- attention, matmul, softmax: replicate; heads (S(1) on [batch, heads, seq, head_dim] tensors).
- reshape (view, transpose, permute, contiguous): replicate; shard, following the input's sharded dim through the
  shape change where that dim maps onto one output dim.

Enumerated candidates are named `sequence` (elementwise/dropout/reduction with output S(1) on a tensor of rank >= 3,
as the registry names them), `heads` (attention with output S(1)), `partial` (an elementwise or reshape op reading
a partial sum its producer can output, `partial_inputs`, with output P: DTensor runs only ops linear in it so) or
`shard`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from planner import dtensor_rules
from planner.graph import OpNode
from planner.plan import OpPlacement
from planner.shard_flow import REDUCES, callee, split_problems

Rule = Callable[[OpNode, int], list[OpPlacement]]
"""A strategy rule: (op, tp degree) -> the placements it may take (replicate included)."""

_RULES: dict[str, Rule] = {}


def register(*kinds: str) -> Callable[[Rule], Rule]:
    """Decorator registering a rule for one or more op kinds."""
    def wrap(rule: Rule) -> Rule:
        for kind in kinds:
            _RULES[kind] = rule
        return rule
    return wrap


def registered_kinds() -> tuple[str, ...]:
    """Op kinds that have a rule other than the replicate-only fallback."""
    return tuple(sorted(_RULES))


def strategies_for(op: OpNode, tp: int, partial_inputs: frozenset[int] = frozenset()) -> list[OpPlacement]:
    """All candidate placements of `op` over a tp axis of size `tp` (see the module docstring); replicate is
    always first. With tp == 1 every strategy is the same computation, so only replicate is returned.
    `partial_inputs`: positions k of `op.inputs` whose producer can output a partial sum (`partial_inputs`):
    an elementwise or reshape op may then read them as `P`."""
    rep = replicate(op)
    if tp <= 1:
        return [rep]
    partial = frozenset(partial_inputs) if op.kind in PARTIAL_KINDS else frozenset()
    key = (dtensor_rules.signature(op), tuple(m.shape for m in op.output_meta), tp, partial)
    checked = _CHECKED.get(key)
    if checked is None:
        checked = _CHECKED[key] = tuple(_checked(op, tp, partial))
    return [rep] + [replace(p, module=op.module_path) for p in checked]


def partial_inputs(graph, tp: int) -> dict[str, frozenset[int]]:
    """Per op name, the positions of its inputs whose producer has a candidate with a plain partial-sum output
    (a rowwise Linear, or an elementwise/reshape op of such partials), walking the graph in order.

    Not offered: a vocabulary-parallel embedding's output (a masked partial, which the executor reduces before it
    meets other partial sums), and, for an op in a repeated block, a producer outside its block instance (the
    block's ILP is solved once for every copy, and its edges from outside are priced against fixed producers)."""
    out: dict[str, frozenset[int]] = {}
    gives_partial: set[str] = set()
    by_name = {op.name: op for op in graph.ops}
    for op in graph.ops:
        ks = frozenset(k for k, src in enumerate(op.inputs) if src in gives_partial and
                       (op.block is None or by_name[src].block == op.block))
        if ks:
            out[op.name] = ks
        if op.kind != "embedding" and any(p.output == "P" for p in strategies_for(op, tp, ks)):
            gives_partial.add(op.name)
    return out


_CHECKED: dict[tuple, tuple[OpPlacement, ...]] = {}
"""`strategies_for`'s non-replicate candidates per (op signature, output shapes, tp): blocks repeat."""

ENUMERATED_KINDS = frozenset({"elementwise", "dropout", "reshape", "matmul", "softmax", "attention"})
"""Kinds whose input placements are enumerated and checked with DTensor (beyond the registry's proposals);
attention's inputs (q, k, v, a mask) are enumerated jointly (one placement for all)."""

PARTIAL_KINDS = frozenset({"elementwise", "reshape"})
"""Kinds that may read a partial-sum input (kept only where DTensor propagates a partial output: an op linear in
that input, e.g. add, neg, a mul by a replicated factor, a view; a nonlinear one, e.g. gelu, would all-reduce)."""

MAX_ENUMERATED = 64
"""At most this many input combinations are tried per op (a bound on ops with many inputs, e.g. a wide cat)."""


def _checked(op: OpNode, tp: int, partial: frozenset[int] = frozenset()) -> list[OpPlacement]:
    """The non-replicate candidates DTensor confirms: registry proposals, then enumerated ones (module docstring)."""
    rep = replicate(op)
    base = dtensor_rules.propagate(op, rep.inputs, rep.params, tp)
    if base is None or not base.runs_as_placed:
        return []  # DTensor cannot run it on meta (no rule, a custom op): replicate only
    out: list[OpPlacement] = []
    seen = {_layout(rep)}
    rule = _RULES.get(op.kind)
    for p in (rule(op, tp) if rule is not None else []):
        if p.strategy == "replicate" or _layout(p) in seen or any(x != "R" for x in p.inputs[len(op.inputs):]):
            continue  # (an input no producer feeds is replicated, whatever the rule says)
        r = dtensor_rules.propagate(op, p.inputs, p.params, tp)
        if r is None or not r.runs_as_placed or not _keeps(op, r.output, p.output, tp):
            continue
        q = p if r.output == p.output else replace(p, output=r.output)
        if r.local:
            ins = list(q.inputs)
            for k, where in r.local:
                ins[k] = where
            q = replace(q, inputs=tuple(ins))
        if _layout(q) not in seen:
            seen.add(_layout(q))
            out.append(q)
    if _enumerated(op):
        combos = _joint_combinations(op, tp) if op.kind == "attention" else _input_combinations(op, tp, partial)
        for inputs in combos:
            r = dtensor_rules.propagate(op, inputs, (), tp)
            reads_partial = "P" in inputs
            if r is None or not r.runs_as_placed or r.local or \
                    not _keeps(op, r.output, "P" if reads_partial else None, tp) or \
                    (reads_partial and r.output != "P"):
                continue  # (partial inputs: only an op linear in them, whose output is a partial sum)
            name = "sequence" if op.kind in ("elementwise", "dropout", "other") and r.output == "S(1)" and \
                out_rank(op) >= 3 else "heads" if op.kind == "attention" and r.output == "S(1)" else \
                "partial" if reads_partial else "shard"
            q = OpPlacement(strategy=name, module=op.module_path, inputs=inputs, output=r.output)
            if _layout(q) not in seen:
                seen.add(_layout(q))
                out.append(q)
    return out


def _layout(p: OpPlacement) -> tuple:
    return (p.inputs, p.output, p.params)


def _keeps(op: OpNode, output: str | None, proposed: str | None, tp: int) -> bool:
    """The registry's pruning of an output placement DTensor propagated: never the batch dim (0), a sharded size
    tp divides, a partial sum only where proposed (by the registry, or by an enumerated candidate of a
    `PARTIAL_KINDS` op reading a partial input)."""
    if output is None:
        return False
    if output == "P":
        return proposed == "P"
    if output.startswith("S("):
        return _divisible(op, int(output[2:-1]), tp) and output != "S(0)"
    return True


def _enumerated(op: OpNode) -> bool:
    """Whether `op`'s input placements are enumerated: an `ENUMERATED_KINDS` op, or a reduction left as `other`
    (a hand-written RMSNorm's `mean` over the hidden dim runs on a sequence shard), reading no parameters."""
    return not op.params and (op.kind in ENUMERATED_KINDS or (op.kind == "other" and callee(op.target) in REDUCES))


def _input_combinations(op: OpNode, tp: int, partial: frozenset[int] = frozenset()) -> list[tuple[str, ...]]:
    """Every tuple of placements of the producer-fed inputs with something sharded or partial: each R, S(d) on a
    dim d >= 1 whose size tp divides, or P for an input in `partial` (at most `MAX_ENUMERATED`, in a fixed order,
    the combinations with a P first so that the cap never drops them; none for an op no producer feeds)."""
    if not op.inputs:
        return []
    shapes = _activation_shapes(op)
    options = []
    for k in range(len(op.inputs)):
        shape = shapes[k] if k < len(shapes) else ()
        options.append(["R"] + [shard(d) for d in range(1, len(shape)) if shape[d] >= tp and shape[d] % tp == 0])
    with_p = [c for c in itertools.islice(itertools.product(*[["P", "R"] if k in partial else ["R"]
                                                              for k in range(len(options))]), MAX_ENUMERATED + 1)
              if "P" in c]
    combos = [c for c in itertools.islice(itertools.product(*options), MAX_ENUMERATED + 1) if set(c) != {"R"}]
    return (with_p + combos)[:MAX_ENUMERATED]


def _joint_combinations(op: OpNode, tp: int) -> list[tuple[str, ...]]:
    """Attention's inputs (q, k, v and a mask, when producers feed them) all take one placement: S(d) on a dim
    d >= 1 that tp divides in every input of that rank; an input with another rank, or broadcast on d (a mask of
    one head), stays R. A joint enumeration (one candidate per dim), not a product."""
    shapes = _activation_shapes(op)[:len(op.inputs)]
    if not shapes:
        return []
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(1, rank):
        sizes = [s[d] for s in shapes if len(s) == rank and s[d] > 1]
        if not sizes or any(n < tp or n % tp for n in sizes):
            continue
        out.append(tuple(shard(d) if len(s) == rank and s[d] > 1 else "R" for s in shapes)
                   + ("R",) * (len(op.inputs) - len(shapes)))
    return out


# ---- helpers ----------------------------------------------------------------------------------------------------

def shard(dim: int) -> str:
    """The placement string sharding tensor dim `dim`."""
    return f"S({dim})"


def n_inputs(op: OpNode) -> int:
    """Number of activation inputs (graph edges) of the op; at least 1 so a placement always names one."""
    return max(1, len(op.inputs))


def out_rank(op: OpNode) -> int:
    """Rank of the op's first output (0 if it has none)."""
    return len(op.output_meta[0].shape) if op.output_meta else 0


def _activation_shapes(op: OpNode) -> list[tuple[int, ...]]:
    """Shapes of the op's activation inputs: per producer where the tracer recorded which tensor each feeds
    (`OpNode.input_sources`), else input_meta minus the parameters, in call order."""
    if op.inputs and len(op.input_sources) == len(op.input_meta):
        return [next((m.shape for m, s in zip(op.input_meta, op.input_sources) if s == k), ())
                for k in range(len(op.inputs))]
    param_shapes = [p.shape for p in op.params]
    shapes = []
    for m in op.input_meta:
        if m.shape in param_shapes:
            param_shapes.remove(m.shape)
            continue
        shapes.append(m.shape)
    return shapes


def replicate(op: OpNode) -> OpPlacement:
    """Everything replicated over tp: every tp rank computes the whole op."""
    return OpPlacement(strategy="replicate", module=op.module_path, inputs=("R",) * n_inputs(op), output="R",
                       params=("R",) * len(op.params))


def _follow(op: OpNode, out_dim: int) -> tuple[str, ...]:
    """Input placements for an elementwise op whose output is sharded on `out_dim`: each input is sharded on the
    dim broadcasting aligns with it (trailing alignment), or R where that dim is broadcast or absent."""
    shapes = _activation_shapes(op)
    rank = out_rank(op)
    out_size = op.output_meta[0].shape[out_dim]
    placements = []
    for k in range(n_inputs(op)):
        shape = shapes[k] if k < len(shapes) else ()
        d = out_dim - (rank - len(shape))
        placements.append(shard(d) if d >= 0 and shape[d] == out_size else "R")
    return tuple(placements)


def _divisible(op: OpNode, dim: int, tp: int) -> bool:
    """Whether the output's size on `dim` exists and divides by tp."""
    if not op.output_meta or dim < 0 or dim >= out_rank(op):
        return False
    size = op.output_meta[0].shape[dim]
    return size >= tp and size % tp == 0


# ---- rules ------------------------------------------------------------------------------------------------------

@register("linear")
def linear_rule(op: OpNode, tp: int) -> list[OpPlacement]:
    """Megatron column- and row-parallel linear layers: nn.Linear's weight [out, in] (`linear`), or a weight read
    as the right operand of a matmul, [in, out] (`addmm`/`mm`: HF GPT-2's Conv1D); an optional bias [out]."""
    weights = [p for p in op.params if len(p.shape) == 2]
    if len(weights) != 1 or not op.output_meta:
        return []
    transposed = str(op.target).split(".")[-2:-1] in (["addmm"], ["mm"], ["matmul"])
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    out_f, in_f = weights[0].shape[out_dim], weights[0].shape[in_dim]
    last = out_rank(op) - 1
    n = n_inputs(op)
    out = []
    if out_f % tp == 0:
        params = tuple(shard(out_dim) if len(p.shape) == 2 else "S(0)" for p in op.params)
        out.append(OpPlacement(strategy="colwise", module=op.module_path, inputs=("R",) * n, output=shard(last),
                               params=params))
    if in_f % tp == 0:
        params = tuple(shard(in_dim) if len(p.shape) == 2 else "R" for p in op.params)
        out.append(OpPlacement(strategy="rowwise", module=op.module_path, inputs=(shard(last),) + ("R",) * (n - 1),
                               output="P", params=params))
    return out


@register("embedding")
def embedding_rule(op: OpNode, tp: int) -> list[OpPlacement]:
    """Vocab-parallel embedding: each rank holds V/tp rows; out-of-range ids give zeros, summed by the reduction."""
    if len(op.params) != 1 or len(op.params[0].shape) != 2 or op.params[0].shape[0] % tp:
        return []
    return [OpPlacement(strategy="vocab", module=op.module_path, inputs=("R",) * n_inputs(op), output="P",
                        params=("S(0)",))]


def _sequence(op: OpNode, tp: int) -> list[OpPlacement]:
    """The sequence-parallel placement S(1) on [batch, seq, ...] activations, parameters replicated."""
    if out_rank(op) < 3 or not _divisible(op, 1, tp):
        return []
    return [OpPlacement(strategy="sequence", module=op.module_path, inputs=_follow(op, 1), output=shard(1),
                        params=("R",) * len(op.params))]


@register("norm")
def norm_rule(op: OpNode, tp: int) -> list[OpPlacement]:
    """Norms reduce over the last dim, so only the sequence dim may be sharded."""
    return _sequence(op, tp)


@register("elementwise", "dropout")
def elementwise_rule(op: OpNode, tp: int) -> list[OpPlacement]:
    """Elementwise ops run on any shard: the sequence dim, or the last (hidden) dim following a colwise linear."""
    out = _sequence(op, tp)
    last = out_rank(op) - 1
    if not op.params and last >= 1 and _divisible(op, last, tp) and (last != 1 or not out):
        out.append(OpPlacement(strategy="shard", module=op.module_path, inputs=_follow(op, last),
                               output=shard(last)))
    return out


@register("attention", "matmul", "softmax")
def heads_rule(op: OpNode, tp: int) -> list[OpPlacement]:
    """Head-parallel attention: q, k, v (and scores) of shape [batch, heads, seq, ...] sharded on heads (dim 1)."""
    if op.params or out_rank(op) != 4 or not _divisible(op, 1, tp):
        return []
    shapes = _activation_shapes(op)
    if any(len(s) != 4 for s in shapes):
        return []
    # an attention mask broadcast over heads ([b, 1, s, s]) stays replicated
    return [OpPlacement(strategy="heads", module=op.module_path, inputs=_follow(op, 1), output="S(1)")]


@register("reshape")
def reshape_rule(op: OpNode, tp: int) -> list[OpPlacement]:
    """Views, transposes and permutes keep a shard when the sharded input dim lands on one output dim."""
    shapes = _activation_shapes(op)
    if op.params or len(op.output_meta) != 1 or not shapes:
        return []
    src, dst = shapes[0], op.output_meta[0].shape
    out = []
    for d in range(1, len(src)):
        k = map_dim(src, dst, d, op.target)
        if k is None or k == 0 or src[d] % tp or dst[k] % tp:
            continue
        out.append(OpPlacement(strategy="shard", module=op.module_path,
                               inputs=(shard(d),) + ("R",) * (n_inputs(op) - 1), output=shard(k)))
    return out


def map_dim(src: Sequence[int], dst: Sequence[int], d: int, target: str = "") -> int | None:
    """The output dim a shard on input dim `d` becomes under a view/transpose from shape `src` to `dst`, or None
    when the shard would not stay contiguous (or the mapping is ambiguous).

    Same rank and a permutation of sizes: a transpose; the single swap of two dims that turns `src` into `dst`
    decides (ambiguous swaps, e.g. equal sizes, give None). Otherwise a view: dim d maps to output dim k when the
    sizes before them multiply to the same number and the sharded size splits or merges cleanly at k."""
    src, dst = tuple(src), tuple(dst)
    is_permute = any(w in target for w in ("transpose", "permute", ".t", ".mT"))
    if len(src) == len(dst) and sorted(src) == sorted(dst) and (src != dst or is_permute):
        swaps = {(i, j) for i in range(len(src)) for j in range(i + 1, len(src))
                 if _swap(src, i, j) == dst}
        if src == dst:
            return None  # a transpose of equal sizes: cannot tell which dims moved
        if len(swaps) != 1:
            return None
        i, j = swaps.pop()
        return j if d == i else i if d == j else d
    before = _prod(src[:d])
    for k in range(len(dst)):
        if _prod(dst[:k]) == before:
            if dst[k] % src[d] == 0 or src[d] % dst[k] == 0:
                return k
            return None
    return None


def _swap(shape: tuple[int, ...], i: int, j: int) -> tuple[int, ...]:
    s = list(shape)
    s[i], s[j] = s[j], s[i]
    return tuple(s)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def placement_name(p: OpPlacement | None) -> str:
    """A compact readable form, `strategy: inputs -> output | params`, e.g. `colwise: R -> S(2) | S(0),S(0)`."""
    if p is None:
        return "replicate"
    text = f"{p.strategy}: {','.join(p.inputs)} -> {p.output}"
    return text + (f" | {','.join(p.params)}" if p.params else "")


# ---- what a plan must satisfy -------------------------------------------------------------------------------------
# The executor makes every parameter a DTensor with the placement the plan gives it and runs every op on DTensors, so
# any per-op layout computes the model's function. What a layout must still satisfy is stated here once: (1) every
# op of one parameter-holding module has one strategy, (2) a tied weight is laid out identically by all its holders,
# (3) tp divides every parameter dim the layout shards, and (4) no op misreads a colwise Linear's shards
# (`planner.shard_flow`: correct under the executor, but only through an all-gather the cost model does not price,
# so the search keeps those Linears off colwise). These read plain data (no torch, no search, no cost model).

PARAM_STRATEGIES = ("colwise", "rowwise", "vocab", "sequence")
"""Strategies that say how a module's parameters are laid out (the others describe activations only)."""


@dataclass(frozen=True)
class TPModule:
    """A parameter-holding module of a traced graph, as the plan checks see it."""

    path: str
    """Module path, e.g. `h.0.attn.q_proj`."""
    kind: str
    """`linear` or `embedding` (the kind of the op that calls it), `norm` (another module holding parameters whose
    ops all run in it, e.g. a hand-written RMSNorm) or `other` (a module with children that also holds parameters
    directly)."""


def module_strategies(ops: Mapping[str, OpPlacement], modules: Sequence[TPModule]) -> tuple[dict[str, str], list[str]]:
    """Module path -> strategy from a plan's per-op placements, and the problems found (rule 1 above).

    Only placements whose strategy lays out parameters (`PARAM_STRATEGIES`) on a parameter-holding module count;
    two different ones for one module are a problem."""
    by_path = {m.path for m in modules}
    out: dict[str, str] = {}
    problems: list[str] = []
    for name, p in ops.items():
        if p.strategy not in PARAM_STRATEGIES or p.module not in by_path:
            continue
        if out.setdefault(p.module, p.strategy) != p.strategy:
            problems.append(f"module {p.module} is placed both {out[p.module]} and {p.strategy} (op {name}); "
                            "give every op of one module the same strategy")
    return out, problems


def tied_problems(graph, ops: Mapping[str, OpPlacement]) -> list[str]:
    """Parameters read by several ops (a tied weight: one name) that the ops lay out differently, a replicated op
    counting as `R` (rule 2 above)."""
    layouts: dict[str, dict[str, str]] = {}  # parameter -> op -> its placement of it
    for op in graph.ops:
        p = ops.get(op.name)
        for k, prm in enumerate(op.params):
            layouts.setdefault(prm.name, {})[op.name] = p.params[k] if p is not None and k < len(p.params) else "R"
    out = []
    for param, by_op in layouts.items():
        if len(set(by_op.values())) > 1:
            named = ", ".join(f"{graph.op(n).module_path or n} ({(ops[n].strategy if n in ops else 'replicate')}: "
                              f"{where})" for n, where in by_op.items())
            out.append(f"tied parameter {param} is laid out differently by {named}; place the embedding vocab and "
                       "the head colwise (both shard the weight's vocabulary dim), or replicate both")
    return out


def graph_tp_modules(graph) -> list[TPModule]:
    """The parameter-holding modules of a traced graph, as `TPModule`s (what the plan checks read).

    A module's kind comes from the op that calls it (op kind `linear` / `embedding`, whatever the call: nn.Linear,
    F.linear, HF's Conv1D addmm); other modules that own a parameter directly are `norm` if no op runs in a
    sub-module of theirs, else `other`."""
    paths = {op.module_path for op in graph.ops}
    found: dict[str, TPModule] = {}
    for op in graph.ops:
        for p in op.params:
            if op.kind in ("linear", "embedding"):
                owner, kind = op.module_path, op.kind
            else:
                owner = p.name.rpartition(".")[0]
                kind = "other" if any(q.startswith(owner + ".") for q in paths) else "norm"
            found.setdefault(owner, TPModule(path=owner, kind=kind))
    return list(found.values())


def plan_tp_problems(graph, ops: Mapping[str, OpPlacement], tp: int,
                     modules: Sequence[TPModule] | None = None) -> list[str]:
    """Everything that stops these per-op placements from being a plan over a tp axis of size `tp` (rules 1-4
    above; empty: the plan runs and is priced as it runs). `modules`: `graph_tp_modules(graph)` when already at
    hand (it walks every op)."""
    mods = graph_tp_modules(graph) if modules is None else modules
    strategies, problems = module_strategies(ops, mods)
    return problems + tied_problems(graph, ops) + divisibility_problems(graph, ops, tp) + \
        graph_split_problems(graph, mods, strategies, tp)


def divisibility_problems(graph, ops: Mapping[str, OpPlacement], tp: int) -> list[str]:
    """Parameters the placements shard on a dim tp does not divide (rule 3 above)."""
    out = []
    for name, p in ops.items():
        op = graph.op(name) if name in graph.index else None
        if op is None:
            continue
        for param, where in zip(op.params, p.params):
            if where.startswith("S(") and where[2:-1].isdigit():
                d = int(where[2:-1])
                if d >= len(param.shape) or param.shape[d] % tp:
                    out.append(f"op {name} shards parameter {param.name} {tuple(param.shape)} on dim {d}, which "
                               f"tp={tp} does not divide; replicate it or choose a tp that divides it")
    return out


def graph_split_problems(graph, modules: Sequence[TPModule], strategies: Mapping[str, str], tp: int) -> list[str]:
    """Ops that would misread the local shards of the layout's colwise Linears (`planner.shard_flow`), one line
    each naming the Linear's module and the op."""
    colwise = {m.path for m in modules if strategies.get(m.path) == "colwise"}
    return [f"module {module}: {problem}" for module, problem in split_problems(graph, colwise, tp)]
