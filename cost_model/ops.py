"""Layout-free facts of an op graph that the cost model (and the default plan) read: which op produces the logits the
loss reads, which linear is the LM head, which embedding holds the vocabulary, and which ops' outputs the
executor's selective recomputation keeps. Nothing here decides or infers a layout: placements come from the plan
(`Plan.ops`), and which op patterns can shard how from planner.strategies.

Selective recomputation is the executor's op-level policy (executor.parallel.selective_context, torchtitan's
`_op_sac_save_list`), applied per checkpointed block with a fresh matmul counter. At the dispatcher it keeps the
outputs of the SDPA kernels, of `aten.max.default`, of functional reduce-scatters and of every other `mm` / `addmm`
in forward order (the 1st, 3rd, ...), and recomputes the rest. `sac_kept` maps that onto the graph's ops in their
order: an op is *kept* when it dispatches one of those kernels (`sac_class`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from planner.graph import NO_REPEATED_BLOCKS, OpGraph, OpNode
from planner.op_kinds import SDPA_CALLS

VIEW_KINDS = frozenset({"reshape"})
"""Kinds that only re-view a tensor."""
_MM_CALLS = frozenset({"linear", "mm", "addmm"})
"""Call names (`call_name`) that dispatch exactly one `mm` or `addmm`: nn.Linear / F.linear (aten.linear folds any
leading dims into one matrix), and the kernels themselves (HF GPT-2's Conv1D is an addmm)."""
_MATMUL_CALLS = frozenset({"matmul", "__matmul__"})
"""`torch.matmul` / `@`: one `mm` when it folds to a matrix product (an operand of rank 2), else `bmm`."""


def consumers(graph: OpGraph) -> dict[str, list[str]]:
    """Op name to the names of the ops that read its output."""
    out: dict[str, list[str]] = defaultdict(list)
    for op in graph.ops:
        for src in op.inputs:
            out[src].append(op.name)
    return out


def downstream(graph: OpGraph, name: str) -> frozenset[str]:
    """Every op reached forward from `name`'s output (not `name` itself)."""
    users = consumers(graph)
    seen: set[str] = set()
    stack = list(users[name])
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(users[n])
    return frozenset(seen)


def logits_producer(graph: OpGraph, loss: OpNode) -> str | None:
    """The op whose output a loss op reads as its first tensor (the logits of a classifier or language model), or
    None when the loss reads no graph op's output there."""
    if loss.kind != "loss" or not loss.input_meta:
        return None
    first = loss.input_meta[0].shape
    for src in loss.inputs:
        if src in graph.index and graph.op(src).output_meta and graph.op(src).output_meta[0].shape == first:
            return src
    return None


def loss_op(graph: OpGraph) -> OpNode | None:
    """The loss that reads the logits: the last loss op whose input is more than one number (a loss function that
    returns the loss the model computed, `outputs.loss` or nanoGPT's `(logits, loss)[1]`, reads a scalar; the
    model's own cross-entropy before it reads the logits); None without one."""
    losses = [op for op in reversed(graph.ops) if op.kind == "loss"]
    return next((op for op in losses if op.input_meta and op.input_meta[0].numel > 1), losses[0] if losses else None)


def lm_head(graph: OpGraph) -> str | None:
    """The LM head: the linear whose output (through views only) the loss reads as its logits; None without one."""
    loss = loss_op(graph)
    name = logits_producer(graph, loss) if loss is not None else None
    while name is not None and name in graph.index:
        op = graph.op(name)
        if op.kind == "linear":
            return name
        if op.kind not in VIEW_KINDS or not op.inputs:
            return None
        name = op.inputs[0]
    return None


def vocab_embedding(graph: OpGraph) -> str | None:
    """The vocabulary embedding: the embedding op with the largest weight outside the repeated blocks."""
    embeds = [op for op in graph.ops if op.block is None and op.kind == "embedding" and op.params]
    return max(embeds, key=lambda o: o.params[0].numel).name if embeds else None


def call_name(op: OpNode) -> str:
    """What an op calls, without namespace or overload: `aten.addmm.default` -> `addmm`, `torch.nn.Linear` ->
    `linear`, `Tensor.max` -> `max`, `operator.matmul` -> `matmul`."""
    parts = op.target.split(".")
    if parts[0] == "aten" and len(parts) >= 3:
        parts = parts[:-1]  # the overload
    return parts[-1].strip("_").lower()


def sac_class(op: OpNode) -> str | None:
    """How the executor's selective policy sees an op: "mm" when it dispatches one `mm` / `addmm` (counted, every
    other one kept), "save" when it dispatches a kernel whose output is always kept (SDPA, `aten.max.default`: a
    full reduction, no dim), None when its outputs are recomputed. An nn.MultiheadAttention call is one "save" op:
    its in- and out-projections are two mm/addmm, so the count's parity after it is unchanged."""
    name = call_name(op)
    if op.kind == "attention":
        return "save"
    if op.kind == "linear" and (name in _MM_CALLS or (name.endswith("linear") and name != "bilinear")):
        return "mm"  # also nn.Linear's subclasses (MultiheadAttention's out_proj)
    if name in _MATMUL_CALLS:
        ranks = [len(m.shape) for m in op.input_meta[:2]]
        return "mm" if len(ranks) == 2 and min(ranks) == 2 else None
    if name == "max" and tuple(a for a in op.args if a != "T") == ():
        return "save"
    return None


def attention_core(op: OpNode) -> bool:
    """Whether `recompute: attention` re-runs `op` in backward: an SDPA call (Megatron-LM's core attention)."""
    return op.kind == "attention" and call_name(op) in SDPA_CALLS


def attention_recompute_problem(graph: OpGraph) -> str | None:
    """Why `recompute: attention` cannot apply to this model (one line naming the fix), or None: it re-runs the
    blocks' SDPA calls, so each block needs one and no other attention op (nn.MultiheadAttention's projections,
    or a hand-written matmul/softmax, would be priced as re-run but are not)."""
    in_blocks = [op for op in graph.ops if op.block is not None]
    other = next((op for op in in_blocks if op.kind == "attention" and not attention_core(op)), None)
    if other is not None:
        where = other.module_path or other.name
        return (f"recompute=attention re-runs F.scaled_dot_product_attention calls, but {where} computes attention "
                f"with {other.target}; use recompute=selective or full")
    if not any(attention_core(op) for op in in_blocks):
        how = " (its attention is hand-written matmul/softmax)" if any(op.kind == "softmax" for op in in_blocks) else ""
        return (f"recompute=attention re-runs F.scaled_dot_product_attention calls, but the model's blocks make "
                f"none{how}; use recompute=selective or full")
    with_sdpa = {op.block for op in in_blocks if attention_core(op)}
    without = next((op.block for op in in_blocks if op.block not in with_sdpa), None)
    if without is not None:
        units = "" if graph.repeats_blocks else f" ({NO_REPEATED_BLOCKS})"
        return (f"recompute=attention re-runs each block's F.scaled_dot_product_attention call, but block {without} "
                f"makes none{units}; use recompute=selective or full")
    return None


def sac_kept(graph: OpGraph, ops: Sequence[int]) -> frozenset[int]:
    """Indices (into `graph.ops`) among `ops` — one checkpointed block, in forward order — whose outputs the
    executor's selective policy keeps: every "save" op and the 1st, 3rd, ... "mm" op (`sac_class`)."""
    kept: set[int] = set()
    mms = 0
    for i in ops:
        what = sac_class(graph.ops[i])
        if what == "mm":
            mms += 1
            if mms % 2 == 1:
                kept.add(i)
        elif what == "save":
            kept.add(i)
    return frozenset(kept)


def shards_last_dim(placement: str, ndim: int) -> bool:
    """Whether a placement (`S(d)`, d possibly negative) shards the last of `ndim` dims."""
    if not placement.startswith("S(") or ndim == 0:
        return False
    d = int(placement[2:-1])
    return d % ndim == ndim - 1


def sequence_shard(placement: str, ndim: int) -> bool:
    """Whether `placement` shards a tensor of `ndim` dims along a dim other than its last (a sequence or batch
    shard, not a feature shard): what gathering to R then saving as the shard applies to (`executor.tp`)."""
    return placement.startswith("S(") and not shards_last_dim(placement, ndim)
