"""What a tensor-parallel plan must satisfy (`planner.strategies.plan_tp_problems`), and that the search writes the
placement ILP's own answer: no layout replaces it, a tp whose answer shards nothing is skipped (or, when tp is
forced, solved again with the Linears sharded), and a flat block gets sharded like any other."""
import json
import os

import pytest
from shared import SMALL_GPT

from planner.defaults import megatron_placements
from planner.errors import PlanError
from planner.strategies import TPModule, module_strategies, plan_tp_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _mods():
    m = [TPModule(path="wte", kind="embedding")]
    m += [TPModule(path=f"h.0.attn.{n}", kind="linear") for n in "qkvo"]
    return m + [TPModule(path="h.0.ln", kind="norm"), TPModule(path="lm_head", kind="linear")]


def _placed(graph, wanted):
    """Op name -> the candidate placement of that strategy (`planner.strategies`), for {op name: strategy}."""
    from planner.strategies import strategies_for
    return {n: next(p for p in strategies_for(graph.op(n), 2) if p.strategy == s) for n, s in wanted.items()}


def test_any_layout_passes_but_a_tied_weight_laid_out_twice():
    """No pair structure is required any more (a lone colwise, a lone rowwise, sequence norms without
    pairs); a tied weight's holders must agree, a replicated holder counting as R."""
    from test_search_fakes import tied_gpt
    g = tied_gpt(2)
    for wanted in ({"emb": "vocab", "head": "colwise", "h.0_fc": "colwise", "h.0_proj": "rowwise"},
                   {"h.0_fc": "colwise"}, {"h.1_fc": "rowwise"}, {"h.0_fc": "colwise", "h.1_proj": "rowwise"},
                   {"h.0_ln": "sequence", "h.1_fc": "colwise"}, {}):
        assert plan_tp_problems(g, _placed(g, wanted), 2) == [], wanted
    for wanted in ({"head": "colwise"}, {"emb": "vocab"}, {"emb": "vocab", "head": "rowwise"}):
        problems = plan_tp_problems(g, _placed(g, wanted), 2)
        assert len(problems) == 1 and "tied parameter emb.weight is laid out differently" in problems[0], wanted


def test_one_strategy_per_module():
    from planner.plan import OpPlacement
    ops = {"a": OpPlacement(strategy="colwise", module="h.0.attn.q"),
           "b": OpPlacement(strategy="rowwise", module="h.0.attn.q"),
           "c": OpPlacement(strategy="heads", module="h.0.attn")}  # an activation placement: not a module's
    strategies, problems = module_strategies(ops, _mods())
    assert strategies == {"h.0.attn.q": "colwise"}
    assert len(problems) == 1 and "h.0.attn.q is placed both colwise and rowwise" in problems[0]


def test_a_parameter_sharded_on_a_dim_tp_does_not_divide_is_a_problem():
    from test_search_fakes import tiny_gpt
    from planner.strategies import strategies_for
    g = tiny_gpt(1)
    fc = next(op for op in g.ops if op.kind == "linear" and op.block is not None)
    col = next(p for p in strategies_for(fc, 2) if p.strategy == "colwise")
    assert plan_tp_problems(g, {fc.name: col}, 2) == []
    problems = plan_tp_problems(g, {fc.name: col}, 3)  # 64 output features do not split 3 ways
    assert problems and all("tp=3 does not divide" in p for p in problems)


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_megatron_placements_of_the_examples_pass(example):
    """The layout a hand-written mesh-only plan gets (`default_plan`) passes the same checks."""
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    g = trace_model(load_model_file(os.path.join(EXAMPLES, example)))
    for sp in (False, True):
        ops = megatron_placements(g, 2, sp)
        assert plan_tp_problems(g, ops, 2) == []
        strategies = {p.module: p.strategy for p in ops.values() if p.strategy in ("colwise", "rowwise", "vocab")}
        assert sorted(set(strategies.values())) == ["colwise", "rowwise", "vocab"]
        assert all(p.strategy not in ("colwise", "rowwise") or g.op(n).kind == "linear" for n, p in ops.items())
        assert not any(g.op(n).kind == "loss" for n in ops)  # the loss reads gathered logits


