"""Layout facts the search, the cost model and the executor must agree on.

From per-op placements to per-parameter placements (what `Plan.parameters` holds): the search and the cost model
think per op (`OpPlacement.params`, in `OpNode.params` order); the executor distributes parameters by name. A
parameter read by several ops (a tied embedding / LM head) must get one layout; `parameter_placements` raises
PlanError naming both ops when it does not.

What a pipeline stage boundary sends: `boundary_placements`.
"""
from __future__ import annotations

from typing import Collection, Mapping

from planner.errors import PlanError
from planner.graph import OpGraph
from planner.plan import OpPlacement, Plan


def parameter_placements(graph: OpGraph, ops: Mapping[str, OpPlacement]) -> dict[str, str]:
    """Parameter name -> its placement over tp (`S(dim)`), for every parameter some placed op shards; parameters
    only replicated ops read are left out (the plan's convention: unlisted means replicated)."""
    out: dict[str, str] = {}
    by: dict[str, str] = {}
    for name, placement in ops.items():
        if name not in graph.index:
            continue
        op = graph.ops[graph.index[name]]
        for param, where in zip(op.params, placement.params):
            seen = out.get(param.name, "R")
            if param.name in by and seen != where:
                raise PlanError(f"parameter {param.name} is placed {seen} by op {by[param.name]} and {where} by op "
                                f"{name}; give every op that reads it the same layout")
            by[param.name] = name
            out[param.name] = where
    return {k: v for k, v in out.items() if v != "R"}


def boundary_placements(plan: Plan, blocks: Collection[str]) -> dict[str, str]:
    """Under sequence parallelism, block path (of `blocks`) -> its output's placement (its last placed op's, in the
    plan's op order, the graph's), for every block whose output is a shard (`S(d)`, e.g. the sequence shard). A
    block listed here crosses a pipeline stage boundary as that shard: each tp rank sends its own to the same tp
    rank of the next stage, which reads it with that placement (as Megatron-LM's pipeline sends the
    sequence-parallel shard). Every other value crossing a boundary (a block not listed, any other module, glue
    between modules) is sent whole. Without sequence parallelism nothing is listed: the residual stream a block
    returns is replicated there, and its last placed op (the plan lists no replicated op) may be an earlier one,
    e.g. attention split by heads."""
    if not plan.sequence_parallel:
        return {}
    leaf: dict[str, tuple[int, str]] = {}  # module -> (position, output) of its own last op
    for i, placement in enumerate(plan.ops.values()):
        if placement.module:
            leaf[placement.module] = (i, placement.output)
    depths = sorted({b.count(".") + 1 for b in blocks})
    last: dict[str, tuple[int, str]] = {}  # block -> the same over every module inside it
    for module, (i, out) in leaf.items():
        parts = module.split(".")
        for k in depths:
            if k > len(parts):
                break
            block = ".".join(parts[:k])
            if block in blocks and last.get(block, (-1, ""))[0] < i:
                last[block] = (i, out)
    return {b: out for b, (_, out) in last.items() if out.startswith("S")}
