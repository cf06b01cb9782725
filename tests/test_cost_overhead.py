"""The measured refinements of the compute model: per-op host overheads (plain and DTensor), compute-bound kernel
costs per element, the optimizer's per-tensor cost, and their profile fields (round trip, validation)."""
from __future__ import annotations

import dataclasses

import pytest

from cost_model.work import kernel_family
from cost_model.dtypes import autocast_dtypes
from cost_model.backward import extra_reads, recompute_stop
from cost_model.layers import LayerCoster, runs_on_dtensors
from cost_model.model import CostModel
from hardware_profiles.load import cluster_from_dict, cluster_to_dict, load_cluster
from hardware_profiles.schema import OpOverhead, ProfileError
from planner.defaults import default_plan
from test_memory_activations import cluster, megatron_gpt

FWD, BWD, OPT = 1e-3, 2e-3, 5e-4


def _with(cl, **dev):
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, **dev))


def test_overhead_adds_exactly_per_op_and_per_backward_node():
    g = megatron_gpt(layers=2)
    base = cluster(per_node=1)
    over = _with(base, op_overhead=OpOverhead(forward=FWD, backward=BWD, optimizer=OPT))
    a, b = CostModel(base), CostModel(over)
    for op in g.ops:
        f0, b0 = a.op_time(op, None, 1, 1, "bf16")
        f1, b1 = b.op_time(op, None, 1, 1, "bf16")
        assert f1 - f0 == pytest.approx(FWD)  # views included: each is a dispatcher call
        assert b1 - b0 == pytest.approx(BWD * (1 + len(op.params)))  # + one gradient accumulation per parameter
    plan = default_plan(g, base, 1, "bf16", {"dp": 1, "tp": 1, "pp": 1, "mbs": 1}, "m")
    p0, p1 = a.predict(g, plan), b.predict(g, plan)
    n_params = sum(len(op.params) for op in g.ops)
    # plus autocast's casts (an op and an autograd node each: activations, and each linear's fp32 parameters) and
    # autograd's sums of gradients read several times
    n_casts = sum(len(d.casts) for d in autocast_dtypes(g, "bf16", "fp32").values()) \
        + sum(len(op.params) for op in g.ops if op.kind == "linear")
    want = len(g.ops) * (FWD + BWD) + n_params * BWD + n_casts * (FWD + BWD) + sum(extra_reads(g).values()) * BWD
    assert p1.breakdown["compute_s"] - p0.breakdown["compute_s"] == pytest.approx(want)
    tensors = len({p.name for op in g.ops for p in op.params})
    assert p1.breakdown["optimizer_s"] - p0.breakdown["optimizer_s"] == pytest.approx(tensors * OPT)


def test_ops_on_dtensors_pay_the_dtensor_overhead():
    g = megatron_gpt()
    over = _with(cluster(per_node=2), op_overhead=OpOverhead(forward=FWD, dtensor_forward=7 * FWD))
    cm = CostModel(over)
    ops = default_plan(g, cluster(per_node=2), 2, "bf16", {"tp": 2, "dp": 1}, "m").ops
    base = CostModel(cluster(per_node=2))
    assert ops["h0_fc1"].strategy == "colwise"
    # a placed op runs on DTensors; any op does where its module is (replicated ops and views alike)
    for name, dt in (("h0_fc1", None), ("h0_add1", True), (next(op.name for op in g.ops if op.kind == "reshape"),
                                                            True)):
        op = g.op(name)
        f1, _ = cm.op_time(op, ops.get(name), 2, 1, "bf16", dtensor=dt)
        f0, _ = base.op_time(op, ops.get(name), 2, 1, "bf16", dtensor=dt)
        assert f1 - f0 == pytest.approx(7 * FWD), name
        f1, _ = cm.op_time(op, None, 1, 1, "bf16")  # tp = 1: plain tensors
        f0, _ = base.op_time(op, None, 1, 1, "bf16")
        assert f1 - f0 == pytest.approx(FWD), name


