"""Per-layer costs of a plan: what one micro-batch of one `OpGraph.layers()` entry costs on one device.

A layer's cost depends only on its ops and their placements, so structurally identical blocks (same block type,
same placements) are priced once and reused (`LayerCoster`).

Recomputation is priced as the executor applies it (executor.parallel.apply_ac) on each block. torch's
non-reentrant checkpoint replays the block's forward in backward and stops as soon as every tensor the backward
saved is regenerated (early stop, on by default): ops after the last one producing a saved tensor do not re-run
(in a GPT block, the MLP's output projection and the residual add). Up to there:
- `full` re-runs every op, attention and tp collectives included;
- `attention` (Megatron-LM's selective) re-runs each SDPA call on its own in backward (executor.parallel): the
  attention kernel's forward re-runs and its internals are not kept (the log-sum-exp; priced unfused, the s x s
  probabilities), while q, k, v (the call's inputs) and its output (which its reader saves) are; each call pays
  its re-run call's host cost (the profile's `checkpoint_call_*`), no early stop involved; the TorchFunctionMode
  that finds those calls adds the profile's `function_mode_op` to every op of the block's forward;
- `selective` is torchtitan's op-level policy (executor.parallel.selective_context), priced per op from the graph's
  op order (`cost_model.ops.sac_kept`): the outputs of the attention kernel (SDPA), of a full `max` and of every
  other mm/addmm (the 1st, 3rd, ... linear or folding matmul in forward order) are kept; every other op (norms,
  activations, residual adds, the 2nd, 4th, ... linears, a hand-written attention's batched score matmuls and
  softmax) re-runs, with the tp collectives feeding re-run ops (one per tensor) except reduce-scatters, whose
  outputs it keeps.

Checkpointing's own host cost: torch's checkpoint packs and unpacks every saved tensor through Python hooks, and
selective checkpointing runs every op of the forward and of the re-run through a Python dispatch mode that asks
the policy; each op of a checkpointed block pays the profile's measured per-op figure (`checkpoint_*` / `sac_*`,
a linear its `*_linear_*` one) in forward, and again in backward if the re-run reaches it (kept ops included:
the mode still intercepts them to hand back the saved output). The re-run's kernels and host time join the
backward's before they are combined (`ComputeModel.combine`): on GPUs the host runs ahead, so a re-run costs its
kernels until its host work (re-dispatch plus checkpointing's hooks) outgrows them.

Autocast copies: under bf16/fp16 autocast a linear's fp32 weight is cast to the compute dtype in forward (6 bytes
per element; once per micro-batch, once per step under pipelining where one autocast region spans the schedule; none
under FSDP2, which gathers parameters already in the compute dtype: ZeRO >= 1 and every tp or pp plan,
`Plan.fsdp_mixed_precision`), and its weight gradient is cast back to fp32 and accumulated over micro-batches in
backward (6 bytes per element, plus 12 for every micro-batch after the first: read both, write the sum; at fp32 that
sum alone). Under FSDP2 / `replicate` the 16-bit parameter gets a 16-bit gradient (no cast); where micro-batches
accumulate it unsharded (ZeRO-0/1, pipelining) FSDP2 converts the first to fp32 (`to_accumulated_grad_if_needed`, 6
bytes) and adds each later one to that sum (read 4 + 2, write 4); ZeRO-2/3 reduce every micro-batch and keep none.
Priced as memory-bound kernels on the compute stream, one per parameter tensor, each also one more dispatched op in
forward and one more autograd node (ToCopyBackward) in backward, as an activation's cast is
(`ComputeModel.op_parts`).

Host dispatch: with tp > 1 an op runs on DTensors (and pays the profile's DTensor figures) unless its module is one
the plan leaves wholly replicated (`runs_on_dtensors`, as executor.tp decides which subtrees run on plain tensors);
each call of such a subtree pays the profile's `dtensor_local_call_*` (its inputs unwrapped, its outputs rewrapped).

Loss: when the plan leaves the logits the loss reads sharded on their last dim (the vocabulary or classes: a
column-parallel LM head) and the loss reads class indices (cross-entropy), the executor computes it
vocabulary-parallel (`loss_parallel`): no logits all-gather; each rank works on its vocabulary shard and three
all-reduces of one fp32 value per row (max, sum of exponentials, target logit; torch.distributed.tensor.parallel.loss)
run in forward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

from cost_model.backward import extra_reads, input_grads, recompute_stop
from cost_model.dtypes import autocast_dtypes
from cost_model.kernels import PRECISION_BYTES
from cost_model.work import FREE_KINDS, split_inputs, tensor_bytes
from cost_model.ops import attention_core, logits_producer, sac_kept, sequence_shard, shards_last_dim
from planner.autocast import AUTOCAST_LOWER_KINDS
from planner.graph import Layer, OpGraph, dtype_bytes
from planner.layout import boundary_placements
from planner.plan import OpPlacement, Plan

LOSS_PARALLEL_ALL_REDUCES = 3
"""All-reduces of one fp32 value per logits row in a vocabulary-parallel cross-entropy's forward: the row max
(log-softmax), the sum of exponentials, and the target's logit (nll_loss); its backward is local
(torch.distributed.tensor.parallel.loss)."""


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
    param_sizes: tuple = ()
    """(name, local elements) of each parameter tensor the layer reads, in the order its ops first read them: what
    autograd adds to the gradients' sum one tensor at a time, and what the single-tensor AdamW steps through."""
    block: bool = False
    """Whether the layer is one of the model's repeated blocks (the executor wraps each in its own FSDP2 unit)."""
    tensors: dict = field(default_factory=dict)
    """Parameter name -> what the executor makes of it under tensor parallelism: "plain", "dtensor" (its module is
    tensor-parallel) or "partial" (a replicated DTensor whose gradient is Partial: the weights of
    sequence-parallel norms); the optimizer's per-tensor overhead counts these."""
    partial_elems: dict = field(default_factory=dict)
    """Parameter name -> local elements, for the "partial" tensors (their gradients are all-reduced once before
    the optimizer, executor.tp.reduce_partial_grads)."""
    kernels: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of kernels alone, the backward's re-run included (what `fwd_compute` and
    `bwd_compute` + `recompute` combine with `host`)."""
    host: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of host dispatch alone, the backward's re-run and checkpointing included."""
    cast_weight_bytes: float = 0.0
    """Bytes of the 16-bit copies autocast makes of the layer's linear weights (fp32 parameters under autocast,
    cached for the autocast region and saved by each linear for its backward; 0 where FSDP2 gathers them 16-bit)."""
    checkpointed: bool = False
    """Whether the layer's forward runs under torch's checkpoint (full or selective recomputation): its linears
    then keep no weight copies for backward, and its re-run casts them again."""
    out_full_bytes: float = 0.0
    """Bytes a pipeline stage boundary after this layer sends per device: `out_bytes`, or, for an output sharded
    over tp that is sent whole (all but a block's: `planner.layout.boundary_placements`), the gathered tensor."""
    boundary_gather: tuple[float, float] = (0.0, 0.0)
    """For an output sharded over tp and sent whole: (the all-gather to a whole tensor in forward, the all-gather of
    the gradient of the whole tensor read back sharded, in backward), which a pipeline stage boundary after this
    layer costs (`executor.tp.stage_boundary_hooks`)."""

    def __post_init__(self):
        object.__setattr__(self, "out_full_bytes", max(self.out_full_bytes, self.out_bytes))  # frozen


