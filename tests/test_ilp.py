"""The placement ILP: optimum equals brute force; hand-computable answers; memory budget; block reuse."""
import numpy as np
import pytest

from planner.plan import OpPlacement
from planner.search.ilp import CostContext, ILPError, ILPProblem, LayerTimes, brute_force, build_problem, solve
from planner.search.placement import PlacementSolver
from planner.strategies import map_dim, placement_name, strategies_for
from test_search_fakes import FakeCostModel, make_op, mlp_block, tied_gpt, tiny_gpt


def _p(name: str) -> OpPlacement:
    return OpPlacement(strategy=name)


def random_problem(rng: np.random.Generator, n_ops: int, budget_frac: float | None) -> ILPProblem:
    sizes = rng.integers(1, 5, size=n_ops)
    strategies = [[_p(f"s{i}") for i in range(k)] for k in sizes]
    compute = [rng.uniform(0, 10, size=k) for k in sizes]
    memory = [rng.uniform(0, 10, size=k) for k in sizes]
    edges = []
    for v in range(1, n_ops):
        for u in rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False):
            edges.append((int(u), v, rng.uniform(0, 5, size=(sizes[u], sizes[v]))))
    budget = None
    if budget_frac is not None:
        lo = sum(m.min() for m in memory)
        hi = sum(m.max() for m in memory)
        budget = lo + budget_frac * (hi - lo)
    return ILPProblem(names=[f"op{v}" for v in range(n_ops)], strategies=strategies, compute=compute,
                      memory=memory, edges=edges, budget=budget)


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force_on_random_problems(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, n_ops=7, budget_frac=[None, 0.3, 0.6][seed % 3])
    ilp, ref = solve(problem), brute_force(problem)
    assert ilp.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)
    if problem.budget is not None:
        assert ilp.memory <= problem.budget + 1e-6


MODULES = ("b", "b.attn", "b.attn.q", "b.attn", "b.mlp", "b.mlp.fc", "")


def with_layer_times(rng: np.random.Generator, problem: ILPProblem, overlap: bool) -> ILPProblem:
    """`problem` with random per-layer kernels and host dispatch, DTensor extras on its replicated strategies (s0)
    and local-call costs over nested module paths."""
    n = len(problem.names)
    problem.strategies = [[_p("replicate")] + [_p(f"s{i}") for i in range(1, len(s))] for s in problem.strategies]
    parts = [rng.uniform(0, 3, size=(len(s), 4)) for s in problem.strategies]
    extra = [np.array([rng.uniform(0, 2, size=4) if i == 0 else np.zeros(4) for i in range(len(s))])
             for s in problem.strategies]
    cut = int(rng.integers(1, n))
    problem.times = LayerTimes(parts, extra, [MODULES[v % len(MODULES)] for v in range(n)],
                               [list(range(cut)), list(range(cut, n))], overlap=overlap,
                               local_call=tuple(rng.uniform(0, 1, size=2)),
                               fixed_on=frozenset({"b.mlp"}) if rng.uniform() < 0.3 else frozenset())
    return problem


@pytest.mark.parametrize("seed", range(12))
def test_layer_times_equal_brute_force_on_random_problems(seed):
    """Kernels and host combined per layer (their max per pass where the host runs ahead, their sum else), DTensor
    dispatch by module and local calls: the solver's linearisation gives brute force's optimum."""
    rng = np.random.default_rng(100 + seed)
    problem = with_layer_times(rng, random_problem(rng, n_ops=7, budget_frac=[None, 0.5][seed % 2]),
                               overlap=seed % 3 != 0)
    ilp, ref = solve(problem), brute_force(problem)
    assert ilp.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)
    assert problem.objective(ilp.choice) == pytest.approx(ilp.objective)