def test_only_wholly_replicated_modules_run_on_plain_tensors():
    g = megatron_gpt(layers=2)
    base = cluster(per_node=2)
    over = _with(base, op_overhead=OpOverhead(forward=FWD, dtensor_forward=7 * FWD))
    plan = default_plan(g, base, 2, "bf16", {"tp": 2, "dp": 1, "pp": 1, "mbs": 1, "sp": 0}, "m")
    on = runs_on_dtensors(plan)
    placed = {pl.module for pl in plan.ops.values() if pl.strategy != "replicate"}
    assert placed and all(on(m) for m in placed)
    some = sorted(placed)[0]
    assert on(some.rpartition(".")[0]) and not on(some[:-1])  # an ancestor module, not a name's prefix
    assert on("")  # the root's own ops (embedding sums, the loss) see its DTensor activations
    plain = {op.module_path for op in g.ops if op.module_path and not any(
        q == op.module_path or q.startswith(op.module_path + ".") for q in placed)}
    assert plain and not any(on(m) for m in plain)  # e.g. the norms, unplaced without sequence parallelism
    n_dt = sum(1 for op in g.ops if on(op.module_path))
    d = CostModel(over).predict(g, plan).breakdown["compute_s"] - CostModel(base).predict(g, plan).breakdown[
        "compute_s"]
    # autocast's casts are plain ops, one per tensor the tp executor shares among its linear readers (q, k, v)
    coster = LayerCoster(CostModel(base), g, plan, CostModel(base).tp_group(2))
    n_casts = 0
    for layer in g.layers():
        done: set[str] = set()
        for i in layer.ops:
            casts = coster._shared_casts(g.ops[i], plan.ops.get(g.ops[i].name), done)
            n_casts += len(casts.casts) if casts is not None else 0
    assert n_casts < sum(len(c.casts) for c in autocast_dtypes(g, "bf16", "bf16").values())
    # and no weight casts: FSDP2 computes with bf16 weights under tp (Plan.fsdp_mixed_precision)
    assert plan.fsdp_mixed_precision
    assert d == pytest.approx((n_dt * 7 * FWD + (len(g.ops) - n_dt + n_casts) * FWD) * plan.num_microbatches)
    assert not runs_on_dtensors(default_plan(g, base, 2, "bf16", {"tp": 1, "dp": 2}, "m"))("")


def test_matmuls_pay_their_measured_dispatch():
    g = megatron_gpt()
    mm = next(op for op in g.ops if op.kind == "matmul")
    ov = OpOverhead(forward=FWD, backward=BWD, matmul_forward=3 * FWD, matmul_backward=5 * BWD,
                    dtensor_forward=7 * FWD, dtensor_matmul_forward=11 * FWD, dtensor_matmul_backward=13 * BWD)
    cm, base = CostModel(_with(cluster(per_node=2), op_overhead=ov)), CostModel(cluster(per_node=2))
    for tp, f_want, b_want in ((1, 3 * FWD, 5 * BWD), (2, 11 * FWD, 13 * BWD)):
        dt = tp > 1
        (f1, b1), (f0, b0) = (c.op_time(mm, None, tp, 1, "bf16", dtensor=dt) for c in (cm, base))
        assert (f1 - f0, b1 - b0) == (pytest.approx(f_want), pytest.approx(b_want))


def test_kernel_cost_prices_compute_bound_elementwise_ops():
    g = megatron_gpt()
    gelu = dataclasses.replace(g.op("h0_gelu"), target="F.gelu")  # the hand-made graph names no callee
    assert kernel_family(gelu) == "gelu" and kernel_family(g.op("h0_add1")) == "add"
    for target, family in (("aten.gelu.default", "gelu"), ("aten.tanh.default", "tanh"),
                           ("aten.add.Tensor", "add")):  # export's names: the overload is not the callee
        assert kernel_family(dataclasses.replace(gelu, target=target)) == family
    elems = gelu.output_meta[0].numel
    slow = _with(cluster(), kernel_costs={"gelu": (1e-6, 3e-6)})  # far above the bytes term
    f, b = CostModel(slow).op_time(gelu, None, 1, 1, "bf16")
    assert (f, b) == (pytest.approx(elems * 1e-6), pytest.approx(elems * 3e-6))
    f2, _ = CostModel(slow).op_time(gelu, None, 1, 2, "bf16", traced_batch_size=1)
    assert f2 == pytest.approx(2 * f)
    fast = _with(cluster(), kernel_costs={"gelu": (1e-30, 1e-30)})  # below the bytes term: the roofline holds
    assert CostModel(fast).op_time(gelu, None, 1, 1, "bf16") == CostModel(cluster()).op_time(gelu, None, 1, 1,
                                                                                             "bf16")


def test_kernel_families():
    g = megatron_gpt()
    fam = {op.kind: kernel_family(op) for op in g.ops}
    assert fam["norm"] == "layer_norm" and fam["linear"] is None and fam["reshape"] is None