def test_every_ranked_plan_passes_and_is_the_ilps_answer():
    from test_search_fakes import RESHARD, FakeCostModel, fake_cluster, tiny_gpt
    from planner.search.outer import OuterSearch
    graph = tiny_gpt(4)
    cheap = {k: v / 1000 for k, v in RESHARD.items()}  # layout changes cheap enough that tp=2 shards something
    for sp in (0, 1):
        search = OuterSearch(graph, fake_cluster(nodes=1, devices_per_node=8),
                             FakeCostModel(default_time=1.0, reshard=cheap), batch_size=16, forced={"tp": 2, "sp": sp})
        result = search.run()
        assert result.ranked
        for s in result.ranked:
            assert plan_tp_problems(graph, s.plan.ops, s.plan.mesh.tp) == []
            ilp = search.placer.solve(2, s.plan.microbatch_size, "bf16", bool(sp))
            assert dict(s.plan.ops) == dict(ilp.ops)
        assert not any("Megatron" in n for n in result.notes)


def _search(forced, reshard_scale=1.0, **kw):
    from test_search_fakes import RESHARD, FakeCostModel, fake_cluster, tiny_gpt
    from planner.search.outer import OuterSearch
    reshard = {k: v * reshard_scale for k, v in RESHARD.items()}
    search = OuterSearch(tiny_gpt(2), fake_cluster(nodes=1, devices_per_node=2),
                         FakeCostModel(default_time=1e-3, reshard=reshard), batch_size=4, forced=forced, **kw)
    return search, search.run()


def test_an_all_replicated_tp_is_skipped_unless_forced():
    """The fake's layout changes cost seconds against 1 ms ops: the ILP shards nothing at tp=2 (dp=1 keeps the
    tp=2 groups' compute bound below tp=1's, so they are visited)."""
    search, res = _search({"dp": 1})
    assert all(s.plan.mesh.tp == 1 for s in res.ranked)
    assert "tp=2: the placement ILP found no weight worth sharding at tp=2 on this cluster" in " ".join(res.notes)
    assert search.placer.solve(2, 1, "bf16", False).ops == {}
    search, res = _search({"tp": 2, "sp": 0})
    assert res.ranked and all(s.plan.mesh.tp == 2 for s in res.ranked)
    assert any("tp=2 is forced: solved again with at least one Linear of every block" in n for n in res.notes)
    for s in res.ranked:
        for k in range(2):  # a Linear of each block sharded, colwise or rowwise as the ILP chose
            assert {f"h.{k}_fc", f"h.{k}_proj"} & set(s.plan.ops)
        assert dict(s.plan.ops) == dict(search.placer.solve(2, s.plan.microbatch_size, "bf16", False,
                                                            shard_a_linear=True).ops)
    assert not any("Megatron" in n for n in res.notes)
    _, res = _search({"sp": 1})  # sequence parallelism forced: tp > 1 is what the user asked for
    assert res.ranked and all(s.plan.mesh.tp == 2 and s.plan.sequence_parallel for s in res.ranked)
    assert any("sp=1 is forced: solved again with at least one Linear of every block" in n for n in res.notes)


def test_an_all_replicated_tp_is_solved_sharded_when_no_other_plan_exists():
    """A batch of 1 on 2 devices without a pipeline leaves only dp=1 x tp=2, where the ILP shards nothing: the
    search said "no candidate plan could be built" (a tiny Llama on 4 DGX H100 at batch 12 met it); it now solves
    that tp as a forced one and says so."""
    from test_search_fakes import RESHARD, FakeCostModel, fake_cluster, tiny_gpt
    from planner.search.outer import OuterSearch
    search = OuterSearch(tiny_gpt(2), fake_cluster(nodes=1, devices_per_node=2),
                         FakeCostModel(default_time=1e-3, reshard=RESHARD), batch_size=1, forced={"pp": 1})
    res = search.run()
    assert res.ranked and all(s.plan.mesh.tp == 2 for s in res.ranked)
    for s in res.ranked:
        assert dict(s.plan.ops) == dict(search.placer.solve(2, 1, "bf16", s.plan.sequence_parallel,
                                                            shard_a_linear=True).ops)
    assert any("tp=2: the placement ILP found no weight worth sharding (first seen at micro-batch size 1), but no "
               "plan without it was found: solved again with at least one Linear of every block" in n
               for n in res.notes)
    assert not any(n.endswith("skipped") for n in res.notes), res.notes  # the first pass's note is withdrawn