def test_a_host_bound_layer_costs_its_host_time():
    """Two ops whose sharded strategy cuts the kernels from 4 to 1 s but raises host dispatch from 1 to 4 s. Where
    the host runs ahead of the kernels a layer costs max(kernels, host): sharding one op gives max(5, 5) = 5 s,
    both max(2, 8) = 8 s, none max(8, 2) = 8 s, so the ILP shards one. Summed per op, as the ILP once priced it, all
    three cost 8 s; on one timeline (CPU ranks: kernels + host) all three cost 10 s."""
    strategies = [[_p("replicate"), _p("colwise")] for _ in range(2)]
    parts = [np.array([[4.0, 0, 1.0, 0], [1.0, 0, 4.0, 0]]) for _ in range(2)]
    none = [np.zeros((2, 4)) for _ in range(2)]

    def problem(overlap):
        return ILPProblem(names=["a", "b"], strategies=strategies, compute=[np.zeros(2), np.zeros(2)],
                          memory=[np.zeros(2), np.zeros(2)],
                          times=LayerTimes(parts, none, ["m.a", "m.b"], [[0, 1]], overlap=overlap))
    gpu = problem(True)
    assert [gpu.objective(c) for c in ((0, 0), (0, 1), (1, 0), (1, 1))] == [8.0, 5.0, 5.0, 8.0]
    sol = solve(gpu)
    assert sol.objective == 5.0 and sorted(sol.choice) == [0, 1]
    cpu = problem(False)
    assert {cpu.objective(c) for c in ((0, 0), (0, 1), (1, 1))} == {10.0}


def test_replicated_ops_of_a_placed_module_pay_dtensor_dispatch():
    """An op of module `m` left replicated dispatches as a DTensor op (+1 s) once another op of `m`, or of a module
    under it, is placed; one of an unplaced module nested in a placed one pays a local call instead (0.25 s), as
    `cost_model.layers` prices them."""
    strategies = [[_p("replicate"), _p("colwise")], [_p("replicate")], [_p("replicate")]]
    parts = [np.array([[1.0, 0, 0, 0], [0.5, 0, 0, 0]]), np.array([[1.0, 0, 0, 0]]), np.array([[1.0, 0, 0, 0]])]
    extra = [np.array([[0, 0, 1.0, 0], [0, 0, 0, 0]]), np.array([[0, 0, 1.0, 0]]), np.array([[0, 0, 1.0, 0]])]
    problem = ILPProblem(names=["lin", "act", "other"], strategies=strategies,
                         compute=[np.zeros(n) for n in (2, 1, 1)], memory=[np.zeros(n) for n in (2, 1, 1)],
                         times=LayerTimes(parts, extra, ["m.lin", "m", "m.other"], [[0, 1, 2]],
                                          local_call=(0.25, 0.0)))
    # replicated: nothing on DTensors; the outermost unplaced module m is one local call
    assert problem.objective((0, 0, 0)) == pytest.approx(3.0 + 0.25)
    # lin placed: m and m.lin on DTensors, act pays the DTensor extra, m.other is a local call
    assert problem.objective((1, 0, 0)) == pytest.approx(2.5 + 1.0 + 0.25)
    assert solve(problem).objective == pytest.approx(3.25)


def test_infeasible_budget_raises():
    problem = random_problem(np.random.default_rng(0), n_ops=4, budget_frac=0.0)
    problem.budget = sum(m.min() for m in problem.memory) * 0.5
    with pytest.raises(ILPError):
        solve(problem)
    with pytest.raises(ILPError):
        brute_force(problem)


