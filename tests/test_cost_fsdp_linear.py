"""Measured terms for FSDP2's per-module cost, Partial-gradient optimizer steps under sequence parallelism, and
nn.Linear's own forward/backward rates: each adds exactly what the profile says, and round-trips through YAML."""
from __future__ import annotations

import dataclasses

import pytest

from cost_model.model import CostModel
from hardware_profiles.load import cluster_from_dict, cluster_to_dict
from hardware_profiles.schema import OpOverhead, ProfileError
from planner.defaults import default_plan
from test_memory_activations import cluster, megatron_gpt

MOD, TEN = 3e-3, 1e-4


def _with(cl, **dev):
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, **dev))


@pytest.mark.parametrize("zero,keys", [(3, ("fsdp_module_reshard", "fsdp_tensor_reshard")),
                                       (1, ("fsdp_module", "fsdp_tensor"))])
def test_fsdp_overhead_per_module_and_tensor(zero, keys):
    g = megatron_gpt(layers=3)
    base = cluster(per_node=2)
    over = _with(base, op_overhead=OpOverhead(**dict(zip(keys, (MOD, TEN)))))
    plan = default_plan(g, base, 2, "bf16", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": zero}, "m")
    p0, p1 = CostModel(base).predict(g, plan), CostModel(over).predict(g, plan)
    blocks = {op.block for op in g.ops if op.block}
    tensors = len({p.name for op in g.ops for p in op.params})
    root_tensors = len({p.name for op in g.ops if not op.block for p in op.params})
    want = (len(blocks) + 1) * MOD + tensors * TEN  # each block and the root are fully_shard'ed
    if zero == 3:  # the root is not resharded after forward: its hooks cost the plain (unmeasured here) figures
        want -= MOD + root_tensors * TEN
    # on the compute stream (the step grows by at most as much: the longer backward hides more dp reduction)
    d = p1.breakdown["compute_s"] - p0.breakdown["compute_s"]
    assert d == pytest.approx(want * plan.num_microbatches)
    assert 0 < p1.step_time_s - p0.step_time_s <= d * (1 + 1e-9)
    # no FSDP without data parallelism, nor under DDP (ZeRO-0)
    for force in ({"dp": 1, "tp": 2, "pp": 1, "mbs": 1}, {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 0}):
        plan = default_plan(g, base, 2, "bf16", force, "m")
        assert CostModel(over).predict(g, plan).step_time_s == CostModel(base).predict(g, plan).step_time_s


def test_fsdp_hooks_are_host_work_hidden_behind_kernels_on_gpus():
    # on a GPU the hooks run on the host while earlier kernels run: a unit pays only what they make its host
    # outlast its kernels (ComputeModel.added); CPU ranks, whose host is the device, pay them whole
    from cost_model.step import StepPredictor
    g = megatron_gpt(layers=3)
    gpu = _with(cluster(per_node=2), async_host=True)  # no per-op host cost: a unit's host is its hooks alone
    plan = default_plan(g, gpu, 2, "bf16", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 1}, "m")
    blocks = len({op.block for op in g.ops if op.block})
    tensors = len({p.name for op in g.ops for p in op.params})

    def extra(cl, mod, ten):
        over = _with(cl, op_overhead=OpOverhead(fsdp_module=mod, fsdp_tensor=ten))
        sp = StepPredictor(CostModel(over), g, plan)
        return sum(sp.fsdp_overhead(sp.chunks[0][0].layers)), sp.chunks[0][0].layers
    hidden, layers = extra(gpu, 1e-12, 0.0)  # far below every pass's kernels
    assert hidden == 0.0 and min(min(l.kernels) for l in layers) > 1e-10
    kernels = sum(l.kernels[0] + l.kernels[1] for l in layers)
    big = 1.0  # far above them: every pass's kernels hide that much of its hooks, no more
    shown, _ = extra(gpu, big, TEN)
    assert shown == pytest.approx((blocks + 1) * big + tensors * TEN - kernels)
    cpu, _ = extra(_with(gpu, async_host=False), MOD, TEN)
    assert cpu == pytest.approx((blocks + 1) * MOD + tensors * TEN)


