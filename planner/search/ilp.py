r"""Intra-stage placement: an integer program choosing one strategy per op (autoparallel / Alpa intra-op style).

For a set of ops V (one repeated block, or the ops outside blocks), each op v has candidate strategies S_v
(`planner.strategies`), and each graph edge e = (u -> v) between ops of V has a re-sharding table
r_e[i, j] = reshard time (forward + backward) from u's output under strategy i to the layout v's strategy j wants,
each collective with the ranks' wait to line up where the profile measured one (`reshard_cost`).

    variables   x[v, i] in {0, 1}                    op v uses strategy i
                y[e, i, j] in [0, 1]                 edge e joins strategy i at its source with j at its sink
    minimise    sum_v sum_i c[v, i] x[v, i]  +  sum_e sum_{i,j} r_e[i, j] y[e, i, j]
    subject to  sum_i x[v, i] = 1                              for every op v           add_one_strategy_per_op
                sum_j y[e, i, j] = x[u, i]   for every i        for every edge u -> v    add_edge_consistency
                sum_i y[e, i, j] = x[v, j]   for every j
                sum_v sum_i m[v, i] x[v, i] <= M                (when a budget is set)   add_memory_limit
                x[u, i] + x[v, j] <= 1       for each excluded pair                    add_exclusions
                sum_{(v, i) in R} x[v, i] >= 1   for each required set R                add_requirements

c[v, i] is the op's compute time (forward + backward) under strategy i plus the re-sharding cost from
neighbours outside V whose strategy is already fixed (`add_objective` folds those linear terms in); m[v, i] is
`alpha * param_bytes + beta * activation_bytes` from the cost model's `op_memory`. Excluded pairs: two holders of
a tied weight laying it out differently, and an edge whose consumer reads a partial sum (`P`) its producer's
strategy does not output (DTensor cannot turn a shard or a replica into the partial sums the consumer's other
inputs are: `partial_mismatch`). A required set (forced tp, when the free answer shards nothing): at least one
of its (op, strategy) pairs is chosen, e.g. some Linear of a block sharded. The edge constraints are the
tight linearisation of y = x_u x_v: with x integral each y[e] is a transportation plan between two unit vectors,
which forces y[e, i, j] = x[u, i] x[v, j], so y may stay continuous. (The McCormick form y <= x_u, y <= x_v,
y >= x_u + x_v - 1 is much weaker: a 200-op x 8-strategy instance does not finish in 120 s, while this one
solves to optimality in seconds; measured with ortools 9.15 on 2 cores, see issue 5.)

A repeated block is solved once and its answer reused for every copy: the edges that enter the block from
outside are rewired to come from the block's own output op, so the boundary re-sharding between consecutive
copies is priced inside the one problem. All costs come from the cost model passed in; nothing is re-derived here.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from planner.graph import OpNode
from planner.plan import OpPlacement

SOLVERS = ("SCIP", "CBC", "HIGHS")
"""MILP back-ends tried in order through ortools' pywraplp (all three ship with ortools 9.15)."""


class ILPError(RuntimeError):
    """The solver found no feasible assignment (memory budget too small) or failed."""