TENSOR_KINDS = ("plain", "dtensor", "partial")
"""What a parameter tensor is at the optimizer, in increasing cost (see `LayerCost.tensors`)."""


def _tensor_kind(pl, on_dtensors: bool, sequence_parallel: bool) -> str:
    """The `TENSOR_KINDS` entry of the parameters of an op with placement `pl` that runs on DTensors or not."""
    if not on_dtensors:
        return "plain"
    if pl is not None and pl.strategy == "sequence" and sequence_parallel:
        # a replicated norm weight read by a sequence-sharded input gets a Partial gradient, reduced when an
        # optimizer op reads it
        return "partial"
    return "dtensor"  # executor.tp makes such a module's parameters DTensors (unlisted ones Replicate)


def runs_on_dtensors(plan: Plan) -> Callable[[str], bool]:
    """Whether an op of the given module path runs on DTensors under `plan` (executor.tp): with tp > 1 everything
    does except the modules the plan leaves wholly replicated (no op in them placed other than `replicate`, no
    parameter of theirs sharded), which run on plain local tensors; the root module's own ops never are."""
    if plan.mesh.tp <= 1:
        return lambda path: False
    placed = {pl.module for pl in plan.ops.values() if pl.strategy != "replicate"}
    placed |= {name.rpartition(".")[0] for name in plan.parameters}
    # a path runs on DTensors when it is a placed module or one of their ancestors: every such path, once
    ancestors = set().union(*map(_prefixes, placed))

    def on(path: str) -> bool:
        return not path or path in ancestors
    return on