def test_sequence_parallel_norm_weights_pay_one_gradient_all_reduce_and_the_dtensor_optimizer_cost():
    g = megatron_gpt(layers=2)
    base = cluster(per_node=2)
    over = _with(base, op_overhead=OpOverhead(dtensor_optimizer=1e-4, dtensor_partial_optimizer=5e-3))
    force = {"dp": 1, "tp": 2, "pp": 1, "mbs": 1}
    sp = default_plan(g, base, 2, "bf16", {**force, "sp": 1}, "m")
    assert sp.sequence_parallel and any(pl.strategy == "sequence" for pl in sp.ops.values())
    norm_tensors = len({p.name for op in g.ops for p in op.params
                        if sp.ops.get(op.name) is not None and sp.ops[op.name].strategy == "sequence"})
    assert norm_tensors > 0
    no_sp = default_plan(g, base, 2, "bf16", {**force, "sp": 0}, "m")
    d_sp = CostModel(over).predict(g, sp).breakdown["optimizer_s"] - CostModel(base).predict(g, sp).breakdown[
        "optimizer_s"]
    d_no = CostModel(over).predict(g, no_sp).breakdown["optimizer_s"] - CostModel(base).predict(g, no_sp).breakdown[
        "optimizer_s"]
    # without SP the norms are wholly replicated modules: plain tensors (executor.tp runs them locally); with SP
    # their Partial gradients are all-reduced once before the optimizer (not in each AdamW op: 5e-3 is unused)
    assert d_sp - d_no == pytest.approx(norm_tensors * 1e-4)
    cm = CostModel(base)
    one = cm.comm.time("all_reduce", 4, cm.tp_group(2))
    extra = cm.predict(g, sp).breakdown["optimizer_s"] - cm.predict(g, no_sp).breakdown["optimizer_s"]
    assert extra >= norm_tensors * one > 0


def test_linear_priced_from_measured_linear_rates_at_fp32():
    g = megatron_gpt()
    lin = g.op("h0_fc1")
    base = cluster()
    meas = _with(base, linear_efficiency=((1e3, 0.5), (1e12, 0.5)), linear_backward_efficiency=((1e3, 0.25),))
    f0, b0 = CostModel(base).op_time(lin, None, 1, 1, "fp32")
    f1, b1 = CostModel(meas).op_time(lin, None, 1, 1, "fp32")
    pk = base.device.peak_flops["fp32"]
    assert f1 == pytest.approx(max(lin.fwd_flops / (pk * 0.5), f0))
    assert b1 == pytest.approx(max(lin.bwd_flops / (pk * 0.25), b0))
    assert CostModel(meas).op_time(lin, None, 1, 1, "bf16") == CostModel(base).op_time(lin, None, 1, 1, "bf16")


def test_new_fields_round_trip_and_validate():
    c = _with(cluster(), op_overhead=OpOverhead(fsdp_module=MOD, dtensor_partial_optimizer=2e-3),
              linear_efficiency=((1e6, 0.3), (1e9, 0.9)), linear_backward_efficiency=((1e6, 0.2), (1e9, 0.7)))
    assert cluster_from_dict(cluster_to_dict(c)) == c
    d = cluster_to_dict(c)
    d["device"]["linear_efficiency"] = [[1e6, 1.5]]
    with pytest.raises(ProfileError) as e:
        cluster_from_dict(d)
    assert "device.linear_efficiency[0][1]" in str(e.value)


def test_linear_pays_its_measured_whole_call_overhead():
    g = megatron_gpt()
    lin, norm = g.op("h0_fc1"), g.op("h0_ln1")
    base = cluster(per_node=2)
    ov = OpOverhead(forward=1e-5, backward=2e-5, linear_forward=7e-5, linear_backward=9e-5,
                    dtensor_linear_forward=3e-4, dtensor_linear_backward=5e-4)
    cm, cm0 = CostModel(_with(base, op_overhead=ov)), CostModel(base)
    f, b = (x - y for x, y in zip(cm.op_time(lin, None, 1, 1, "bf16"), cm0.op_time(lin, None, 1, 1, "bf16")))
    assert (f, b) == (pytest.approx(7e-5), pytest.approx(9e-5))  # replaces the per-op and per-node charges
    f, b = (x - y for x, y in zip(cm.op_time(norm, None, 1, 1, "bf16"), cm0.op_time(norm, None, 1, 1, "bf16")))
    assert (f, b) == (pytest.approx(1e-5), pytest.approx(2e-5 * 3))  # other ops keep them
    pl = default_plan(g, base, 2, "bf16", {"tp": 2, "dp": 1}, "m").ops["h0_fc1"]
    f, b = (x - y for x, y in zip(cm.op_time(lin, pl, 2, 1, "bf16"), cm0.op_time(lin, pl, 2, 1, "bf16")))
    assert (f, b) == (pytest.approx(3e-4), pytest.approx(5e-4))


