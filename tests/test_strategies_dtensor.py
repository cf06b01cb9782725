"""Candidates from DTensor's own sharding propagation (`planner.dtensor_rules`) and how `strategies_for` uses it.

Ops are built by hand (`make_op`, real targets) or traced from a small model, and DTensor runs them on meta
DTensors over a mesh with no process group: Megatron's Linear splits, the vocabulary-parallel embedding, the
sequence-parallel norm, head-parallel attention, views through heads, an op DTensor has no rule for.
"""
import dataclasses
import os

import pytest
import torch.distributed as dist

from planner import dtensor_rules
from planner.dtensor_rules import propagate
from planner.strategies import partial_inputs, placement_name, strategies_for
from test_search_fakes import make_op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _with(op, **changes):
    return dataclasses.replace(op, **changes)


FC = make_op("fc", "linear", ["x"], (2, 8, 64), [("fc.weight", (64, 16)), ("fc.bias", (64,))],
             in_shapes=[(2, 8, 16)])
PROJ = make_op("proj", "linear", ["x"], (2, 8, 16), [("proj.weight", (16, 64)), ("proj.bias", (16,))],
               in_shapes=[(2, 8, 64)])


def test_linear_colwise_and_rowwise():
    col = propagate(FC, ("R",), ("S(0)", "S(0)"), 2)
    assert col.output == "S(2)" and col.runs_as_placed
    row = propagate(PROJ, ("S(2)",), ("S(1)", "R"), 2)
    assert row.output == "P" and row.runs_as_placed  # the bias R -> P is DTensor's own (local) way, not a move
    # a column-sharded weight reading a sequence-sharded input: DTensor all-gathers the input first
    wrong = propagate(FC, ("S(1)",), ("S(0)", "S(0)"), 2)
    assert wrong is not None and not wrong.runs_as_placed and wrong.redistributes
    assert not dist.is_initialized()  # no process group was needed


def test_embedding_vocab_parallel_gives_a_partial_sum():
    emb = make_op("emb", "embedding", [], (2, 8, 16), [("emb.weight", (32, 16))])
    r = propagate(emb, ("R",), ("S(0)",), 2)
    assert r.output == "P" and r.runs_as_placed
    assert propagate(emb, ("R",), ("S(1)",), 2).output == "S(2)"  # hidden-sharded table: hidden-sharded output


def test_layernorm_runs_on_sequence_shards_not_hidden_shards():
    ln = make_op("ln", "norm", ["x"], (2, 8, 16), [("ln.weight", (16,)), ("ln.bias", (16,))])
    seq = propagate(ln, ("S(1)",), ("R", "R"), 2)
    assert seq.output == "S(1)" and seq.runs_as_placed
    hidden = propagate(ln, ("S(2)",), ("R", "R"), 2)
    assert not hidden.runs_as_placed  # normalising over the sharded dim needs the whole row
    assert [placement_name(p) for p in strategies_for(ln, 2)] == ["replicate: R -> R | R,R",
                                                                 "sequence: S(1) -> S(1) | R,R"]


def test_sdpa_shards_heads_not_sequence():
    sdpa = make_op("a", "attention", ["q", "k", "v"], (2, 4, 8, 4), in_shapes=[(2, 4, 8, 4)] * 3,
                   target="F.scaled_dot_product_attention")
    sdpa = _with(sdpa, args=("T", "T", "T", ("is_causal", True)))
    heads = propagate(sdpa, ("S(1)",) * 3, (), 2)
    assert heads.output == "S(1)" and heads.runs_as_placed
    assert not propagate(sdpa, ("S(2)",) * 3, (), 2).runs_as_placed  # keys and values are needed whole
    assert [p.strategy for p in strategies_for(sdpa, 2)] == ["replicate", "heads"]


