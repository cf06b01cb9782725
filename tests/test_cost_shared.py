"""Blocks sharing a module (tests/zoo/shared_module.py: the last block reuses the first block's MLP) are priced as
the executor holds them: each parameter once per rank (parameters, gradients, optimizer state, tensors the
optimizer steps), the blocks sharing it as one FSDP2 unit (executor.parallel._units), and under pipelining a copy
per stage whose gradients are summed between the stages (executor.pipeline.tied_pairs). Models without sharing
keep their costs."""
from __future__ import annotations

import os

import pytest

from cost_model.communication import Group
from cost_model.model import CostModel
from cost_model.sharing import own_params
from cost_model.step import StepPredictor
from executor.parallel import _units, blocks
from executor.pipeline import tied_pairs
from hardware_profiles.load import load_cluster
from planner.defaults import default_plan
from planner.model_file import build, load_model_file
from planner.trace import trace_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(path):
    mf = load_model_file(os.path.join(ROOT, path))
    return build(mf), trace_model(mf, batch_size=8, progress=False)


@pytest.fixture(scope="module")
def shared():
    return _load(os.path.join("tests", "zoo", "shared_module.py"))


@pytest.fixture(scope="module")
def cpu():
    return load_cluster("cpu-local")


def _plan(g, cl, **force):
    return default_plan(g, cl, 8, "fp32", {"dp": 1, "tp": 1, "pp": 1, "mbs": 4, **force}, "m")


def _elems(mods) -> int:
    """Parameter elements of modules (one or a list: an FSDP2 unit), each parameter once."""
    mods = mods if isinstance(mods, list) else [mods]
    return sum(p.numel() for p in {id(p): p for m in mods for p in m.parameters()}.values())


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_shared_module_counted_once(shared, cpu, zero):
    model, g = shared
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    sp = StepPredictor(CostModel(cpu), g, _plan(g, cpu, dp=2, zero=zero))
    assert sp.rank_params(0) == psi  # 47136 (55488 before: the shared MLP twice)
    assert sum(sp.rank_tensors(0).values()) == tensors
    # FSDP2 units as the executor wraps them: blocks 0 and 3 together (at block 0), 1 and 2 alone
    layers = sp.chunks[0][0].layers
    units = [e for e, l in zip(sp.unit_elems(layers), layers) if l.block and e]
    executor_units = [_elems(u) for u in _units(model, [p for p, _ in blocks(model)])]
    assert units == executor_units and len(sp._units(sp.chunks[0][0])) == len(executor_units) + 1
    mem = sp.run(False).memory_breakdown
    # the executor's bytes (plan measure's allocator tracker reads these): fp32 parameters, Adam's m and v
    shard = 2 if zero >= 1 else 1
    assert mem["optimizer"] == pytest.approx(8 * psi / shard, rel=1e-9)
    # FSDP2 gathers all (ZeRO-1), or the root and the biggest unit (ZeRO-3: blocks 0 and 3 together)
    gathered = {0: 0, 1: psi, 3: psi - sum(executor_units) + max(executor_units)}[zero]
    assert mem["parameters"] == pytest.approx(4 * psi / shard + 4 * gathered, rel=1e-9)
    if zero == 0:  # DDP's flat gradient buckets
        assert mem["buffers"] == pytest.approx(4 * psi, rel=1e-9)


def test_shared_module_across_stages(shared, cpu):
    """pp=2 cuts between blocks 1 and 2: each stage holds its own copy of the shared MLP, and its gradients are
    all-reduced between the two stages before the optimizer, as for a tied embedding."""
    model, g = shared
    sp = StepPredictor(CostModel(cpu), g, _plan(g, cpu, pp=2))
    mods = [[m for l in sp.layers[s.start_layer:s.end_layer] for m in [l.name] if l.block_type]
            for s in sp.plan.stages]
    params = dict(model.named_parameters())
    tied = sum(params[name].numel() for name, stages in tied_pairs(model, mods) if stages == [0, 1])
    stage = [sum(_elems(dict(model.named_modules())[m]) for m in ms) for ms in mods]
    roots = sum(p.numel() for p in model.parameters()) - _elems([m for _, m in blocks(model)])
    assert tied and sp.rank_params(0) + sp.rank_params(1) == sum(stage) + roots
    assert sp.tied_all_reduce() == pytest.approx(sp.cm.comm.time("all_reduce", tied * 4.0, Group(2, 1)))


def test_no_sharing_unchanged(cpu):
    """A model whose blocks share nothing (examples/gpt.py: its tied embedding and head are outside the blocks)
    keeps every cached block cost as it is, and counts its parameters as torch does."""
    model, g = _load(os.path.join("examples", "gpt.py"))
    plan = _plan(g, cpu, dp=2, zero=1)
    sp = StepPredictor(CostModel(cpu), g, plan)
    costs = [l for ch in sp.chunks[0] for l in ch.layers]
    assert all(a is b for a, b in zip(own_params(g, plan, sp.layers, costs), costs))
    assert sp.rank_params(0) == sum(p.numel() for p in model.parameters())
    layers = sp.chunks[0][0].layers
    assert [e for e, l in zip(sp.unit_elems(layers), layers) if l.block] == [l.param_elems for l in layers if l.block]
