"""A tensor-parallel plan must train the model's own function.

The executor runs every op on DTensors, so an op that splits, chunks or reduces along a colwise Linear's sharded
dim (a fused gate/up projection then `chunk(2)`) computes the right thing, but only by gathering the whole tensor
first, which the plan would not price. `planner.shard_flow` finds such ops and `plan` keeps those Linears off
colwise, with a note; a tp plan without parameter placements is refused before launch.

The net under all of it, every zoo model and bundled example training its own function under tp, is
tests/test_zoo.py.
"""
import json
import os
from dataclasses import replace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(ROOT, "tests", "zoo")
EXAMPLES = os.path.join(ROOT, "examples")
TOL = 1e-5
STEPS = 3
BATCH = 4


def _graph(path):
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    return trace_model(load_model_file(path), batch_size=2, progress=False)


def _colwise_problems(graph, colwise, tp=2):
    from planner.shard_flow import split_problems
    return split_problems(graph, colwise, tp)


# ---- the shard-flow check on its own ------------------------------------------------------------------------------

def test_chunk_of_a_colwise_fused_gate_up_is_found():
    g = _graph(os.path.join(ZOO, "swiglu_fused.py"))
    probs = _colwise_problems(g, {"h.0.mlp.gate_up", "h.0.attn.q", "h.0.attn.k", "h.0.attn.v"})
    assert [m for m, _ in probs] == ["h.0.mlp.gate_up"]
    assert "chunk" in probs[0][1] and "sharded dim 2" in probs[0][1]


def test_separate_gate_and_up_and_heads_views_are_fine():
    g = _graph(os.path.join(ZOO, "swiglu_separate.py"))
    cols = {f"h.{i}.{m}" for i in range(2) for m in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")}
    assert _colwise_problems(g, cols) == []


def test_nanogpt_fused_qkv_split_is_found():
    g = _graph(os.path.join(ZOO, "nanogpt_fused_qkv.py"))
    probs = _colwise_problems(g, {"h.0.attn.c_attn", "h.0.mlp.c_fc"})
    assert [m for m, _ in probs] == ["h.0.attn.c_attn"] and "split" in probs[0][1]


def test_view_into_an_outer_factor_tp_does_not_divide_is_found(tmp_path):
    """[b, s, 3h] -> [b, s, 3, heads, hd] then unbind: each rank would hold a mix of q, k and v."""
    model = tmp_path / "packed.py"
    model.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class A(nn.Module):\n"
        "    def __init__(s):\n"
        "        super().__init__(); s.qkv = nn.Linear(32, 96); s.out = nn.Linear(32, 32)\n"
        "    def forward(s, x):\n"
        "        b, t, _ = x.shape\n"
        "        q, k, v = s.qkv(x).view(b, t, 3, 4, 8).transpose(1, 3).unbind(2)\n"
        "        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))\n"
        "        return s.out(y.transpose(1, 2).reshape(b, t, 32))\n"
        "class M(nn.Module):\n"
        "    def __init__(s):\n"
        "        super().__init__(); s.h = nn.ModuleList(A() for _ in range(2))\n"
        "    def forward(s, x):\n"
        "        for a in s.h: x = x + a(x)\n"
        "        return x\n"
        "def build_model(): return M()\n"
        "def sample_batch(b): return torch.randn(b, 8, 32), torch.randn(b, 8, 32)\n")
    probs = _colwise_problems(_graph(str(model)), {"h.0.qkv"})
    assert len(probs) == 1 and "outer factor of 3" in probs[0][1]


@pytest.mark.parametrize("example", ["gpt.py", "llama.py", "hf_llama.py"])
def test_bundled_megatron_pairs_pass(example):
    if example.startswith("hf_"):
        pytest.importorskip("transformers")
    from planner.defaults import refused_pairs
    assert refused_pairs(_graph(os.path.join(EXAMPLES, example)), 2) == {}


