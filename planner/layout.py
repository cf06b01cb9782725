"""From per-op placements to per-parameter placements: what `Plan.parameters` holds.

The search and the cost model think per op (`OpPlacement.params`, in `OpNode.params` order); the executor
distributes parameters by name. A parameter read by several ops (a tied embedding / LM head) must get one layout;
`parameter_placements` raises PlanError naming both ops when it does not.
"""
from __future__ import annotations

from typing import Mapping

from planner.errors import PlanError
from planner.graph import OpGraph
from planner.plan import OpPlacement


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
