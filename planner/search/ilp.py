r"""Intra-stage placement: an integer program choosing one strategy per op (autoparallel / Alpa intra-op style).

For a set of ops V (one repeated block, or the ops outside blocks), each op v has candidate strategies S_v
(`planner.strategies`), and each graph edge e = (u -> v) between ops of V has a re-sharding table
r_e[i, j] = reshard time (forward + backward) from u's output under strategy i to the layout v's strategy j wants,
each collective with the ranks' wait to line up where the profile measured one (`reshard_cost`).

    variables   x[v, i] in {0, 1}                    op v uses strategy i
                y[e, i, j] in [0, 1]                 edge e joins strategy i at its source with j at its sink
    minimise    sum_v sum_i c[v, i] x[v, i]  +  sum_e sum_{i,j} r_e[i, j] y[e, i, j]
                + shared reads  + sum over layers L of T_f[L] + T_b[L]
    subject to  sum_i x[v, i] = 1                              for every op v           add_one_strategy_per_op
                sum_j y[e, i, j] = x[u, i]   for every i        for every edge u -> v    add_edge_consistency
                sum_i y[e, i, j] = x[v, j]   for every j
                sum_v sum_i m[v, i] x[v, i] <= M                (when a budget is set)   add_memory_limit
                x[u, i] + x[v, j] <= 1       for each excluded pair                    add_exclusions
                sum_{(v, i) in R} x[v, i] >= 1   for each required set R                add_requirements
                sum_v x[v, c_v] <= |V| - 1   for each forbidden assignment c
                z >= each reader's y (or x)  per shared read and source strategy       add_shared_reads
                T_f[L] >= kernels_f(L), T_f[L] >= host_f(L)  (GPUs; summed on CPU)     add_layer_times
                d[M] >= x[v, i] and d[M] <= their sum, over the strategies placing module M or one under it

The ops' compute is kept as the step prediction adds it up (`LayerTimes`, `cost_model.layers`): per layer,
kernels and host dispatch summed apart and joined per pass by their max where the host runs ahead of the device
(T_f, T_b minimised above both); a replicated op's dispatch is a DTensor op's when its module runs on DTensors
(d[M], the OR of the strategies placing M or a module under it; the op pays through w >= x + d[M] - 1), and a
module off DTensors under one on them is one local call (d[parent] - d[M]). Linears reading one tensor in one
placement (q, k and v) share one redistribution and one input-gradient reduction (Megatron's f), as the executor
runs them (`SharedRead`: z is the OR of their edges). c[v, i] holds what is linear in x: the re-sharding from
neighbours outside V whose strategy is already fixed (`add_objective` folds those terms in); m[v, i] is
`alpha * param_bytes + beta * activation_bytes` from the cost model's `op_memory`. Excluded pairs: two holders of
a tied weight laying it out differently, and an edge whose consumer reads a partial sum (`P`) its producer's
strategy does not output (DTensor cannot turn a shard or a replica into the partial sums the consumer's other
inputs are: `partial_mismatch`). A required set (forced tp, when the free answer shards nothing): at least one
of its (op, strategy) pairs is chosen, e.g. some Linear of a block sharded. The edge constraints are the
tight linearisation of y = x_u x_v: with x integral each y[e] is a transportation plan between two unit vectors,
which forces y[e, i, j] = x[u, i] x[v, j], so y may stay continuous. (The McCormick form y <= x_u, y <= x_v,
y >= x_u + x_v - 1 is much weaker: a 200-op x 8-strategy instance does not finish in 120 s, while this one
solves to optimality in seconds; measured with ortools 9.15 on 2 cores, see issue 5.) With x integral, d, z, w
and T take their exact values at the optimum: each is bounded on the side the objective pushes it towards.

What the step prediction prices and this does not: the ranks' wait is charged at its shortest measured window
(the prediction's depends on the pass), re-gathers of sequence shards in backward, and the casts autocast shares
among a tensor's readers.

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
SCIP_PARAMETERS = "separating/maxrounds = 0\nseparating/maxroundsroot = 0\n"
"""SCIP without cutting planes: the edge linearisation is already tight, and separating cuts took most of SCIP's
time on problems with layer times and required sets (ortools 9.15, 2 cores: a zoo model's 24 tp=2 problems 15.5
-> 2.6 s, a Llama's on dgx-h100 at tp=4 11.8 -> 1.0 s), for the same optimum and the same choices on every problem
of those and of GPT-2 XL's and GPT-3 175B's searches. Branching still proves optimality (gap 0); between answers
tied on the objective SCIP may pick another one than with cuts (the README's forced GPT example)."""


class ILPError(RuntimeError):
    """The solver found no feasible assignment (memory budget too small) or failed."""


@dataclass
class SharedRead:
    """Linears reading one tensor in one placement (q, k and v from one norm): the executor redistributes the
    tensor once for all of them and reduces its input gradient once, after the column-parallel ones
    (`executor.tp`; the step prediction prices it so, `cost_model.layers`). Paid once when any reader is chosen."""

    source: int | None
    """The producing op's index in the problem, or None: an outside producer whose placement is fixed."""
    readers: list[tuple[int, int, int | None]]
    """(op v, strategy j, its edge from `source` in `ILPProblem.edges`) for every reader strategy that reads the
    tensor in this placement."""
    partial: list[tuple[int, int, int | None]]
    """The subset whose strategy is column-parallel on a replicated read: their input gradient is a partial sum."""
    cost_any: np.ndarray
    """Per source strategy (one entry for a fixed source): the redistribution, forward and backward, once."""
    cost_part: np.ndarray
    """Per source strategy: what the input-gradient reduction adds once when a column-parallel reader is chosen."""

    def cost(self, choice: Sequence[int]) -> float:
        """Seconds this shared read adds to an assignment."""
        i = 0 if self.source is None else choice[self.source]
        any_ = any(choice[v] == j for v, j, _ in self.readers)
        part = any(choice[v] == j for v, j, _ in self.partial)
        return float(self.cost_any[i]) * any_ + float(self.cost_part[i]) * part


@dataclass
class LayerTimes:
    """What the ops cost per layer as the step prediction adds it up (`cost_model.layers`): kernels and host
    dispatch summed apart over a layer's ops and joined per pass (their max where the host runs ahead of the
    device, `overlap`; else their sum), each op's host dispatch that of a DTensor op when its module runs on
    DTensors (a module placed, or one holding a placed module: `runs_on_dtensors`), and one unwrap / rewrap per
    call of a module tensor parallelism leaves wholly replicated (executor.tp's local modules)."""

    parts: list[np.ndarray]
    """Per op, per strategy: (forward kernels, backward kernels, forward host, backward host) seconds, with the
    op's module on plain tensors for a replicated strategy (on DTensors for the others)."""
    on_dtensors: list[np.ndarray]
    """Per op, per strategy: what the four parts gain when a replicated strategy's module runs on DTensors."""
    modules: list[str]
    """Per op: its module path."""
    layers: list[list[int]]
    """The ops of each layer (a repeated block is one)."""
    overlap: bool = False
    """Host dispatch runs ahead of the kernels (GPUs): a pass costs max(kernels, host)."""
    local_call: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) host seconds per call of a module left on plain tensors."""
    fixed_on: frozenset[str] = frozenset()
    """Module paths on DTensors whatever this problem chooses (placed by ops outside it, or their ancestors)."""

    def prefixes(self, layer: Sequence[int]) -> list[str]:
        """Every module path that is one of the layer's ops' paths or an ancestor of one (root excluded)."""
        return list(dict.fromkeys(a for v in layer for a in _ancestors(self.modules[v])))

    def members(self, path: str, strategies: list[list[OpPlacement]]) -> list[tuple[int, int]]:
        """(op, strategy) pairs that put `path` on DTensors: a non-replicated strategy of an op at or under it."""
        return [(v, i) for v, m in enumerate(self.modules) if m == path or m.startswith(path + ".")
                for i, p in enumerate(strategies[v]) if p.strategy != "replicate"]

    def seconds(self, choice: Sequence[int], strategies: list[list[OpPlacement]]) -> float:
        """The layers' compute seconds under one assignment."""
        placed = {self.modules[v] for v, i in enumerate(choice) if strategies[v][i].strategy != "replicate"}

        def on(path: str) -> bool:
            return not path or path in self.fixed_on or any(q == path or q.startswith(path + ".") for q in placed)
        total = 0.0
        for layer in self.layers:
            t = np.zeros(4)
            for v in layer:
                t += self.parts[v][choice[v]]
                if on(self.modules[v]):
                    t += self.on_dtensors[v][choice[v]]
            calls = sum(on(m.rpartition(".")[0]) - on(m) for m in self.prefixes(layer))
            t[2:] += calls * np.asarray(self.local_call)
            total += (max(t[0], t[2]) + max(t[1], t[3])) if self.overlap else float(t.sum())
        return total


@dataclass
class ILPProblem:
    """One strategy-selection problem as plain arrays (no graph or cost model inside)."""

    names: list[str]
    """Op names, one per variable group."""
    strategies: list[list[OpPlacement]]
    """Candidate placements per op."""
    compute: list[np.ndarray]
    """Per op, per strategy: seconds (forward + backward) added as they are: the re-sharding to fixed outside
    neighbours, and the op's own compute where `times` is not given."""
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
    shared: list[SharedRead] = field(default_factory=list)
    """Redistributions that linears reading one tensor share (their edges carry no cost of their own)."""
    times: LayerTimes | None = None
    """The ops' compute, combined per layer as the step prediction combines it (None: all in `compute`)."""
    forbidden: list[tuple[int, ...]] = field(default_factory=list)
    """Whole assignments the answer may not be (solving again with the answer forbidden gives the next best)."""

    def allows(self, choice: Sequence[int]) -> bool:
        """Whether the assignment avoids every excluded pair and meets every required set."""
        if any(choice[u] == i and choice[v] == j for u, i, v, j in self.exclusions):
            return False
        if tuple(choice) in self.forbidden:
            return False
        return all(any(choice[v] == i for v, i in req) for req in self.require_any)

    def objective(self, choice: Sequence[int]) -> float:
        """The objective value of one assignment (strategy index per op)."""
        total = sum(float(self.compute[v][i]) for v, i in enumerate(choice))
        total += sum(g.cost(choice) for g in self.shared)
        total += self.times.seconds(choice, self.strategies) if self.times is not None else 0.0
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
                  graph: Any = None, layers: Sequence[Sequence[str]] | None = None) -> ILPProblem:
    """Price every (op, strategy) and every edge with the cost model and return the ILP's arrays.

    `producers` maps any op name to its node (for edge tensor shapes); `fixed` gives the placement of outside ops
    whose strategy is already chosen (edges from them become linear costs); outside producers neither in `ops` nor
    in `fixed` are taken to deliver replicated tensors; `rewire` maps an outside producer name to an op inside the
    set that stands for it (a block's output feeding the next copy). With the ops' `graph` the cost model prices
    each op as the step prediction does (autocast's casts, the input gradients the graph needs). `layers` groups
    the op names by layer (default: one layer), over which kernels and host dispatch are combined (`LayerTimes`)."""
    rewire = rewire or {}
    index = {op.name: k for k, op in enumerate(ops)}
    strategies = [candidates[op.name] for op in ops]
    args = (ctx.tp, ctx.microbatch_size, ctx.precision)
    compute, memory = [], []
    parts, on_dtensors = [], []
    for op, strats in zip(ops, strategies):
        compute.append(np.zeros(len(strats)))
        own = [np.asarray(cost_model.op_parts(op, _arg(p), *args, graph=graph, dtensor=p.strategy != "replicate"),
                          dtype=float) for p in strats]
        on_dtensors.append(np.array([
            np.asarray(cost_model.op_parts(op, None, *args, graph=graph, dtensor=True), dtype=float) - t
            if p.strategy == "replicate" else np.zeros(4) for p, t in zip(strats, own)]))
        # and FSDP2's fp32 sum of a linear's 16-bit weight gradient over micro-batches (any 16-bit tp plan), at its
        # many-micro-batch limit: a replicated weight's costs tp times a sharded one's. The ILP prices a layout for
        # any micro-batch count, and one micro-batch makes no sum; not at fp32 (autograd's sum), the precision of
        # CPU ranks, whose plans mostly run one micro-batch, where 16-bit plans at scale run many
        summed = [cost_model.grad_accumulation_time(op, _arg(p), ctx.tp, ctx.precision) if ctx.precision != "fp32"
                  else 0.0 for p in strats]
        parts.append(np.array([t + np.array([0.0, a, 0.0, 0.0]) for t, a in zip(own, summed)]))
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
    # linears reading one tensor in one placement: (source name, placement) -> readers, partial readers, meta
    groups: dict[tuple[str, str], tuple[list, list, Any]] = {}
    for v, op in enumerate(ops):
        for k, src_name in enumerate(op.inputs):
            meta = _edge_meta(producers.get(src_name))
            if meta is None:
                continue
            want = [_input(p, k) for p in strategies[v]]
            src_name = rewire.get(src_name, src_name) if src_name not in index else src_name
            u = index.get(src_name)
            shared = op.kind == "linear" and u != v
            if u is not None:
                table = np.zeros((len(strategies[u]), len(want))) if shared else \
                    np.array([[reshard(meta, a.output, w) for w in want] for a in strategies[u]])
                exclusions += [(u, i, v, j) for i, a in enumerate(strategies[u]) for j, w in enumerate(want)
                               if partial_mismatch(a.output, w) and (u != v or i == j)]
                if u == v:
                    compute[v] = compute[v] + np.diag(table)
                else:
                    edges.append((u, v, table))
            else:
                have = fixed[src_name].output if src_name in fixed else "R"
                if not shared:
                    compute[v] = compute[v] + np.array([reshard(meta, have, w) for w in want])
                exclusions += [(v, j, v, j) for j, w in enumerate(want) if partial_mismatch(have, w)]
            if shared:
                e = len(edges) - 1 if u is not None else None
                for j, (p, w) in enumerate(zip(strategies[v], want)):
                    readers, partial, _ = groups.setdefault((src_name, w), ([], [], meta))
                    readers.append((v, j, e))
                    if _partial_grad(p, w):
                        partial.append((v, j, e))
    shared_reads = []
    for (src_name, w), (readers, partial, meta) in groups.items():
        u = index.get(src_name)
        outs = [a.output for a in strategies[u]] if u is not None else \
            [fixed[src_name].output if src_name in fixed else "R"]
        once = np.array([reshard_cost(cost_model, meta, o, w, args) for o in outs])
        part = np.array([reshard_cost(cost_model, meta, o, w, args, partial=True) for o in outs]) - once
        shared_reads.append(SharedRead(u, readers, partial if part.any() else [], once, np.maximum(part, 0.0)))
    per_layer = [[index[n] for n in names if n in index] for names in layers] if layers else [list(range(len(ops)))]
    placed_outside = {p.module for p in fixed.values() if p.strategy != "replicate"}
    times = LayerTimes(parts, on_dtensors, [op.module_path for op in ops], [g for g in per_layer if g],
                       overlap=cost_model.async_host, local_call=tuple(cost_model.local_call_host),
                       fixed_on=frozenset(a for q in placed_outside for a in _ancestors(q)))
    return ILPProblem(names=[op.name for op in ops], strategies=strategies, compute=compute, memory=memory,
                      edges=edges, budget=budget, exclusions=exclusions, shared=shared_reads, times=times)


