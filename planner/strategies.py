"""Candidate placements per op kind: the per-op half of the search space (FlexFlow's SOAP in DTensor placements).

A *rule* is registered per `OpNode.kind` with `@register(kind)` (autoparallel's `@register_rule` idiom) and returns
the `OpPlacement`s an op may take over a tensor-parallel axis of size `tp`. Ops whose kind has no rule fall back to
`replicate` only, which is always valid. Placements use DTensor's shorthand with non-negative dims: `R`, `S(d)`,
`P`. The dp axis always shards the batch (dim 0), so dim 0 is never sharded over tp here.

Communication between ops is never hidden inside a strategy: each strategy states the layout it *requires* of each
activation input and the layout it *produces*, and the search prices every mismatch on a graph edge with the cost
model's `reshard_time`. So Megatron's sequence-parallel pair is expressed as edges: a `sequence` norm (output S(1))
feeding a `colwise` linear (input R) is an all-gather S(1)->R on that edge, and a `rowwise` linear (output P)
feeding a `sequence` norm (input S(1)) is a reduce-scatter P->S(1).

Rules by kind (each filtered by divisibility of the sharded size by tp):

- linear: replicate; colwise (weight S(0), bias S(0), input R, output S(last)); rowwise (weight S(1), bias R, input
  S(last), output P).
- embedding: replicate; vocab (weight S(0), input R, output P).
- norm: replicate; sequence (input/output S(1), parameters R).
- elementwise, dropout: replicate; sequence (S(1)); shard (follow the input: S(last) in, S(last) out).
- attention, matmul, softmax: replicate; heads (S(1) on [batch, heads, seq, head_dim] tensors).
- reshape (view, transpose, permute, contiguous): replicate; shard, following the input's sharded dim through the
  shape change where that dim maps onto one output dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from planner.graph import OpNode
from planner.plan import OpPlacement
from planner.shard_flow import pair_colwise, split_problems

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


def strategies_for(op: OpNode, tp: int) -> list[OpPlacement]:
    """All candidate placements of `op` over a tp axis of size `tp`; replicate is always first.

    With tp == 1 every strategy is the same computation, so only replicate is returned."""
    rep = replicate(op)
    if tp <= 1:
        return [rep]
    rule = _RULES.get(op.kind)
    out = [rep]
    if rule is not None:
        for p in rule(op, tp):
            if p.strategy != "replicate" and p not in out:
                out.append(p)
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
    """Shapes of the op's activation inputs: input_meta minus the parameters, in call order."""
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
    return [OpPlacement(strategy="heads", module=op.module_path, inputs=("S(1)",) * n_inputs(op), output="S(1)")]


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


# ---- what the executor can apply ---------------------------------------------------------------------------------
# The executor turns a plan into DTensor parallel styles per *module*, so only some per-op layouts can run. These
# functions state that contract once; the search checks its answers with them and the executor refuses anything
# else with the first problem they name. They read plain data (no torch, no search, no cost model).

MODULE_KINDS = {"linear": ("colwise", "rowwise"), "embedding": ("vocab",), "norm": ("sequence",), "other": ()}
"""Module kind -> the non-replicate strategies the executor can apply to it: nn.Linear column/row parallel,
nn.Embedding vocab parallel, any other parameter-holding leaf module (a norm) sequence parallel."""
LINEAR_CALLS = ("torch.nn.Linear", "aten.linear.default")
"""`OpNode.target`s of an nn.Linear module call (fx leaf module; torch.export's aten op under the module)."""
EMBEDDING_CALLS = ("torch.nn.Embedding", "aten.embedding.default")
"""`OpNode.target`s of an nn.Embedding module call."""
WEIGHT_LAYOUT = {"colwise": "S(0)", "rowwise": "S(1)", "vocab": "S(0)", "sequence": "R", "replicate": "R"}
"""How each module strategy lays out the module's weight over tp (tied weights must agree)."""


@dataclass(frozen=True)
class TPModule:
    """A parameter-holding module as the tp contract sees it (built from an OpGraph or from an nn.Module)."""

    path: str
    """Module path, e.g. `h.0.attn.q_proj`."""
    kind: str
    """`linear` (nn.Linear), `embedding` (nn.Embedding), `norm` (another leaf holding parameters) or `other`
    (a module with children that also holds parameters directly)."""
    position: str
    """`pre` (before the repeated blocks), `block` (inside one) or `post` (after them)."""
    params: tuple[str, ...] = ()
    """Canonical names of the parameters it holds (a tied weight has one name for all its holders)."""


