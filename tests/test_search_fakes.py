"""Hand-computable fakes for the search tests: tiny graphs and a table-driven cost model.

FakeCostModel prices with numbers a person can check:
- op_time: the op's table time t (seconds, forward + backward = t, split 1/3 : 2/3) times the micro-batch size,
  divided by tp when the op is sharded (a placement with something sharded, `splits_work`: an op on partial sums
  computes whole tensors); per-(op, strategy) overrides win.
- reshard_time: a fixed time per kind of change (table RESHARD) per 128 elements of the tensor, times the
  micro-batch size (so an all-gather of a 4h-wide activation costs 4x that of an h-wide one).
- op_memory: parameters 4 bytes per element, divided by tp for each parameter placed S(d); activations 4 bytes per
  output element per sample, divided by tp when the output is sharded.
- predict: a small closed-form step model (documented on the method) so outer-loop behaviour can be checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from cost_model.work import splits_work
from cost_model.prediction import Prediction
from hardware_profiles.schema import Cluster, DeviceSpec, LinkSpec
from planner.graph import OpGraph, OpNode, ParamInfo, TensorMeta

RESHARD = {("S", "R"): 1.0, ("P", "R"): 2.0, ("P", "S"): 1.0, ("S", "S"): 1.5, ("R", "S"): 0.0,
           ("R", "P"): 0.0, ("S", "P"): 1.0}
"""Seconds per micro-batch sample for a layout change (by the leading letter of source, destination)."""


TARGETS = {"linear": "torch.nn.Linear", "embedding": "torch.nn.Embedding", "norm": "torch.nn.LayerNorm",
           "attention": "F.scaled_dot_product_attention", "loss": "F.mse_loss"}
"""What each kind calls by default (a real callable, so `planner.dtensor_rules` can check its placements);
elementwise ops call F.gelu (one input) or operator.add (two)."""


def make_op(name, kind, inputs=(), shape=(1, 8, 16), params=(), block=None, block_type=None, module="",
            in_shapes=None, target="") -> OpNode:
    """An fp32 op with the given output shape; parameters are (name, shape) pairs. An embedding with no input shape
    given reads int64 ids of the output's shape without its last dim."""
    in_shapes = in_shapes if in_shapes is not None else [shape] * len(inputs)
    pinfo = tuple(ParamInfo(n, tuple(s), "float32") for n, s in params)
    metas = tuple(TensorMeta(tuple(s), "float32") for s in in_shapes)
    if kind == "embedding" and not metas:
        metas = (TensorMeta(tuple(shape[:-1]), "int64"),)
    metas += tuple(TensorMeta(p.shape, "float32") for p in pinfo)
    out = TensorMeta(tuple(shape), "float32")
    default = TARGETS.get(kind, ("F.gelu" if len(in_shapes) == 1 else "operator.add") if kind == "elementwise"
                          else kind)
    target = target or default
    module_call = target.startswith("torch.nn.")
    args = ("T",) * (len(metas) - (len(pinfo) if module_call else 0))
    return OpNode(name=name, kind=kind, target=target, module_path=module or name, inputs=tuple(inputs),
                  input_meta=metas, output_meta=(out,), fwd_flops=0, bwd_flops=0, bytes_read=0,
                  bytes_written=out.bytes, params=pinfo, saved=(out,), block=block, block_type=block_type, args=args)


def mlp_block(prefix: str, prev: str, h: int = 16, block_type: str = "h.*") -> list[OpNode]:
    """A pre-norm MLP residual block: norm -> fc (h->4h) -> gelu -> proj (4h->h) -> add."""
    b = dict(block=prefix, block_type=block_type)
    return [
        make_op(f"{prefix}_ln", "norm", [prev], (1, 8, h), [(f"{prefix}.ln.weight", (h,))],
                module=f"{prefix}.ln", **b),
        make_op(f"{prefix}_fc", "linear", [f"{prefix}_ln"], (1, 8, 4 * h),
                [(f"{prefix}.mlp.fc.weight", (4 * h, h)), (f"{prefix}.mlp.fc.bias", (4 * h,))],
                in_shapes=[(1, 8, h)], module=f"{prefix}.mlp.fc", **b),
        make_op(f"{prefix}_act", "elementwise", [f"{prefix}_fc"], (1, 8, 4 * h), module=f"{prefix}.mlp", **b),
        make_op(f"{prefix}_proj", "linear", [f"{prefix}_act"], (1, 8, h),
                [(f"{prefix}.mlp.proj.weight", (h, 4 * h))], in_shapes=[(1, 8, 4 * h)], module=f"{prefix}.mlp.proj",
                **b),
        make_op(f"{prefix}_add", "elementwise", [prev, f"{prefix}_proj"], (1, 8, h), module=prefix, **b),
    ]