def add_fixed_consumers(problem: ILPProblem, ops: Sequence[OpNode], consumers: Sequence[OpNode],
                        fixed: Mapping[str, OpPlacement], cost_model: Any, ctx: CostContext) -> None:
    """Add to `problem` the re-sharding from its ops to already-placed consumers outside it (linear terms)."""
    index = {op.name: k for k, op in enumerate(ops)}
    args = (ctx.tp, ctx.microbatch_size, ctx.precision)
    shared: dict[tuple[int, str], bool] = {}  # linears reading (op u, placement): any of them column-parallel
    for c in consumers:
        for k, src_name in enumerate(c.inputs):
            if src_name not in index or c.name not in fixed:
                continue
            u = index[src_name]
            meta = _edge_meta(ops[u])
            if meta is None:
                continue
            want = _input(fixed[c.name], k)
            problem.exclusions += [(u, i, u, i) for i, p in enumerate(problem.strategies[u])
                                   if partial_mismatch(p.output, want)]
            if c.kind == "linear":  # one redistribution and one gradient reduction for all of them (SharedRead)
                shared[(u, want)] = shared.get((u, want), False) or _partial_grad(fixed[c.name], want)
                continue
            extra = [0.0 if p.output == want else reshard_cost(cost_model, meta, p.output, want, args)
                     for p in problem.strategies[u]]
            problem.compute[u] = problem.compute[u] + np.array(extra)
    for (u, want), partial in shared.items():
        meta = _edge_meta(ops[u])
        problem.compute[u] = problem.compute[u] + np.array(
            [reshard_cost(cost_model, meta, p.output, want, args, partial=partial) for p in problem.strategies[u]])


