"""planner.blocks: one rule for a model's blocks, read by the tracer (the graph's layers, which the search cuts into
pipeline stages) and by the executor (checkpointing, FSDP units, the pipeline split). Repeated blocks win; a model
without them is cut at its top-level units."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

from planner.blocks import find_blocks, layer_blocks, layer_modules, top_level_units
from planner.model_file import build, load_model_file
from planner.trace import trace_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


class Wrapped(nn.Module):
    """Units inside a Sequential child, beside a plain child."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.net(x))


def test_top_level_units():
    assert top_level_units(_mlp()) == ["0", "2", "4"]
    assert top_level_units(Wrapped()) == ["net.0", "net.2.0", "head"]
    assert top_level_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []  # one unit: nothing to cut
    assert top_level_units(nn.Linear(2, 2)) == []


def test_repeated_blocks_win_over_units():
    model = build(load_model_file(os.path.join(EXAMPLES, "gpt.py")), "meta")
    assert layer_blocks(model) == find_blocks(model) and set(find_blocks(model)) == {f"h.{i}" for i in range(4)}
    assert layer_modules(model) == [["wte", "wpe"], ["h.0"], ["h.1"], ["h.2"], ["h.3"], ["ln_f", "lm_head"]]
    assert find_blocks(_mlp()) == {} and layer_blocks(_mlp()) == {"0": "0", "2": "2", "4": "4"}
    assert layer_modules(_mlp()) == [["0"], ["1"], ["2"], ["3"], ["4"]]


@pytest.mark.parametrize("example", ["mlp.py", "gpt.py", "resnet.py"])
def test_graph_layers_follow_the_rule(example):
    """The traced graph's layers (what the search cuts and the cost model prices) are the executor's layers: each
    graph layer's modules lie in one executor layer, in the same order, and every executor layer with ops has its
    graph layer (the root's own ops, e.g. the loss, ride along without modules)."""
    mf = load_model_file(os.path.join(EXAMPLES, example))
    graph = trace_model(mf, batch_size=2, progress=False)
    executor = layer_modules(build(mf, "meta"))

    def where(path: str) -> int:
        return next(k for k, layer in enumerate(executor) if any(path == m or path.startswith(m + ".") for m in layer))
    traced = [{where(m) for m in mods} for mods in (graph.layer_modules(l) for l in graph.layers()) if mods]
    assert all(len(k) == 1 for k in traced), traced
    with_ops = sorted({where(op.module_path) for op in graph.ops if op.module_path})
    assert [k.pop() for k in traced] == with_ops
    assert set(graph.block_types) == set(layer_blocks(build(mf, "meta")).values())


def test_layer_ranges_of_a_plan_without_modules_count_the_loss_layer():
    """A hand-written plan's stage layer ranges are `OpGraph.layers()`'s, which end with the loss after a model's last
    block (examples/mlp.py: 5 modules, 6 layers): the executor cuts the same layers (it said 'the model has 5
    layers')."""
    from executor.pipeline import stage_modules
    from planner.model_file import build, load_model_file
    from planner.plan import Mesh, Plan, StageSpec
    from planner.trace import trace_model
    mf = load_model_file(os.path.join(ROOT, "examples", "mlp.py"))
    assert len(trace_model(mf, batch_size=2, progress=False).layers()) == 6
    stages = (StageSpec(start_layer=0, end_layer=3, rank=0), StageSpec(start_layer=3, end_layer=6, rank=1))
    plan = Plan(mesh=Mesh(pp=2), global_batch_size=2, microbatch_size=1, num_microbatches=2, stages=stages)
    assert stage_modules(build(mf, "meta"), plan) == [["0", "1", "2"], ["3", "4"]]


def test_pipeline_split_of_a_model_without_blocks():
    """The executor's fallback stages (a plan without StageSpec.modules) cut between units, and the chained stages
    compute the model's forward."""
    from executor.errors import ExecutorError
    from executor.pipeline import split_model, stage_modules
    from planner.plan import Mesh, Plan
    torch.manual_seed(0)
    model = _mlp()
    plan = Plan(mesh=Mesh(pp=2), global_batch_size=2, microbatch_size=1, num_microbatches=2)
    mods = stage_modules(model, plan)
    assert mods == [["0", "1", "2"], ["3", "4"]]
    x = torch.randn(2, 4)
    out = x
    for stage in split_model(model, mods):
        out = stage(out)
    torch.testing.assert_close(out, model(x))
    with pytest.raises(ExecutorError, match="use pp = 1"):
        stage_modules(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), plan)
    # a stage naming a module the model lacks: one line naming it (it was `Sequential has no attribute 'nope'`)
    from planner.plan import StageSpec
    named = Plan(mesh=Mesh(pp=2), global_batch_size=2, microbatch_size=1, num_microbatches=2,
                 stages=(StageSpec(start_layer=0, end_layer=3, modules=("0", "nope"), rank=0),
                         StageSpec(start_layer=3, end_layer=6, modules=("3", "4"), rank=1)))
    with pytest.raises(ExecutorError, match="stage 0 of the plan lists module 'nope'"):
        stage_modules(model, named)
