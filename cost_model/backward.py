"""What autograd does over an op graph, whatever the plan: which of an op's inputs get a gradient, how many
gradients are summed into a tensor several ops read, and where a checkpointed block's re-run stops (torch's
non-reentrant checkpoint, early stop). Read by the per-op costs (`cost_model.model`) and the per-layer ones
(`cost_model.layers`)."""
from __future__ import annotations

from cost_model.work import floating, split_inputs
from planner.graph import Layer, OpGraph
from planner.shard_flow import callee

MULTI_OUTPUT = frozenset({"split", "split_with_sizes", "chunk", "unbind"})
"""Ops whose readers each take a different piece (getitem): their backward joins the pieces, it sums nothing."""


def _needs_grad(graph: OpGraph) -> set[str]:
    """Names of the ops whose outputs need a gradient: downstream of a parameter."""
    grad: set[str] = set()
    for op in graph.ops:
        if op.params or any(src in grad for src in op.inputs):
            grad.add(op.name)
    return grad


def input_grads(graph: OpGraph) -> dict[str, tuple[bool, ...]]:
    """Per op name, per `input_meta` tensor, whether autograd computes its gradient: a parameter, or a floating
    tensor made by an op downstream of a parameter (a RoPE table or a mask gets none). Cached on the graph."""
    out = graph.__dict__.get("_shardwise_input_grads")
    if out is not None:
        return out
    grad = _needs_grad(graph)
    out = {}
    for op in graph.ops:
        acts, par = split_inputs(op)
        flags = [False] * len(op.input_meta)
        for i in par:
            flags[i] = True
        for j, i in enumerate(acts):
            k = op.input_sources[i] if i < len(op.input_sources) else j
            src = op.inputs[k] if 0 <= k < len(op.inputs) else None
            flags[i] = src in grad and floating(op.input_meta[i])
        out[op.name] = tuple(flags)
    graph.__dict__["_shardwise_input_grads"] = out
    return out


def extra_reads(graph: OpGraph) -> dict[str, int]:
    """Per op name, how many more times than once the graph's ops read its output, for floating outputs that
    need a gradient (downstream of a parameter): autograd sums that many gradients into it in backward. Kept on
    the graph like its cached properties."""
    out = graph.__dict__.get("_shardwise_extra_reads")
    if out is not None:
        return out
    grad = _needs_grad(graph)
    reads: dict[str, int] = {}
    for op in graph.ops:
        for src in op.inputs:
            if src in grad:
                reads[src] = reads.get(src, 0) + 1
    out = {}
    for name, n in reads.items():
        op = graph.op(name)
        if n > 1 and op.output_meta and floating(op.output_meta[0]) and callee(op.target) not in MULTI_OUTPUT:
            out[name] = n - 1
    graph.__dict__["_shardwise_extra_reads"] = out
    return out


def recompute_stop(graph: OpGraph, layer: Layer) -> int:
    """Position in `layer.ops` of the last op a checkpointed re-run executes (early stop): the last op that saves
    a tensor for backward, or the op before it when that op is a matmul kind, which saves only its inputs (its
    output is not needed, so the replay stops once its inputs exist)."""
    for pos in range(len(layer.ops) - 1, -1, -1):
        op = graph.ops[layer.ops[pos]]
        if op.saved:
            return pos - 1 if op.kind in ("linear", "matmul") else pos
    return -1