def reshard_cost(cost_model: Any, meta: Any, src: str, dst: str, args: tuple, partial: bool = False) -> float:
    """Forward + backward seconds of one re-sharding as the ILP prices an edge: the collectives (`reshard_time`;
    `partial`: the consumer's input gradient is a partial sum, reduced on the way back, Megatron's f) and, for each,
    the ranks' wait to line up (`reshard_wait`), which the step prediction charges every blocking collective on
    ranks sharing a host's cores. Without the wait the ILP took collectives for cheaper than the prediction does
    and could pick a layout with more of them that the prediction itself ranks slower."""
    if src == dst and not partial:
        return 0.0
    f, b = cost_model.reshard_time(meta, src, dst, *args, **({"consumer_partial_grad": True} if partial else {}))
    wait = cost_model.reshard_wait(args[0])
    return f + b + wait * ((f > 0) + (b > 0))


def _partial_grad(p: OpPlacement, want: str) -> bool:
    """Whether a linear under `p` reading its input as `want` makes a partial input gradient (column-parallel on a
    replicated read), as `cost_model.layers` charges it."""
    return p.strategy == "colwise" and want == "R"


def _ancestors(path: str) -> list[str]:
    """A module path and every ancestor of it, outermost first (`a`, `a.b`, `a.b.c`); none for the root ("")."""
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


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
            if name == "SCIP":
                solver.SetSolverSpecificParametersAsString(SCIP_PARAMETERS)
            break
    else:
        raise ILPError("no MILP back-end available in ortools (tried " + ", ".join(SOLVERS) + ")")
    x = add_one_strategy_per_op(solver, problem)
    y = add_edge_consistency(solver, problem, x)
    add_memory_limit(solver, problem, x)
    add_exclusions(solver, problem, x)
    add_requirements(solver, problem, x)
    add_objective(solver, problem, x, y, add_shared_reads(solver, problem, x, y) + add_layer_times(solver, problem, x))
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
    """sum of x[v, i] over each required set >= 1; sum_v x[v, c_v] <= n - 1 for each forbidden assignment c."""
    for req in problem.require_any:
        solver.Add(solver.Sum([x[v][i] for v, i in req]) >= 1)
    for c in problem.forbidden:
        solver.Add(solver.Sum([x[v][i] for v, i in enumerate(c)]) <= len(c) - 1)


