"""One training step of a plan: stage pass times, the pipeline simulation, gradient reduction, optimizer.

Streams per representative device (one per pipeline rank): compute (passes, tp collectives on its critical path),
a data-parallel stream (gradient reductions, ZeRO traffic), point-to-point transfers on the dependency edges. What
is priced is what the executor does (executor.parallel, executor.runner; torch's pipelining stage):

- Dtypes: gradients are reduced in fp32 (`GRAD_REDUCE_BYTES`: FSDP2's reduce_dtype, DDP's fp32 buckets; Megatron-LM
  does the same for bf16 models); ZeRO parameter all-gathers move the compute dtype (FSDP2's param_dtype).
- Without pipelining: ZeRO 0 with DDP all-reduces DDP_BUCKET_BYTES buckets (the first: 1 MiB) of fp32 gradients during
  the last micro-batch's backward as they fill, and its reducer's own work (hooks, bucket copies, waits: the profile's
  `ddp_*` per step, tensor and byte) delays that backward and the reduction; FSDP2 units (each block, then the root
  holding the rest) reduce when their backward ends: ZeRO-1 and `replicate` (ZeRO 0 with tensor parallelism) in the last
  micro-batch only, ZeRO-2/3 in every micro-batch, on their own stream.
- With pipelining, torch's stage defers every FSDP2/replicate reduction to after each chunk's last backward
  (`PipelineStage.perform_reduce_grad`) and the compute stream waits for it: exposed. One-chunk schedules (GPipe,
  1F1B) run it after the flush; the interleaved one (a `REDUCE_GRAD` action right after each chunk's last backward,
  torch's `_add_reduce_grad`) mid-schedule, where the rank's next passes wait for it (the simulator's `hold`).
- ZeRO-1/2 all-gather parameters once per step, in the first micro-batch's forward (prefetched one unit ahead; kept
  whole between micro-batches; under pipelining each stage's exposed part delays the first micro-batch); ZeRO-3 gathers
  each unit before its forward and again before its backward in every micro-batch (prefetched one ahead), as FSDP2 does
  with reshard_after_forward; under pipelining once per micro-batch (a backward leaves parameters whole, a forward
  reshards them: 1F1B alternates the two).
- FSDP2's copies (ZeRO >= 1), memory-bound kernels priced by their bytes (torch's
  distributed/fsdp/_fully_shard/_fsdp_collectives.py): before each all-gather, on its stream, the parameter shard
  is cast to the compute dtype and copied into the all-gather input (`all_gather_copy_in`); after it, on the compute
  stream, the gathered buffer is split into the unsharded parameters (`split_with_sizes_copy`: reads and writes the
  unit's parameters); before each reduce-scatter, on the compute stream (`foreach_reduce` copies in before
  switching to the reduce-scatter stream), the unsharded gradients are copied into the fp32 reduce-scatter input
  (`chunk_cat`, which converts the compute-dtype ones; an fp32 sum where micro-batches accumulated one).
- A weight tied between the first and the last pipeline stage (embedding and LM head): its fp32 gradient copies
  are all-reduced between the two ranks after the dp reduction, before the optimizer (Megatron-LM's embedding
  all-reduce; executor.pipeline.sum_tied_grads).
- Contention: compute that overlaps a data-parallel collective runs slower by the comm model's
  `overlap_slowdown` (NCCL's CTAs take SMs and HBM bandwidth) for the overlapped time.
- Pipeline sends under 1F1B: torch's Schedule1F1B waits for each send of its steady state (fused with the next
  receive) before computing on, so a stage's pass that sends is longer by the transfer on any device (GPipe and
  the interleaved schedule wait for their sends later, overlapped).
- Shared cores (`DeviceSpec.comm_shares_compute`: gloo on CPU ranks): a collective's copies, reductions and
  send/receive loop run on the rank's own cores, so nothing overlaps: ZeRO gathers and reduce-scatters add to the
  passes, each gradient all-reduce or reduce-scatter delays the backward still running by its whole time, and a
  stage's send of activations or gradients keeps its rank busy for the transfer. Each such collective (and each
  tensor-parallel one, `cost_model.layers`) also waits for the ranks, which reach it apart after the same work:
  the profile's `sync_wait` for the compute since they last met (`CommModel.sync_wait`); FSDP2's collectives block
  on CPU ranks (its backward prefetch too), DDP's bucket all-reduces run on beside the backward and the ranks meet
  once, where it waits for the last.
- The runner's own host work before the first pass: with dp > 1 one dp sub-mesh lookup per step to slice the
  replica's share of the global batch (the profile's `mesh_slice`), on the compute stream (counted as compute).
- The loss: after the optimizer the runner all-reduces the step's scalar loss over pp, then over dp, and reads it
  (`executor.runner.Runner._reduce_loss`, inside the measured step).
- Optimizer: Adam over the local (sharded) parameters, memory-bound: per parameter it reads fp32 weight, m, v and
  the fp32 gradient and writes weight, m and v (28 bytes; first-principles byte count of torch.optim.AdamW's fused
  update; the executor keeps no 16-bit copy for it to write, unlike Megatron-LM's optimizer).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from functools import cached_property

import numpy as np

from cost_model.communication import Group, mesh_groups
from cost_model.layers import TENSOR_KINDS, LayerCost, LayerCoster
from cost_model.memory import DDP_BUCKET_BYTES, memory_per_rank
from cost_model.prediction import Prediction, TraceEvent
from cost_model.sharing import block_units, own_params, unit_counts, unit_heads
from cost_model.assumptions import step_assumptions
from cost_model.compute import peak_flops
from cost_model.simulator import simulate
from planner.errors import PlanError
from planner.graph import OpGraph
from planner.plan import Plan

CLIP_HOST_OPS = 12
"""Ops `executor.grad_clip.clip_grad_norm` dispatches per step besides its foreach norm and multiply (stack,
square, weights, sum, sqrt, clamp, ... ; counted in its source)."""
GRAD_CLIP_BYTES = 4.0
"""Bytes per gradient element the clipping norm reads (fp32 gradients of fp32 parameters; the multiply reads and
writes them: twice)."""
ADAM_BYTES_PER_PARAM = {"bf16": 28.0, "fp16": 28.0, "fp32": 28.0}
"""Bytes the Adam update moves per local parameter (see the module docstring): the same at every precision, since
the executor's parameters stay fp32 and no 16-bit copy is written (autocast casts at use; FSDP2 in its gather)."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first gradient bucket (the last layers' gradients, ready first) closes at 1 MiB with the default bucket
size (torch.nn.parallel.distributed: `first_bucket_bytes_cap = dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB in c10d),
the later ones at DDP_BUCKET_BYTES."""
GRAD_REDUCE_BYTES = 4.0
"""Bytes per gradient element in data-parallel reductions: the executor keeps fp32 parameters and reduces their
gradients in fp32 (FSDP2 `MixedPrecisionPolicy(reduce_dtype=torch.float32)`; DDP buckets and `replicate` hold the
fp32 parameters' gradients), as Megatron-LM does for bf16 models (its arguments.py: "bfloat16 requires gradient
accumulation and all-reduce to be done in fp32")."""


@dataclass
class Chunk:
    """One pipeline stage (chunk c of rank r) and its per-micro-batch pass times."""

    layers: list
    """LayerCost of each layer, in model order."""
    fwd_s: float = 0.0
    """Forward pass seconds (compute, tp collectives, exposed ZeRO-3 gathers)."""
    bwd_s: float = 0.0
    """Backward pass seconds (compute, recompute, tp collectives, exposed ZeRO-2/3 traffic)."""
    compute_s: float = 0.0
    """Pure compute of one forward + backward (including recomputation)."""
    zero_comm_s: float = 0.0
    """ZeRO-2/3 collective seconds per micro-batch (overlapped or not)."""
    first_gather_s: float = 0.0
    """ZeRO-1/2: the exposed part of the once-per-step parameter all-gathers in the chunk's first forward."""
    gather_once_s: float = 0.0
    """ZeRO-1/2: the chunk's once-per-step parameter all-gathers (overlapped or not)."""
    contention_s: float = 0.0
    """Seconds per micro-batch by which overlapped ZeRO collectives slow the chunk's compute."""


def _check(graph: OpGraph, plan: Plan, cluster) -> tuple:
    layers = graph.layers()
    n = plan.mesh.pp * plan.virtual_stages
    if plan.world_size != cluster.world_size:
        raise PlanError(f"plan needs {plan.world_size} devices (dp x tp x pp) but cluster {cluster.name} has "
                        f"{cluster.world_size}; change the mesh or --nodes")
    stages = [(s.start_layer, s.end_layer) for s in plan.stages] or ([(0, len(layers))] if n == 1 else [])
    if len(stages) != n:
        raise PlanError(f"plan has {len(stages)} stages but pp x virtual_stages = {n}; give one stage per chunk")
    if stages[0][0] != 0 or stages[-1][1] != len(layers) or any(a[1] != b[0] for a, b in zip(stages, stages[1:])) \
            or any(e <= s for s, e in stages):
        raise PlanError(f"plan stages {stages} must cover layers 0..{len(layers)} contiguously, each non-empty; "
                        "the model has a different number of layers than the plan was made for?")
    return layers, stages


def _prefetched(compute: list[float], comm: list[float], slow: float = 0.0) -> float:
    """End of a chain of layers whose layer i waits for its gather i; gather i+1 is issued when layer i starts.
    Compute overlapping a gather runs `slow` slower for the overlapped time."""
    return _with_reduce(compute, comm, [0.0] * len(compute), slow)


def _with_reduce(compute: list[float], gather: list[float], reduce: list[float], slow: float = 0.0) -> float:
    """Backward chain: gathers prefetched as in `_prefetched`; layer i's gradient reduce-scatter runs on its own
    stream once layer i's backward ends. Compute overlapping either stream runs `slow` slower for the overlapped
    time. Returns when both streams are done."""
    comm_end = gather[0] if gather else 0.0
    comp_end = rs_free = 0.0
    for i, (c, r) in enumerate(zip(compute, reduce)):
        start = max(comp_end, comm_end)
        nxt = gather[i + 1] if i + 1 < len(gather) else 0.0
        comm_end = start + nxt  # the next gather is issued when this layer starts
        busy = min(c, nxt + max(0.0, rs_free - start))
        comp_end = start + c + slow * busy
        rs_free = max(rs_free, comp_end) + r
    return max(comp_end, rs_free)


def _overlap(spans: list[tuple[float, float, str]], start: float, end: float) -> float:
    """Seconds of `spans` (start, duration, name) that fall inside [start, end]."""
    return sum(max(0.0, min(s + d, end) - max(s, start)) for s, d, _ in spans)


def fsdp_gather_copy_bytes(elems: float, dp: int, pbytes: float) -> tuple[float, float]:
    """Bytes FSDP2 copies around one all-gather of `elems` parameter elements over `dp` ranks in the compute dtype
    (`pbytes` per element): (on the all-gather stream: the fp32 shard cast to the compute dtype when they differ,
    then copied into the all-gather input; on the compute stream: the gathered buffer read and split into the
    unsharded parameters)."""
    shard = elems / dp
    return shard * ((4.0 + pbytes if pbytes != 4.0 else 0.0) + 2 * pbytes), 2 * elems * pbytes


def fsdp_reduce_copy_bytes(elems: float, pbytes: float, accumulated: bool = False) -> float:
    """Bytes of FSDP2's copy of `elems` unsharded gradient elements into its fp32 reduce-scatter input
    (`chunk_cat` reads them, in the compute dtype or, `accumulated` over micro-batches, fp32, and writes fp32)."""
    return elems * ((GRAD_REDUCE_BYTES if accumulated else pbytes) + GRAD_REDUCE_BYTES)


class StepPredictor:
    """Assembles one step's prediction (see the module docstring)."""

    def __init__(self, cm, graph: OpGraph, plan: Plan):
        """Price every chunk of `plan` on `cm`'s cluster."""
        self.cm, self.graph, self.plan = cm, graph, plan
        cl = cm.cluster
        self.layers, self.stage_ranges = _check(graph, plan, cl)
        mesh = plan.mesh
        self.dp, self.tp, self.pp, self.v, self.m = mesh.dp, mesh.tp, mesh.pp, plan.virtual_stages, \
            plan.num_microbatches
        self.groups = mesh_groups(self.dp, self.tp, self.pp, cl.devices_per_node)
        self.pbytes = 4.0 if plan.precision == "fp32" else 2.0
        self.gbytes = GRAD_REDUCE_BYTES
        self.zero = plan.zero_stage if self.dp > 1 else 0
        self.deferred = self.pp > 1 and self.dp > 1  # the pipelining stage defers dp reductions to the flush
        self.slow = cm.comm.overlap_slowdown(self.groups["dp"])
        self.serial = cm.comm.shares_compute(self.groups["dp"])
        coster = LayerCoster(cm, graph, plan, self.groups["tp"])
        costs = own_params(graph, plan, self.layers, [coster.cost(layer) for layer in self.layers])
        if self.pp > 1 and self.tp > 1:
            costs = self._whole_boundaries(costs)
        self.chunks = [[None] * self.v for _ in range(self.pp)]
        for i, (s, e) in enumerate(self.stage_ranges):
            self.chunks[i % self.pp][i // self.pp] = self._chunk(costs[s:e])
        bound = max((costs[e - 1].out_full_bytes for _, e in self.stage_ranges[:-1]), default=0.0)
        self.p2p_s = cm.comm.time("send_recv", bound, self.groups["pp"]) if self.pp > 1 else 0.0
        if self.pp > 1 and (cm.comm.shares_compute(self.groups["pp"]) or plan.schedule == "1f1b"):
            self._sender_busy()

    def _whole_boundaries(self, costs: list[LayerCost]) -> list[LayerCost]:
        """Under tp a stage sends a block's sharded output (sequence parallelism) as each rank's shard, and any
        other output whole (`executor.tp.stage_boundary_hooks`): a sharded output sent whole is all-gathered at the
        end of the sender's forward, and the receiver, which reads it replicated, all-gathers its gradient at the
        end of its backward; the receiver holds the whole tensor (the receive buffer) while the micro-batch is in
        flight, beyond the shard its first layer keeps."""
        costs = list(costs)
        for _, e in self.stage_ranges[:-1]:
            out, nxt = costs[e - 1], costs[e]
            if out.out_full_bytes <= out.out_bytes:
                continue
            fwd, bwd = out.boundary_gather
            costs[e - 1] = replace(out, tp_fwd=out.tp_fwd + fwd)
            costs[e] = replace(nxt, tp_bwd=nxt.tp_bwd + bwd,
                               act_bytes=nxt.act_bytes + out.out_full_bytes - out.out_bytes)
        return costs

    def _sender_busy(self) -> None:
        """Every pass that sends its output to a neighbouring stage (each forward but the last stage's, each
        backward but the first stage's) keeps its rank busy for the transfer: on shared cores the send runs there;
        under 1F1B the schedule waits for it (torch.distributed.pipelining's Schedule1F1B fires each send of its
        steady state together with the next receive and waits for both before computing on:
        `_wait_batch_p2p(_batch_p2p(fwd_sends + bwd_recvs))`; on GPUs NCCL's wait holds the compute stream)."""
        last = self.pp * self.v - 1
        wait = lambda t: self.cm.comm.sync_wait(self.groups["pp"], t)  # noqa: E731  (shared cores only)
        for r in range(self.pp):
            for c, ch in enumerate(self.chunks[r]):
                stage = c * self.pp + r
                ch.fwd_s += self.p2p_s + wait(ch.fwd_s) if stage < last else 0.0
                ch.bwd_s += self.p2p_s + wait(ch.bwd_s) if stage > 0 else 0.0

    def _coll(self, name: str, nbytes: float) -> float:
        return self.cm.comm.time(name, nbytes, self.groups["dp"])

    def _copy_in(self, nbytes: float) -> float:
        """Seconds of FSDP2's copy-in before one reduction of `nbytes` fp32 bytes outside the passes (ZeRO >= 1;
        0 otherwise): the gradients micro-batches accumulated in fp32, else the last one's in the compute dtype."""
        if self.zero < 1 or nbytes <= 0:
            return 0.0
        held = self.deferred or self.m > 1
        return self.cm.compute.memory_time(fsdp_reduce_copy_bytes(nbytes / self.gbytes, self.pbytes, held))

    def _reduce(self, coll: str, nbytes: float) -> float:
        """One gradient reduction of `nbytes` fp32 bytes outside the passes: the collective and its copy-in."""
        return self._coll(coll, nbytes) + self._copy_in(nbytes)

    def _chunk(self, layers: list[LayerCost]) -> Chunk:
        ch = Chunk(layers=layers)
        fwd_c = [l.fwd_compute + l.tp_fwd for l in layers]
        bwd_c = [l.bwd_compute + l.tp_bwd + l.recompute for l in layers]
        ch.compute_s = sum(l.fwd_compute + l.bwd_compute + l.recompute - l.recompute_tp for l in layers)
        zero, n = self.zero, len(layers)
        elems = self.unit_elems(layers)
        gathers = [self._coll("all_gather", e * self.pbytes) for e in elems]
        # under pipelining no reduce-scatter runs inside a micro-batch's backward (deferred to the flush)
        reduces = [0.0] * n if self.deferred else [self._coll("reduce_scatter", e * self.gbytes) for e in elems]
        again = self.regathered(layers)
        if zero >= 1:  # FSDP2's copies (module docstring): copy-ins on the collectives' streams
            mem = self.cm.compute.memory_time
            copies = [fsdp_gather_copy_bytes(e, self.dp, self.pbytes) if e else (0.0, 0.0) for e in elems]
            gathers = [g + mem(c_in) if c_in else g for g, (c_in, _) in zip(gathers, copies)]
            # the reduce-scatters' copy-ins (every micro-batch under ZeRO-2/3) run at the end of the unit's backward
            ins = [mem(fsdp_reduce_copy_bytes(e, self.pbytes)) if r and zero >= 2 else 0.0
                   for r, e in zip(reduces, elems)]
            bwd_c = [c + i for c, i in zip(bwd_c, ins)]
            ch.compute_s += sum(ins)
            outs = [mem(c_out) if c_out else 0.0 for _, c_out in copies]
            if zero == 3:  # the copy-out after each gather runs on the compute stream, in the pass that gathers
                fwd_c = [c + o for c, o in zip(fwd_c, outs)]
                bwd_c = [c + o * a for c, o, a in zip(bwd_c, outs, again)]
                ch.compute_s += sum(outs) + sum(o * a for o, a in zip(outs, again))
            else:  # ZeRO-1/2: once per step, with the gather
                gathers = [g + o for g, o in zip(gathers, outs)]
        ch.fwd_s, ch.bwd_s = sum(fwd_c), sum(bwd_c)
        if self.serial and zero >= 1:  # shared cores: every ZeRO collective adds to its pass
            # and waits for the ranks after the compute before it: the layer's pass, or its share of it
            wait = lambda t: self.cm.comm.sync_wait(self.groups["dp"], t)  # noqa: E731
            fwd_w = [wait(c) if g > 0 else 0.0 for g, c in zip(gathers, fwd_c)]
            if zero == 3:
                bwd_g = [g * a for g, a in zip(gathers, again)]
                # FSDP2's collectives block on CPU ranks (its backward prefetch of the next unit's gather too): a
                # layer's backward meets the ranks at its gather and at its reduce-scatter, each after half of it
                per_b = [(g > 0) + (r > 0) for g, r in zip(bwd_g, reduces)]
                bwd_w = [k * wait(c / k) if k else 0.0 for k, c in zip(per_b, bwd_c)]
                ch.fwd_s, ch.bwd_s = ch.fwd_s + sum(gathers) + sum(fwd_w), \
                    ch.bwd_s + sum(bwd_g) + sum(reduces) + sum(bwd_w)
                ch.zero_comm_s = sum(gathers) + sum(fwd_w) + sum(bwd_g) + sum(reduces) + sum(bwd_w)
            elif zero == 2 and not self.deferred:
                reduces = [r + (wait(c) if r > 0 else 0.0) for r, c in zip(reduces, bwd_c)]
                ch.bwd_s, ch.zero_comm_s = ch.bwd_s + sum(reduces), sum(reduces)
            gathers = [g + w for g, w in zip(gathers, fwd_w)]  # ZeRO-1/2's once-per-step gathers wait alike
        elif zero == 3:
            # under pipelining parameters stay whole after a backward (the stage's reshard_after_backward=False)
            # and are resharded after a forward: one gather per micro-batch, counted in its forward
            bwd_g = [g * a for g, a in zip(gathers, again)]
            ch.fwd_s = _prefetched(fwd_c, gathers, self.slow)
            ch.bwd_s = _with_reduce(bwd_c[::-1], bwd_g[::-1], reduces[::-1], self.slow)
            ch.zero_comm_s = sum(gathers) + sum(bwd_g) + sum(reduces)
            ch.contention_s = 0.0 if not self.slow else ch.fwd_s + ch.bwd_s - _prefetched(fwd_c, gathers) \
                - _with_reduce(bwd_c[::-1], bwd_g[::-1], reduces[::-1])
        elif zero == 2 and not self.deferred:
            ch.bwd_s = _with_reduce(bwd_c[::-1], [0.0] * n, reduces[::-1], self.slow)
            ch.zero_comm_s = sum(reduces)
            ch.contention_s = 0.0 if not self.slow else \
                ch.bwd_s - _with_reduce(bwd_c[::-1], [0.0] * n, reduces[::-1])
        if zero in (1, 2):
            ch.gather_once_s = sum(gathers)
            ch.first_gather_s = sum(gathers) if self.serial else _prefetched(fwd_c, gathers, self.slow) - sum(fwd_c)
        elif zero == 3 and self.deferred:
            # a stage's first backward of the step finds its parameters resharded by the forward before it and
            # gathers them; later backwards find them whole (or follow a forward that gathered): m + 1 sweeps a
            # step (GPipe and 1F1B alike; counted on 2 CPU ranks, 15 all-gathers of 3 units at m = 4), its
            # copy-outs on the compute stream
            back = _prefetched(bwd_c[::-1], gathers[::-1], self.slow) - sum(bwd_c)
            ch.gather_once_s = sum(gathers) + sum(outs)
            ch.first_gather_s = (sum(gathers) if self.serial else back) + sum(outs)
        # FSDP2's hooks: the profile measures forward + backward together, charged here half to each pass
        fsdp_f, fsdp_b = self.fsdp_overhead(layers)
        ch.fwd_s, ch.bwd_s, ch.compute_s = ch.fwd_s + fsdp_f, ch.bwd_s + fsdp_b, ch.compute_s + fsdp_f + fsdp_b
        return ch

    # ---- per-rank quantities -------------------------------------------------------------------------------
    def rank_params(self, r: int) -> float:
        """Parameter elements rank r holds (its chunks' layers; a tied weight once per rank)."""
        seen: dict[str, float] = {}
        total = 0.0
        for ch in self.chunks[r]:
            for l in ch.layers:
                if l.params:
                    for k, n in l.params.items():
                        seen.setdefault(k, n)
                else:
                    total += l.param_elems
        return total + sum(seen.values())

    def rank_tensors(self, r: int) -> dict[str, int]:
        """Parameter tensors rank r's optimizer steps over, by kind (`cost_model.layers.TENSOR_KINDS`; a tied
        weight once per rank); under FSDP2 (ZeRO >= 1 with dp > 1) every parameter is a DTensor shard."""
        seen: dict[str, str] = {}
        count = dict.fromkeys(TENSOR_KINDS, 0)
        for ch in self.chunks[r]:
            for l in ch.layers:
                if l.params:  # outside blocks: names may repeat across layers (tied weights)
                    for k, v in l.tensors.items():
                        seen[k] = max(seen.get(k, "plain"), v, key=TENSOR_KINDS.index)
                else:
                    for v in l.tensors.values():
                        count[v] += 1
        for v in seen.values():
            count[v] += 1
        if self.dp > 1 and self.plan.zero_stage >= 1:
            count["dtensor"] += count["plain"]
            count["plain"] = 0
        return count

    def optimizer_time(self, r: int, shard: float) -> float:
        """One AdamW step on rank r over `shard` local parameter elements: the profile's measured per-element
        cost (else the bytes roofline) plus its per-tensor overhead for plain and DTensor parameters; a
        Partial-gradient DTensor parameter pays the DTensor figure and one all-reduce of its gradient over tp
        (executor.tp.reduce_partial_grads sums it once before the optimizer)."""
        dev = self.cm.cluster.device
        per_elem = dev.kernel_costs.get("adamw")
        if per_elem:
            t = shard * per_elem[0]
        else:
            t = self.cm.compute.memory_time(shard * ADAM_BYTES_PER_PARAM[self.plan.precision])
        n, ov = self.rank_tensors(r), dev.op_overhead
        partial: dict = {}  # a block's names are its first copy's: key them by layer too (a tied weight once)
        for c, ch in enumerate(self.chunks[r]):
            for i, l in enumerate(ch.layers):
                for name, e in l.partial_elems.items():
                    partial[(c, i, name) if l.block and not l.params else name] = e
        reduce = sum(self.cm.comm.time("all_reduce", e * self.gbytes, self.groups["tp"]) for e in partial.values())
        return t + n["plain"] * ov.optimizer + (n["dtensor"] + n["partial"]) * ov.dtensor_optimizer + reduce

    def clip_times(self, r: int, shard: float) -> tuple[float, float]:
        """(norm, scale) seconds of the plan's gradient clipping on rank r over `shard` local fp32 gradient elements,
        either side of its one scalar all-reduce (`executor.grad_clip`): a foreach norm reading them, then a
        foreach multiply rewriting them, at the profile's memory curve, each at least one kernel; with the host
        dispatch of half the ops that combine the norms each, and, off GPUs (torch's foreach runs per tensor
        there), one op per gradient tensor each."""
        cm, dev = self.cm, self.cm.cluster.device
        ops = CLIP_HOST_OPS / 2 + (0 if dev.async_host else sum(self.rank_tensors(r).values()))
        host = ops * dev.op_overhead.forward
        return tuple(cm.compute.combine(max(cm.compute.memory_time(b * shard), dev.kernel_floor), host)
                     for b in (GRAD_CLIP_BYTES, 2 * GRAD_CLIP_BYTES))

    def fsdp_overhead(self, layers: list[LayerCost]) -> tuple[float, float]:
        """FSDP2's own (forward, backward) seconds per micro-batch for one chunk under ZeRO >= 1 with dp > 1: the
        profile's measured cost per `fully_shard`ed module (each block, and the chunk's root, as the executor
        wraps them) and per parameter tensor, half in each pass; (0, 0) otherwise. The hooks are host work (the
        profile times them on tiny modules): on CPU ranks they add to the pass; on GPUs they join each unit's host
        dispatch, and cost only what that makes the host outlast the unit's kernels (`ComputeModel.added`)."""
        if self.dp <= 1 or self.plan.zero_stage < 1:
            return 0.0, 0.0
        ov = self.cm.cluster.device.op_overhead
        reshard = self.plan.zero_stage == 3
        per_mod, per_t = (ov.fsdp_module_reshard, ov.fsdp_tensor_reshard) if reshard else \
            (ov.fsdp_module, ov.fsdp_tensor)
        # a block's cost is shared by identical blocks (its names are the first one's): count blocks' tensors
        # per layer, the others by name (a tied weight once); the root's cost goes with its first layer
        # blocks sharing a module are one unit, its tensors counted once (`unit_counts`)
        shares = [m * per_mod + t * per_t if l.block else 0.0 for l, (m, t) in zip(layers, unit_counts(layers))]
        root = [i for i, l in enumerate(layers) if not l.block]
        root_t = len({k for l in layers if not l.block for k in l.tensors})
        if reshard and not self.deferred:  # the root is not resharded after forward (executor.parallel.apply_fsdp)
            per_mod, per_t = ov.fsdp_module, ov.fsdp_tensor
        shares[root[0] if root else 0] += per_mod + root_t * per_t
        if not self.cm.cluster.device.async_host:
            return sum(shares) / 2, sum(shares) / 2
        added = self.cm.compute.added
        return (sum(added(l.kernels[0], l.host[0], 0.0, x / 2) for l, x in zip(layers, shares)),
                sum(added(l.kernels[1], l.host[1], 0.0, x / 2) for l, x in zip(layers, shares)))

    def unit_elems(self, layers: list[LayerCost]) -> list[float]:
        """Parameter elements the data-parallel collectives of each layer move: a block's own (its FSDP2 unit);
        the root's, every parameter outside the blocks once (a weight tied between the embedding and the LM head
        too), with the first layer outside the blocks, and nothing with the others: the executor gathers and
        reduces the root as one unit, and DDP reduces a shared parameter once."""
        root: dict = {}
        for i, l in enumerate(layers):
            if not l.block:
                root.update(l.params or {f"#{i}": l.param_elems})
        first = next((i for i, l in enumerate(layers) if not l.block), None)
        units = block_units(layers)  # blocks sharing a module: one unit, at the first
        return [units[i] if l.block else (sum(root.values()) if i == first else 0.0)
                for i, l in enumerate(layers)]

    def regathered(self, layers: list[LayerCost]) -> list[bool]:
        """Whether ZeRO-3 gathers each layer's parameters again for its backward: a block's, outside pipelining;
        the root stays whole from its forward to its backward (executor.parallel.apply_fsdp), and a pipeline
        stage's parameters are gathered for backward once a step (`_chunk`)."""
        return [l.block and not self.deferred for l in layers]

    def _units(self, ch: Chunk) -> list[tuple[int, float]]:
        """The chunk's gradient-reduction units as the executor wraps them: each block (its index in the chunk)
        and the root holding the other layers (index -1: reduced when the chunk's backward ends; a tied weight
        once), with their fp32 gradient bytes."""
        elems, head = self.unit_elems(ch.layers), unit_heads(ch.layers)
        out = [(i, e * self.gbytes) for i, (l, e) in enumerate(zip(ch.layers, elems)) if l.block and head[i] == i]
        first = next((i for i, l in enumerate(ch.layers) if not l.block), None)
        return out + ([(-1, elems[first] * self.gbytes)] if first is not None else [])

    @cached_property
    def deferred_units(self) -> list[list[list[tuple[int, float]]]]:
        """Each chunk's deferred gradient reductions under pipelining, by rank and chunk: (unit index as `_units`,
        seconds) each; priced once for the simulator's holds and the dp stream's spans."""
        coll = "all_reduce" if self.zero == 0 else "reduce_scatter"
        return [[[(i, self._reduce(coll, b)) for i, b in self._units(ch)] for ch in row] for row in self.chunks]

    def dp_tail(self, r: int, times) -> tuple[float, list[tuple[float, float, str]], float, float]:
        """Rank r's data-parallel gradient reduction outside the passes (see the module docstring): returns the
        dp stream's end, its spans (start, duration, name), the seconds by which it slows the overlapped
        backward, and the seconds FSDP2's copy-ins add to the compute stream (GPUs)."""
        zero = self.zero
        if self.dp <= 1 or (zero >= 2 and not self.deferred):
            return 0.0, [], 0.0, 0.0
        coll = "all_reduce" if zero == 0 else "reduce_scatter"
        label = coll.replace("_", "-")
        spans: list[tuple[float, float, str]] = []
        if self.deferred:  # after each chunk's last backward; the compute stream waits for it
            if times.stream_end is not None:  # interleaved: mid-schedule, as the simulator held the stream
                at = [float(times.b_end[r, c].max()) for c in range(self.v)]
            else:  # after the flush
                at = [float(times.rank_end()[r])] * self.v
            free = 0.0
            for c in sorted(range(self.v), key=lambda c: at[c]):
                free = max(free, at[c])
                for i, d in self.deferred_units[r][c]:
                    spans.append((free, d, f"{label} grads c{c} " + (f"layer {i}" if i >= 0 else "root")))
                    free += d
            return free, spans, 0.0, 0.0
        ready: list[tuple[float, float]] = []  # (ready time, bytes)
        ddp = zero == 0 and self.tp == 1  # DDP's buckets; else FSDP2 units (fully_shard / replicate)
        windows = []
        for c, ch in enumerate(self.chunks[r]):
            j = int(np.argmax(times.b_end[r, c]))
            start, end = float(times.b_start[r, c, j]), float(times.b_end[r, c, j])
            windows.append((start, end))
            per = [l.bwd_compute + l.tp_bwd + l.recompute for l in ch.layers]
            total = sum(per) or 1.0
            done = {}  # layer index -> when its backward ends (layers run in reverse)
            t = start
            for i in reversed(range(len(ch.layers))):
                t += (end - start) * per[i] / total
                done[i] = t
            if ddp:
                acc = 0.0
                elems = self.unit_elems(ch.layers)
                for i in reversed(range(len(ch.layers))):
                    acc += elems[i] * self.gbytes
                    if acc >= (DDP_BUCKET_BYTES if ready else DDP_FIRST_BUCKET_BYTES):
                        ready.append((done[i], acc))
                        acc = 0.0
                if acc > 0:
                    ready.append((end, acc))
            else:
                ready += [(done[i] if i >= 0 else end, b) for i, b in self._units(ch)]
        ready.sort()
        free = delay = met = 0.0
        last_end = max(b for _, b in windows)
        for k, (t, b) in enumerate(ready):
            # on GPUs FSDP2's copy-in runs on the compute stream when the unit's backward ends: it delays the rest
            # of the backward and the collective (on shared cores it joins the reduction's own time below)
            copy = 0.0 if self.serial else self._copy_in(b)
            delay += copy
            s = max(free, t + delay)
            d = self._reduce(coll, b) if self.serial else self._coll(coll, b)
            if self.serial and not ddp:  # FSDP2's reductions block: the ranks meet at each
                d += self.cm.comm.sync_wait(self.groups["dp"], t - met)
                met = t
            elif self.serial and k == len(ready) - 1:
                # DDP's run on while the backward goes on: the ranks meet once, where it waits for the last
                d += self.cm.comm.sync_wait(self.groups["dp"], t)
            spans.append((s, d, f"{label} grads {'bucket' if ddp else 'unit'} {k}"))
            free = s + d
            if self.serial and t < last_end:  # shared cores: the backward still to run waits for it
                delay += d
        # DDP's reducer works on the compute thread, before the buckets go out (hooks, copies into the buckets) and
        # after they are back (waiting, copies out): it delays both the backward's end and the reduction's
        own = self.ddp_reducer(r) if ddp else 0.0
        if self.serial:
            return free + own, spans, delay + own, 0.0
        slowed = self.slow * sum(_overlap(spans, a, b) for a, b in windows)
        return free + own, spans, slowed + own, delay

    def step_host(self) -> float:
        """Host seconds of the runner's own work per step before the first pass: with dp > 1 it takes the replica's
        share of the global batch through one dp sub-mesh lookup (the profile's `mesh_slice`; executor.runner
        `local_batch`)."""
        return self.cm.cluster.device.op_overhead.mesh_slice if self.dp > 1 else 0.0

    def ddp_reducer(self, r: int) -> float:
        """DDP's own seconds in rank r's synchronised backward beyond its all-reduces (`OpOverhead.ddp_call`,
        `ddp_tensor`, `ddp_byte`: measured by `plan profile`; 0 in profiles without them)."""
        ov = self.cm.cluster.device.op_overhead
        return ov.ddp_call + sum(self.rank_tensors(r).values()) * ov.ddp_tensor \
            + self.rank_params(r) * self.gbytes * ov.ddp_byte

    def tied_all_reduce(self) -> float:
        """Seconds of the all-reduce of a weight tied between the first and the last pipeline stage (its fp32
        gradient, the local shard under FSDP2) between the two ranks holding it; 0 without one."""
        if self.pp <= 1:
            return 0.0
        first = {k: v for l in self.chunks[0][0].layers for k, v in l.params.items()}
        last = {k: v for l in self.chunks[-1][-1].layers for k, v in l.params.items()}
        elems = sum(first[k] for k in first.keys() & last.keys())
        if elems <= 0:
            return 0.0
        shard = elems / self.dp if self.zero >= 1 else elems
        pair = Group(2, 2 if self.groups["pp"].nodes > 1 else 1)
        return self.cm.comm.time("all_reduce", shard * self.gbytes, pair)

    def loss_all_reduces(self, opt: float) -> tuple[float, float]:
        """Seconds of the step's loss reduction after the optimizer (`executor.runner.Runner._reduce_loss`): one
        scalar all-reduce over pp (the last stage's loss to every rank) and one over dp, each waiting for its
        ranks (on shared cores they arrive apart after the `opt` seconds of optimizer since they last met: the
        profile's `sync_wait`). Returns (pp seconds, dp seconds)."""
        out = []
        for axis, n in (("pp", self.pp), ("dp", self.dp)):
            g = self.groups[axis]
            out.append(self.cm.comm.scalar_all_reduce(g) + self.cm.comm.sync_wait(g, opt) if n > 1 else 0.0)
            opt = opt if n <= 1 else 0.0  # the second follows the first
        return out[0], out[1]

    def unshard_ready(self) -> np.ndarray | None:
        """Under the interleaved schedule with ZeRO-1/2 on devices whose collectives run beside compute: when each
        chunk's once-per-step parameter all-gather is done, by rank and chunk, else None. torch's multi-stage
        schedule issues each stage's FSDP unshard ahead of its passes (`_add_unshard_reshard`: UNSHARD actions for
        the next three stages, async, before the first receive), one after another on the all-gather stream from
        the step's start, and a forward waits for its stage's (`_assert_unsharded`): a rank waiting for its first
        input gathers meanwhile, so only what outlasts that wait is exposed. (Single-stage schedules gather in
        FSDP2's pre-forward hook once the input has arrived: `run`'s lead.)"""
        if self.v <= 1 or self.zero not in (1, 2) or self.serial:
            return None
        return np.cumsum([[ch.gather_once_s for ch in row] for row in self.chunks], axis=1)

    def pass_times(self):
        """Every pass's start and end (`cost_model.simulator.PipelineTimes`); under the interleaved schedule each
        rank's compute stream also waits out each chunk's deferred gradient reductions after its last backward, and
        a chunk's forwards wait for its prefetched parameters (`unshard_ready`)."""
        fwd = np.array([[ch.fwd_s for ch in row] for row in self.chunks])
        bwd = np.array([[ch.bwd_s for ch in row] for row in self.chunks])
        hold = None
        if self.deferred and self.v > 1:
            hold = np.array([[sum(d for _, d in units) for units in row] for row in self.deferred_units])
        return simulate(self.plan.schedule, fwd, bwd, self.m, self.p2p_s, hold, self.unshard_ready())

    def run(self, timeline: bool) -> Prediction:
        """Simulate and assemble the prediction."""
        times = self.pass_times()
        comp_end = times.rank_end()
        # ZeRO-1/2's once-per-step gathers run in each stage's first forward (FSDP2's pre-forward hook, when the
        # stage's input has arrived), so the first micro-batch meets every stage's exposed gather on its way through
        # the pipeline: the whole schedule shifts by their sum; prefetched from the step's start under the
        # interleaved schedule (`unshard_ready`), they are in the simulated times, exposed where the first rank's
        # first forward waits for its own
        prefetched = self.unshard_ready() is not None
        lead = 0.0 if prefetched else sum(ch.first_gather_s for row in self.chunks for ch in row)
        gather_wait = float(times.f_start[0, 0, 0]) if prefetched else 0.0
        host = self.step_host()
        leads = [lead + host] * self.pp
        t_end, rows = [], []
        for r in range(self.pp):
            dp_end, spans, slowed, copies = self.dp_tail(r, times)
            spans = [(a + leads[r], d, n) for a, d, n in spans]
            end = float(comp_end[r]) + leads[r] + slowed + copies
            t_end.append(max(end, dp_end + leads[r] if spans else 0.0))
            rows.append((spans, slowed, copies))
        tied = self.tied_all_reduce()
        tied_at = max(t_end[0], t_end[-1])
        if tied:
            t_end[0] = t_end[-1] = tied_at + tied
        totals, extras, events = [], [], []
        psis = [self.rank_params(r) for r in range(self.pp)]
        shards = [psi / self.dp if self.zero >= 1 else psi for psi in psis]
        clips, clip_ar, starts = [(0.0, 0.0)] * self.pp, 0.0, list(t_end)
        if self.plan.max_grad_norm > 0:  # every rank's norm meets in one all-reduce before any optimizer step
            clips = [self.clip_times(r, shards[r]) for r in range(self.pp)]
            n = self.plan.world_size
            world = Group(n, -(-n // self.cm.cluster.devices_per_node))
            met = max(t_end[r] + clips[r][0] for r in range(self.pp))
            clip_ar = self.cm.comm.scalar_all_reduce(world) + self.cm.comm.sync_wait(world, max(c[0] for c in clips))
            starts = [met + clip_ar + clips[r][1] for r in range(self.pp)]
        for r in range(self.pp):
            psi = psis[r]
            adam = self.optimizer_time(r, shards[r])
            opt = adam + sum(clips[r])  # the clipping counts as optimizer work; its all-reduce as exposed comm
            totals.append(starts[r] + adam)
            spans, slowed, copies = rows[r]
            extras.append(dict(opt=opt, spans=spans, psi=psi, lead=leads[r], host=host, slowed=slowed, copies=copies,
                               clip_ar=clip_ar,
                               gather_wait=gather_wait,
                               end=t_end[r], tied=tied if r in (0, self.pp - 1) else 0.0))
            if timeline:
                events += [TraceEvent(name=n, device=r, stream="dp", start_s=a, duration_s=d) for a, d, n in spans]
                if tied and r in (0, self.pp - 1):
                    events.append(TraceEvent(name="all-reduce tied weight grads", device=r, stream="pp",
                                             start_s=tied_at, duration_s=tied))
                if clip_ar:
                    events += [TraceEvent(name="gradient norm", device=r, stream="optimizer", start_s=t_end[r],
                                          duration_s=clips[r][0]),
                               TraceEvent(name="all-reduce gradient norm", device=r, stream="dp",
                                          start_s=met, duration_s=clip_ar),
                               TraceEvent(name="clip gradients", device=r, stream="optimizer",
                                          start_s=met + clip_ar, duration_s=clips[r][1])]
                events.append(TraceEvent(name="optimizer step", device=r, stream="optimizer", start_s=starts[r],
                                         duration_s=adam))
        if timeline:
            events = self._pass_events(times, leads) + events
        crit = int(np.argmax(totals))
        loss_pp, loss_dp = self.loss_all_reduces(extras[crit]["opt"])
        if timeline:
            for stream, at, d in (("pp", max(totals), loss_pp), ("dp", max(totals) + loss_pp, loss_dp)):
                events += [TraceEvent(name="all-reduce loss", device=r, stream=stream, start_s=at, duration_s=d)
                           for r in range(self.pp) if d > 0]
        extras[crit].update(loss_pp=loss_pp, loss_dp=loss_dp)
        step = max(totals) + loss_pp + loss_dp
        return self._assemble(step, crit, extras, comp_end, tuple(events))

    def _pass_events(self, times, leads: list[float]) -> list[TraceEvent]:
        """Every F and B pass on the compute stream (shifted by the rank's lead: ZeRO-1/2's first gathers), the
        communication inside it (`_pass_comm`), and ZeRO-1/2's once-per-step parameter gathers."""
        out = []
        for r in range(self.pp):
            lead = leads[r]
            if self.chunks[r][0].gather_once_s:
                out.append(TraceEvent(name="all-gather params (once per step)", device=r, stream="dp",
                                      start_s=0.0, duration_s=sum(ch.gather_once_s for ch in self.chunks[r])))
            for c in range(self.v):
                tag = f" c{c}" if self.v > 1 else ""
                for mb in range(self.m):
                    for kind, start, end in (("F", times.f_start, times.f_end), ("B", times.b_start, times.b_end)):
                        s, e = float(start[r, c, mb]) + lead, float(end[r, c, mb]) + lead
                        name = f"{kind} mb{mb}{tag}"
                        out.append(TraceEvent(name=name, device=r, stream="compute", start_s=s, duration_s=e - s))
                        out += [TraceEvent(name=f"{what} {name}", device=r, stream=stream, start_s=t, duration_s=d)
                                for stream, what, t, d in self._pass_comm(r, c, kind, s, e)]
        return out

    def _pass_comm(self, r: int, c: int, kind: str, s: float, e: float) -> list[tuple[str, str, float, float]]:
        """(stream, what, start, duration) of the communication of one pass: its tensor-parallel collectives as one
        tp span (their total, at the pass's end); ZeRO-3's parameter all-gathers as one dp span at its start and
        ZeRO-2/3's gradient reduce-scatters as one at its end; the pipeline send after it, on pp."""
        ch, stage = self.chunks[r][c], c * self.pp + r
        fwd = kind == "F"
        tp = sum(l.tp_fwd if fwd else l.tp_bwd + l.recompute_tp for l in ch.layers)
        zero = self.plan.zero_stage if self.dp > 1 else 0
        pbytes = [e * self.pbytes for e in self.unit_elems(ch.layers)]
        again = self.regathered(ch.layers)
        gather = sum(self._coll("all_gather", b) for b, a in zip(pbytes, again) if fwd or a) if zero == 3 else 0.0
        reduce = sum(self._coll("reduce_scatter", b) for b in pbytes) if zero >= 2 and not fwd else 0.0
        d = e - s
        out = [("tp", "tp collectives", max(s, e - tp), min(tp, d))] if tp > 0 else []
        out += [("dp", "all-gather params", s, min(gather, d))] if gather > 0 else []
        out += [("dp", "reduce-scatter grads", max(s, e - reduce), min(reduce, d))] if reduce > 0 else []
        if self.p2p_s > 0 and (stage < self.pp * self.v - 1 if fwd else stage > 0):
            out.append(("pp", "send activations" if fwd else "send gradients", e, self.p2p_s))
        return out

    def _assemble(self, step, crit, extras, comp_end, events) -> Prediction:
        plan, m, dev = self.plan, self.m, self.cm.cluster.device
        x = extras[crit]
        opt = x["opt"]
        row = self.chunks[crit]
        busy = m * sum(ch.fwd_s + ch.bwd_s for ch in row)
        compute = m * sum(ch.compute_s for ch in row)
        # what runs after the rank's last pass: the first-forward gather delay, contention on the last backward,
        # the dp reduction's exposed tail and the tied-weight all-reduce
        # the interleaved schedule's mid-schedule reductions hold the compute stream between passes
        held = sum(d for a, d, _ in x["spans"] if a + d <= float(comp_end[crit]) + x["lead"] + 1e-12) \
            if self.deferred and self.v > 1 else 0.0
        exposed = (busy - compute) + held + x["gather_wait"] \
            + max(0.0, x["end"] - float(comp_end[crit]) - x["host"] - x["copies"]) + x["loss_pp"] + x["loss_dp"] \
            + x["clip_ar"]
        compute += x["host"] + x["copies"]  # the step's own host work before the first pass; FSDP2's last copy-ins
        bubble = max(0.0, step - compute - exposed - opt)
        layers = [l for ch in row for l in ch.layers]
        breakdown = {
            "compute_s": compute, "exposed_comm_s": exposed, "bubble_s": bubble, "optimizer_s": opt,
            "tp_comm_s": m * sum(l.tp_fwd + l.tp_bwd + l.recompute_tp for l in layers),
            "dp_comm_s": sum(d for _, d, _ in x["spans"]) + m * sum(ch.zero_comm_s for ch in row)
            + sum(ch.gather_once_s for ch in row) + x["loss_dp"],
            "pp_comm_s": (2 * m * self.v * self.p2p_s if self.pp > 1 else 0.0) + x["tied"] + x["loss_pp"],
            "recompute_s": m * sum(l.recompute for l in layers),
            "contention_s": m * sum(ch.contention_s for ch in row) + x["slowed"],
            # per pass: the compute (as in `compute_s`), and what it combines per layer (max on GPUs, sum on CPU
            # ranks): kernels alone and host dispatch alone
            "forward_compute_s": m * sum(l.fwd_compute for l in layers),
            "backward_compute_s": m * sum(l.bwd_compute + l.recompute - l.recompute_tp for l in layers),
            "forward_kernels_s": m * sum(l.kernels[0] for l in layers),
            "forward_host_s": m * sum(l.host[0] for l in layers),
            "backward_kernels_s": m * sum(l.kernels[1] for l in layers),
            "backward_host_s": m * sum(l.host[1] for l in layers),
        }
        mems = [memory_per_rank(self, r, extras[r]["psi"]) for r in range(self.pp)]
        worst = max(range(self.pp), key=lambda r: mems[r]["total"])
        per_sample = self.graph.__dict__.get("_shardwise_flops_per_sample")
        if per_sample is None:  # kept on the graph like its cached properties (7k ops for a 1T model)
            per_sample = self.graph.__dict__["_shardwise_flops_per_sample"] = self.graph.flops_per_sample()
        flops = per_sample * plan.global_batch_size
        tflops = flops / step / plan.world_size / 1e12 if step > 0 else 0.0
        pk = peak_flops(dev, plan.precision)
        per_dev = tuple(int(x["total"]) for x in mems)
        return Prediction(
            step_time_s=step, breakdown=breakdown, peak_memory_bytes=max(per_dev), memory_per_device_bytes=per_dev,
            memory_breakdown={k: int(v) for k, v in mems[worst].items() if k != "total"},
            tflops_per_device=tflops, mfu=tflops * 1e12 / pk, fits=max(per_dev) <= dev.usable_memory_bytes,
            assumptions=step_assumptions(self, pk, ADAM_BYTES_PER_PARAM[plan.precision]), timeline=events)


def predict_step(cm, graph: OpGraph, plan: Plan, timeline: bool = False) -> Prediction:
    """Predict one training step of `plan` (see the module docstring)."""
    return StepPredictor(cm, graph, plan).run(timeline)
