"""The search only writes tensor-parallel layouts the executor applies (`planner.strategies.tp_layout_problems`)."""
import os

import pytest

from planner.defaults import megatron_placements
from planner.strategies import TPModule, plan_tp_problems, tp_layout_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mods():
    m = [TPModule(path="wte", kind="embedding", position="pre", params=("wte.weight",))]
    m += [TPModule(path=f"h.0.attn.{n}", kind="linear", position="block", params=(f"h.0.attn.{n}.weight",))
          for n in ("q", "k", "v", "o")]
    m += [TPModule(path="h.0.ln", kind="norm", position="block", params=("h.0.ln.weight",)),
          TPModule(path="lm_head", kind="linear", position="post", params=("wte.weight",))]
    return m


MEGATRON = {"h.0.attn.q": "colwise", "h.0.attn.k": "colwise", "h.0.attn.v": "colwise", "h.0.attn.o": "rowwise",
            "wte": "vocab", "lm_head": "colwise"}


def test_contract_accepts_megatron_and_names_each_unsupported_layout():
    assert tp_layout_problems(_mods(), MEGATRON, False) == []
    assert tp_layout_problems(_mods(), {**MEGATRON, "h.0.ln": "sequence"}, True) == []
    cases = [({**MEGATRON, "h.0.attn.o": "colwise"}, False, "h.0.attn.q is colwise without a rowwise"),
             ({**MEGATRON, "h.0.attn.k": "replicate"}, False, "not one Megatron pair"),
             ({**MEGATRON, "lm_head": "replicate"}, False, "tied parameter wte.weight"),
             (MEGATRON, True, "h.0.ln must be sequence-parallel"),
             ({**MEGATRON, "h.0.ln": "sequence"}, False, "sequence_parallel off")]
    for layout, sp, words in cases:
        problems = tp_layout_problems(_mods(), layout, sp)
        assert problems and words in problems[0], (layout, problems)


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_megatron_placements_of_the_examples_are_runnable(example):
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    g = trace_model(load_model_file(os.path.join(ROOT, "examples", example)))
    for sp in (False, True):
        ops = megatron_placements(g, 2, sp)
        assert plan_tp_problems(g, ops, sp, 2) == []
        strategies = {p.module: p.strategy for p in ops.values() if p.strategy in ("colwise", "rowwise", "vocab")}
        assert sorted(set(strategies.values())) == ["colwise", "rowwise", "vocab"]
        assert all(p.strategy not in ("colwise", "rowwise") or g.op(n).kind == "linear" for n, p in ops.items())
        assert not any(g.op(n).kind == "loss" for n in ops)  # the loss reads gathered logits


def test_every_ranked_plan_is_runnable():
    from test_search_fakes import RESHARD, FakeCostModel, fake_cluster, tiny_gpt
    from planner.search.outer import OuterSearch
    graph = tiny_gpt(4)
    cheap = {k: v / 1000 for k, v in RESHARD.items()}  # layout changes cheap enough that tp=2 shards something
    for sp in (0, 1):
        search = OuterSearch(graph, fake_cluster(nodes=1, devices_per_node=8),
                             FakeCostModel(default_time=1.0, reshard=cheap), batch_size=16, forced={"tp": 2, "sp": sp})
        ranked = search.run().ranked
        assert ranked
        for s in ranked:
            assert plan_tp_problems(graph, s.plan.ops, s.plan.sequence_parallel, s.plan.mesh.tp) == []