def test_megatron_mlp_is_the_hand_optimum():
    """norm -> fc -> gelu -> proj: colwise/shard/rowwise computes 1/tp of fc, gelu and proj and pays one P->R
    all-reduce (2 s) on the way out; everything replicated costs 4 x 1 s. At tp=4: 1 + 3 x 0.25 + 2 = 3.75 s
    (the norm stays replicated: sharding it would cost a reshard back to R for the colwise input, 1 s, to save
    0.75 s)."""
    ops = [make_op("in", "elementwise", [], (1, 8, 16))] + mlp_block("b", "in")[:4]
    cm = FakeCostModel()
    ctx = CostContext(tp=4, microbatch_size=1, precision="bf16")
    cands = {op.name: strategies_for(op, 4) for op in ops[1:]}
    producers = {op.name: op for op in ops}
    consumer = make_op("out", "elementwise", ["b_proj"], (1, 8, 16))
    problem = build_problem(ops[1:], cands, cm, ctx, producers=producers, fixed={})
    from planner.search.ilp import add_fixed_consumers
    add_fixed_consumers(problem, ops[1:], [consumer], {"out": strategies_for(consumer, 4)[0]}, cm, ctx)
    sol = solve(problem)
    names = [problem.strategies[v][i].strategy for v, i in enumerate(sol.choice)]
    assert names == ["replicate", "colwise", "shard", "rowwise"]
    assert sol.objective == pytest.approx(1 + 3 * 0.25 + 2.0)
    assert sol.objective == pytest.approx(brute_force(problem).objective)


def test_each_collective_pays_the_ranks_wait():
    """The same MLP on ranks that reach each collective apart (`reshard_wait`, 0.5 s here): Megatron's layout pays
    its all-reduce's two directions (the fake prices both) and a wait for each, 3.75 + 2 x 0.5 = 4.75 s, so the
    replicated MLP (4 s, no collective) is cheaper, as the step prediction would rank them."""
    class Waiting(FakeCostModel):
        @staticmethod
        def reshard_wait(tp):
            return 0.5

    ops = [make_op("in", "elementwise", [], (1, 8, 16))] + mlp_block("b", "in")[:4]
    cm = Waiting()
    ctx = CostContext(tp=4, microbatch_size=1, precision="bf16")
    cands = {op.name: strategies_for(op, 4) for op in ops[1:]}
    consumer = make_op("out", "elementwise", ["b_proj"], (1, 8, 16))
    problem = build_problem(ops[1:], cands, cm, ctx, producers={op.name: op for op in ops}, fixed={})
    from planner.search.ilp import add_fixed_consumers, reshard_cost
    add_fixed_consumers(problem, ops[1:], [consumer], {"out": strategies_for(consumer, 4)[0]}, cm, ctx)
    sol = solve(problem)
    assert [problem.strategies[v][i].strategy for v, i in enumerate(sol.choice)] == ["replicate"] * 4
    assert sol.objective == pytest.approx(4.0)
    meta = ops[4].output_meta[0]
    assert reshard_cost(cm, meta, "P", "R", (4, 1, "bf16")) == pytest.approx(2.0 + 2 * 0.5)
    assert reshard_cost(cm, meta, "R", "R", (4, 1, "bf16")) == 0.0  # no collective, no wait


def test_adding_two_partial_sums_saves_an_all_reduce():
    """Two rowwise Linears (x -> p1, x -> p2) added, feeding a replicated consumer: reading the partial sums
    directly (P + P -> P, a free P -> P edge) pays one P -> R all-reduce after the add (2 s) instead of one per
    Linear. Linears 2 x 1/2 s, the add 1 s on whole tensors, one all-reduce: 1 + 1 + 2 = 4 s. Without partial
    inputs the best is the sequence-sharded add: two reduce-scatters (1 s each), the add 1/2 s, an all-gather 1 s,
    4.5 s (replicated: two all-reduces, 1 + 1 + 4 = 6 s)."""
    from planner.graph import OpGraph
    from planner.search.ilp import add_fixed_consumers
    from planner.strategies import partial_inputs
    x = make_op("x", "elementwise", [], (1, 8, 16))
    lin = [make_op(n, "linear", ["x"], (1, 8, 16), [(f"{n}.weight", (16, 16))], in_shapes=[(1, 8, 16)])
           for n in ("p1", "p2")]
    add = make_op("add", "elementwise", ["p1", "p2"], (1, 8, 16))
    out = make_op("out", "elementwise", ["add"], (1, 8, 16))
    graph = OpGraph(model_name="pp", ops=(x, *lin, add, out), parameters=(), batch_size=1)
    partial = partial_inputs(graph, 2)
    assert partial["add"] == frozenset({0, 1})
    cm = FakeCostModel()
    ctx = CostContext(tp=2, microbatch_size=1, precision="bf16")
    cands = {op.name: [p for p in strategies_for(op, 2) if p.strategy == "rowwise"] for op in lin}
    ops = [*lin, add]

    def solved(add_cands):
        problem = build_problem(ops, {**cands, "add": add_cands}, cm, ctx, producers={o.name: o for o in graph.ops},
                                fixed={"x": strategies_for(x, 2)[0]})
        add_fixed_consumers(problem, ops, [out], {"out": strategies_for(out, 2)[0]}, cm, ctx)
        sol = solve(problem)
        assert sol.objective == pytest.approx(brute_force(problem).objective)
        return problem.strategies[2][sol.choice[2]], sol.objective

    chosen, cost = solved(strategies_for(add, 2, partial["add"]))
    assert placement_name(chosen) == "partial: P,P -> P" and cost == pytest.approx(4.0)
    chosen, cost = solved(strategies_for(add, 2))
    assert chosen.strategy == "sequence" and cost == pytest.approx(4.5)