def test_attention_inputs_are_enumerated_jointly_with_a_head_shard():
    """q, k, v and a producer-fed [seq, seq] mask (which the registry's all-4-d rule does not cover): one placement
    for q, k and v together; the mask, of another rank, stays replicated; only the heads run without moving."""
    sdpa = make_op("a", "attention", ["q", "k", "v", "mask"], (2, 4, 8, 4),
                   in_shapes=[(2, 4, 8, 4)] * 3 + [(8, 8)], target="F.scaled_dot_product_attention")
    sdpa = _with(sdpa, args=("T", "T", "T", ("attn_mask", "T")))
    from planner.strategies import _RULES, _joint_combinations
    assert _RULES["attention"](sdpa, 2) == []
    assert _joint_combinations(sdpa, 2) == [("S(1)",) * 3 + ("R",), ("S(2)",) * 3 + ("R",),
                                            ("S(3)",) * 3 + ("R",)]
    assert [placement_name(p) for p in strategies_for(sdpa, 2)] == ["replicate: R,R,R,R -> R",
                                                                   "heads: S(1),S(1),S(1),R -> S(1)"]
    # grouped-query attention: k and v with 2 heads for q's 4 shard on heads too at tp=2, not at tp=4
    gqa = make_op("g", "attention", ["q", "k", "v"], (2, 4, 8, 4), in_shapes=[(2, 4, 8, 4)] + [(2, 2, 8, 4)] * 2,
                  target="F.scaled_dot_product_attention")
    gqa = _with(gqa, args=("T", "T", "T", ("enable_gqa", True)))
    assert ("S(1)",) * 3 in {p.inputs for p in strategies_for(gqa, 2)}
    assert [p.strategy for p in strategies_for(gqa, 4)] == ["replicate"]


def test_add_of_two_partial_sums_is_a_partial_sum():
    add = make_op("add", "elementwise", ["a", "b"], (2, 8, 16))
    assert all("P" not in p.inputs for p in strategies_for(add, 2))  # no producer gives P: none offered
    got = {p.inputs: (p.strategy, p.output) for p in strategies_for(add, 2, frozenset({0, 1}))}
    assert got[("P", "P")] == ("partial", "P")
    assert got[("R", "P")] == ("partial", "P")  # DTensor splits the replica locally: x/tp + partial sums
    assert ("P", "S(1)") not in got  # DTensor would reduce-scatter the partial sums first
    view = _with(make_op("v", "reshape", ["a"], (2, 8, 4, 4), in_shapes=[(2, 8, 16)], target="Tensor.view"),
                 args=("T", 2, 8, 4, 4))
    assert ("partial", "P") in {(p.strategy, p.output) for p in strategies_for(view, 2, frozenset({0}))}


def test_a_nonlinear_op_never_reads_a_partial_sum():
    """gelu(P) would need the sum first (DTensor all-reduces); a norm or softmax is not offered P at all (the
    registry's pruning: only elementwise and reshape ops may read partial sums)."""
    gelu = make_op("g", "elementwise", ["a"], (2, 8, 16), target="F.gelu")
    assert propagate(gelu, ("P",), (), 2).redistributes == ("input 0 P -> R",)
    assert all("P" not in p.inputs for p in strategies_for(gelu, 2, frozenset({0})))
    sm = _with(make_op("sm", "softmax", ["s"], (2, 4, 8, 8), target="F.softmax"), args=("T", ("dim", -1)))
    assert all("P" not in p.inputs for p in strategies_for(sm, 2, frozenset({0})))


def test_partial_inputs_follow_partial_sums_through_the_graph():
    """Two rowwise Linears (partial outputs) added, then negated, then gelu'd: the add and the neg may read P, the
    gelu's consumer may not; an embedding's (masked) partial sum is never offered onward."""
    from planner.graph import OpGraph
    emb = make_op("emb", "embedding", [], (2, 8, 16), [("emb.weight", (32, 16))], module="emb")
    ops = [emb, make_op("x", "elementwise", ["emb"], (2, 8, 16), target="torch.neg"),
           _with(PROJ, name="p1", inputs=("x",), module_path="p1"), _with(PROJ, name="p2", inputs=("x",),
                                                                         module_path="p2"),
           make_op("add", "elementwise", ["p1", "p2"], (2, 8, 16)),
           make_op("neg", "elementwise", ["add"], (2, 8, 16), target="torch.neg"),
           make_op("gelu", "elementwise", ["neg"], (2, 8, 16), target="F.gelu"),
           make_op("out", "elementwise", ["gelu"], (2, 8, 16), target="torch.neg")]
    graph = OpGraph(model_name="p", ops=tuple(ops), parameters=(), batch_size=2)
    assert partial_inputs(graph, 2) == {"add": frozenset({0, 1}), "neg": frozenset({0}), "gelu": frozenset({0})}