@dataclass
class ILPProblem:
    """One strategy-selection problem as plain arrays (no graph or cost model inside)."""

    names: list[str]
    """Op names, one per variable group."""
    strategies: list[list[OpPlacement]]
    """Candidate placements per op."""
    compute: list[np.ndarray]
    """Per op, per strategy: seconds (forward + backward), including costs to fixed outside neighbours."""
    memory: list[np.ndarray]
    """Per op, per strategy: bytes counted against the budget."""
    edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    """(source op, sink op, re-sharding seconds [strategies of source, strategies of sink])."""
    budget: float | None = None
    """Memory limit for sum of chosen `memory`, or None for no limit."""
    exclusions: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(op u, strategy i, op v, strategy j) that may not be chosen together (two holders of one tied weight laying
    it out differently); (u, i, u, i) excludes strategy i of op u on its own."""
    require_any: list[list[tuple[int, int]]] = field(default_factory=list)
    """Sets of (op, strategy) of which the assignment must choose at least one each."""

    def allows(self, choice: Sequence[int]) -> bool:
        """Whether the assignment avoids every excluded pair and meets every required set."""
        if any(choice[u] == i and choice[v] == j for u, i, v, j in self.exclusions):
            return False
        return all(any(choice[v] == i for v, i in req) for req in self.require_any)

    def objective(self, choice: Sequence[int]) -> float:
        """The objective value of one assignment (strategy index per op)."""
        total = sum(float(self.compute[v][i]) for v, i in enumerate(choice))
        return total + sum(float(r[choice[u], choice[v]]) for u, v, r in self.edges)

    def memory_of(self, choice: Sequence[int]) -> float:
        """Bytes the assignment counts against the budget."""
        return sum(float(self.memory[v][i]) for v, i in enumerate(choice))


# ---- building a problem from the graph and the cost model ------------------------------------------------------

@dataclass(frozen=True)
class CostContext:
    """What the cost model needs besides the op: tp degree, micro-batch size, precision."""

    tp: int
    """Tensor-parallel degree."""
    microbatch_size: int
    """Samples per micro-batch."""
    precision: str
    """bf16, fp16 or fp32."""
    alpha: float = 1.0
    """Weight of parameter bytes in the memory term."""
    beta: float = 1.0
    """Weight of activation bytes in the memory term."""


def build_problem(ops: Sequence[OpNode], candidates: Mapping[str, list[OpPlacement]], cost_model: Any,
                  ctx: CostContext, *, producers: Mapping[str, OpNode], fixed: Mapping[str, OpPlacement],
                  rewire: Mapping[str, str] | None = None, budget: float | None = None,
                  graph: Any = None) -> ILPProblem:
    """Price every (op, strategy) and every edge with the cost model and return the ILP's arrays.

    `producers` maps any op name to its node (for edge tensor shapes); `fixed` gives the placement of outside ops
    whose strategy is already chosen (edges from them become linear costs); outside producers neither in `ops` nor
    in `fixed` are taken to deliver replicated tensors; `rewire` maps an outside producer name to an op inside the
    set that stands for it (a block's output feeding the next copy). With the ops' `graph` the cost model prices
    each op as the step prediction does (autocast's casts, the input gradients the graph needs)."""
    rewire = rewire or {}
    index = {op.name: k for k, op in enumerate(ops)}
    strategies = [candidates[op.name] for op in ops]
    args = (ctx.tp, ctx.microbatch_size, ctx.precision)
    compute, memory = [], []
    for op, strats in zip(ops, strategies):
        compute.append(np.array([sum(cost_model.op_time(op, _arg(p), *args, graph=graph)) for p in strats],
                                dtype=float))
        mem = [cost_model.op_memory(op, _arg(p), *args) for p in strats]
        memory.append(np.array([ctx.alpha * pb + ctx.beta * ab for pb, ab in mem], dtype=float))
    reshard_cache: dict[tuple[Any, str, str], float] = {}

    def reshard(meta: Any, src: str, dst: str) -> float:
        key = (meta, src, dst)
        if key not in reshard_cache:
            reshard_cache[key] = 0.0 if src == dst else reshard_cost(cost_model, meta, src, dst, args)
        return reshard_cache[key]

    edges: list[tuple[int, int, np.ndarray]] = []
    exclusions: list[tuple[int, int, int, int]] = []
    for v, op in enumerate(ops):
        for k, src_name in enumerate(op.inputs):
            meta = _edge_meta(producers.get(src_name))
            if meta is None:
                continue
            want = [_input(p, k) for p in strategies[v]]
            src_name = rewire.get(src_name, src_name) if src_name not in index else src_name
            if src_name in index:
                u = index[src_name]
                table = np.array([[reshard(meta, a.output, w) for w in want] for a in strategies[u]])
                exclusions += [(u, i, v, j) for i, a in enumerate(strategies[u]) for j, w in enumerate(want)
                               if partial_mismatch(a.output, w) and (u != v or i == j)]
                if u == v:
                    compute[v] = compute[v] + np.diag(table)
                else:
                    edges.append((u, v, table))
            else:
                have = fixed[src_name].output if src_name in fixed else "R"
                compute[v] = compute[v] + np.array([reshard(meta, have, w) for w in want])
                exclusions += [(v, j, v, j) for j, w in enumerate(want) if partial_mismatch(have, w)]
    return ILPProblem(names=[op.name for op in ops], strategies=strategies, compute=compute, memory=memory,
                      edges=edges, budget=budget, exclusions=exclusions)


def add_fixed_consumers(problem: ILPProblem, ops: Sequence[OpNode], consumers: Sequence[OpNode],
                        fixed: Mapping[str, OpPlacement], cost_model: Any, ctx: CostContext) -> None:
    """Add to `problem` the re-sharding from its ops to already-placed consumers outside it (linear terms)."""
    index = {op.name: k for k, op in enumerate(ops)}
    args = (ctx.tp, ctx.microbatch_size, ctx.precision)
    for c in consumers:
        for k, src_name in enumerate(c.inputs):
            if src_name not in index or c.name not in fixed:
                continue
            u = index[src_name]
            meta = _edge_meta(ops[u])
            if meta is None:
                continue
            want = _input(fixed[c.name], k)
            extra = [0.0 if p.output == want else reshard_cost(cost_model, meta, p.output, want, args)
                     for p in problem.strategies[u]]
            problem.compute[u] = problem.compute[u] + np.array(extra)
            problem.exclusions += [(u, i, u, i) for i, p in enumerate(problem.strategies[u])
                                   if partial_mismatch(p.output, want)]


def reshard_cost(cost_model: Any, meta: Any, src: str, dst: str, args: tuple) -> float:
    """Forward + backward seconds of one re-sharding as the ILP prices an edge: the collectives (`reshard_time`)
    and, for each, the ranks' wait to line up (`reshard_wait`), which the step prediction charges every blocking
    collective on ranks sharing a host's cores. Without it the ILP took collectives for cheaper than the prediction
    does and could pick a layout with more of them that the prediction itself ranks slower."""
    f, b = cost_model.reshard_time(meta, src, dst, *args)
    wait = cost_model.reshard_wait(args[0])
    return f + b + wait * ((f > 0) + (b > 0))


def partial_mismatch(have: str, want: str) -> bool:
    """A consumer input that wants a partial sum fed anything else: the executor refuses it (DTensor has no
    S -> P, and an R -> P split would be a layout no strategy states), so the ILP never joins the two."""
    return want == "P" and have != "P"


def _arg(p: OpPlacement) -> OpPlacement | None:
    """The cost model's convention: None means replicated."""
    return None if p.strategy == "replicate" else p


def _input(p: OpPlacement, k: int) -> str:
    return p.inputs[k] if k < len(p.inputs) else "R"


def _edge_meta(producer: OpNode | None) -> Any:
    if producer is None or not producer.output_meta:
        return None
    return producer.output_meta[0]


# ---- solving ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ILPSolution:
    """A solved problem."""

    choice: tuple[int, ...]
    """Strategy index per op."""
    objective: float
    """Seconds: compute plus re-sharding of the chosen strategies."""
    memory: float
    """Bytes the choice counts against the budget."""
    solver: str
    """Which back-end solved it (or `brute-force`, `trivial`)."""


def solve(problem: ILPProblem, time_limit_s: float = 30.0) -> ILPSolution:
    """Solve the ILP to optimality (relative gap 0); raises ILPError when infeasible or no back-end answers."""
    if all(len(s) == 1 for s in problem.strategies):
        choice = (0,) * len(problem.names)
        if problem.budget is not None and problem.memory_of(choice) > problem.budget:
            raise ILPError(f"needs {problem.memory_of(choice):.3g} bytes, budget {problem.budget:.3g}")
        if not problem.allows(choice):
            raise ILPError("the only candidates lay a tied weight out differently or miss a required strategy")
        return ILPSolution(choice, problem.objective(choice), problem.memory_of(choice), "trivial")
    from ortools.linear_solver import pywraplp
    for name in SOLVERS:
        solver = pywraplp.Solver.CreateSolver(name)
        if solver is not None:
            break
    else:
        raise ILPError("no MILP back-end available in ortools (tried " + ", ".join(SOLVERS) + ")")
    x = add_one_strategy_per_op(solver, problem)
    y = add_edge_consistency(solver, problem, x)
    add_memory_limit(solver, problem, x)
    add_exclusions(solver, problem, x)
    add_requirements(solver, problem, x)
    add_objective(solver, problem, x, y)
    solver.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, 0.0)
    status = solver.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        why = f"status {status}"
        if status == pywraplp.Solver.INFEASIBLE:
            why = "infeasible under " + " and ".join(
                w for w, on in (("the memory budget", problem.budget is not None),
                                ("the excluded pairs (tied weights, partial-sum edges)", bool(problem.exclusions)),
                                ("the required strategies", bool(problem.require_any))) if on)
        raise ILPError(f"{name}: {why}")
    choice = tuple(int(np.argmax([xi.solution_value() for xi in xv])) for xv in x)
    return ILPSolution(choice, problem.objective(choice), problem.memory_of(choice), name)


def add_one_strategy_per_op(solver: Any, problem: ILPProblem) -> list[list[Any]]:
    """x[v, i] binary with sum_i x[v, i] = 1: every op takes exactly one strategy."""
    x = []
    for v, strats in enumerate(problem.strategies):
        xv = [solver.BoolVar(f"x[{v},{i}]") for i in range(len(strats))]
        solver.Add(solver.Sum(xv) == 1)
        x.append(xv)
    return x


def add_edge_consistency(solver: Any, problem: ILPProblem, x: list[list[Any]]) -> list[list[list[Any]]]:
    """y[e, i, j] in [0, 1] whose rows sum to x[u, i] and columns to x[v, j] (tight linearisation of x_u x_v)."""
    ys = []
    for e, (u, v, table) in enumerate(problem.edges):
        nu, nv = table.shape
        y = [[solver.NumVar(0.0, 1.0, f"y[{e},{i},{j}]") for j in range(nv)] for i in range(nu)]
        for i in range(nu):
            solver.Add(solver.Sum(y[i]) == x[u][i])
        for j in range(nv):
            solver.Add(solver.Sum([y[i][j] for i in range(nu)]) == x[v][j])
        ys.append(y)
    return ys


def add_memory_limit(solver: Any, problem: ILPProblem, x: list[list[Any]]) -> None:
    """sum_v sum_i m[v, i] x[v, i] <= M when a budget M is set."""
    if problem.budget is None:
        return
    terms = [float(problem.memory[v][i]) * x[v][i] for v in range(len(x)) for i in range(len(x[v]))]
    solver.Add(solver.Sum(terms) <= float(problem.budget))


def add_exclusions(solver: Any, problem: ILPProblem, x: list[list[Any]]) -> None:
    """x[u, i] + x[v, j] <= 1 for every excluded pair."""
    for u, i, v, j in problem.exclusions:
        solver.Add(x[u][i] + x[v][j] <= 1)


def add_requirements(solver: Any, problem: ILPProblem, x: list[list[Any]]) -> None:
    """sum of x[v, i] over each required set >= 1."""
    for req in problem.require_any:
        solver.Add(solver.Sum([x[v][i] for v, i in req]) >= 1)


def add_objective(solver: Any, problem: ILPProblem, x: list[list[Any]], y: list[list[list[Any]]]) -> None:
    """Minimise compute (with fixed-neighbour re-sharding folded in) plus edge re-sharding."""
    terms = [float(problem.compute[v][i]) * x[v][i] for v in range(len(x)) for i in range(len(x[v]))]
    for (u, v, table), ye in zip(problem.edges, y):
        terms += [float(table[i, j]) * ye[i][j] for i in range(table.shape[0]) for j in range(table.shape[1])
                  if table[i, j] != 0.0]
    solver.Minimize(solver.Sum(terms))


def brute_force(problem: ILPProblem, max_assignments: int = 2_000_000) -> ILPSolution:
    """Enumerate every assignment (tests' reference); raises ILPError when none fits or the space is too large."""
    sizes = [len(s) for s in problem.strategies]
    if math.prod(sizes) > max_assignments:
        raise ILPError(f"{math.prod(sizes)} assignments is too many to enumerate")
    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(*(range(n) for n in sizes)):
        if problem.budget is not None and problem.memory_of(choice) > problem.budget + 1e-9:
            continue
        if not problem.allows(choice):
            continue
        obj = problem.objective(choice)
        if best is None or obj < best[0] - 1e-15:
            best = (obj, choice)
    if best is None:
        raise ILPError("no assignment fits the memory budget, the tied weights and the required strategies")
    return ILPSolution(best[1], best[0], problem.memory_of(best[1]), "brute-force")
