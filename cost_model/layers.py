"""Per-layer costs of a plan: what one micro-batch of one `OpGraph.layers()` entry costs on one device.

A layer's cost depends only on its ops and their placements, so structurally identical blocks (same block type,
same placements) are priced once and reused (`LayerCoster`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from cost_model.compute import DTENSOR_STRATEGIES, split_inputs, tensor_bytes
from cost_model.ops import roles
from planner.graph import Layer, OpGraph
from planner.plan import Plan


@dataclass(frozen=True)
class LayerCost:
    """One micro-batch of one layer on one device."""

    fwd_compute: float
    """Forward compute seconds."""
    bwd_compute: float
    """Backward compute seconds (without recomputation)."""
    tp_fwd: float
    """Tensor-parallel collectives in forward (on the critical path)."""
    tp_bwd: float
    """Tensor-parallel collectives in backward."""
    recompute: float
    """Forward work re-run in backward (compute and its tp collectives) under the plan's recompute policy."""
    recompute_tp: float
    """The tp-collective part of `recompute`."""
    act_bytes: float
    """Activation bytes kept from forward to backward under the recompute policy."""
    act_full_bytes: float
    """Activation bytes the layer saves without recomputation (the working set while its backward runs)."""
    out_bytes: float
    """Bytes of the layer's output on one device (what a pipeline stage boundary sends)."""
    param_elems: float = 0.0
    """Parameter elements this device holds for the layer (after tp sharding)."""
    params: dict = field(default_factory=dict)
    """For layers outside blocks: parameter name to its local elements, so that a weight tied between the first
    and the last layer (embedding and LM head) counts once on a rank that holds both. Empty for blocks, whose
    parameters are their own."""
    block: bool = False
    """Whether the layer is one of the model's repeated blocks (the executor wraps each in its own FSDP2 unit)."""
    tensors: dict = field(default_factory=dict)
    """Parameter name -> what the executor makes of it under tensor parallelism: "plain", "dtensor" (its module is
    tensor-parallel) or "partial" (a replicated DTensor whose gradient is Partial: the weights of
    sequence-parallel norms); the optimizer's per-tensor overhead counts these."""


TENSOR_KINDS = ("plain", "dtensor", "partial")
"""What a parameter tensor is at the optimizer, in increasing cost (see `LayerCost.tensors`)."""


def _tensor_kind(pl, tp: int, sequence_parallel: bool) -> str:
    """The `TENSOR_KINDS` entry of the parameters of an op with placement `pl`."""
    if tp <= 1 or pl is None:
        return "plain"
    if pl.strategy == "sequence" and sequence_parallel:
        # SequenceParallel keeps the norm's weights replicated while its input is sharded over the sequence, so
        # their gradients stay Partial until an op reads them (torch.distributed.tensor.parallel.SequenceParallel)
        return "partial"
    return "dtensor" if pl.strategy in DTENSOR_STRATEGIES else "plain"


def _local_params(op, placement, tp: int) -> dict[str, float]:
    out = {}
    pls = list(placement.params) if placement is not None else []
    for j, p in enumerate(op.params):
        pl = pls[j] if j < len(pls) else "R"
        out[p.name] = p.numel / (tp if pl.startswith("S") else 1)
    return out