def test_view_through_heads_follows_the_shard():
    view = make_op("view", "reshape", ["fc"], (2, 8, 4, 16), in_shapes=[(2, 8, 64)], target="Tensor.view")
    view = _with(view, args=("T", 2, 8, 4, 16))
    assert propagate(view, ("S(2)",), (), 2).output == "S(2)"  # hidden shard -> heads shard
    assert propagate(view, ("S(1)",), (), 2).output == "S(1)"
    t = make_op("t", "reshape", ["view"], (2, 4, 8, 16), in_shapes=[(2, 8, 4, 16)], target="Tensor.transpose")
    t = _with(t, args=("T", 1, 2))
    assert propagate(t, ("S(2)",), (), 2).output == "S(1)"
    outs = {p.inputs: p.output for p in strategies_for(view, 2)[1:]}
    assert outs == {("S(1)",): "S(1)", ("S(2)",): "S(2)"}


def test_an_op_without_a_rule_keeps_replicate_only():
    renorm = make_op("r", "elementwise", ["x"], (2, 8, 16), target="torch.renorm")
    renorm = _with(renorm, args=("T", 2, 0, 1.0))  # DTensor registers no sharding strategy for aten.renorm
    assert propagate(renorm, ("R",), (), 2) is None
    assert [p.strategy for p in strategies_for(renorm, 2)] == ["replicate"]
    custom = make_op("c", "elementwise", ["x"], (2, 8, 16), target="mymodel.fused_bias_gelu")
    assert propagate(custom, ("R",), (), 2) is None  # a custom function: nothing to call
    assert [p.strategy for p in strategies_for(custom, 2)] == ["replicate"]


def test_strategies_for_puts_replicate_first_and_keeps_what_dtensor_confirms():
    cands = strategies_for(FC, 2)
    assert cands[0].strategy == "replicate"
    assert [placement_name(p) for p in cands[1:]] == ["colwise: R -> S(2) | S(0),S(0)",
                                                      "rowwise: S(2) -> P | S(1),R"]
    assert all(p.module == "fc" for p in cands)
    assert [p.strategy for p in strategies_for(FC, 1)] == ["replicate"]
    for p in cands[1:]:
        assert propagate(FC, p.inputs, p.params, 2).runs_as_placed


def test_a_registry_proposal_dtensor_cannot_run_is_dropped():
    """A LayerNorm over the last two dims ([seq, hidden]): the registry proposes the sequence shard, but the norm
    reduces over the sequence dim too, so DTensor would all-gather it first: only replicate remains."""
    from planner.strategies import _RULES
    ln = make_op("ln", "norm", ["x"], (2, 8, 16), [("ln.weight", (8, 16))])
    assert [p.strategy for p in _RULES["norm"](ln, 2)] == ["sequence"]
    assert not propagate(ln, ("S(1)",), ("R",), 2).runs_as_placed
    assert [p.strategy for p in strategies_for(ln, 2)] == ["replicate"]


def test_matmul_gets_the_sharded_dims_dtensor_offers():
    """q @ k^T on [b, heads, s, hd] x [b, heads, hd, s]: heads (registry), and from enumeration the query's sequence
    dim or the key's sequence dim sharded alone; the contraction (a partial sum) is not offered."""
    mm = make_op("mm", "matmul", ["q", "kt"], (2, 4, 8, 8), in_shapes=[(2, 4, 8, 16), (2, 4, 16, 8)],
                 target="torch.matmul")
    got = {p.inputs: (p.strategy, p.output) for p in strategies_for(mm, 2)}
    assert got[("R", "R")] == ("replicate", "R")
    assert got[("S(1)", "S(1)")] == ("heads", "S(1)")
    assert got[("S(2)", "R")] == ("shard", "S(2)")
    assert got[("R", "S(3)")] == ("shard", "S(3)")
    assert all(out != "P" for _, out in got.values())
    assert all(inputs[0] != "S(0)" for inputs in got)  # dim 0 (the batch) never sharded over tp


