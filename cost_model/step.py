"""One training step of a plan: stage pass times, the pipeline simulation, gradient reduction, optimizer.

Streams per representative device (one per pipeline rank): compute (passes, tp collectives on its critical path),
a data-parallel stream (gradient buckets, ZeRO traffic), point-to-point transfers on the dependency edges.

- ZeRO 0/1: gradients accumulate locally over micro-batches; during each chunk's last backward, buckets of
  DDP_BUCKET_BYTES are all-reduced (0) or reduce-scattered (1) as their layers finish, overlapped with the rest of
  the backward; ZeRO-1 all-gathers the updated parameters after the optimizer step.
- ZeRO 2: gradients are reduce-scattered layer by layer in every micro-batch's backward (so only a shard is kept),
  on a second stream; parameters are all-gathered after the step.
- ZeRO 3: additionally each layer's parameters are all-gathered before its forward and again before its backward,
  prefetched one layer ahead (FSDP's default), on their own stream.
- Optimizer: Adam over the local (sharded) parameters, memory-bound: per parameter it reads fp32 weight, m, v and
  the gradient and writes weight, m, v and the 16-bit copy (30 bytes in mixed precision, 28 in fp32; first-principles
  byte count of torch.optim.AdamW's fused update).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_model.communication import mesh_groups
from cost_model.layers import TENSOR_KINDS, LayerCost, LayerCoster
from cost_model.memory import DDP_BUCKET_BYTES, DeviceWork, in_flight, peak_memory
from cost_model.prediction import Prediction, TraceEvent
from cost_model.compute import peak_flops
from cost_model.simulator import simulate
from planner.errors import PlanError
from planner.graph import OpGraph
from planner.plan import Plan

ADAM_BYTES_PER_PARAM = {"bf16": 30.0, "fp16": 30.0, "fp32": 28.0}
"""Bytes the Adam update moves per local parameter (see the module docstring)."""


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


def _prefetched(compute: list[float], comm: list[float]) -> float:
    """End of a chain of layers whose layer i waits for its gather i; gather i+1 is issued when layer i starts."""
    comm_free = comp_end = comp_start = 0.0
    for c, g in zip(compute, comm):
        comm_free = max(comm_free, comp_start) + g
        comp_start = max(comp_end, comm_free)
        comp_end = comp_start + c
    return comp_end


def _with_reduce(compute: list[float], gather: list[float], reduce: list[float]) -> float:
    """Backward chain: gathers prefetched as in `_prefetched`; layer i's gradient reduce-scatter runs on its own
    stream once layer i's backward ends. Returns when both streams are done."""
    comm_free = comp_end = comp_start = rs_free = 0.0
    for c, g, r in zip(compute, gather, reduce):
        comm_free = max(comm_free, comp_start) + g
        comp_start = max(comp_end, comm_free)
        comp_end = comp_start + c
        rs_free = max(rs_free, comp_end) + r
    return max(comp_end, rs_free)


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
        coster = LayerCoster(cm, graph, plan, self.groups["tp"])
        costs = [coster.cost(layer) for layer in self.layers]
        self.chunks = [[None] * self.v for _ in range(self.pp)]
        for i, (s, e) in enumerate(self.stage_ranges):
            self.chunks[i % self.pp][i // self.pp] = self._chunk(costs[s:e])
        bound = max((costs[e - 1].out_bytes for _, e in self.stage_ranges[:-1]), default=0.0)
        self.p2p_s = cm.comm.time("send_recv", bound, self.groups["pp"]) if self.pp > 1 else 0.0

    def _coll(self, name: str, nbytes: float) -> float:
        return self.cm.comm.time(name, nbytes, self.groups["dp"])

    def _chunk(self, layers: list[LayerCost]) -> Chunk:
        ch = Chunk(layers=layers)
        fwd_c = [l.fwd_compute + l.tp_fwd for l in layers]
        bwd_c = [l.bwd_compute + l.tp_bwd + l.recompute for l in layers]
        ch.compute_s = sum(l.fwd_compute + l.bwd_compute + l.recompute - l.recompute_tp for l in layers)
        zero = self.plan.zero_stage if self.dp > 1 else 0
        pbytes = [l.param_elems * self.pbytes for l in layers]
        if zero == 3:
            gathers = [self._coll("all_gather", b) for b in pbytes]
            reduces = [self._coll("reduce_scatter", b) for b in pbytes]
            ch.fwd_s = _prefetched(fwd_c, gathers)
            ch.bwd_s = _with_reduce(bwd_c[::-1], gathers[::-1], reduces[::-1])
            ch.zero_comm_s = 2 * sum(gathers) + sum(reduces)
        elif zero == 2:
            reduces = [self._coll("reduce_scatter", b) for b in pbytes]
            ch.fwd_s = sum(fwd_c)
            ch.bwd_s = _with_reduce(bwd_c[::-1], [0.0] * len(layers), reduces[::-1])
            ch.zero_comm_s = sum(reduces)
        else:
            ch.fwd_s, ch.bwd_s = sum(fwd_c), sum(bwd_c)
        # FSDP2's hooks and copies run on the compute stream; the profile measures forward + backward together,
        # charged here half to each pass
        fsdp = self.fsdp_overhead(layers)
        ch.fwd_s, ch.bwd_s, ch.compute_s = ch.fwd_s + fsdp / 2, ch.bwd_s + fsdp / 2, ch.compute_s + fsdp
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
        cost (else the bytes roofline) plus its per-tensor overhead for plain, DTensor and Partial-gradient DTensor
        parameters (the last all-reduce their gradient in each optimizer op that reads it)."""
        dev = self.cm.cluster.device
        per_elem = dev.kernel_costs.get("adamw")
        if per_elem:
            t = shard * per_elem[0]
        else:
            t = self.cm.compute.memory_time(shard * ADAM_BYTES_PER_PARAM[self.plan.precision])
        n, ov = self.rank_tensors(r), dev.op_overhead
        partial = ov.dtensor_partial_optimizer or ov.dtensor_optimizer
        return t + n["plain"] * ov.optimizer + n["dtensor"] * ov.dtensor_optimizer + n["partial"] * partial

    def fsdp_overhead(self, layers: list[LayerCost]) -> float:
        """FSDP2's own seconds per micro-batch (forward + backward) for one chunk under ZeRO >= 1 with dp > 1: the
        profile's measured cost per `fully_shard`ed module (each block, and the chunk's root, as the executor
        wraps them) and per parameter tensor; 0 otherwise."""
        if self.dp <= 1 or self.plan.zero_stage < 1:
            return 0.0
        ov = self.cm.cluster.device.op_overhead
        reshard = self.plan.zero_stage == 3
        per_mod, per_t = (ov.fsdp_module_reshard, ov.fsdp_tensor_reshard) if reshard else \
            (ov.fsdp_module, ov.fsdp_tensor)
        modules = 1 + sum(1 for l in layers if l.block)
        # a block's cost is shared by identical blocks (its names are the first one's): count blocks' tensors
        # per layer, the others by name (a tied weight once)
        tensors = sum(len(l.tensors) for l in layers if l.block) + len({k for l in layers if not l.block
                                                                         for k in l.tensors})
        return modules * per_mod + tensors * per_t

    def dp_tail(self, r: int, times) -> tuple[float, list[tuple[float, float, str]]]:
        """ZeRO 0/1 gradient buckets of rank r, overlapped with each chunk's last backward; returns the dp
        stream's end and its spans (start, duration, name)."""
        zero = self.plan.zero_stage
        if self.dp <= 1 or zero >= 2:
            return 0.0, []
        coll = "all_reduce" if zero == 0 else "reduce_scatter"
        ready: list[tuple[float, float]] = []  # (ready time, bytes)
        for c, ch in enumerate(self.chunks[r]):
            j = int(np.argmax(times.b_end[r, c]))
            start, end = float(times.b_start[r, c, j]), float(times.b_end[r, c, j])
            per = [l.bwd_compute + l.tp_bwd + l.recompute for l in reversed(ch.layers)]
            total = sum(per) or 1.0
            t, acc = start, 0.0
            for l, d in zip(reversed(ch.layers), per):
                t += (end - start) * d / total
                acc += l.param_elems * self.pbytes
                if acc >= DDP_BUCKET_BYTES:
                    ready.append((t, acc))
                    acc = 0.0
            if acc > 0:
                ready.append((end, acc))
        ready.sort()
        free, spans = 0.0, []
        for i, (t, b) in enumerate(ready):
            s = max(free, t)
            d = self._coll(coll, b)
            spans.append((s, d, f"{coll.replace('_', '-')} grads bucket {i}"))
            free = s + d
        return free, spans

    def run(self, timeline: bool) -> Prediction:
        """Simulate and assemble the prediction."""
        plan, cm, m = self.plan, self.cm, self.m
        fwd = np.array([[ch.fwd_s for ch in row] for row in self.chunks])
        bwd = np.array([[ch.bwd_s for ch in row] for row in self.chunks])
        times = simulate(plan.schedule, fwd, bwd, m, self.p2p_s)
        comp_end = times.rank_end()
        zero = plan.zero_stage if self.dp > 1 else 0
        totals, extras, events = [], [], []
        for r in range(self.pp):
            psi = self.rank_params(r)
            shard = psi / self.dp if zero >= 1 else psi
            opt = self.optimizer_time(r, shard)
            ag_after = self._coll("all_gather", psi * self.pbytes) if zero in (1, 2) else 0.0
            dp_end, spans = self.dp_tail(r, times)
            t_end = max(float(comp_end[r]), dp_end)
            totals.append(t_end + opt + ag_after)
            extras.append((opt, ag_after, dp_end, spans, psi))
            if timeline:
                events += [TraceEvent(name=n, device=r, stream="dp", start_s=s, duration_s=d) for s, d, n in spans]
                events.append(TraceEvent(name="optimizer step", device=r, stream="optimizer", start_s=t_end,
                                         duration_s=opt))
                if ag_after:
                    events.append(TraceEvent(name="all-gather params", device=r, stream="dp",
                                             start_s=t_end + opt, duration_s=ag_after))
        if timeline:
            events = self._pass_events(times) + events
        step = max(totals)
        crit = int(np.argmax(totals))
        return self._assemble(step, crit, totals, extras, comp_end, tuple(events))

    def _pass_events(self, times) -> list[TraceEvent]:
        """Every F and B pass on the compute stream, and the communication inside it (`_pass_comm`)."""
        out = []
        for r in range(self.pp):
            for c in range(self.v):
                tag = f" c{c}" if self.v > 1 else ""
                for mb in range(self.m):
                    for kind, start, end in (("F", times.f_start, times.f_end), ("B", times.b_start, times.b_end)):
                        s, e = float(start[r, c, mb]), float(end[r, c, mb])
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
        pbytes = [l.param_elems * self.pbytes for l in ch.layers]
        gather = sum(self._coll("all_gather", b) for b in pbytes) if zero == 3 else 0.0
        reduce = sum(self._coll("reduce_scatter", b) for b in pbytes) if zero >= 2 and not fwd else 0.0
        d = e - s
        out = [("tp", "tp collectives", max(s, e - tp), min(tp, d))] if tp > 0 else []
        out += [("dp", "all-gather params", s, min(gather, d))] if gather > 0 else []
        out += [("dp", "reduce-scatter grads", max(s, e - reduce), min(reduce, d))] if reduce > 0 else []
        if self.p2p_s > 0 and (stage < self.pp * self.v - 1 if fwd else stage > 0):
            out.append(("pp", "send activations" if fwd else "send gradients", e, self.p2p_s))
        return out

    def _assemble(self, step, crit, totals, extras, comp_end, events) -> Prediction:
        plan, m, dev = self.plan, self.m, self.cm.cluster.device
        opt, ag_after, dp_end, spans, _ = extras[crit]
        row = self.chunks[crit]
        busy = m * sum(ch.fwd_s + ch.bwd_s for ch in row)
        compute = m * sum(ch.compute_s for ch in row)
        exposed = (busy - compute) + max(0.0, dp_end - float(comp_end[crit])) + ag_after
        bubble = max(0.0, step - compute - exposed - opt)
        layers = [l for ch in row for l in ch.layers]
        breakdown = {
            "compute_s": compute, "exposed_comm_s": exposed, "bubble_s": bubble, "optimizer_s": opt,
            "tp_comm_s": m * sum(l.tp_fwd + l.tp_bwd + l.recompute_tp for l in layers),
            "dp_comm_s": sum(d for _, d, _ in spans) + m * sum(ch.zero_comm_s for ch in row) + ag_after,
            "pp_comm_s": 2 * m * self.v * self.p2p_s if self.pp > 1 else 0.0,
            "recompute_s": m * sum(l.recompute for l in layers),
        }
        mems = [memory_per_rank(self, r, extras[r][4]) for r in range(self.pp)]
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
            assumptions=self._assumptions(pk), timeline=events)

    def _assumptions(self, pk: float) -> tuple[str, ...]:
        plan, cl, g = self.plan, self.cm.cluster, self.groups
        zero = plan.zero_stage if self.dp > 1 else 0
        dp_how = {0: f"gradients all-reduced in {DDP_BUCKET_BYTES >> 20} MiB buckets overlapped with each chunk's last "
                     "backward",
                  1: f"gradients reduce-scattered in {DDP_BUCKET_BYTES >> 20} MiB buckets overlapped with the last backward, "
                     "parameters all-gathered after the step",
                  2: "gradients reduce-scattered per layer in every micro-batch's backward, parameters all-gathered after "
                     "the step",
                  3: "parameters all-gathered per layer (prefetched one layer ahead) in forward and backward, "
                     "gradients reduce-scattered per layer in every micro-batch"}[zero]
        out = [
            f"compute: per-op roofline at {plan.precision} (peak {pk / 1e12:.0f} TFLOP/s, "
            f"{cl.device.memory_bandwidth / 1e9:.0f} GB/s) scaled by the profile's measured efficiency curves; "
            "views launch no kernel" + ("; measured per-op overheads and elementwise kernel costs from the profile"
                                        if cl.device.op_overhead.forward or cl.device.kernel_costs else ""),
            f"tp={self.tp}: collectives on the critical path over {g['tp'].nodes} node(s); one input-gradient "
            "all-reduce per tensor read by several column-parallel linears (as a fused QKV)",
            (f"dp={self.dp}, ZeRO-{zero}: {dp_how}" + (
                "; FSDP2's measured cost per fully_shard'ed module and parameter tensor"
                if zero >= 1 and (cl.device.op_overhead.fsdp_module or cl.device.op_overhead.fsdp_module_reshard)
                else "")) if self.dp > 1 else "dp=1: no gradient reduction",
            f"pp={self.pp}, schedule {plan.schedule}" + (f" with v={self.v}" if self.v > 1 else "")
            + f", {self.m} micro-batches of {plan.microbatch_size}; stage-boundary send/recv "
              f"{self.p2p_s * 1e6:.1f} us" + (" over the network" if g["pp"].nodes > 1 else ""),
            "communication: ring alpha-beta formulas per link level, hierarchical across nodes (NCCL ring "
            "latency model); measured curves in the profile take precedence",
            "dp and tp streams do not contend for links; tp collectives are not overlapped with compute",
            ("optimizer: AdamW over the local shard at the profile's measured cost per element and per tensor"
             if "adamw" in cl.device.kernel_costs else
             f"optimizer: Adam over the local shard, memory-bound ({ADAM_BYTES_PER_PARAM[plan.precision]:.0f} "
             "bytes per parameter)"),
            f"activations: the traced graph's saved tensors at {plan.precision} (masks 1 byte), recompute "
            f"{plan.recompute}, sequence parallel {'on' if plan.sequence_parallel else 'off'}; in-flight "
            f"micro-batches per {plan.schedule}",
            f"memory: usable {cl.device.usable_memory_fraction:.0%} of {cl.device.memory_bytes / 2**30:.0f} GiB "
            "per device (the profile's allocator headroom)",
        ]
        return tuple(out)