class LayerCoster:
    """Prices the layers of one graph under one plan, reusing the cost of identical blocks."""

    def __init__(self, model, graph: OpGraph, plan: Plan, tp_group):
        """`model` is the CostModel (op_time, op_memory, reshard_time); `tp_group` the tp communication group."""
        self.model, self.graph, self.plan, self.tp_group = model, graph, plan, tp_group
        self.tp = plan.mesh.tp
        self.mbs, self.prec = plan.microbatch_size, plan.precision
        self.roles = roles(graph)
        self._cache: dict = {}

    def cost(self, layer: Layer) -> LayerCost:
        """The cost of one layer (cached per block type and placement pattern)."""
        ops = self.plan.ops
        pattern = tuple(_pattern(ops.get(self.graph.ops[i].name)) for i in layer.ops)
        key = (layer.block_type, pattern) if layer.block_type else None
        if key is not None and key in self._cache:
            return self._cache[key]
        c = self._compute(layer)
        if self.plan.recompute == "selective" and layer.block_type is not None:
            c = replace(c, act_bytes=min(c.act_full_bytes, self._sac_kept_bytes(layer)))
        if key is not None:
            self._cache[key] = c
        return c

    def _compute(self, layer: Layer) -> LayerCost:
        g, plan, tp, m = self.graph, self.plan, self.tp, self.model
        traced = g.batch_size
        names = {g.ops[i].name for i in layer.ops}
        core = self.roles.core
        fwd = bwd = host_f = host_b = tp_fwd = tp_bwd = rec = rec_tp = act = act_full = 0.0
        params: dict[str, float] = {}
        tensors: dict[str, bool] = {}
        reduced: set[str] = set()  # producers whose input-gradient reduction is already charged
        full = plan.recompute == "full" and layer.block_type is not None
        for i in layer.ops:
            op = g.ops[i]
            pl = plan.ops.get(op.name)
            # kernels and host dispatch are summed apart and combined per layer (max on GPUs: asynchronous)
            kf, kb, hf, hb = m.op_parts(op, pl, tp, self.mbs, self.prec, traced_batch_size=traced,
                                        sequence_parallel=plan.sequence_parallel)
            fwd, bwd, host_f, host_b = fwd + kf, bwd + kb, host_f + hf, host_b + hb
            f = m.compute.combine(kf, hf)
            sources = []
            for k, src in enumerate(op.inputs):
                if src not in g.index:
                    sources.append("R")
                    continue
                src_pl = plan.ops.get(src)
                s_pl = src_pl.output if src_pl is not None else "R"
                d_pl = pl.inputs[k] if pl is not None and k < len(pl.inputs) else "R"
                sources.append(s_pl)
                producer = g.op(src)
                if not producer.output_meta:
                    continue
                partial = (pl is not None and pl.strategy == "colwise" and d_pl == "R" and tp > 1
                           and src not in reduced)
                if partial:
                    reduced.add(src)
                ef, eb = m.reshard_time(producer.output_meta[0], s_pl, d_pl, tp, self.mbs, self.prec,
                                        consumer_partial_grad=partial, traced_batch_size=traced)
                tp_fwd, tp_bwd = tp_fwd + ef, tp_bwd + eb
                if full:
                    rec_tp += ef
            _, a = m.op_memory(op, pl, tp, self.mbs, self.prec, traced_batch_size=traced,
                               input_sources=tuple(sources))
            act_full += a
            if plan.recompute == "selective" and op.name in core:
                rec += f
                a = self._kept_by_core_op(op, pl, tuple(sources), core)
            act += a
            params.update(_local_params(op, pl, tp))
            kind = _tensor_kind(pl, tp, plan.sequence_parallel)
            for p in op.params:
                tensors[p.name] = max(tensors.get(p.name, "plain"), kind, key=TENSOR_KINDS.index)
        fwd, bwd = m.compute.combine(fwd, host_f), m.compute.combine(bwd, host_b)
        if full:
            rec += fwd
            act = self._block_input_bytes(layer, names)
        out_bytes = self._output_bytes(layer)
        return LayerCost(fwd_compute=fwd, bwd_compute=bwd, tp_fwd=tp_fwd, tp_bwd=tp_bwd, recompute=rec + rec_tp,
                         recompute_tp=rec_tp, act_bytes=act, act_full_bytes=act_full, out_bytes=out_bytes,
                         param_elems=sum(params.values()),
                         params={} if layer.block_type else params, block=layer.block_type is not None,
                         tensors=tensors)

    def _sac_kept_bytes(self, layer: Layer) -> float:
        """Activation bytes a block keeps from forward to backward under the executor's selective recomputation
        (torchtitan's op-level SAC, executor.parallel.apply_ac): its input (torch.utils.checkpoint saves the
        checkpointed function's inputs) and the outputs its policy caches — the attention kernel's (SDPA) and every
        other linear's (the 1st, 3rd, ...: one mm/addmm each). Everything else is rematerialised in backward."""
        g, tp = self.graph, self.tp
        names = {g.ops[i].name for i in layer.ops}
        keep = self._block_input_bytes(layer, names, sharded=self.plan.sequence_parallel and tp > 1)
        linears = 0
        for i in layer.ops:
            op = g.ops[i]
            linears += op.kind == "linear"
            kept = linears % 2 == 1 if op.kind == "linear" else op.kind == "attention"
            if kept and op.output_meta:
                pl = self.plan.ops.get(op.name)
                div = tp if pl is not None and pl.output.startswith("S") else 1
                keep += tensor_bytes(op.output_meta[0], self.prec) * self.mbs / g.batch_size / div
        return keep

    def _kept_by_core_op(self, op, pl, sources, core) -> float:
        """Bytes a core op still keeps under selective recomputation: only its inputs produced outside the core
        (q, k, v)."""
        acts, _ = split_inputs(op)
        metas = [op.input_meta[i] for i in acts]
        keep = 0.0
        for t in op.saved:
            k = next((k for k, mt in enumerate(metas) if mt.shape == t.shape), None)
            if k is None or k >= len(op.inputs) or op.inputs[k] in core:
                continue
            d_pl = pl.inputs[k] if pl is not None and k < len(pl.inputs) else "R"
            src = sources[k] if k < len(sources) else d_pl
            div = self.tp if (d_pl.startswith("S") or src.startswith("S")) else 1
            keep += tensor_bytes(t, self.prec) * self.mbs / self.graph.batch_size / div
        return keep

    def _block_input_bytes(self, layer: Layer, names: set[str], sharded: bool = False) -> float:
        """Bytes of the block's input, the one tensor full recomputation keeps (sharded with SP; `sharded`: also
        when its producer is replicated, as the first block's input, which the executor shards on entry)."""
        g = self.graph
        for i in layer.ops:
            op = g.ops[i]
            for src in op.inputs:
                if src in g.index and src not in names and g.op(src).output_meta:
                    meta = g.op(src).output_meta[0]
                    pl = self.plan.ops.get(src)
                    div = self.tp if sharded or (pl is not None and pl.output.startswith("S")) else 1
                    return tensor_bytes(meta, self.prec) * self.mbs / g.batch_size / div
        return 0.0

    def _output_bytes(self, layer: Layer) -> float:
        last = self.graph.ops[layer.ops[-1]]
        if not last.output_meta:
            return 0.0
        pl = self.plan.ops.get(last.name)
        div = self.tp if pl is not None and pl.output.startswith("S") else 1
        return tensor_bytes(last.output_meta[0], self.prec) * self.mbs / self.graph.batch_size / div


def _pattern(pl):
    if pl is None:
        return None
    return (pl.strategy, pl.inputs, pl.output, pl.params)