def test_a_partial_input_is_never_fed_anything_but_a_partial_sum():
    """The add's partial candidate made free: with its producers replicated (their rowwise priced out) it still
    cannot be chosen, since the executor cannot turn a replica or a shard into partial sums."""
    from planner.graph import OpGraph
    from planner.search.ilp import partial_mismatch
    from planner.strategies import partial_inputs
    lin = [make_op(n, "linear", ["x"], (1, 8, 16), [(f"{n}.weight", (16, 16))], in_shapes=[(1, 8, 16)])
           for n in ("p1", "p2")]
    add = make_op("add", "elementwise", ["p1", "p2"], (1, 8, 16))
    graph = OpGraph(model_name="pp", ops=(*lin, add), parameters=(), batch_size=1)
    cm = FakeCostModel(overrides={("p1", "rowwise"): 50.0, ("p2", "rowwise"): 50.0, ("add", "partial"): 0.0})
    ctx = CostContext(tp=2, microbatch_size=1, precision="bf16")
    cands = {op.name: strategies_for(op, 2, partial_inputs(graph, 2).get(op.name, frozenset())) for op in graph.ops}
    assert "partial" in {p.strategy for p in cands["add"]}
    problem = build_problem(list(graph.ops), cands, cm, ctx, producers={o.name: o for o in graph.ops}, fixed={})
    sol = solve(problem)
    assert [problem.strategies[v][i].strategy for v, i in enumerate(sol.choice)][:2] != ["rowwise", "rowwise"]
    assert problem.strategies[2][sol.choice[2]].strategy != "partial"
    assert partial_mismatch("S(2)", "P") and partial_mismatch("R", "P") and not partial_mismatch("P", "P")


def test_memory_budget_forces_sharding():
    """A replicated-is-faster linear (override) flips to colwise when the budget excludes its full weight."""
    op = make_op("fc", "linear", ["x"], (1, 8, 64), [("fc.weight", (64, 16))], in_shapes=[(1, 8, 16)])
    x = make_op("x", "elementwise", [], (1, 8, 16))
    cm = FakeCostModel(overrides={("fc", "colwise"): 5.0, ("fc", "rowwise"): 5.0})
    ctx = CostContext(tp=2, microbatch_size=1, precision="bf16")
    cands = {"fc": strategies_for(op, 2)}
    free = solve(build_problem([op], cands, cm, ctx, producers={"x": x}, fixed={}))
    assert cands["fc"][free.choice[0]].strategy == "replicate"
    weight, act = 64 * 16 * 4, 64 * 8 * 4
    tight = build_problem([op], cands, cm, ctx, producers={"x": x}, fixed={}, budget=weight / 2 + act)
    sol = solve(tight)
    assert cands["fc"][sol.choice[0]].strategy in ("colwise", "rowwise")
    assert sol.memory <= weight / 2 + act