def test_a_linear_on_a_sequence_pays_its_measured_flattening():
    """A (batch, sequence, features) input: F.linear flattens and restores the leading dims, two dispatches more,
    which the probe times on a (1, 2, 2) input (`linear_nd_*`); a 2-D input keeps the 2-D figures."""
    g = megatron_gpt()
    lin = g.op("h0_fc1")
    assert len(lin.input_meta[0].shape) == 3
    flat = dataclasses.replace(lin, input_meta=(dataclasses.replace(lin.input_meta[0], shape=(32, 64)),
                                                *lin.input_meta[1:]))
    base = cluster(per_node=2)
    ov = OpOverhead(forward=1e-5, backward=2e-5, linear_forward=7e-5, linear_backward=9e-5, linear_nd_forward=8e-5,
                    linear_nd_backward=1.1e-4, dtensor_linear_forward=3e-4, dtensor_linear_backward=5e-4,
                    dtensor_linear_nd_forward=6e-4, dtensor_linear_nd_backward=7e-4)
    cm, cm0 = CostModel(_with(base, op_overhead=ov)), CostModel(base)

    def extra(op, pl=None, tp=1):
        return tuple(x - y for x, y in zip(cm.op_time(op, pl, tp, 1, "bf16"), cm0.op_time(op, pl, tp, 1, "bf16")))
    assert extra(lin) == (pytest.approx(8e-5), pytest.approx(1.1e-4))
    assert extra(flat) == (pytest.approx(7e-5), pytest.approx(9e-5))
    pl = default_plan(g, base, 2, "bf16", {"tp": 2, "dp": 1}, "m").ops["h0_fc1"]
    assert extra(lin, pl, 2) == (pytest.approx(6e-4), pytest.approx(7e-4))
    # a profile measured before these fields: the 2-D figures
    old = dataclasses.replace(ov, linear_nd_forward=0.0, linear_nd_backward=0.0)
    cm = CostModel(_with(base, op_overhead=old))
    assert extra(lin) == (pytest.approx(7e-5), pytest.approx(9e-5))


@pytest.mark.parametrize("shared", [True, False])
def test_ddp_reducer_adds_its_measured_cost_per_call_tensor_and_byte(shared):
    g = megatron_gpt(layers=3)
    base = _with(cluster(per_node=2), comm_shares_compute=shared)
    call, ten, byte = 2e-3, 5e-5, 1e-10
    over = _with(base, op_overhead=OpOverhead(ddp_call=call, ddp_tensor=ten, ddp_byte=byte))
    plan = default_plan(g, base, 2, "bf16", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 0}, "m")
    p0, p1 = CostModel(base).predict(g, plan), CostModel(over).predict(g, plan)
    tensors = len({p.name for op in g.ops for p in op.params})
    params = {p.name: p.numel for op in g.ops for p in op.params}
    want = call + tensors * ten + sum(params.values()) * 4 * byte  # fp32 gradients
    assert tensors
    assert p1.step_time_s - p0.step_time_s == pytest.approx(want, rel=1e-6)
    # once per step, not per micro-batch; nothing without DDP (FSDP2 under ZeRO >= 1, replicate under tp)
    plan = default_plan(g, base, 4, "bf16", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 0}, "m")
    assert plan.num_microbatches == 2
    assert CostModel(over).predict(g, plan).step_time_s - CostModel(base).predict(g, plan).step_time_s == \
        pytest.approx(want, rel=1e-6)
    for force in ({"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 1}, {"dp": 1, "tp": 2, "pp": 1, "mbs": 1}):
        plan = default_plan(g, base, 2, "bf16", force, "m")
        assert CostModel(over).predict(g, plan).step_time_s == CostModel(base).predict(g, plan).step_time_s


def test_ddp_overheads_round_trip_through_yaml():
    c = _with(cluster(per_node=2), op_overhead=OpOverhead(ddp_call=1e-3, ddp_tensor=2e-5, ddp_byte=3e-10))
    back = cluster_from_dict(cluster_to_dict(c))
    assert back.device.op_overhead == c.device.op_overhead


def test_dtensor_redistribute_overhead_is_added_to_every_tensor_parallel_collective():
    g = megatron_gpt(layers=2)
    base = cluster(per_node=2)
    x = 4e-4
    over = _with(base, op_overhead=OpOverhead(dtensor_redistribute=x))
    meta = next(op.output_meta[0] for op in g.ops if op.kind == "linear")
    m0, m1 = CostModel(base), CostModel(over)
    for src, dst, partial in (("S(1)", "R", True), ("S(1)", "R", False), ("P", "R", False), ("P", "S(1)", False),
                              ("R", "S(1)", False), ("R", "R", True), ("R", "R", False)):
        t0 = m0.reshard_time(meta, src, dst, 2, 1, "bf16", consumer_partial_grad=partial)
        t1 = m1.reshard_time(meta, src, dst, 2, 1, "bf16", consumer_partial_grad=partial)
        for a, b in zip(t0, t1):  # a collective pays it, no collective pays nothing
            assert b == pytest.approx(a + x) if a > 0 else b == 0.0
    assert m1.reshard_time(meta, "S(1)", "R", 1, 1, "bf16") == (0.0, 0.0)  # no tp, no collective
    c = _with(base, op_overhead=OpOverhead(dtensor_redistribute=x))
    assert cluster_from_dict(cluster_to_dict(c)).device.op_overhead.dtensor_redistribute == x
