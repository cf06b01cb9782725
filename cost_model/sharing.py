"""Blocks that share a module (a parameter held by two layers, one of them a block: tests/zoo/shared_module.py's
last block reuses the first block's MLP).

A block's `LayerCost` is cached and shared by identical blocks (`cost_model.layers.LayerCoster.cost`), so it names
no parameters of its own (`params` empty) and its `tensors` carry the first identical block's names: the step
would count a shared parameter once per block. The executor holds it once per stage: FSDP2 wraps the blocks that
share it as one unit (`executor.parallel._units`), DDP reduces it once, the optimizer steps it once, and a stage
holding one of them keeps its own copy, whose gradient is summed with the other stage's
(`executor.pipeline.tied_pairs`), as for a tied embedding. `own_params` gives such blocks their parameters by the
graph's names (a shared parameter's first name), so the step counts each by name, as it does a tied weight
outside the blocks; other blocks keep their cached cost, unchanged.
"""
from __future__ import annotations

from dataclasses import replace

from cost_model.layers import TENSOR_KINDS, LayerCost, local_params
from planner.graph import OpGraph
from planner.plan import Plan


def own_params(graph: OpGraph, plan: Plan, layers, costs: list[LayerCost]) -> list[LayerCost]:
    """`costs` with each block that holds a parameter another layer also holds carrying its parameters by name
    (`params`: local elements after tp; `tensors`, `partial_elems` renamed from the cached block's); `layers` is
    `graph.layers()`, whose indices `OpGraph.blocks_sharing_parameters` names."""
    sharing = graph.blocks_sharing_parameters
    if not sharing:
        return costs
    out = list(costs)
    for k, (layer, cost) in enumerate(zip(layers, costs)):
        if k not in sharing:
            continue
        # the layer whose ops the cached cost was computed from: the first holding the same object
        src = layers[next(j for j, c in enumerate(costs) if c is cost)]
        rename: dict[str, str] = {}
        params: dict[str, float] = {}
        for i, j in zip(layer.ops, src.ops):
            op, twin = graph.ops[i], graph.ops[j]
            rename.update((b.name, a.name) for a, b in zip(op.params, twin.params))
            params.update(local_params(op, plan.ops.get(op.name), plan.mesh.tp))
        tensors: dict[str, str] = {}
        for name, kind in cost.tensors.items():
            real = rename.get(name, name)
            tensors[real] = max(tensors.get(real, "plain"), kind, key=TENSOR_KINDS.index)
        out[k] = replace(cost, params=params, tensors=tensors,
                         partial_elems={rename.get(n, n): e for n, e in cost.partial_elems.items()})
    return out


def unit_heads(layers: list[LayerCost]) -> list[int]:
    """For each layer of a chunk, the index of the first block of its FSDP2 unit (blocks sharing a parameter are
    one unit, in the position of the first: `executor.parallel._units`, per stage); a layer outside the blocks,
    or a block sharing nothing in the chunk, is its own."""
    head = list(range(len(layers)))
    first: dict[str, int] = {}  # parameter name -> the first block holding it
    for i, l in enumerate(layers):
        if not (l.block and l.params):
            continue
        for name in l.params:
            j = first.setdefault(name, i)
            a, b = head[j], head[i]
            if a != b:  # join the two units under the earlier block
                lo, hi = min(a, b), max(a, b)
                head = [lo if h == hi else h for h in head]
    return head


def block_units(layers: list[LayerCost]) -> list[float]:
    """For each layer of a chunk, the parameter elements of the FSDP2 unit it heads (`unit_heads`: blocks sharing
    a module, each parameter once), 0 for a block in an earlier block's unit; a layer outside the blocks, its
    own."""
    head, units = unit_heads(layers), {}
    for i, l in enumerate(layers):
        if l.block and l.params:
            units.setdefault(head[i], {}).update(l.params)
    return [sum(units[i].values()) if i in units else l.param_elems if head[i] == i else 0.0
            for i, l in enumerate(layers)]


def unit_counts(layers: list[LayerCost]) -> list[tuple[int, int]]:
    """For each layer of a chunk, the FSDP2 units it heads (1, or 0 for a block in an earlier block's unit) and
    the parameter tensors it adds to its unit (a shared module's once)."""
    head, seen, out = unit_heads(layers), set(), []
    for i, l in enumerate(layers):
        if l.block and l.params:
            out.append((int(head[i] == i), len(l.tensors.keys() - seen)))
            seen.update(l.tensors)
        else:
            out.append((1, len(l.tensors)))
    return out