def test_block_solved_once_and_reused_for_copies():
    g = tiny_gpt(n_blocks=4)
    solver = PlacementSolver(g, FakeCostModel())
    res = solver.solve(tp=4, microbatch_size=1, precision="bf16", sp=False)
    assert solver.solves == 2  # one block ILP + the ops outside blocks
    for k in range(4):
        assert res.ops[f"h.{k}_fc"].strategy == "colwise"
        assert res.ops[f"h.{k}_fc"].module == f"h.{k}.mlp.fc"
        assert res.ops[f"h.{k}_proj"].strategy == "rowwise"
    solver.solve(tp=4, microbatch_size=1, precision="bf16", sp=False)
    assert solver.solves == 2  # cached
    assert solver.solve(tp=1, microbatch_size=1, precision="bf16").ops == {}


def test_sequence_parallel_switch():
    g = tiny_gpt(n_blocks=2)
    solver = PlacementSolver(g, FakeCostModel())
    on = solver.solve(tp=2, microbatch_size=1, precision="bf16", sp=True)
    off = solver.solve(tp=2, microbatch_size=1, precision="bf16", sp=False)
    assert on.sequence_parallel and on.ops["h.0_ln"].strategy == "sequence"
    assert not off.sequence_parallel
    assert all(p.strategy != "sequence" for p in off.ops.values())


def test_strategy_registry():
    fc = make_op("fc", "linear", ["x"], (2, 8, 64), [("w", (64, 16)), ("b", (64,))], in_shapes=[(2, 8, 16)])
    names = {p.strategy: p for p in strategies_for(fc, 4)}
    assert set(names) == {"replicate", "colwise", "rowwise"}
    assert names["colwise"].params == ("S(0)", "S(0)") and names["colwise"].output == "S(2)"
    assert names["rowwise"].params == ("S(1)", "R") and names["rowwise"].output == "P"
    assert placement_name(names["colwise"]) == "colwise: R -> S(2) | S(0),S(0)"
    assert [p.strategy for p in strategies_for(fc, 1)] == ["replicate"]
    # 64 output features do not split 3 ways; 16 input features neither
    assert [p.strategy for p in strategies_for(fc, 3)] == ["replicate"]
    unknown = make_op("u", "mystery", ["x"])
    assert [p.strategy for p in strategies_for(unknown, 8)] == ["replicate"]
    sdpa = make_op("a", "attention", ["q", "k", "v"], (2, 4, 8, 4), in_shapes=[(2, 4, 8, 4)] * 3)
    assert [p.strategy for p in strategies_for(sdpa, 4)] == ["replicate", "heads"]
    assert [p.strategy for p in strategies_for(sdpa, 8)] == ["replicate"]


def test_map_dim_through_views_and_transposes():
    assert map_dim((2, 8, 16), (2, 8, 4, 4), 2) == 2          # split hidden into heads
    assert map_dim((2, 8, 4, 4), (2, 4, 8, 4), 2, "transpose") == 1
    assert map_dim((2, 4, 8, 4), (2, 8, 4, 4), 1, "transpose") == 2
    assert map_dim((2, 8, 4, 4), (2, 8, 16), 2) == 2          # merge heads back
    assert map_dim((2, 8, 16), (16, 16), 1) is None           # sequence shard is not contiguous after flatten
    assert map_dim((2, 4, 4, 4), (2, 4, 4, 4), 1, "transpose") is None  # ambiguous


def test_block_problem_from_a_graph_matches_brute_force():
    """The real block problem (rewired boundary edge, sequence and shard options) on a 5-op block at tp=2."""
    g = tiny_gpt(n_blocks=2)
    cm = FakeCostModel()
    ctx = CostContext(tp=2, microbatch_size=2, precision="bf16")
    ops = [g.op(f"h.1_{s}") for s in ("ln", "fc", "act", "proj", "add")]
    cands = {op.name: strategies_for(op, 2) for op in ops}
    rewire = {f"h.0_{s}": f"h.1_{s}" for s in ("ln", "fc", "act", "proj", "add")}
    producers = {op.name: op for op in g.ops}
    for frac in (None, 0.2):
        problem = build_problem(ops, cands, cm, ctx, producers=producers, fixed={}, rewire=rewire)
        if frac is not None:
            lo, hi = sum(m.min() for m in problem.memory), sum(m.max() for m in problem.memory)
            problem.budget = lo + frac * (hi - lo)
        assert any(u == 4 for u, _, _ in problem.edges)  # the boundary edge h.1_add -> h.1_ln / h.1_add
        assert solve(problem).objective == pytest.approx(brute_force(problem).objective)