def predict_step(cm, graph: OpGraph, plan: Plan, timeline: bool = False) -> Prediction:
    """Predict one training step of `plan` (see the module docstring)."""
    return StepPredictor(cm, graph, plan).run(timeline)


def memory_per_rank(sp: StepPredictor, r: int, psi: float) -> dict[str, float]:
    """Peak bytes on one device of pipeline rank r, by part (`cost_model.memory.peak_memory`)."""
    plan, cl = sp.plan, sp.cm.cluster
    chunks = sp.chunks[r]
    n_stages = len(sp.stage_ranges)
    stage = [c * sp.pp + r for c in range(len(chunks))]
    boundary = []
    for c, i in enumerate(stage):
        recv_fwd = sp.chunks[(i - 1) % sp.pp][(i - 1) // sp.pp].layers[-1].out_bytes if i > 0 else 0.0
        recv_bwd = chunks[c].layers[-1].out_bytes if i < n_stages - 1 else 0.0
        boundary.append(recv_fwd + recv_bwd)  # torch.distributed.pipelining: one receive buffer per micro-batch
    tensors = [v for ch in chunks for l in ch.layers for v in l.params.values()]
    tensors += [l.param_elems / max(1, len(l.tensors)) for ch in chunks for l in ch.layers if l.block]
    work = DeviceWork(
        params=psi, layers=tuple(tuple(ch.layers) for ch in chunks),
        held=in_flight(plan.schedule, sp.pp, sp.v, sp.m, r), microbatches=sp.m, dp=sp.dp,
        zero_stage=plan.zero_stage if sp.dp > 1 else 0, precision=plan.precision, pipelined=sp.pp > 1,
        # executor.parallel.apply_ddp: DDP unless parameters are DTensors (tp) or the module is a pipeline stage
        ddp=sp.dp > 1 and sp.tp == 1 and sp.pp == 1,
        logits=loss_input_elems(sp.graph, plan) if (n_stages - 1) in stage else 0.0,
        boundary=tuple(boundary), largest_tensor=max(tensors, default=0.0),
        # CPU ranks (gloo over loopback) take AdamW's single-tensor path: torch.optim.optimizer.
        # _default_to_fused_or_foreach picks foreach only for tensors on CUDA-like devices
        foreach=cl.intra_node.kind != "loopback")
    out = peak_memory(work)
    out["headroom"] = cl.device.memory_bytes - cl.device.usable_memory_bytes
    return out


def loss_input_elems(graph: OpGraph, plan: Plan) -> float:
    """Elements per device of the loss's input (the logits) for one micro-batch: the vocabulary shard when a
    column-parallel head's sharded logits go to a cross-entropy on class indices (the executor's
    `loss_parallel`), else the whole tensor; 0 when the graph has no loss op."""
    loss = next((op for op in reversed(graph.ops) if op.kind == "loss"), None)
    if loss is None or not loss.input_meta:
        return 0.0
    logits = loss.input_meta[0]
    elems = logits.numel * plan.microbatch_size / graph.batch_size
    head = plan.ops.get(loss.inputs[0]) if loss.inputs else None
    integer = len(loss.input_meta) > 1 and loss.input_meta[1].dtype.removeprefix("torch.").startswith(("int", "uint"))
    if plan.mesh.tp > 1 and head is not None and head.strategy == "colwise" and head.output.startswith("S") \
            and integer:
        elems /= plan.mesh.tp
    return elems