@pytest.mark.parametrize("recompute,key", [("full", "checkpoint"), ("selective", "sac")])
def test_checkpointed_block_ops_pay_the_measured_checkpoint_cost(recompute, key):
    """Every op of a checkpointed block pays the forward figure; the ops the re-run reaches (up to early stop) pay
    the backward one; linears their own figures; nothing outside blocks or without recompute."""
    g = megatron_gpt(layers=2)
    base = cluster(per_node=1)
    figs = {f"{key}_forward": 1e-3, f"{key}_backward": 2e-3, f"{key}_linear_forward": 4e-3,
            f"{key}_linear_backward": 8e-3}
    other = "sac" if key == "checkpoint" else "checkpoint"  # the other policy's figures must not be charged
    over = _with(base, op_overhead=OpOverhead(**figs, **{f"{other}_forward": 1.0, f"{other}_backward": 1.0}))
    block = next(l for l in g.layers() if l.block_type)
    ops = [g.ops[i] for i in block.ops]
    stop = recompute_stop(g, block)
    fig = lambda op, part: figs[f"{key}_{'linear_' if op.kind == 'linear' else ''}{part}"]  # noqa: E731
    for rc in ("none", recompute):
        plan = default_plan(g, base, 1, "bf16", {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "recompute": rc}, "m")
        c0 = LayerCoster(CostModel(base), g, plan, CostModel(base).tp_group(1)).cost(block)
        c1 = LayerCoster(CostModel(over), g, plan, CostModel(over).tp_group(1)).cost(block)
        want_f = sum(fig(op, "forward") for op in ops) if rc != "none" else 0.0
        want_b = sum(fig(op, "backward") for op in ops[:stop + 1]) if rc != "none" else 0.0
        assert c1.fwd_compute - c0.fwd_compute == pytest.approx(want_f)
        assert c1.recompute - c0.recompute == pytest.approx(want_b)
        assert c1.bwd_compute == pytest.approx(c0.bwd_compute)
        head = g.layers()[-1]
        assert LayerCoster(CostModel(over), g, plan, CostModel(over).tp_group(1)).cost(head).fwd_compute == \
            pytest.approx(LayerCoster(CostModel(base), g, plan, CostModel(base).tp_group(1)).cost(head).fwd_compute)


def test_mesh_slice_is_paid_once_per_step_with_dp():
    """The runner's dp sub-mesh lookup (one per step, to slice the global batch) adds to the step and its compute,
    only where dp > 1."""
    g = megatron_gpt(layers=2)
    base = cluster(per_node=2)
    over = _with(base, op_overhead=OpOverhead(mesh_slice=3e-3))
    for mesh, paid in (({"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 0}, True),
                       ({"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 3}, True),
                       ({"dp": 1, "tp": 2, "pp": 1, "mbs": 1}, False)):
        plan = default_plan(g, base, 4, "bf16", mesh, "m")
        p0, p1 = CostModel(base).predict(g, plan), CostModel(over).predict(g, plan)
        want = 3e-3 if paid else 0.0
        assert p1.step_time_s - p0.step_time_s == pytest.approx(want), mesh
        assert p1.breakdown["compute_s"] - p0.breakdown["compute_s"] == pytest.approx(want), mesh
        assert p1.breakdown["exposed_comm_s"] == pytest.approx(p0.breakdown["exposed_comm_s"]), mesh


def test_fields_round_trip_and_default_to_zero():
    c = load_cluster("cpu-local")
    assert c.device.op_overhead.forward > 0 and "gelu" in c.device.kernel_costs
    assert cluster_from_dict(cluster_to_dict(c)) == c
    gpu = cluster_to_dict(load_cluster("dgx-a100-80gb"))
    assert gpu["device"]["op_overhead"]["forward"] > 0  # cited eager-dispatch figures (see the preset)
    del gpu["device"]["op_overhead"]
    bare = cluster_from_dict(gpu)
    assert bare.device.op_overhead == OpOverhead() and bare.device.kernel_costs == {}
    assert "op_overhead" not in cluster_to_dict(bare)["device"]


@pytest.mark.parametrize("field,value,expected", [
    ("op_overhead", {"forward": -1e-6}, "device.op_overhead.forward: must be > 0"),
    ("op_overhead", {"launch": 1e-6}, "device.op_overhead.launch: unknown key"),
    ("op_overhead", {"forward": 2.0}, "implausibly large"),
    ("kernel_costs", {"gelu": 1e-9}, "device.kernel_costs.gelu: expected [forward, backward]"),
    ("kernel_costs", {"erf": [1e-9, 1e-9]}, "device.kernel_costs.erf: unknown key"),
])
def test_bad_fields_name_their_path(field, value, expected):
    d = cluster_to_dict(load_cluster("dgx-a100-80gb"))
    d["device"][field] = value
    with pytest.raises(ProfileError, match=None) as e:
        cluster_from_dict(d)
    assert expected in str(e.value)