@functools.lru_cache(maxsize=65536)
def _prefixes(path: str) -> tuple[str, ...]:
    """'a.b.c' -> ('a', 'a.b', 'a.b.c'); module paths repeat across a search's plans, so kept."""
    parts = path.split(".")
    return tuple(".".join(parts[:k]) for k in range(1, len(parts) + 1))


def local_params(op, placement, tp: int) -> dict[str, float]:
    """Elements of each of the op's parameters on one tp rank under `placement` (None: replicated)."""
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
        self.on_dtensors = runs_on_dtensors(plan)
        self.dtypes = autocast_dtypes(graph, plan.precision, plan.precision if plan.fsdp_mixed_precision
                                      else "fp32", model.cluster.cpu_ranks)
        self.extra_reads = extra_reads(graph)
        self.grads = input_grads(graph)
        self.recomputed = plan.recomputed_blocks(stage_blocks(graph, plan))
        self.sent_sharded = boundary_placements(plan, {b for names in graph.block_types.values() for b in names}) \
            if self.tp > 1 and plan.mesh.pp > 1 else {}
        self._cache: dict = {}

    def policy(self, layer: Layer) -> str:
        """The recompute policy `layer` runs under: the plan's on its blocks, none elsewhere; with
        `Plan.recompute_blocks`, full on the blocks they name and none (under `full`) or selective (under
        `selective`) on the others."""
        if layer.block_type is None:
            return "none"
        if layer.name in self.recomputed:
            return "full"
        return "none" if self.plan.recompute == "full" else self.plan.recompute

    def cost(self, layer: Layer) -> LayerCost:
        """The cost of one layer (cached per block type and placement pattern)."""
        policy = self.policy(layer)
        key = None
        if layer.block_type:
            ops = self.plan.ops
            names, sources, reads = _layer_reads(self.graph)[layer.ops[0]]
            # the block's edges from outside it depend on where those tensors live: the first block reads the
            # embedding's output (a vocabulary-parallel partial sum, say), later ones the previous block's
            # (and the last block's output, read once, sums no gradients where the others' do)
            outside = tuple(pl.output if pl is not None else "R" for pl in map(ops.get, sources))
            key = (layer.block_type, tuple(map(_pattern, map(ops.get, names))), outside, reads, policy)
        if key is not None and key in self._cache:
            return self._cache[key]
        c = self._compute(layer, policy)
        if policy == "selective":
            c = replace(c, act_bytes=min(c.act_full_bytes, self._sac_kept_bytes(layer)))
        if key is not None:
            self._cache[key] = c
        return c

    def _compute(self, layer: Layer, policy: str) -> LayerCost:
        g, plan, tp, m = self.graph, self.plan, self.tp, self.model
        traced = g.batch_size
        names = {g.ops[i].name for i in layer.ops}
        fwd = bwd = host_f = host_b = tp_fwd = tp_bwd = rec_k = rec_h = rec_tp = act = act_full = 0.0
        params: dict[str, float] = {}
        tensors: dict[str, bool] = {}
        partial_elems: dict[str, float] = {}
        reduced: set[str] = set()  # producers whose input-gradient reduction is already charged
        full, selective, attn = policy == "full", policy == "selective", policy == "attention"
        stop = recompute_stop(g, layer) if full or selective else -1
        kept = sac_kept(g, layer.ops) if selective else frozenset()
        regathered: set[str] = set()  # producers whose tp collective a re-run already repeats
        # sequence parallelism outside checkpointed blocks: a tensor gathered from a sequence shard is saved as the
        # shard and gathered again in backward, once per tensor (executor.tp.keep_shards)
        keep = plan.sequence_parallel and tp > 1 and not (full or selective)
        backward_gathers: set[str] = set()
        shared: set[tuple[str, str]] = set()  # (producer, placement) a linear has redistributed in forward
        cast_done: set[str] = set()  # producers whose autocast cast the tp executor shares among their readers
        casts: dict[str, float] = {}  # autocast's 16-bit weight copies, once per parameter (its cache)
        cast_weights = self.prec != "fp32" and not plan.fsdp_mixed_precision
        n_fwd = n_bwd = 0  # blocking tp collectives per pass (each waits for the ranks: `CommModel.sync_wait`)
        for pos, i in enumerate(layer.ops):
            op = g.ops[i]
            pl = plan.ops.get(op.name)
            vocab_loss = self._vocab_parallel_loss(op)
            if vocab_loss is not None:
                pl = vocab_loss
            # kernels and host dispatch are summed apart and combined per layer (max on GPUs: asynchronous)
            dt = self.on_dtensors(op.module_path)
            casting = self._shared_casts(op, pl, cast_done)
            kf, kb, hf, hb = m.op_parts(op, pl, tp, self.mbs, self.prec, traced_batch_size=traced, dtensor=dt,
                                        dtypes=casting, grads=self.grads[op.name])
            cf, cb = self._autocast_copies(op, pl)
            pf, pb = self._autocast_copy_dispatch(op)
            af, ah = self._gradient_sums(op, pl)
            kf, kb, hf, hb = kf + cf, kb + cb + af, hf + pf, hb + ah + pb
            fwd, bwd, host_f, host_b = fwd + kf, bwd + kb, host_f + hf, host_b + hb
            core = attn and attention_core(op)  # re-run in backward on its own
            ck_f, ck_b = self._checkpoint_host(op.kind, policy) if full or selective or core else (0.0, 0.0)
            # under `attention` a Python TorchFunctionMode sees every call of the block's forward
            host_f += ck_f + (m.cluster.device.op_overhead.function_mode_op if attn else 0.0)
            # views launch nothing, so re-running them costs nothing either
            rerun = core or (pos <= stop and (full or (i not in kept and op.kind not in FREE_KINDS)))
            # the re-run's kernels and host dispatch (its own and checkpointing's) join the backward's
            rec_k += kf if rerun else 0.0
            rec_h += (hf if rerun else 0.0) + (ck_b if pos <= stop or core else 0.0)
            sources, edges = self._edges(op, pl, vocab_loss is not None, reduced)
            for src, s_pl, d_pl, ef, eb, nf, partial in edges:
                # executor.tp: linears reading one tensor in one placement (q, k, v) share one redistribution in
                # forward and one gradient reduction in backward; a recomputation re-runs each reader's own. The
                # all-reduce of a partial input gradient is charged with the first column-parallel reader
                # (`_edges`), whether or not a replicated linear read the tensor before it
                once = op.kind == "linear" and (src, d_pl) in shared
                if op.kind == "linear":
                    shared.add((src, d_pl))
                back = eb if partial or not once else 0.0
                tp_fwd, tp_bwd = tp_fwd + (0.0 if once else ef), tp_bwd + back
                n_fwd += 0 if once else nf
                n_bwd += 1 if back > 0 else 0
                if keep and d_pl == "R" and src not in backward_gathers \
                        and sequence_shard(s_pl, len(g.op(src).output_meta[0].shape)):
                    backward_gathers.add(src)
                    tp_bwd += ef
                    n_bwd += 1
                # selective keeps the outputs of reduce-scatters (partial -> sequence shard), as torchtitan's list does
                scattered = selective and s_pl == "P" and d_pl.startswith("S")
                if rerun and ef > 0 and not scattered and (full or src not in regathered):
                    rec_tp += ef
                    regathered.add(src)
            # an input saved by an earlier op, cast again here (not shared by the tp executor): its own copy is kept
            recast = tuple(i for i in op.saved_elsewhere if casting is not None and i in casting.casts)
            _, a = m.op_memory(op, pl, tp, self.mbs, self.prec, traced_batch_size=traced,
                               input_sources=tuple(sources), keep_shards=keep, dtypes=self.dtypes.get(op.name),
                               recast=recast)
            act_full += a
            # a checkpointed SDPA call keeps its inputs and output, not the kernel's internals
            act += m.op_memory(op, pl, tp, self.mbs, self.prec, traced_batch_size=traced, input_sources=tuple(sources),
                               keep_shards=keep, dtypes=self.dtypes.get(op.name), inputs_only=True)[1] if core else a
            local = local_params(op, pl, tp)
            params.update(local)
            if cast_weights and op.kind == "linear":
                casts.update(local)
            kind = _tensor_kind(pl, dt, plan.sequence_parallel)
            for p in op.params:
                tensors[p.name] = max(tensors.get(p.name, "plain"), kind, key=TENSOR_KINDS.index)
                if tensors[p.name] == "partial":
                    partial_elems[p.name] = local[p.name]
        calls = self._local_calls(layer)
        if calls:  # executor.tp runs each such subtree on plain tensors through hooks that unwrap and rewrap
            ov = m.cluster.device.op_overhead
            host_f += calls * ov.dtensor_local_call_forward
            host_b += calls * ov.dtensor_local_call_backward
            rec_h += (calls * ov.dtensor_local_call_forward) if full else 0.0
        # recomputation: what re-running adds to the backward, host and kernels combined over the whole backward
        # (on GPUs a backward whose re-run makes it host-bound costs its host time)
        rec = m.compute.added(bwd, host_b, rec_k, rec_h)
        kern_f, kern_b = fwd, bwd
        fwd, bwd = m.compute.combine(fwd, host_f), m.compute.combine(bwd, host_b)
        # ranks sharing a host's cores reach each collective apart: the compute between two is the pass's share
        tp_fwd += n_fwd * m.comm.sync_wait(self.tp_group, fwd / n_fwd) if n_fwd else 0.0
        tp_bwd += n_bwd * m.comm.sync_wait(self.tp_group, bwd / n_bwd) if n_bwd else 0.0
        if full:
            act = self._block_input_bytes(layer, names)
        out_bytes = self._output_bytes(layer)
        out_full, boundary = self._boundary(layer, out_bytes)
        return LayerCost(fwd_compute=fwd, bwd_compute=bwd, tp_fwd=tp_fwd, tp_bwd=tp_bwd, recompute=rec + rec_tp,
                         recompute_tp=rec_tp, act_bytes=act, act_full_bytes=act_full, out_bytes=out_bytes,
                         param_elems=sum(params.values()), param_sizes=tuple(params.items()),
                         params={} if layer.block_type else params, block=layer.block_type is not None,
                         tensors=tensors, partial_elems=partial_elems, kernels=(kern_f, kern_b + rec_k),
                         host=(host_f, host_b + rec_h),
                         cast_weight_bytes=sum(casts.values()) * PRECISION_BYTES[self.prec],
                         checkpointed=full or selective, out_full_bytes=out_full, boundary_gather=boundary)

    def _local_calls(self, layer: Layer) -> int:
        """Calls per micro-batch of modules the plan leaves wholly replicated in this layer (executor.tp
        `local_modules`): the outermost module of each op's path that runs on plain tensors; none without tp."""
        if self.tp <= 1:
            return 0
        tops = set()
        for i in layer.ops:
            path = self.graph.ops[i].module_path
            if not path or self.on_dtensors(path):
                continue
            parts = path.split(".")
            tops.add(next(p for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1))
                          if not self.on_dtensors(p)))
        return len(tops)

    def _checkpoint_host(self, kind: str, policy: str) -> tuple[float, float]:
        """(forward, backward) host seconds checkpointing adds to one op of a checkpointed block beyond its plain
        forward, backward and re-run (the profile's `checkpoint_*` / `sac_*` per op, the `*_linear_*` figures for
        a linear; see the module docstring); backward applies to the ops the re-run reaches."""
        ov = self.model.cluster.device.op_overhead
        if policy == "attention":  # one re-run call around one SDPA call, not spread over a block
            return ov.checkpoint_call_forward, ov.checkpoint_call_backward
        key = "sac" if policy == "selective" else "checkpoint"
        lin = "linear_" if kind == "linear" else ""
        return getattr(ov, f"{key}_{lin}forward"), getattr(ov, f"{key}_{lin}backward")

    def _edges(self, op, pl, vocab_loss: bool, reduced: set[str]) -> tuple[list[str], list[tuple]]:
        """The placement each input of `op` arrives in (its producer's output, "R" from outside the graph) and,
        per input produced in the graph, (producer, its placement, the one `op` reads, forward and backward tp
        seconds to get it there: Megatron's f/g via `reshard_time`, or a vocabulary-parallel loss's all-reduces;
        and how many collectives the forward seconds are, and whether the backward seconds hold this tensor's
        input-gradient reduction). `reduced` collects producers whose input-gradient all-reduce is charged (once
        per tensor)."""
        g, plan, tp = self.graph, self.plan, self.tp
        logits = logits_producer(g, op) if vocab_loss else None
        sources, edges = [], []
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
            partial = pl is not None and pl.strategy == "colwise" and d_pl == "R" and tp > 1 and src not in reduced
            if partial:
                reduced.add(src)
            if src == logits:
                ef, eb, calls = self._loss_parallel_time(producer.output_meta[0]), 0.0, LOSS_PARALLEL_ALL_REDUCES
            else:
                # a tensor moves in the dtype autocast gave it; one a linear reads, cast first (executor.tp)
                moved = self.prec if op.kind in AUTOCAST_LOWER_KINDS else self._dtype(src)
                ef, eb = self.model.reshard_time(producer.output_meta[0], s_pl, d_pl, tp, self.mbs, moved,
                                                 consumer_partial_grad=partial, traced_batch_size=g.batch_size)
                calls = 1
            edges.append((src, s_pl, d_pl, ef, eb, calls if ef > 0 else 0, partial))
        return sources, edges

    def _autocast_copies(self, op, pl) -> tuple[float, float]:
        """(forward, backward) seconds of autocast's weight cast and the weight gradient's cast and accumulation
        for one micro-batch of a linear (see the module docstring); at fp32 the accumulation alone; 0 for other
        ops."""
        if op.kind != "linear" or not op.params:
            return 0.0, 0.0
        plan = self.plan
        elems = sum(local_params(op, pl, self.tp).values())
        m, mesh = plan.num_microbatches, plan.mesh
        compute = self.model.compute
        if self.prec == "fp32":
            # autograd adds each later micro-batch's fp32 gradient to the sum wherever micro-batches accumulate it
            # whole: all but ZeRO-2/3 outside pipelining
            each = mesh.dp > 1 and plan.zero_stage >= 2 and mesh.pp == 1
            return 0.0, 0.0 if each else self.model.grad_accumulation_time(op, pl, self.tp, "fp32", m)
        if plan.fsdp_mixed_precision:
            # FSDP2 keeps the gradient 16-bit unless micro-batches accumulate it unsharded (then fp32, see above)
            if mesh.pp == 1 and (plan.zero_stage >= 2 or m == 1):
                return 0.0, 0.0
            return 0.0, self.model.grad_accumulation_time(op, pl, self.tp, self.prec, m)
        # autograd converts the 16-bit weight gradient up to fp32 (widening), then accumulates it as at fp32
        cast = 6.0 / (m if mesh.pp > 1 else 1)
        return compute.memory_time(elems * cast), compute.cast_time(elems * 6.0, True, self.prec) + \
            self.model.grad_accumulation_time(op, pl, self.tp, "fp32", m)

    def _autocast_copy_dispatch(self, op) -> tuple[float, float]:
        """(forward, backward) host seconds of `_autocast_copies`' casts for one micro-batch: each parameter tensor's
        cast is one op in forward (once per step under pipelining) and one ToCopyBackward node in backward, on plain
        tensors (under tp FSDP2 computes with 16-bit weights: no casts)."""
        if self.prec == "fp32" or op.kind != "linear" or not op.params or self.plan.fsdp_mixed_precision:
            return 0.0, 0.0
        ov, n, mesh = self.model.cluster.device.op_overhead, len(op.params), self.plan.mesh
        return n * ov.forward / (self.plan.num_microbatches if mesh.pp > 1 else 1), n * ov.backward

    def _shared_casts(self, op, pl, done: set[str]):
        """`op`'s autocast dtypes, without the casts the tp executor already made for an earlier reader of the same
        tensor: a placed linear's fp32 input is cast once, before its redistribution, for all its consecutive
        readers (executor.tp.autocast_dtype); `done` collects the producers cast so far in this layer."""
        d = self.dtypes.get(op.name)
        if d is None or not d.casts or self.tp <= 1 or pl is None or pl.strategy == "replicate" \
                or op.kind not in AUTOCAST_LOWER_KINDS:
            return d
        acts, _ = split_inputs(op)
        srcs = {i: op.inputs[acts.index(i)] for i in d.casts if acts.index(i) < len(op.inputs)}
        keep = tuple(i for i in d.casts if srcs.get(i) not in done)
        done.update(srcs.values())
        return replace(d, casts=keep)

    def _gradient_sums(self, op, pl) -> tuple[float, float]:
        """(kernel, host) backward seconds autograd spends summing the gradients of `op`'s output, read by
        `extra_reads` more ops than one: one add per extra reader (read two gradients, write one, in the output's
        dtype), dispatched by the autograd engine."""
        n = self.extra_reads.get(op.name, 0)
        if not n or not op.output_meta:
            return 0.0, 0.0
        div = self.tp if pl is not None and pl.output.startswith("S") and self.tp > 1 else 1
        size = tensor_bytes(op.output_meta[0], self._dtype(op.name)) * self.mbs / self.graph.batch_size / div
        compute = self.model.compute
        return n * compute._floor(compute.memory_time(3 * size)), n * self.model.cluster.device.op_overhead.backward

    def _vocab_parallel_loss(self, op) -> OpPlacement | None:
        """For a cross-entropy loss (class-index targets) whose logits the plan leaves sharded on their last dim
        (what the executor's `loss_parallel` reads: a column-parallel LM head's output), the placement the executor
        gives it (the logits' shard, the rest replicated); None otherwise."""
        logits = logits_producer(self.graph, op) if self.tp > 1 else None
        if logits is None or len(op.input_meta) < 2:
            return None
        hp = self.plan.ops.get(logits)
        meta, target = op.input_meta[0], op.input_meta[1]
        if hp is None or not shards_last_dim(hp.output, len(meta.shape)):
            return None
        integer = target.dtype.removeprefix("torch.") in ("int64", "int32", "int16", "int8", "uint8")
        if not integer or len(meta.shape) != len(target.shape) + 1:
            return None
        return OpPlacement(strategy="shard", module=op.module_path, inputs=(hp.output, "R"), output="R")

    def _loss_parallel_time(self, logits) -> float:
        """Forward seconds of a vocabulary-parallel cross-entropy's all-reduces (`LOSS_PARALLEL_ALL_REDUCES` of
        one fp32 value per logits row) over the tp group."""
        rows = logits.numel / max(1, logits.shape[-1]) * self.mbs / self.graph.batch_size
        one = self.model.comm.time("all_reduce", rows * dtype_bytes("float32"), self.tp_group)
        return LOSS_PARALLEL_ALL_REDUCES * one

    def _sac_kept_bytes(self, layer: Layer) -> float:
        """Activation bytes a block keeps from forward to backward under the executor's selective recomputation
        (torchtitan's op-level SAC, executor.parallel.selective_context): its input (torch.utils.checkpoint saves
        the checkpointed function's inputs), the outputs of the ops its policy keeps (`cost_model.ops.sac_kept`:
        SDPA, a full max, every other mm/addmm) and of its tp reduce-scatters (a partial sum redistributed to a
        shard, once per tensor). Everything else is rematerialised in backward."""
        g, tp, plan = self.graph, self.tp, self.plan
        names = {g.ops[i].name for i in layer.ops}
        keep = self._block_input_bytes(layer, names, sharded=plan.sequence_parallel and tp > 1)
        per_sample = self.mbs / g.batch_size
        for i in sac_kept(g, layer.ops):
            op = g.ops[i]
            if op.output_meta:
                pl = plan.ops.get(op.name)
                div = tp if pl is not None and pl.output.startswith("S") else 1
                keep += tensor_bytes(op.output_meta[0], self._dtype(op.name)) * per_sample / div
        return keep + self._scattered_bytes(layer)

    def _scattered_bytes(self, layer: Layer) -> float:
        """Bytes of the tp reduce-scatter outputs (a partial sum redistributed to a shard, once per tensor) in a
        block's forward, which selective recomputation keeps."""
        g, tp, plan = self.graph, self.tp, self.plan
        keep, scattered = 0.0, set()
        for i in layer.ops if tp > 1 else ():
            pl = plan.ops.get(g.ops[i].name)
            for k, src in enumerate(g.ops[i].inputs):
                src_pl = plan.ops.get(src)
                d_pl = pl.inputs[k] if pl is not None and k < len(pl.inputs) else "R"
                if src in g.index and src_pl is not None and src_pl.output == "P" and d_pl.startswith("S") \
                        and src not in scattered and g.op(src).output_meta:
                    scattered.add(src)
                    keep += tensor_bytes(g.op(src).output_meta[0], self._dtype(src)) * self.mbs / g.batch_size / tp
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
                    return tensor_bytes(meta, self._dtype(src)) * self.mbs / g.batch_size / div
        return 0.0

    def _output_bytes(self, layer: Layer) -> float:
        last = self.graph.ops[layer.ops[-1]]
        if not last.output_meta:
            return 0.0
        pl = self.plan.ops.get(last.name)
        div = self.tp if pl is not None and pl.output.startswith("S") else 1
        return tensor_bytes(last.output_meta[0], self._dtype(last.name)) * self.mbs / self.graph.batch_size / div

    def _boundary(self, layer: Layer, out_bytes: float) -> tuple[float, tuple[float, float]]:
        """(`LayerCost.out_full_bytes`, `LayerCost.boundary_gather`) of the layer's output: a block's sharded
        output crosses a stage boundary as its shard, any other sharded output whole (`executor.tp`)."""
        last = self.graph.ops[layer.ops[-1]]
        pl = self.plan.ops.get(last.name)
        if not last.output_meta or pl is None or not pl.output.startswith("S") or self.tp <= 1 \
                or (layer.block_type is not None and layer.name in self.sent_sharded):
            return out_bytes, (0.0, 0.0)
        meta, prec = last.output_meta[0], self._dtype(last.name)
        kw = dict(traced_batch_size=self.graph.batch_size)
        fwd = self.model.reshard_time(meta, pl.output, "R", self.tp, self.mbs, prec, **kw)[0]
        bwd = self.model.reshard_time(meta, "R", pl.output, self.tp, self.mbs, prec, **kw)[1]
        return out_bytes * self.tp, (fwd, bwd)

    def _dtype(self, name: str) -> str:
        """The precision op `name` writes its output in under autocast (`cost_model.dtypes`)."""
        d = self.dtypes.get(name)
        return d.output if d is not None else self.prec