def tiny_gpt(n_blocks: int = 2, h: int = 16, vocab: int = 32) -> OpGraph:
    """embedding -> n MLP blocks -> head linear -> loss; traced with batch 1, sequence 8."""
    ops = [make_op("emb", "embedding", [], (1, 8, h), [("emb.weight", (vocab, h))], in_shapes=[])]
    prev = "emb"
    for k in range(n_blocks):
        ops += mlp_block(f"h.{k}", prev, h)
        prev = f"h.{k}_add"
    ops.append(make_op("head", "linear", [prev], (1, 8, vocab), [("head.weight", (vocab, h))],
                       in_shapes=[(1, 8, h)]))
    ops.append(make_op("loss", "loss", ["head"], (), in_shapes=[(1, 8, vocab)]))
    params = {p.name: p for op in ops for p in op.params}
    return OpGraph(model_name="tiny", ops=tuple(ops), parameters=tuple(params.values()), batch_size=1)


def tied_gpt(n_blocks: int = 2) -> OpGraph:
    """tiny_gpt with the head reading the embedding's weight (one parameter name, as the tracers give a tied one)."""
    g = tiny_gpt(n_blocks)
    ops = [replace(op, params=tuple(replace(p, name="emb.weight") for p in op.params)) if op.name == "head" else op
           for op in g.ops]
    params = {p.name: p for op in ops for p in op.params}
    return OpGraph(model_name="tied", ops=tuple(ops), parameters=tuple(params.values()), batch_size=1)


def _kind(placement: str) -> str:
    return placement[0]


