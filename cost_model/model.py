"""The cost model: op-level prices for the search and a whole-step prediction for a plan.

`CostModel(cluster)` is the one object the search receives. Op-level queries (what the ILP sums):
`op_time`, `reshard_time`, `op_memory`. Whole plans: `predict(graph, plan)` -> `Prediction`, which prices each
layer once per block type (cost_model.layers), builds per-stage pass times, simulates the pipeline schedule
(cost_model.simulator) and adds data-parallel gradient reduction, ZeRO traffic and the optimizer step
(cost_model.step).

The graph's per-op figures are for `graph.batch_size` samples at the traced dtype; every query scales them to
`microbatch_size` samples and re-prices float tensors at the plan's precision (bool masks stay 1 byte).
"""
from __future__ import annotations

import math

from hardware_profiles.schema import Cluster
from cost_model.communication import CommModel, Group
from cost_model.compute import ComputeModel
from cost_model.layers import local_params
from cost_model.dtypes import autocast_dtypes
from cost_model.backward import input_grads, recompute_stop
from cost_model.ops import sequence_shard
from cost_model.prediction import Prediction
from cost_model.work import attention_dropout, kernel_elems, op_work, split_inputs, splits_work, tensor_bytes
from planner.graph import OpGraph, OpNode, TensorMeta
from planner.autocast import fp32_lists
from planner.plan import OpPlacement, Plan, fsdp_mixed_precision


def op_precision(kind: str, precision: str, cpu: bool = False) -> str:
    """The dtype an op of `kind` computes in under the executor's autocast at `precision` (`cpu`: CPU autocast's
    fp32 list)."""
    return "fp32" if precision in ("bf16", "fp16") and kind in fp32_lists(cpu)[0] else precision


def _kind(pl: str) -> str:
    if pl.startswith("S"):
        return "S"
    return "P" if pl == "P" else "R"


def _shard_dim(pl: str) -> int:
    """The tensor dim of a `S(d)` placement."""
    return int(pl[2:-1])


