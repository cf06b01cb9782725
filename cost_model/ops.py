"""Structural roles of ops in a transformer-like graph, read off the graph alone (no names assumed).

Megatron-LM's tensor-parallel layout (Shoeybi et al. 2019) in graph terms, per repeated block:
- *colwise*: a linear whose activation input is a norm's output (possibly through views);
- *between*: ops reached forward from a colwise linear before the next linear (views, attention, activation,
  softmax, dropout); they work on sharded heads / features and need no communication;
- *rowwise*: the linear that ends such a region;
- *core*: the attention internals inside a between region (an activation x activation matmul and everything after
  it up to the region's end, views excluded) — what selective recomputation drops (Korthikanti et al. 2022 Sec 5).
Outside blocks: the largest embedding is the *vocab* embedding and the last linear is the *lm_head* (colwise over
the vocabulary).

The cost model uses the roles for selective recomputation (`core`); planner.defaults uses `vocab` and `lm_head`
(its colwise/rowwise pairs come from the module structure, which also covers norms traced as elementwise ops).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from planner.graph import OpGraph

VIEW_KINDS = frozenset({"reshape"})
"""Kinds that only re-view a tensor."""


@dataclass(frozen=True)
class Roles:
    """Op names by Megatron role (see the module docstring)."""

    colwise: frozenset = field(default_factory=frozenset)
    """Linears split on output features."""
    rowwise: frozenset = field(default_factory=frozenset)
    """Linears split on input features (their output is a partial sum)."""
    between: frozenset = field(default_factory=frozenset)
    """Ops between a colwise and a rowwise linear (sharded, no communication)."""
    core: frozenset = field(default_factory=frozenset)
    """Attention internals (a subset of `between`) that selective recomputation recomputes."""
    vocab: str | None = None
    """The vocabulary embedding op."""
    lm_head: str | None = None
    """The output projection to the vocabulary."""
    after_head: frozenset = field(default_factory=frozenset)
    """Ops downstream of the LM head (loss over vocabulary shards)."""


def consumers(graph: OpGraph) -> dict[str, list[str]]:
    """Op name to the names of the ops that read its output."""
    out: dict[str, list[str]] = defaultdict(list)
    for op in graph.ops:
        for src in op.inputs:
            out[src].append(op.name)
    return out


def _reads_norm(graph: OpGraph, name: str) -> bool:
    """Whether an op's activation input comes from a norm, through views only."""
    seen = set()
    stack = list(graph.op(name).inputs)
    while stack:
        src = stack.pop()
        if src in seen or src not in graph.index:
            continue
        seen.add(src)
        op = graph.op(src)
        if op.kind == "norm":
            return True
        if op.kind in VIEW_KINDS:
            stack.extend(op.inputs)
    return False


def roles(graph: OpGraph) -> Roles:
    """The Megatron roles of the graph's ops (computed once per graph and kept on it, like its cached
    properties)."""
    cached = graph.__dict__.get("_shardwise_roles")
    if cached is None:
        cached = _compute_roles(graph)
        graph.__dict__["_shardwise_roles"] = cached
    return cached


def _compute_roles(graph: OpGraph) -> Roles:
    users = consumers(graph)
    colwise, rowwise, between, core = set(), set(), set(), set()
    for op in graph.ops:
        if op.block is None or op.kind != "linear" or not _reads_norm(graph, op.name):
            continue
        colwise.add(op.name)
        region: list[str] = []
        stack, seen = list(users[op.name]), set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            nxt = graph.op(name)
            if nxt.block != op.block or nxt.kind == "norm":
                continue
            if nxt.kind == "linear":
                if name not in colwise:
                    rowwise.add(name)
                continue
            region.append(name)
            stack.extend(users[name])
        between.update(region)
    for name in between:
        op = graph.op(name)
        # activation x activation matmul (scores) opens the attention core
        if op.kind == "matmul" and sum(1 for s in op.inputs if s in between or s in colwise) >= 2:
            stack = [name]
            while stack:
                n = stack.pop()
                if n in core or n not in between:
                    continue
                if graph.op(n).kind not in VIEW_KINDS:
                    core.add(n)
                    stack.extend(users[n])
    outside = [op for op in graph.ops if op.block is None]
    embeds = [op for op in outside if op.kind == "embedding" and op.params]
    vocab = max(embeds, key=lambda o: o.params[0].numel).name if embeds else None
    heads = [op for op in outside if op.kind == "linear"]
    lm_head = heads[-1].name if heads and any(o.block for o in graph.ops) else None
    after: set[str] = set()
    if lm_head is not None:
        stack = list(users[lm_head])
        while stack:
            n = stack.pop()
            if n not in after:
                after.add(n)
                stack.extend(users[n])
    return Roles(colwise=frozenset(colwise), rowwise=frozenset(rowwise), between=frozenset(between),
                 core=frozenset(core), vocab=vocab, lm_head=lm_head, after_head=frozenset(after))