def test_ilp_failure_and_layout_problems_skip_the_tp_with_one_note(monkeypatch):
    from planner.search.ilp import ILPError
    from planner.search.outer import OuterSearch
    from planner.search.placement import PlacementSolver
    solve = PlacementSolver.solve

    def failing(self, tp, *a, **kw):
        if tp > 1:
            raise ILPError("SCIP: status 6")
        return solve(self, tp, *a, **kw)
    monkeypatch.setattr(PlacementSolver, "solve", failing)
    with pytest.raises(PlanError, match="tp=2: the placement ILP failed .SCIP: status 6; micro-batch size"):
        _search({"tp": 2, "sp": 0})
    monkeypatch.setattr(PlacementSolver, "solve", solve)
    monkeypatch.setattr(OuterSearch, "tp_problems", lambda self, ops, tp: ["module h.0.mlp.fc: a made-up problem"])
    with pytest.raises(PlanError, match="the placement ILP's layout cannot be a plan .module h.0.mlp.fc: a made-up"):
        _search({"tp": 2, "sp": 0}, reshard_scale=1e-4)
    # tp not forced: the tp=1 plans remain, one note says why tp=2 is gone
    _, res = _search({"dp": 1}, reshard_scale=1e-4)
    assert res.ranked and all(s.plan.mesh.tp == 1 for s in res.ranked)
    assert sum("a made-up problem" in n for n in res.notes) == 1


# ---- through `plan`, on the CPU profile -------------------------------------------------------------------------

def _plan(tmp_path, model, force, capsys):
    from planner.cli import main as plan_main
    from planner.plan import Plan
    out = tmp_path / "plan.json"
    args = [str(model), "--cluster", "cpu-local", "--batch-size", "4", "--precision", "fp32", "-o", str(out),
            "--json"]
    assert plan_main(args + (["--force", force] if force else [])) == 0
    report = json.loads(capsys.readouterr().out)
    assert not any("failed the dry run" in n for n in report["notes"])  # the best plan runs, as written
    return Plan.load(out), report


def _small_gpt(tmp_path):
    model = tmp_path / "small_gpt.py"
    model.write_text(SMALL_GPT.format(examples=EXAMPLES))
    return model


def _graph(path):
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    return trace_model(load_model_file(str(path)), progress=False)


def test_forced_tp_writes_the_ilps_answer_for_a_small_gpt(tmp_path, capsys):
    """(a) At --force tp=2 the plan carries the ILP's placements as solved (or, when they shard nothing, the
    cheapest layout with a Linear of every block sharded), no other layout substituted."""
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.search.placement import PlacementSolver
    model = _small_gpt(tmp_path)
    plan, report = _plan(tmp_path, model, "tp=2", capsys)
    assert "Megatron" not in json.dumps(report)
    g = _graph(model)
    blocks = {op.block for op in g.ops if op.kind == "linear" and op.block is not None}
    for block in blocks:
        assert any(plan.ops[op.name].strategy in ("colwise", "rowwise") for op in g.ops
                   if op.kind == "linear" and op.block == block and op.name in plan.ops)
    assert plan_tp_problems(g, plan.ops, 2) == []
    solver = PlacementSolver(g, CostModel(load_cluster("cpu-local")))
    ilp = solver.solve(2, plan.microbatch_size, "fp32", plan.sequence_parallel)
    if all(p.strategy == "sequence" for p in ilp.ops.values()):  # sharded nothing: solved again, as the note says
        assert any("tp=2 is forced: solved again with at least one Linear" in n for n in report["notes"])
        ilp = solver.solve(2, plan.microbatch_size, "fp32", plan.sequence_parallel, shard_a_linear=True)
    assert {k: (p.strategy, p.inputs, p.output, p.params) for k, p in plan.ops.items()} == \
        {k: (p.strategy, p.inputs, p.output, p.params) for k, p in ilp.ops.items()}