class CostModel:
    """Prices ops, resharding and whole plans on one cluster."""

    def __init__(self, cluster: Cluster):
        """Build the compute and communication models of `cluster`."""
        self.cluster = cluster
        self.compute = ComputeModel(cluster.device)
        self.comm = CommModel(cluster)

    # ---- op-level queries (the search's ILP uses only these and `predict`) ----------------------------------
    def tp_group(self, tp: int) -> Group:
        """The tensor-parallel group of size tp (contiguous ranks, inside a node when tp <= devices_per_node)."""
        dpn = self.cluster.devices_per_node
        return Group(tp, max(1, -(-tp // dpn)))

    def op_time(self, op: OpNode, placement: OpPlacement | None, tp: int, microbatch_size: int, precision: str,
                *, traced_batch_size: int = 1, dtensor: bool | None = None, graph: OpGraph | None = None
                ) -> tuple[float, float]:
        """(forward, backward) compute seconds of one op for one micro-batch on one tp rank; placement None means
        replicated. `traced_batch_size` is the graph's `batch_size` (the tracer's default is 1);
        `dtensor` says whether the op runs on DTensors (see `op_work`). Norms, softmax and losses are
        priced in fp32 under a bf16/fp16 plan (`op_precision`: autocast runs them in fp32). With the op's `graph`
        it is priced as the step prediction prices it: autocast's per-tensor dtypes and casts (parameters held in
        fp32, as DDP and plain autocast hold them; at tp > 1 in 16 bits, as FSDP2 computes with them,
        `planner.plan.fsdp_mixed_precision`) and only the input gradients the graph needs
        (`cost_model.backward.input_grads`)."""
        kernel_f, kernel_b, host_f, host_b = self.op_parts(op, placement, tp, microbatch_size, precision,
                                                           traced_batch_size=traced_batch_size, dtensor=dtensor,
                                                           graph=graph)
        return self.compute.combine(kernel_f, host_f), self.compute.combine(kernel_b, host_b)

    @property
    def async_host(self) -> bool:
        """Whether host dispatch runs ahead of the kernels (GPUs): a layer then costs max(kernels, host) per pass,
        else their sum (`ComputeModel.combine`)."""
        return bool(self.cluster.device.async_host)

    @property
    def local_call_host(self) -> tuple[float, float]:
        """(forward, backward) host seconds of one call of a module that tensor parallelism leaves wholly
        replicated (executor.tp runs it on plain tensors, unwrapping its inputs and rewrapping its outputs)."""
        ov = self.cluster.device.op_overhead
        return ov.dtensor_local_call_forward, ov.dtensor_local_call_backward

    def recompute_stop(self, graph: OpGraph, layer) -> int:
        """Position in `layer.ops` of the last op a checkpointed re-run of the layer executes (torch checkpoint's
        early stop; -1: none), as the step prediction prices full recomputation."""
        return recompute_stop(graph, layer)

    def op_parts(self, op: OpNode, placement: OpPlacement | None, tp: int, microbatch_size: int, precision: str,
                 *, traced_batch_size: int = 1, dtensor: bool | None = None, dtypes=None, grads=None,
                 graph: OpGraph | None = None) -> tuple[float, float, float, float]:
        """(forward kernel, backward kernel, forward host, backward host) seconds of one op, as `op_time` before
        `ComputeModel.combine` joins kernels and host dispatch (a layer combines their sums). `dtypes`: the op's
        `cost_model.dtypes.OpDtypes` (each tensor's precision under autocast, and its casts); `grads`: which of
        its inputs need a gradient (`cost_model.backward.input_grads`); both come from `graph` when it is given."""
        if graph is not None:
            held = precision if fsdp_mixed_precision(precision, 1, tp, 1, 0) else "fp32"
            dtypes = autocast_dtypes(graph, precision, held, self.cluster.cpu_ranks).get(op.name)
            grads = input_grads(graph).get(op.name)
        precision = op_precision(op.kind, precision, self.cluster.cpu_ranks)
        scale = 1.0 if op.batch_free else microbatch_size / traced_batch_size  # (a weight-norm weight: one a pass)
        work = op_work(op, placement, tp, scale, precision, dtensor, dtypes, grads)
        return self.compute.op_parts(op.kind, work, precision)

    def grad_accumulation_time(self, op: OpNode, placement: OpPlacement | None, tp: int, precision: str,
                               microbatches: float = math.inf) -> float:
        """Backward seconds per micro-batch of keeping a linear's weight gradient as an fp32 sum over
        `microbatches`: under FSDP2 at 16 bits (FSDPParam.to_accumulated_grad_if_needed) the first converted (6
        bytes per element, the widening cast) and each later one added to the sum (read 4 + 2, write 4); at fp32
        autograd's AccumulateGrad adds each later one (read both, write one: 12 bytes). inf: the many-micro-batch
        limit (the placement ILP, which prices a layout for any micro-batch count). 0 for other ops."""
        if op.kind != "linear" or not op.params:
            return 0.0
        elems = sum(local_params(op, placement, tp).values())
        later = 1.0 if math.isinf(microbatches) else (microbatches - 1) / microbatches
        if precision == "fp32":
            return self.compute.memory_time(elems * 12.0 * later)
        return self.compute.cast_time(elems * 6.0, True, precision) / microbatches + \
            self.compute.memory_time(elems * 10.0 * later)

    def reshard_wait(self, tp: int) -> float:
        """Seconds each blocking tp collective waits for its ranks to line up, for a re-sharding priced on its own
        (the placement ILP): the profile's `sync_wait` after its shortest measured compute (a few ops' worth; the
        compute between two collectives is not known before the layout is). The step prediction charges the wait
        after each pass's own compute between collectives (`LayerCoster`). 0 where not measured (GPUs)."""
        pts = self.cluster.device.sync_wait
        if tp <= 1 or not pts:
            return 0.0
        return self.comm.sync_wait(self.tp_group(tp), pts[0][0])

    def reshard_time(self, meta: TensorMeta, src: str, dst: str, tp: int, microbatch_size: int, precision: str,
                     *, consumer_partial_grad: bool = False, traced_batch_size: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds to move one activation from placement `src` (producer's output) to `dst`
        (consumer's input) over the tp group, and the dual collective on its gradient.

        S->R all-gather / (slice, or reduce-scatter when the consumer's input gradient is partial); P->R all-reduce /
        nothing (Megatron's g); P->S reduce-scatter / all-gather; R->S slice / all-gather; S(a)->S(b) all-to-all both
        ways; R->R nothing / all-reduce when the consumer is column-parallel, whose input gradient is a partial sum
        (Megatron's f). `consumer_partial_grad` says the consumer makes such partial input gradients.

        DTensor runs an all-gather or reduce-scatter on a dim other than 0 through torch's functional collectives,
        which gather along dim 0 and then `cat` the chunks along that dim, or `chunk` the input along it and `cat`
        the chunks before the reduce-scatter: one more copy of the whole tensor (read and written), on the compute
        stream (torch.distributed._functional_collectives, all_gather_tensor / reduce_scatter_tensor)."""
        if tp <= 1:
            return 0.0, 0.0
        size = tensor_bytes(meta, precision) * microbatch_size / traced_batch_size
        group = self.tp_group(tp)
        extra = self.cluster.device.op_overhead.dtensor_redistribute  # per collective, issued through DTensor
        s, d = _kind(src), _kind(dst)
        sharded = src if s == "S" else dst
        copy = self.compute.memory_time(2 * size) if _kind(sharded) == "S" and _shard_dim(sharded) != 0 else 0.0

        def t(coll: str) -> float:
            return self.comm.time(coll, size, group) + extra + (copy if coll != "all_reduce" else 0.0)

        if s == "S" and d == "S":
            return (0.0, 0.0) if src == dst else (t("all_to_all"), t("all_to_all"))
        if d == "R":
            bwd_partial = t("all_reduce") if consumer_partial_grad else 0.0
            if s == "R":
                return 0.0, bwd_partial
            if s == "S":
                return t("all_gather"), (t("reduce_scatter") if consumer_partial_grad else 0.0)
            return t("all_reduce"), 0.0  # P -> R
        if d == "S":
            if s == "R":
                return 0.0, t("all_gather")
            return t("reduce_scatter"), t("all_gather")  # P -> S
        return 0.0, 0.0  # -> P: partial sums pass through (consumer accepts them)

    def op_memory(self, op: OpNode, placement: OpPlacement | None, tp: int, microbatch_size: int, precision: str,
                  *, traced_batch_size: int = 1, input_sources: tuple[str, ...] | None = None,
                  keep_shards: bool = False, dtypes=None, inputs_only: bool = False,
                  recast: tuple[int, ...] = ()) -> tuple[float, float]:
        """(parameter bytes, saved activation bytes) of one op on one tp rank for one micro-batch.

        Parameter bytes are the weights alone at the training precision (model states with gradients and Adam
        are `cost_model.memory.model_state_bytes`). A saved tensor is divided by tp when it is sharded: when it
        is an input whose placement is S(d), or, with `keep_shards` (sequence parallelism outside checkpointed
        blocks: `executor.tp.keep_shards`, Megatron-LM's way), an input gathered whole from a sequence shard
        (`input_sources`: the placement each input arrives in), which is saved as that shard and gathered again in
        backward; when it is the output and the output is S(d); otherwise (masks, internals) when the op itself
        is split. `dtypes` (`cost_model.dtypes.OpDtypes`): a saved input or output at its own precision under
        autocast (an fp32 residual stream saves 4 bytes an element), else the op's. `inputs_only`: what is left when
        the op is re-run on its own in backward: its inputs (the re-run keeps them, q, k and v in whatever layout the
        kernel saved them) and its output (its reader keeps it: the output projection after SDPA saves it, and a
        flash kernel's (b, s, h, d) output transposes back without a copy), not the kernel's internals (the
        log-sum-exp, RNG state, and priced unfused the s x s probabilities). `recast`: the `input_meta` indices of
        inputs that another op saved first (`OpNode.saved_elsewhere`) and that this op casts itself under autocast:
        it saves its own copy at the cast dtype (q, k and v projections of one fp32 norm output keep three)."""
        bytes_per = 4 if precision == "fp32" else 2
        pls = list(placement.params) if placement is not None else []
        par = 0.0
        for j, p in enumerate(op.params):
            pl = pls[j] if j < len(pls) else "R"
            par += p.numel * bytes_per / (tp if pl.startswith("S") and tp > 1 else 1)
        acts, _ = split_inputs(op)
        metas = [op.input_meta[i] for i in acts]
        split = splits_work(placement)
        scale = microbatch_size / traced_batch_size
        # autocast runs norms, softmax and losses (and saves) in fp32; on CPU ranks only the losses
        saved_at = op_precision(op.kind, precision, self.cluster.cpu_ranks)
        total = 0.0
        for n, t in enumerate(op.saved):
            k = next((k for k, m in enumerate(metas) if m.shape == t.shape), None)
            at = saved_at
            if k is not None:
                at = dtypes.inputs[acts[k]] if dtypes is not None else saved_at
                d = placement.inputs[k] if placement is not None and k < len(placement.inputs) else "R"
                sharded = d.startswith("S") or (keep_shards and d == "R" and input_sources is not None
                                                and k < len(input_sources)
                                                and sequence_shard(input_sources[k], len(t.shape)))
            elif inputs_only and all(t.numel != m.numel for m in (*metas, *op.output_meta[:1])):
                continue  # a kernel internal (log-sum-exp, RNG state)
            elif op.output_meta and t.shape == op.output_meta[0].shape:
                at = dtypes.output if dtypes is not None else saved_at
                sharded = placement is not None and placement.output.startswith("S")
            else:
                sharded = split
            total += tensor_bytes(t, at) * (1.0 if n in op.fixed_saved else scale) / (tp if sharded and tp > 1 else 1)
        for i in recast if dtypes is not None and not inputs_only else ():
            k = acts.index(i) if i in acts else None
            if k is None:
                continue
            d = placement.inputs[k] if placement is not None and k < len(placement.inputs) else "R"
            total += tensor_bytes(op.input_meta[i], dtypes.inputs[i]) * scale / (tp if d.startswith("S") and tp > 1
                                                                                  else 1)
        if op.kind == "attention" and len(metas) >= 2 and not inputs_only:
            # torch runs SDPA with dropout on CPU ranks as its math path (the CPU flash kernel takes no dropout),
            # which keeps what unfused attention keeps, its dropout noise in the scores' dtype (input * noise)
            dropout = attention_dropout(op)
            cpu_math = self.cluster.cpu_ranks and dropout
            if self.compute.unfused_attention or cpu_math:
                # unfused attention keeps the probabilities for its backward (and, with dropout, the mask and the
                # dropped-out probabilities the p v GEMM read); the trace saw the fused kernel, which keeps neither
                scores = kernel_elems(op, acts, scale, tp if split and tp > 1 else 1)
                mask = bytes_per if cpu_math else 1  # fused softmax-dropout kernels keep a 1-byte mask
                total += scores * (2 * bytes_per + mask if dropout else bytes_per)
        return par, total

    # ---- whole plans ----------------------------------------------------------------------------------------
    def predict(self, graph: OpGraph, plan: Plan, timeline: bool = False) -> Prediction:
        """Predict one training step of `plan` on this cluster: time with breakdown, memory per pipeline rank,
        throughput, assumptions, and (when `timeline`) the simulated spans."""
        from cost_model.step import predict_step
        return predict_step(self, graph, plan, timeline=timeline)