def stage_blocks(graph: OpGraph, plan: Plan) -> list[list[str]]:
    """Each pipeline stage's blocks in model order (one list, every block, without stages), the form
    `Plan.recomputed_blocks` takes."""
    layers = graph.layers()
    spans = [(s.start_layer, s.end_layer) for s in plan.stages] or [(0, len(layers))]
    return [[l.name for l in layers[a:b] if l.block_type is not None] for a, b in spans]


def _layer_reads(graph: OpGraph) -> dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]]:
    """Per layer, by its first op's index (a module called twice makes two layers of one name): its ops' names,
    the ops outside it whose outputs its ops read (in read order), and each op's `extra_reads`; what
    `LayerCoster.cost` keys its cache on besides the plan. Kept on the graph."""
    out = graph.__dict__.get("_shardwise_layer_reads")
    if out is not None:
        return out
    more = extra_reads(graph)
    out = {}
    for layer in graph.layers():
        names = tuple(graph.ops[i].name for i in layer.ops)
        inside = set(names)
        sources = tuple(src for i in layer.ops for src in graph.ops[i].inputs
                        if src in graph.index and src not in inside)
        if layer.ops:
            out[layer.ops[0]] = (names, sources, tuple(more.get(n, 0) for n in names))
    graph.__dict__["_shardwise_layer_reads"] = out
    return out


def _pattern(pl):
    if pl is None:
        return None
    return (pl.strategy, pl.inputs, pl.output, pl.params)