def test_colwise_refusals_are_per_linear_not_per_pair():
    """The search's filter walks each Linear on its own: the fused gate_up is never colwise, but its sibling down
    projection keeps colwise unless its own output is misread (here the next block's norm reduces over it), and
    attention's q/k/v (whose views and SDPA keep head shards) are never refused."""
    from planner.shard_flow import colwise_refusals
    r = colwise_refusals(_graph(os.path.join(ZOO, "swiglu_fused.py")), 2)
    own = {m for m, (_, where) in r.items() if where == m.rpartition(".")[0]}
    assert own == {"h.0.mlp.gate_up", "h.1.mlp.gate_up"}
    assert "chunk" in r["h.0.mlp.gate_up"][0]
    assert r["h.0.mlp.down"][1] == "h.1.ln1"
    assert not any(m.endswith(("attn.q", "attn.k", "attn.v")) for m in r)


def test_partial_sums_reaching_attention_are_refused_rowwise():
    """nanoGPT's fused c_attn rowwise would feed partial sums through split/view/transpose straight into SDPA;
    the out-projections and the MLP's down projection (residual add, then a norm) stay free to be rowwise."""
    from planner.shard_flow import partial_refusals
    r = partial_refusals(_graph(os.path.join(ZOO, "nanogpt_fused_qkv.py")))
    assert set(r) == {"h.0.attn.c_attn", "h.1.attn.c_attn"}
    assert "scaled_dot_product_attention" in r["h.0.attn.c_attn"][0] and r["h.0.attn.c_attn"][1] == "h.0.attn"


# ---- what the planner and `plan measure` do with it ---------------------------------------------------------------

def _plan(tmp_path, model, name, force):
    from planner.cli import main as plan_main
    out = tmp_path / f"{name}.json"
    code = plan_main([str(model), "--cluster", "cpu-local", "--batch-size", str(BATCH), "--precision", "fp32",
                      "--force", force, "-o", str(out)])
    return code, out


def test_plan_keeps_the_fused_gate_up_off_colwise_and_says_so(tmp_path, capsys):
    from planner.plan import Plan
    code, out = _plan(tmp_path, os.path.join(ZOO, "swiglu_fused.py"), "tp", "tp=2")
    assert code == 0
    printed = capsys.readouterr().out
    assert "kept from column-parallel" in printed and "h.0.mlp.gate_up" in printed and "chunk" in printed
    plan = Plan.load(out)
    placed = {p.module: p.strategy for p in plan.ops.values()}
    assert placed.get("h.0.mlp.gate_up") != "colwise" and placed.get("h.1.mlp.gate_up") != "colwise"


def test_plan_problems_name_the_module_and_the_op():
    from planner.defaults import megatron_placements
    from planner.strategies import plan_tp_problems
    g = _graph(os.path.join(ZOO, "swiglu_separate.py"))
    fused = _graph(os.path.join(ZOO, "swiglu_fused.py"))
    ops = megatron_placements(fused, 2, False)
    gate_up = next(op for op in fused.ops if op.module_path == "h.0.mlp.gate_up")
    down = next(op for op in fused.ops if op.module_path == "h.0.mlp.down")
    sep_col = next(p for op, p in megatron_placements(g, 2, False).items() if p.strategy == "colwise")
    sep_row = next(p for op, p in megatron_placements(g, 2, False).items() if p.strategy == "rowwise")
    ops[gate_up.name] = replace(sep_col, module="h.0.mlp.gate_up")
    ops[down.name] = replace(sep_row, module="h.0.mlp.down")
    problems = plan_tp_problems(fused, ops, 2)
    assert len(problems) == 1 and problems[0].startswith("module h.0.mlp.gate_up: op chunk")


def test_plan_measure_refuses_a_tp_plan_without_placements(tmp_path, capsys):
    """A hand-written mesh-only tp plan: the executor never derives a layout of its own; one line names the fix."""
    from planner.cli import main as plan_main
    code, out = _plan(tmp_path, os.path.join(ZOO, "swiglu_fused.py"), "tp", "tp=2")
    assert code == 0
    d = json.loads(out.read_text())
    d["ops"], d["parameters"] = {}, {}
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(d))
    capsys.readouterr()
    assert plan_main(["measure", str(bare), os.path.join(ZOO, "swiglu_fused.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "places no parameter" in err[0] and "--force tp=2" in err[0], err