FLAT = """
import torch, torch.nn as nn, torch.nn.functional as F
H, HEADS, V, T = 64, 4, 128, 16
class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        s.q, s.k, s.v, s.o = (nn.Linear(H, H) for _ in range(4))
        s.fc, s.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    def forward(s, x):
        b, t, _ = x.shape
        y = s.ln1(x)
        q, k, v = (m(y).view(b, t, HEADS, H // HEADS).transpose(1, 2) for m in (s.q, s.k, s.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, H)
        x = x + s.o(a)
        return x + s.proj(F.gelu(s.fc(s.ln2(x))))
class Flat(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(V, H)
        s.h = nn.ModuleList(Block() for _ in range(2))
        s.ln_f, s.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)
    def forward(s, idx):
        x = s.emb(idx)
        for blk in s.h:
            x = blk(x)
        return s.head(s.ln_f(x))
def build_model():
    return Flat()
def sample_batch(b):
    return torch.randint(0, V, (b, T)), torch.randint(0, V, (b, T))
"""


def test_a_flat_block_gets_tp_placements_with_no_problems(tmp_path, capsys):
    """(b) q, k, v, o, fc, proj all direct children of the block: each offered to the ILP sharded (colwise or
    rowwise), the plan shards Linears of every block as the ILP chooses, nothing refused."""
    from cost_model.model import CostModel
    from hardware_profiles.load import load_cluster
    from planner.search.placement import PlacementSolver
    model = tmp_path / "flat.py"
    model.write_text(FLAT)
    plan, report = _plan(tmp_path, model, "tp=2", capsys)
    g = _graph(model)
    assert plan.mesh.tp == 2 and plan_tp_problems(g, plan.ops, 2) == []
    placed = {p.module: p.strategy for p in plan.ops.values()}
    solver = PlacementSolver(g, CostModel(load_cluster("cpu-local")))
    names = ("q", "k", "v", "o", "fc", "proj")
    for i in range(2):
        assert {placed.get(f"h.{i}.{m}") for m in names} & {"colwise", "rowwise"}
        for m in names:
            op = next(o for o in g.ops if o.module_path == f"h.{i}.{m}" and o.kind == "linear")
            offered = {p.strategy for p in solver._candidates([op], 2, (False, False))[op.name]}
            assert offered & {"colwise", "rowwise"}, (m, offered)
    assert not any("skipped" in n or "kept from" in n or "Megatron" in n for n in report["notes"])


def test_a_search_skips_an_all_replicated_tp_with_a_note(tmp_path, capsys):
    """(c) Not forced: on 2 CPU ranks the small GPT's tp=2 ILP shards nothing, so tp=2 is not a candidate."""
    plan, report = _plan(tmp_path, _small_gpt(tmp_path), None, capsys)
    assert plan.mesh.tp == 1
    notes = " ".join(report["notes"])
    assert "the placement ILP found no weight worth sharding at tp=2 on this cluster" in notes
    assert "Megatron" not in notes


def test_a_layout_that_shards_no_weight_counts_as_sharding_nothing():
    """The executor refuses a tp plan that places no parameter, so activations alone (sequence-parallel norms, a
    root-level elementwise op split) are not a tp layout: the search treats it as sharding nothing."""
    from planner.plan import OpPlacement
    from planner.search.outer import _shards_nothing
    from planner.search.placement import PlacementResult
    seq = OpPlacement(strategy="sequence", inputs=("S(1)",), output="S(1)", params=("R",))
    split = OpPlacement(strategy="shard", inputs=("S(2)",), output="S(2)")
    col = OpPlacement(strategy="colwise", inputs=("R",), output="S(2)", params=("S(0)", "S(0)"))
    assert _shards_nothing(PlacementResult(ops={"n": seq, "x": split}, sequence_parallel=True))
    assert not _shards_nothing(PlacementResult(ops={"n": seq, "fc": col}, sequence_parallel=True))


def test_forced_sp_on_hf_llama_plans_a_runnable_layout(tmp_path, capsys):
    """transformers' Llama at --force tp=2,sp=1 on 2 CPU ranks: the ILP's free answer split only activations (a
    root-level op and the sequence-parallel norms), which the executor refuses; it is solved again with a Linear of
    every block sharded, and the plan passes the dry run."""
    pytest.importorskip("transformers")
    plan, report = _plan(tmp_path, os.path.join(EXAMPLES, "hf_llama.py"), "tp=2,sp=1", capsys)
    assert plan.mesh.tp == 2 and plan.parameters
    assert any("solved again with at least one Linear of every block" in n for n in report["notes"])