def test_softmax_over_rows_may_shard_the_rows_not_the_reduced_dim():
    sm = make_op("sm", "softmax", ["scores"], (2, 4, 8, 8), target="F.softmax")
    sm = _with(sm, args=("T", ("dim", -1)))
    got = {p.inputs: p.output for p in strategies_for(sm, 2)}
    assert got == {("R",): "R", ("S(1)",): "S(1)", ("S(2)",): "S(2)"}  # never S(3): softmax reduces over it


def test_elementwise_enumeration_adds_only_what_runs_without_moving_inputs():
    add = make_op("add", "elementwise", ["a", "b"], (2, 8, 16))
    got = {p.inputs: (p.strategy, p.output) for p in strategies_for(add, 2)}
    assert got == {("R", "R"): ("replicate", "R"), ("S(1)", "S(1)"): ("sequence", "S(1)"),
                   ("S(2)", "S(2)"): ("shard", "S(2)")}


def test_a_reduction_over_the_hidden_dim_runs_on_sequence_shards(llama_graph):
    """A hand-written RMSNorm's `mean(-1, keepdim=True)` keeps a sequence shard (no all-gather of its fp32 input
    before it, and none back to the shard after), and never reads a shard of the dim it reduces."""
    mean = next(op for op in llama_graph.ops if op.target == "aten.mean.dim")
    got = {(p.strategy, p.inputs, p.output) for p in strategies_for(mean, 2)}
    assert ("sequence", ("S(1)",), "S(1)") in got
    assert all(p.inputs != ("S(2)",) for p in strategies_for(mean, 2))


def test_the_sequence_parallel_layout_keeps_every_norm_on_sequence_shards(llama_graph):
    """Megatron's layout with sequence parallelism (`plan --force tp=..,sp=1` without a search) places the RMSNorm's
    mean on the sequence shard like the rest of the norm, so nothing in a norm gathers."""
    from planner.defaults import megatron_placements
    ops = megatron_placements(llama_graph, 2, sequence_parallel=True)
    means = [op.name for op in llama_graph.ops if op.target == "aten.mean.dim"]
    assert means and all(ops[m].inputs == ("S(1)",) and ops[m].output == "S(1)" for m in means)


def test_results_are_cached_per_signature():
    other = _with(FC, name="fc2", module_path="h.1.fc")
    strategies_for(FC, 2)
    size = dtensor_rules.cache_size()
    again = strategies_for(other, 2)
    assert dtensor_rules.cache_size() == size
    assert all(p.module == "h.1.fc" for p in again)


@pytest.fixture(scope="module")
def llama_graph():
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    return trace_model(load_model_file(os.path.join(ROOT, "examples", "llama.py")), batch_size=2, progress=False)


def test_every_candidate_of_a_traced_llama_runs_as_placed(llama_graph):
    """Every non-replicate candidate of every op (partial-sum inputs offered where a producer can output one) is
    one DTensor runs without a communicating redistribution, and its stated output is DTensor's; ops DTensor cannot
    rebuild (the loss) are replicate only."""
    partial = partial_inputs(llama_graph, 2)
    assert any(p.strategy == "partial" for op in llama_graph.ops
               for p in strategies_for(op, 2, partial.get(op.name, frozenset())))
    for op in llama_graph.ops:
        cands = strategies_for(op, 2, partial.get(op.name, frozenset()))
        assert cands[0].strategy == "replicate"
        for p in cands[1:]:
            r = propagate(op, p.inputs, p.params, 2)
            assert r is not None and r.runs_as_placed and r.output == p.output, (op.name, placement_name(p), r)
    loss = llama_graph.op("loss")
    assert [p.strategy for p in strategies_for(loss, 2)] == ["replicate"]


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_plan_force_tp2_writes_plans_that_pass_the_dry_run(example, tmp_path, capsys):
    """`plan --force tp=2` on the bundled GPT and Llama: the plan passes the dry run (the executor asserts every
    module call's propagated output against the plan), and every placed op's output is DTensor's own."""
    import json

    from planner.cli import main
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    model = os.path.join(ROOT, "examples", example)
    out = tmp_path / "tp.json"
    assert main([model, "--cluster", "cpu-local", "--batch-size", "4", "--precision", "fp32", "--force", "tp=2",
                 "-o", str(out)]) == 0
    assert "dry run: ok" in capsys.readouterr().out
    ops = json.loads(out.read_text())["ops"]
    assert any(p["strategy"] == "colwise" for p in ops.values())
    graph = trace_model(load_model_file(model), batch_size=4, progress=False)
    for name, p in ops.items():
        r = propagate(graph.op(name), tuple(p["inputs"]), tuple(p["params"]), 2)
        assert r is not None and r.runs_as_placed and r.output == p["output"], (name, p, r)