@dataclass
class FakeCostModel:
    """Table-driven CostModel stand-in (see the module docstring for the arithmetic)."""

    times: Mapping[str, float] = field(default_factory=dict)
    """Op name -> seconds per sample, replicated (default 1.0)."""
    overrides: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(op name, strategy) -> seconds per sample, replacing the t / tp rule."""
    reshard: Mapping[tuple[str, str], float] = field(default_factory=lambda: dict(RESHARD))
    """Layout-change table."""
    cluster: Cluster | None = None
    """Links and memory predict uses (fake_cluster() when None)."""
    default_time: float = 1.0
    """Seconds per sample of ops missing from `times`."""
    partial_reduce: float = 0.0
    """Seconds per 128 elements per sample of a column-parallel reader's input-gradient reduction (Megatron's f)."""
    calls: dict = field(default_factory=lambda: {"predict": 0})

    def op_time(self, op, placement, tp, microbatch_size, precision, graph=None):
        t = self.times.get(op.name, self.default_time)
        if placement is not None:
            t = self.overrides.get((op.name, placement.strategy), t / tp if splits_work(placement) else t)
        t *= microbatch_size
        return (t / 3, 2 * t / 3)

    def op_parts(self, op, placement, tp, microbatch_size, precision, graph=None, dtensor=None):
        """`op_time` as kernels, with no host dispatch (`compute.combine` adds them)."""
        return (*self.op_time(op, placement, tp, microbatch_size, precision), 0.0, 0.0)

    def grad_accumulation_time(self, op, placement, tp, precision, microbatches=float("inf")):
        """No gradient-accumulation cost in the table."""
        return 0.0

    async_host = False
    local_call_host = (0.0, 0.0)

    @property
    def compute(self):
        return self

    @staticmethod
    def combine(kernel, host):
        return kernel + host

    @staticmethod
    def reshard_wait(tp):
        return 0.0

    def reshard_time(self, meta, src, dst, tp, microbatch_size, precision, consumer_partial_grad=False):
        f = b = 0.0
        if src != dst:
            t = self.reshard[(_kind(src), _kind(dst))] * meta.numel / 128 * microbatch_size
            f, b = t / 2, t / 2
        if consumer_partial_grad and _kind(dst) == "R":
            b += self.partial_reduce * meta.numel / 128 * microbatch_size
        return (f, b)

    def op_memory(self, op, placement, tp, microbatch_size, precision):
        params = 0
        for k, p in enumerate(op.params):
            sharded = placement is not None and k < len(placement.params) and placement.params[k].startswith("S")
            params += p.numel * 4 // (tp if sharded else 1)
        out = op.output_meta[0].numel * 4 * microbatch_size if op.output_meta else 0
        if placement is not None and placement.output.startswith("S"):
            out //= tp
        return (params, out)

    def predict(self, graph, plan, timeline=False):
        """step = compute (op_time plus the re-sharding into each op, reshard_time) of the busiest pipeline rank x
        (m + (pp - 1) / v) + dp gradient all-reduce (+50% under ZeRO-3 for the parameter gathers),
        where the all-reduce moves 2 x param bytes on the device / link bandwidth of the dp group;
        memory = param bytes x 4 (weights, grads, 2 Adam moments; optimizer+grads / dp under ZeRO) + activations x
        in-flight micro-batches (divided by 4 under full recompute)."""
        self.calls["predict"] += 1
        return fake_predict(self, graph, plan)


def fake_predict(cm: FakeCostModel, graph: OpGraph, plan) -> Prediction:
    """The closed-form step model FakeCostModel.predict documents."""
    m, tp, dp, pp = plan.num_microbatches, plan.mesh.tp, plan.mesh.dp, plan.mesh.pp
    layers = graph.layers()
    stages = plan.stages or ()
    bounds = [(s.start_layer, s.end_layer) for s in stages] or [(0, len(layers))]
    stage_t, stage_p, stage_a = [], [], []
    for a, b in bounds:
        t = pb = ab = 0.0
        for layer in layers[a:b]:
            for i in layer.ops:
                op = graph.ops[i]
                pl = plan.placement(op.name)
                t += sum(cm.op_time(op, pl, tp, plan.microbatch_size, plan.precision))
                t += _reshard_into(cm, graph, plan, op, pl)
                p_, a_ = cm.op_memory(op, pl, tp, plan.microbatch_size, plan.precision)
                pb, ab = pb + p_, ab + a_
        stage_t.append(t * (4 / 3 if plan.recompute == "full" else 1.0))
        stage_p.append(pb)
        stage_a.append(ab)
    rank_t = [0.0] * pp
    for k, t in enumerate(stage_t):
        rank_t[(stages[k].rank if stages else 0) % pp] += t
    compute = max(rank_t) * (m + (pp - 1) / plan.virtual_stages)
    cluster = cm.cluster or fake_cluster()
    within = dp * tp <= cluster.devices_per_node
    bw = cluster.intra_node.bandwidth if within else cluster.inter_node.bandwidth
    if tp > cluster.devices_per_node:  # tp across nodes: every layout change crosses the slow link
        compute *= 1.0 + cluster.intra_node.bandwidth / cluster.inter_node.bandwidth
    grad_bytes = max(stage_p)
    dp_comm = 0.0 if dp == 1 else 2 * grad_bytes / bw * (1.5 if plan.zero_stage == 3 else 1.0)
    step = compute + dp_comm
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[plan.zero_stage]
    inflight = m if plan.schedule == "gpipe" else min(pp, m)
    act_div = 4 if plan.recompute == "full" else 1
    mem = [int(p / shard[0] + p / shard[1] + 2 * p / shard[2] + a * inflight / act_div)
           for p, a in zip(stage_p, stage_a)]
    usable = cluster.device.usable_memory_bytes
    return Prediction(step_time_s=step, breakdown={"compute_s": compute, "exposed_comm_s": dp_comm,
                                                   "bubble_s": 0.0, "optimizer_s": 0.0},
                      peak_memory_bytes=max(mem), memory_per_device_bytes=tuple(mem), memory_breakdown={},
                      tflops_per_device=1.0 / step, mfu=0.1 / step, fits=max(mem) <= usable)


def _reshard_into(cm: FakeCostModel, graph: OpGraph, plan, op: OpNode, pl) -> float:
    """Re-sharding of op's inputs from their producers' output layouts (as the real cost model charges it)."""
    total = 0.0
    for k, src in enumerate(op.inputs):
        if src not in graph.index or not graph.op(src).output_meta:
            continue
        src_pl = plan.placement(src)
        have = src_pl.output if src_pl is not None else "R"
        want = pl.inputs[k] if pl is not None and k < len(pl.inputs) else "R"
        total += sum(cm.reshard_time(graph.op(src).output_meta[0], have, want, plan.mesh.tp,
                                     plan.microbatch_size, plan.precision))
    return total


def fake_cluster(nodes: int = 1, devices_per_node: int = 8, memory_bytes: int = 2**40, inter_bw: float = 25e9,
                 intra_bw: float = 300e9) -> Cluster:
    """A cluster for the outer-loop tests (only sizes and links matter to the fake)."""
    dev = DeviceSpec(name="fake", memory_bytes=memory_bytes, usable_memory_fraction=1.0, peak_flops={"bf16": 1e12},
                     memory_bandwidth=1e12, matmul_efficiency=((1.0, 1.0),), memory_efficiency=((1.0, 1.0),))
    return Cluster(name="fake", nodes=nodes, devices_per_node=devices_per_node, device=dev,
                   intra_node=LinkSpec(kind="nvswitch", bandwidth=intra_bw, latency=1e-6),
                   inter_node=LinkSpec(kind="infiniband", bandwidth=inter_bw, latency=1e-6))
