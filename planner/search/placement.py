"""Per-op placements for a whole graph: one ILP per repeated block type, one for the ops between blocks, cached.

The block ILP is solved on one instance (the second, so that its input edges come from the first instance and can
be rewired to its own output: the boundary between consecutive copies is priced) and the answer is copied to every
instance by position. The ops outside blocks (embeddings, final norm, head, loss) are solved next with the block
placements fixed. Answers are cached per (block type, tp, micro-batch size, precision, sequence parallel, memory
budget), so the outer loop solves each distinct problem once.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from planner.graph import Layer, OpGraph, OpNode
from planner.plan import OpPlacement
from planner.search.ilp import CostContext, ILPError, ILPProblem, add_fixed_consumers, build_problem, solve
from planner.shard_flow import colwise_refusals, partial_refusals
from planner.strategies import graph_tp_modules, partial_inputs, strategies_for


@dataclass(frozen=True)
class PlacementResult:
    """Placements for every op of a graph under one (tp, micro-batch, precision, sp, budget)."""

    ops: Mapping[str, OpPlacement]
    """Op name to placement, replicated ops omitted (the `Plan.ops` convention)."""
    sequence_parallel: bool
    """Whether any op uses the `sequence` strategy."""
    block_memory: Mapping[str, float] = field(default_factory=dict)
    """Block type to the bytes its chosen strategies count against a memory budget (one instance)."""


@dataclass
class PlacementSolver:
    """Solves and caches per-op placements for one graph and one cost model."""

    graph: OpGraph
    """The traced model."""
    cost_model: Any
    """Anything with op_time, reshard_time, op_memory (the CostModel interface)."""
    time_limit_s: float = 30.0
    """Per-ILP solver time limit."""
    solves: int = 0
    """ILPs actually solved (cache misses), for reports and tests."""
    _cache: dict[tuple, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.graph.layers()
        by_name = {layer.name: layer for layer in layers}
        self.instances: dict[str, list[Layer]] = {
            bt: [by_name[n] for n in names if n in by_name] for bt, names in self.graph.block_types.items()}
        in_block = {i for layer in layers if layer.block_type is not None for i in layer.ops}
        self.rest = [self.graph.ops[i] for i in range(len(self.graph.ops)) if i not in in_block]
        self.rest_layers = [[self.graph.ops[i].name for i in layer.ops] for layer in layers if layer.block_type is None]
        self.tp_modules = graph_tp_modules(self.graph)  # the parameter-holding modules (walks every op: once)
        self.refused_rowwise = partial_refusals(self.graph)
        """`planner.shard_flow.partial_refusals`: Linears never offered rowwise (any tp)."""
        # a block's answer is copied to every instance by position: an op's candidates must suit all its copies
        self.copies: dict[str, tuple[str, ...]] = {}
        for insts in self.instances.values():
            for pos in range(max((len(inst.ops) for inst in insts), default=0)):
                same = [self.graph.ops[inst.ops[pos]] for inst in insts if pos < len(inst.ops)]
                for op in same:
                    self.copies[op.name] = tuple(o.module_path for o in same)
        norms = {m.path for m in self.tp_modules if m.kind == "norm"}
        self.in_norm_module = {op.name for op in self.graph.ops if op.module_path in norms}

    def solve(self, tp: int, microbatch_size: int, precision: str, sp: bool = True,
              budget_scale: float | None = None, alpha: float = 1.0, beta: float = 1.0,
              shard_a_linear: bool = False) -> PlacementResult | None:
        """Placements minimising compute + re-sharding; None when a block cannot meet its memory budget.

        With `budget_scale` s, each block type must use at most s times the memory (alpha * parameter bytes +
        beta * activation bytes, from `op_memory`) of its unconstrained optimum.
        `sp` is the sequence-parallel switch: on, every norm that can runs sharded on the sequence dim (other ops
        choose freely); off, no op uses the `sequence` strategy.
        `shard_a_linear`: every block type with a Linear that can be sharded shards at least one of them (the
        rest of the graph one, when no block has such a Linear); the ILP still chooses which, how (colwise or
        rowwise) and everything else: the cheapest layout in which tp ranks split some work.
        Raises ILPError when the solver fails other than by a memory budget it cannot meet."""
        if tp <= 1:
            return PlacementResult(ops={}, sequence_parallel=False)
        ctx = CostContext(tp, microbatch_size, precision, alpha, beta)
        choice = (sp, shard_a_linear)
        chosen: dict[str, OpPlacement] = {}
        block_memory: dict[str, float] = {}
        for bt, insts in self.instances.items():
            budget = None
            if budget_scale is not None:
                budget = budget_scale * self._solve_block(bt, insts, ctx, choice, None)[1]
            solved = self._solve_block(bt, insts, ctx, choice, budget)
            if solved is None:
                return None
            per_position, block_memory[bt] = solved
            for inst in insts:
                for pos, i in enumerate(inst.ops):
                    op = self.graph.ops[i]
                    if pos < len(per_position):
                        chosen[op.name] = replace(per_position[pos], module=op.module_path)
        if shard_a_linear and any(p.strategy != "replicate" for name, p in chosen.items()
                                  if self.graph.op(name).kind == "linear"):
            choice = (sp, False)  # a block already shards a Linear: the rest is free
        chosen.update(self._solve_rest(ctx, choice, chosen))
        ops = {k: v for k, v in chosen.items() if v.strategy != "replicate"}
        return PlacementResult(ops=ops, sequence_parallel=_uses_sequence(ops), block_memory=block_memory)

    def refused_colwise(self, tp: int) -> dict[str, tuple[str, str]]:
        """`planner.shard_flow.colwise_refusals` for this tp (Linears never offered colwise), computed once."""
        key = ("refused", tp)
        if key not in self._cache:
            self._cache[key] = colwise_refusals(self.graph, tp)
        return self._cache[key]

    def partial_inputs(self, tp: int) -> dict[str, frozenset[int]]:
        """`planner.strategies.partial_inputs` for this tp (inputs an op may read as partial sums), computed once."""
        key = ("partial", tp)
        if key not in self._cache:
            self._cache[key] = partial_inputs(self.graph, tp)
        return self._cache[key]

    # ---- pieces ---------------------------------------------------------------------------------------------------
    def _candidates(self, ops: list[OpNode], tp: int, choice: tuple[bool, bool]) -> dict[str, list[OpPlacement]]:
        """Strategies per op under `choice` = (sp, shard_a_linear) (see `solve`). A Linear whose colwise output an
        op would misread (`refused_colwise`) in any copy of its block is not offered colwise, one whose partial sums
        reach attention unreduced (`refused_rowwise`) not rowwise. Sequence parallelism off drops `sequence`; on,
        norms (and the ops of a hand-written norm module, e.g. RMSNorm's pow/rsqrt/mul) must use it where they can
        (Megatron-LM's switch)."""
        sp = choice[0]
        out = {}
        refused = self.refused_colwise(tp)
        partial = self.partial_inputs(tp)
        for op in ops:
            strats = strategies_for(op, tp, partial.get(op.name, frozenset()))
            copies = self.copies.get(op.name, (op.module_path,))
            if op.kind == "linear" and any(m in refused for m in copies):
                strats = [p for p in strats if p.strategy != "colwise"]
            if op.kind == "linear" and any(m in self.refused_rowwise for m in copies):
                strats = [p for p in strats if p.strategy != "rowwise"]
            seq = [p for p in strats if p.strategy == "sequence"]
            if not sp:
                strats = [p for p in strats if p.strategy != "sequence"]
            elif (op.kind == "norm" or op.name in self.in_norm_module) and seq:
                strats = seq
            out[op.name] = strats
        return out

    def _solve_block(self, bt: str, insts: list[Layer], ctx: CostContext, choice: tuple[bool, bool],
                     budget: float | None) -> tuple[list[OpPlacement], float] | None:
        key = ("block", bt, ctx, choice, budget)
        if key in self._cache:
            return self._cache[key]
        rep = insts[1] if len(insts) > 1 else insts[0]
        ops = [self.graph.ops[i] for i in rep.ops]
        rewire: dict[str, str] = {}
        if len(insts) > 1:
            prev = [self.graph.ops[i].name for i in insts[0].ops]
            for pos, name in enumerate(prev):
                if pos < len(ops):
                    rewire[name] = ops[pos].name
        problem = build_problem(ops, self._candidates(ops, ctx.tp, choice), self.cost_model, ctx,
                                producers=_Producers(self.graph), fixed={}, rewire=rewire, budget=budget,
                                graph=self.graph)
        exclude_split_ties(problem, ops, {})
        if choice[1]:
            _require_a_sharded_linear(problem, ops)
        self.solves += 1
        try:
            sol = solve(problem, self.time_limit_s)
        except ILPError:
            if budget is None:
                raise
            self._cache[key] = None
            return None
        answer = ([problem.strategies[v][i] for v, i in enumerate(sol.choice)], sol.memory)
        self._cache[key] = answer
        return answer

    def _solve_rest(self, ctx: CostContext, choice: tuple[bool, bool],
                    fixed: Mapping[str, OpPlacement]) -> dict[str, OpPlacement]:
        if not self.rest:
            return {}
        key = ("rest", ctx, choice, tuple(sorted((k, v.strategy, v.output) for k, v in fixed.items())))
        if key in self._cache:
            return self._cache[key]
        ops = self.rest
        problem = build_problem(ops, self._candidates(ops, ctx.tp, choice), self.cost_model, ctx,
                                producers=_Producers(self.graph), fixed=fixed, graph=self.graph,
                                layers=self.rest_layers)
        exclude_split_ties(problem, ops, {op.name: (op, fixed[op.name]) for op in self.graph.ops if op.name in fixed
                                          and op.params})
        rest_names = {op.name for op in ops}
        consumers = [op for op in self.graph.ops if op.name in fixed and any(s in rest_names for s in op.inputs)]
        add_fixed_consumers(problem, ops, consumers, fixed, self.cost_model, ctx)
        if choice[1]:
            _require_a_sharded_linear(problem, ops)
        self.solves += 1
        sol = solve(problem, self.time_limit_s)
        answer = {problem.names[v]: problem.strategies[v][i] for v, i in enumerate(sol.choice)}
        self._cache[key] = answer
        return answer


def _require_a_sharded_linear(problem: ILPProblem, ops: list[OpNode]) -> None:
    """Require `problem` to shard at least one Linear of `ops` (none when no Linear can be sharded)."""
    req = [(v, i) for v, op in enumerate(ops) if op.kind == "linear"
           for i, p in enumerate(problem.strategies[v]) if p.strategy != "replicate"]
    if req:
        problem.require_any.append(req)


def exclude_split_ties(problem: ILPProblem, ops: list[OpNode],
                       fixed: Mapping[str, tuple[OpNode, OpPlacement]]) -> None:
    """Exclude from `problem` the strategy pairs that lay one parameter (a tied weight: same name) out
    differently: between two of its ops, or against an op outside it already placed (`fixed`: name -> (op,
    placement)). A tied embedding and LM head are then both replicated or both shard the weight's dim 0."""
    holders: dict[str, list[tuple[int, int]]] = {}  # parameter -> (op index, position in op.params)
    for u, op in enumerate(ops):
        for k, prm in enumerate(op.params):
            holders.setdefault(prm.name, []).append((u, k))
    outside: dict[str, set[str]] = {}  # parameter -> layouts the placed ops outside give it
    for op, placement in fixed.values():
        for k, prm in enumerate(op.params):
            outside.setdefault(prm.name, set()).add(_param_layout(placement, k))
    for name, held in holders.items():
        for a, (u, ku) in enumerate(held):
            lay_u = [_param_layout(p, ku) for p in problem.strategies[u]]
            for i, lay in enumerate(lay_u):
                if name in outside and outside[name] != {lay}:
                    problem.exclusions.append((u, i, u, i))
            for v, kv in held[a + 1:]:
                for i, lay in enumerate(lay_u):
                    for j, p in enumerate(problem.strategies[v]):
                        if _param_layout(p, kv) != lay:
                            problem.exclusions.append((u, i, v, j))


def _param_layout(p: OpPlacement, k: int) -> str:
    """The placement `p` gives the op's k-th parameter (replicated when it lists none)."""
    return p.params[k] if k < len(p.params) else "R"


class _Producers(Mapping[str, OpNode]):
    """Op name -> OpNode over a graph, without building a dict per call."""

    def __init__(self, graph: OpGraph):
        self.graph = graph

    def __getitem__(self, name: str) -> OpNode:
        return self.graph.ops[self.graph.index[name]]

    def __iter__(self):
        return iter(self.graph.index)

    def __len__(self) -> int:
        return len(self.graph.ops)


def _uses_sequence(ops: Mapping[str, OpPlacement]) -> bool:
    return any(p.strategy == "sequence" for p in ops.values())