def test_propagation_meshes_never_equal_a_real_one():
    """DTensor caches decisions by mesh equality: the propagation mesh must not pass for an executor's tp mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    propagate(FC, ("R",), ("S(0)", "S(0)"), 2)
    real = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",), _init_backend=False, _rank=0)
    assert dtensor_rules._mesh(2) != real


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_tensor_keyword_arguments_keep_their_producers(tracer):
    """`torch.addmm(c, mat2=b, mat1=a)`: the traced op lists its tensors (and producers) in call order (fx: c, b,
    a; export calls aten positionally: c, a, b); the call is rebuilt with each keyword fed its own tensor (sorting
    the keywords by name would hand mat1 b's [8, 6] tensor and fail), and a placement of b lands on mat2."""
    import torch
    import torch.nn as nn

    from planner.model_file import ModelFile, default_loss
    from planner.trace import trace_model

    class KeywordCall(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 8), nn.Linear(16, 48), nn.Linear(16, 6)

        def forward(self, x):
            a = self.a(x)  # [4, 8]
            b = self.b(x).view(8, 24)[:, :6]  # [8, 6]
            c = self.c(x)[0]  # [6]
            return torch.addmm(c, mat2=b, mat1=a)

    mf = ModelFile(path="keyword_call", build_model=KeywordCall, loss_fn=default_loss,
                   sample_batch=lambda n: (torch.randn(4, 16), torch.randn(4, 6)))
    graph = trace_model(mf, batch_size=4, progress=False, tracers=(tracer,))
    op = next(o for o in graph.ops if "addmm" in o.target)
    shapes = [(6,), (8, 6), (4, 8)] if tracer == "fx" else [(6,), (4, 8), (8, 6)]
    assert [graph.op(src).output_meta[0].shape for src in op.inputs] == shapes
    assert propagate(op, ("R", "R", "R"), (), 2).output == "R"
    b_sharded = ("R", "S(1)", "R") if tracer == "fx" else ("R", "R", "S(1)")
    assert propagate(op, b_sharded, (), 2).output == "S(1)"  # mat2 sharded on its columns


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_a_buffer_read_before_the_producer_keeps_replicated(tracer):
    """`torch.mm(self.table, h)` with a registered buffer first: the producer's placement goes to h (its tensor,
    `OpNode.input_sources`), not to the first tensor of the call. h sharded on its columns gives column shards;
    handing that placement to the buffer instead would make a partial sum."""
    import torch
    import torch.nn as nn

    from planner.model_file import ModelFile, default_loss
    from planner.trace import trace_model

    class BufferFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.register_buffer("table", torch.randn(8, 4))

        def forward(self, x):
            return torch.mm(self.table, self.fc(x))  # [8, 4] @ [4, 16]

    mf = ModelFile(path="buffer_first", build_model=BufferFirst, loss_fn=default_loss,
                   sample_batch=lambda n: (torch.randn(4, 16), torch.randn(8, 16)))
    graph = trace_model(mf, batch_size=4, progress=False, tracers=(tracer,))
    op = next(o for o in graph.ops if o.inputs == (graph.module_op("fc").name,))
    assert op.input_sources == (-1, 0)
    r = propagate(op, ("S(1)",), (), 2)
    assert r.output == "S(1)" and r.runs_as_placed