@pytest.mark.parametrize("seed", range(6))
def test_excluded_pairs_are_never_chosen_and_the_optimum_equals_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    problem = random_problem(rng, n_ops=6, budget_frac=[None, 0.6][seed % 2])
    for _ in range(8):
        u, v = (int(a) for a in rng.choice(6, size=2, replace=False))
        problem.exclusions.append((u, int(rng.integers(len(problem.strategies[u]))), v,
                                   int(rng.integers(len(problem.strategies[v])))))
    problem.exclusions.append((0, 0, 0, 0))  # strategy 0 of op 0 on its own
    ilp = _solve_as_brute_force(problem)
    assert ilp is None or ilp.choice[0] != 0


def _solve_as_brute_force(problem: ILPProblem):
    """The ILP's answer, asserted allowed and as cheap as enumeration's; None when both find the problem infeasible."""
    try:
        ref = brute_force(problem)
    except ILPError:
        with pytest.raises(ILPError):
            solve(problem)
        return None
    ilp = solve(problem)
    assert problem.allows(ilp.choice)
    assert ilp.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)
    return ilp


@pytest.mark.parametrize("seed", range(6))
def test_required_sets_are_met_and_the_optimum_equals_brute_force(seed):
    """Each required set (at least one of its (op, strategy) pairs, as forced tp requires a sharded Linear) is met
    by the ILP's answer, which is the cheapest answer that meets them."""
    rng = np.random.default_rng(200 + seed)
    problem = random_problem(rng, n_ops=6, budget_frac=[None, 0.6][seed % 2])
    for _ in range(2):
        ops = [int(v) for v in rng.choice(6, size=2, replace=False) if len(problem.strategies[int(v)]) > 1]
        problem.require_any.append([(v, i) for v in ops for i in range(1, len(problem.strategies[v]))])
    ilp = _solve_as_brute_force(problem)
    if ilp is not None:  # never cheaper than without the requirements
        assert ilp.objective >= brute_force(ILPProblem(**{**problem.__dict__, "require_any": []})).objective - 1e-9


def test_a_tied_embedding_and_head_lay_the_weight_out_alike():
    """Forced to shard a Linear (`shard_a_linear`) in a model whose only Linear is the head, the ILP may not pick
    rowwise (S(1)) or colwise (S(0)) against a replicated embedding: the weight is one tensor. The only consistent
    sharded answer is vocab + colwise, though a rowwise head and a replicated embedding are priced cheaper here."""
    from planner.strategies import plan_tp_problems
    from test_search_fakes import RESHARD
    g = tied_gpt(n_blocks=0)
    cheap = {k: v / 1000 for k, v in RESHARD.items()}
    solver = PlacementSolver(g, FakeCostModel(reshard=cheap, overrides={("head", "colwise"): 5.0,
                                                                        ("emb", "vocab"): 5.0}))
    res = solver.solve(tp=2, microbatch_size=1, precision="bf16", sp=False, shard_a_linear=True)
    assert res.ops["head"].strategy == "colwise" and res.ops["emb"].strategy == "vocab"
    assert plan_tp_problems(g, res.ops, 2) == []
    assert plan_tp_problems(g, solver.solve(tp=2, microbatch_size=1, precision="bf16", sp=False).ops, 2) == []