def add_shared_reads(solver: Any, problem: ILPProblem, x: list[list[Any]], y: list[list[list[Any]]]) -> list[Any]:
    """For each shared read and source strategy i, z_any[i] >= the edge variable y[e, i, j] of every reader
    (x[v, j] for a fixed source) and z_part[i] likewise over the column-parallel readers: minimised, each is the OR
    of its readers, so the redistribution and the gradient reduction are paid once. Returns the objective terms."""
    terms = []
    for g, read in enumerate(problem.shared):
        for name, members, cost in (("any", read.readers, read.cost_any), ("part", read.partial, read.cost_part)):
            for i, c in enumerate(cost):
                if c <= 0.0 or not members:
                    continue
                z = solver.NumVar(0.0, 1.0, f"z_{name}[{g},{i}]")
                for v, j, e in members:
                    solver.Add(z >= (x[v][j] if read.source is None else y[e][i][j]))
                terms.append(float(c) * z)
    return terms


def add_layer_times(solver: Any, problem: ILPProblem, x: list[list[Any]]) -> list[Any]:
    """The layers' compute (`LayerTimes`) as objective terms. Per module path M, d[M] in [0, 1] is bounded below by
    and above by the sum of the x of the strategies that put it on DTensors (its `members`): with x integral, d[M]
    is their OR. A replicated op under M pays its DTensor extra through w >= x + d[M] - 1; a module M off DTensors
    under a parent on them is one local call, d[parent] - d[M]. With `overlap`, a pass costs T >= kernels and
    T >= host (minimised: their max); else their sum."""
    lt = problem.times
    if lt is None:
        return []
    d: dict[str, Any] = {"": 1.0}
    for layer in lt.layers:
        for m in lt.prefixes(layer):
            if m in d:
                continue
            members = lt.members(m, problem.strategies)
            if m in lt.fixed_on or not members:
                d[m] = 1.0 if m in lt.fixed_on else 0.0
                continue
            d[m] = solver.NumVar(0.0, 1.0, f"d[{m}]")
            for v, i in members:
                solver.Add(d[m] >= x[v][i])
            solver.Add(d[m] <= solver.Sum([x[v][i] for v, i in members]))
    terms = []
    for n, layer in enumerate(lt.layers):
        sums: list[list[Any]] = [[], [], [], []]
        for v in layer:
            for i, p in enumerate(problem.strategies[v]):
                for k in range(4):
                    if lt.parts[v][i][k]:
                        sums[k].append(float(lt.parts[v][i][k]) * x[v][i])
                extra = lt.on_dtensors[v][i]
                if not extra.any():
                    continue
                dm = d[lt.modules[v]]
                if isinstance(dm, float):
                    w = x[v][i] if dm else None
                else:
                    w = solver.NumVar(0.0, 1.0, f"w[{v},{i}]")
                    solver.Add(w >= x[v][i] + dm - 1)
                for k in range(4):
                    if w is not None and extra[k]:
                        sums[k].append(float(extra[k]) * w)
        for m in lt.prefixes(layer):
            for k, c in ((2, lt.local_call[0]), (3, lt.local_call[1])):
                if c:
                    sums[k].append(float(c) * (d[m.rpartition(".")[0]] - d[m]))
        if not lt.overlap:
            terms += [t for part in sums for t in part]
            continue
        for f, h, name in ((0, 2, "f"), (1, 3, "b")):
            t = solver.NumVar(0.0, solver.infinity(), f"T{name}[{n}]")
            solver.Add(t >= solver.Sum(sums[f]))
            solver.Add(t >= solver.Sum(sums[h]))
            terms.append(t)
    return terms


def add_objective(solver: Any, problem: ILPProblem, x: list[list[Any]], y: list[list[list[Any]]],
                  shared: Sequence[Any] = ()) -> None:
    """Minimise compute (with fixed-neighbour re-sharding folded in) plus edge re-sharding plus the shared reads'
    terms (`add_shared_reads`)."""
    terms = [float(problem.compute[v][i]) * x[v][i] for v in range(len(x)) for i in range(len(x[v]))]
    terms += list(shared)
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