def module_strategies(ops: Mapping[str, OpPlacement], modules: Sequence[TPModule]) -> tuple[dict[str, str], list[str]]:
    """Module path -> strategy from a plan's per-op placements, and the problems found.

    A placement is a module placement when its strategy is one of colwise, rowwise, vocab, sequence and its module is
    a parameter-holding module. `sequence` on any other module (a residual add on a block, the root) describes an
    activation, not a module, and is skipped; colwise/rowwise/vocab on a module that cannot carry them, or two
    different strategies for one module, are problems."""
    by_path = {m.path: m for m in modules}
    out: dict[str, str] = {}
    problems: list[str] = []
    for name, p in ops.items():
        mod = by_path.get(p.module)
        if p.strategy not in ("colwise", "rowwise", "vocab", "sequence"):
            continue
        if mod is None:
            if p.strategy != "sequence":
                problems.append(f"op {name} is {p.strategy} but its module {p.module or '<root>'!r} is not an "
                                f"nn.Linear/nn.Embedding the executor can shard; replicate it or re-plan")
            continue
        if p.strategy not in MODULE_KINDS[mod.kind]:
            if p.strategy == "sequence" and mod.kind != "norm":
                continue
            problems.append(f"op {name} is {p.strategy} but module {mod.path} is a {mod.kind} module, which "
                            f"takes {' or '.join(MODULE_KINDS[mod.kind] + ('replicate',))}; re-plan")
            continue
        if out.setdefault(mod.path, p.strategy) != p.strategy:
            problems.append(f"module {mod.path} is placed both {out[mod.path]} and {p.strategy} (op {name}); "
                            "give every op of one module the same strategy")
    return out, problems


def tp_layout_problems(modules: Sequence[TPModule], strategies: Mapping[str, str],
                       sequence_parallel: bool) -> list[str]:
    """Why the executor cannot apply this module layout (empty when it can). The runnable layouts are Megatron's:

    - a *pair*: the nn.Linear children of one parent module are all colwise except exactly one rowwise, which
      reads their (head/feature-sharded) outputs; nothing in between communicates;
    - a lone colwise nn.Linear outside the blocks (the LM head): its logits stay sharded over the vocabulary for a
      vocabulary-parallel cross-entropy (`loss_parallel`), all-gathered only for a loss that needs them whole;
    - vocab on nn.Embedding (output all-reduced); replicate anywhere;
    - tied weights laid out identically by every holder (vocab embedding + colwise head both shard dim 0);
    - with sequence parallelism the residual stream is sharded on the sequence dim from the first block on, so
      every Linear in the blocks is in a pair, every norm in or after the blocks is `sequence`, a Linear after
      the blocks is colwise (it gathers its input) and no Embedding sits in a block; `sequence` needs it on.
    """
    problems: list[str] = []
    by_parent: dict[str, list[TPModule]] = {}
    for m in modules:
        if m.kind == "linear":
            by_parent.setdefault(m.path.rpartition(".")[0], []).append(m)
    pairs: set[str] = set()
    for parent, lins in by_parent.items():
        strat = {m.path: strategies.get(m.path, "replicate") for m in lins}
        rows = [p for p, s in strat.items() if s == "rowwise"]
        cols = [p for p, s in strat.items() if s == "colwise"]
        if rows:
            if len(rows) > 1 or not cols or len(rows) + len(cols) != len(lins):
                listed = ", ".join(f"{p}={s}" for p, s in strat.items())
                problems.append(f"module {parent or '<root>'}: its Linears {listed} are not one Megatron pair "
                                "(all colwise but one rowwise); re-plan with the "
                                "Megatron layout")
            pairs.update(strat)
    pos = {m.path: m for m in modules}
    for path, s in strategies.items():
        m = pos.get(path)
        if m is None:
            continue
        if s == "colwise" and path not in pairs and m.position == "block":
            problems.append(f"module {path} is colwise without a rowwise sibling inside a block; pair it with a "
                            "rowwise Linear (Megatron) or replicate it")
        if s == "colwise" and path not in pairs and sequence_parallel and m.position == "pre":
            problems.append(f"module {path} is a lone colwise Linear before the blocks under sequence parallelism; "
                            "replicate it")
        if s == "sequence" and not sequence_parallel:
            problems.append(f"module {path} is sequence-parallel but the plan has sequence_parallel off; turn it on "
                            "or replicate the module")
    if sequence_parallel:
        problems += _sequence_problems(modules, strategies, pairs)
    problems += _tied_problems(modules, strategies)
    return problems