def test_shard_a_linear_takes_the_cheapest_layout_with_a_sharded_linear_in_every_block():
    """Layout changes cost seconds, so the free answer shards nothing. Required to shard a Linear in every block,
    the ILP takes the cheapest such layout: with fc's colwise split priced high, only proj goes rowwise (its input
    split for free, one all-reduce after it), fc and the head stay replicated. Sharding every Linear would
    cost more (the test's second half)."""
    g = tiny_gpt(n_blocks=2)
    dear = {(f"h.{k}_fc", "colwise"): 100.0 for k in range(2)}
    solver = PlacementSolver(g, FakeCostModel(overrides=dear))
    assert solver.solve(tp=2, microbatch_size=1, precision="bf16", sp=False).ops == {}
    res = solver.solve(tp=2, microbatch_size=1, precision="bf16", sp=False, shard_a_linear=True)
    for k in range(2):
        assert res.ops[f"h.{k}_proj"].strategy == "rowwise" and f"h.{k}_fc" not in res.ops
    assert "head" not in res.ops
    cm, ctx = solver.cost_model, CostContext(tp=2, microbatch_size=1, precision="bf16")
    ops = [g.op(n) for n in ("h.1_ln", "h.1_fc", "h.1_act", "h.1_proj", "h.1_add")]
    cands = solver._candidates(ops, 2, (False, True))
    problem = build_problem(ops, cands, cm, ctx, producers={o.name: o for o in g.ops}, fixed={},
                            rewire={"h.0_add": "h.1_add"})
    chosen = [next(i for i, p in enumerate(cands[o.name]) if p == res.ops.get(o.name, cands[o.name][0]))
              for o in ops]
    for i in range(1, len(cands["h.1_fc"])):  # sharding fc too, in any allowed way, costs more than the answer
        alt = list(chosen)
        alt[1] = i
        if problem.allows(alt):
            assert problem.objective(alt) > problem.objective(chosen)


def test_a_colwise_refusal_in_one_block_copy_holds_for_every_copy():
    """The block ILP is solved on one copy and its answer copied by position: h.1's proj may go colwise on its own
    (its output reaches only the head), h.0's may not (the next block's norm reduces over it), so neither does."""
    g = tiny_gpt(n_blocks=2)
    solver = PlacementSolver(g, FakeCostModel())
    refused = solver.refused_colwise(2)
    assert "h.0.mlp.proj" in refused and "h.1.mlp.proj" not in refused
    for name in ("h.0_proj", "h.1_proj"):
        assert "colwise" not in {p.strategy for p in solver._candidates([g.op(name)], 2, (False, False))[name]}