def _sequence_problems(modules: Sequence[TPModule], strategies: Mapping[str, str], pairs: set[str]) -> list[str]:
    out = []
    for m in modules:
        s = strategies.get(m.path, "replicate")
        if m.position == "pre":
            continue
        if m.kind == "norm" and s != "sequence":
            out.append(f"module {m.path} must be sequence-parallel: with sequence parallelism on, the activations "
                       "it sees are sharded on the sequence dim")
        elif m.kind == "linear" and m.position == "block" and m.path not in pairs:
            out.append(f"module {m.path} is a Linear in a block outside a colwise/rowwise pair; with sequence "
                       "parallelism every block Linear must be in one (or turn sequence parallelism off)")
        elif m.kind == "linear" and m.position == "post" and s != "colwise":
            out.append(f"module {m.path} after the blocks must be colwise under sequence parallelism (it gathers "
                       "its sequence-sharded input)")
        elif m.kind in ("embedding", "other") and m.position == "block":
            out.append(f"module {m.path} ({m.kind}) inside a block cannot run on sequence shards; turn sequence "
                       "parallelism off")
    return out


def _tied_problems(modules: Sequence[TPModule], strategies: Mapping[str, str]) -> list[str]:
    holders: dict[str, list[TPModule]] = {}
    for m in modules:
        for p in m.params:
            holders.setdefault(p, []).append(m)
    out = []
    for param, ms in holders.items():
        lay = {m.path: WEIGHT_LAYOUT[strategies.get(m.path, "replicate")] for m in ms}
        if len(ms) > 1 and len(set(lay.values())) > 1:
            named = [(p, strategies.get(p, "replicate")) for p in lay]
            out.append(f"tied parameter {param} is laid out differently by "
                       f"{', '.join(f'{p} ({s})' for p, s in named)}; place the embedding "
                       "vocab and the head colwise (both shard dim 0), or replicate both")
    return out


def graph_tp_modules(graph) -> list[TPModule]:
    """The parameter-holding modules of a traced graph, as `TPModule`s (what `tp_layout_problems` checks).

    A module's kind comes from the op that calls it (`torch.nn.Linear` / `torch.nn.Embedding`); other modules that
    own a parameter directly are `norm` if no op runs in a sub-module of theirs, else `other`."""
    first_block = next((i for i, op in enumerate(graph.ops) if op.block is not None), None)
    paths = {op.module_path for op in graph.ops}
    found: dict[str, TPModule] = {}
    for i, op in enumerate(graph.ops):
        for p in op.params:
            owner = p.name.rpartition(".")[0]
            if op.target in LINEAR_CALLS:
                kind, owner = "linear", op.module_path
            elif op.target in EMBEDDING_CALLS:
                kind, owner = "embedding", op.module_path
            else:
                kind = "other" if any(q.startswith(owner + ".") for q in paths) else "norm"
            if owner in found:
                if p.name not in found[owner].params:
                    found[owner] = TPModule(path=owner, kind=found[owner].kind, position=found[owner].position,
                                            params=found[owner].params + (p.name,))
                continue
            position = "block" if op.block is not None else \
                "pre" if first_block is None or i < first_block else "post"
            found[owner] = TPModule(path=owner, kind=kind, position=position, params=(p.name,))
    return list(found.values())


def plan_tp_problems(graph, ops: Mapping[str, OpPlacement], sequence_parallel: bool, tp: int) -> list[str]:
    """Everything that stops the executor from applying these placements to the traced model over a tp axis of
    size `tp`, or would make it train a different function (empty: runnable and the same function)."""
    mods = graph_tp_modules(graph)
    strategies, problems = module_strategies(ops, mods)
    return problems + tp_layout_problems(mods, strategies, sequence_parallel) + \
        graph_split_problems(graph, mods, strategies, tp)


def graph_split_problems(graph, modules: Sequence[TPModule], strategies: Mapping[str, str], tp: int) -> list[str]:
    """Ops that would misread the local shards of the layout's paired colwise Linears (`planner.shard_flow`)."""
    colwise = pair_colwise(strategies, (m.path for m in modules if m.kind == "linear"))
    return [f"module {module}: {problem}" for module, problem in split_problems(graph, colwise, tp)]