def test_a_traced_parallel_block_sums_its_partial_sums_before_reducing():
    """GPT-J's parallel block, `x + (attn(h) + mlp(h))`, planned with the real cost model at tp=2: with the output
    projections rowwise, the ILP adds their partial sums (P + P -> P) and all-reduces once, not once per branch.
    (Trained under tp=2 by tests/zoo_worker.py, its losses match one process within 1e-6.)"""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.dtensor_rules import propagate
    from planner.model_file import ModelFile, default_loss
    from planner.trace import trace_model

    hidden, heads, seq = 1024, 8, 128

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.qkv = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(3))
            self.o, self.fc, self.proj = nn.Linear(hidden, hidden), nn.Linear(hidden, 4 * hidden), \
                nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, t, c = x.shape
            h = self.ln(x)
            q, k, v = (lin(h).view(b, t, heads, c // heads).transpose(1, 2) for lin in self.qkv)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            return x + (self.o(y) + self.proj(F.gelu(self.fc(h))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(hidden, 64)

        def forward(self, idx):
            x = self.emb(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    mf = ModelFile(path="parallel_block", build_model=Model, loss_fn=default_loss,
                   sample_batch=lambda n: (torch.randint(0, 64, (n, seq)), torch.randint(0, 64, (n, seq))))
    graph = trace_model(mf, batch_size=4, progress=False)
    result = PlacementSolver(graph, CostModel(load_cluster("cpu-local"))).solve(2, 4, "fp32", sp=False)
    sums = [graph.op(n) for n in graph.index if graph.op(n).inputs[1:] and
            {graph.op(s).module_path.rpartition(".")[2] for s in graph.op(n).inputs} == {"o", "proj"}]
    assert len(sums) == 2
    for op in sums:
        p = result.ops[op.name]
        assert placement_name(p) == "partial: P,P -> P"
        assert {result.ops[s].strategy for s in op.inputs} == {"rowwise"}
        r = propagate(op, p.inputs, p.params, 2)
        assert r.runs_as_placed and r.output == "P"


def _qkv(norm_strategy: str):
    """A norm read by three column-parallel linears (q, k, v), the norm's strategy fixed to `norm_strategy`."""
    x = make_op("x", "elementwise", [], (1, 8, 16))
    n = make_op("n", "norm", ["x"], (1, 8, 16), [("n.weight", (16,))], module="n")
    lins = [make_op(q, "linear", ["n"], (1, 8, 16), [(f"{q}.weight", (16, 16))], in_shapes=[(1, 8, 16)], module=q)
            for q in ("q", "k", "v")]
    cands = {"n": [p for p in strategies_for(n, 2) if p.strategy == norm_strategy],
             **{op.name: [p for p in strategies_for(op, 2) if p.strategy == "colwise"] for op in lins}}
    return x, n, lins, cands


@pytest.mark.parametrize("norm, shared", [("sequence", 1.0 + 0.5), ("replicate", 0.5)])
def test_linears_reading_one_tensor_share_its_redistribution(norm, shared):
    """q, k and v read the norm's output column-parallel: the executor redistributes it once for the three and
    reduces its input gradient once (Megatron's f), as the step prediction prices them, so the ILP pays one S -> R
    (1 s in the fake for these 128 elements) and one reduction (0.5 s), not three of each; from a replicated norm
    only the reduction."""
    x, n, lins, cands = _qkv(norm)
    ctx = CostContext(tp=2, microbatch_size=1, precision="bf16")
    problem = build_problem([n, *lins], cands, FakeCostModel(partial_reduce=0.5), ctx,
                            producers={o.name: o for o in (x, n, *lins)}, fixed={})
    sol = solve(problem)
    compute = problem.times.seconds(sol.choice, problem.strategies)
    assert sol.objective - compute == pytest.approx(shared)
    assert sol.objective == pytest.approx(brute_force(problem).objective)


def test_fixed_linear_readers_share_one_redistribution():
    """The same three linears already placed outside the problem: their reads are folded into the norm's cost once."""
    from planner.search.ilp import add_fixed_consumers
    x, n, lins, cands = _qkv("sequence")
    ctx = CostContext(tp=2, microbatch_size=1, precision="bf16")
    cm = FakeCostModel(partial_reduce=0.5)
    problem = build_problem([n], {"n": cands["n"]}, cm, ctx, producers={o.name: o for o in (x, n)}, fixed={})
    before = problem.compute[0].copy()
    add_fixed_consumers(problem, [n], lins, {op.name: cands[op.name][0] for op in lins}, cm, ctx)
    assert problem.compute[0] - before == pytest.approx([1.0 + 0.5])


@pytest.mark.parametrize("seed", range(6))
def test_shared_reads_solve_to_the_brute_force_optimum(seed):
    from planner.search.ilp import SharedRead
    rng = np.random.default_rng(100 + seed)
    problem = random_problem(rng, n_ops=6, budget_frac=None)
    sizes = [len(s) for s in problem.strategies]
    for _ in range(3):
        e = int(rng.integers(len(problem.edges)))
        u, v, _ = problem.edges[e]
        others = [(k, w) for k, (uu, w, _) in enumerate(problem.edges) if uu == u and w != v]
        members = [(v, int(rng.integers(sizes[v])), e)] + [(w, int(rng.integers(sizes[w])), k) for k, w in others]
        fixed_source = bool(rng.integers(2))
        n = 1 if fixed_source else sizes[u]
        problem.shared.append(SharedRead(None if fixed_source else u, members, members[:1],
                                         rng.uniform(0, 5, size=n), rng.uniform(0, 5, size=n)))
    assert solve(problem).objective == pytest.approx(brute_force(problem).objective, rel=1e-9, abs=1e-9)
