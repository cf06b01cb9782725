"""Communication formulas, op-level queries and whole-step predictions of the cost model, with hypothesis
property tests (more bandwidth or FLOP/s never slower; higher ZeRO stage never more memory)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from cost_model.communication import NCCL_RING_BASE_LATENCY_S, CommModel, Group, mesh_groups
from cost_model.compute import interp_log
from cost_model.model import CostModel
from hardware_profiles.schema import CollectiveCurve
from planner.defaults import default_plan, even_stages, stage_block_counts
from planner.errors import PlanError
from planner.graph import TensorMeta
from planner.plan import Plan
from test_memory_activations import cluster, megatron_gpt


def test_ring_all_reduce_formula():
    cl = cluster(intra=100e9)
    cm = CommModel(cl)
    n, size, alpha = 8, 1e9, cl.intra_node.latency
    want = 2 * (n - 1) / n * size / 100e9 + NCCL_RING_BASE_LATENCY_S + 2 * (n - 1) * alpha
    assert cm.time("all_reduce", size, Group(n, 1)) == pytest.approx(want)
    ag = (n - 1) / n * size / 100e9 + NCCL_RING_BASE_LATENCY_S + (n - 1) * alpha
    assert cm.time("all_gather", size, Group(n, 1)) == pytest.approx(ag)
    assert cm.time("reduce_scatter", size, Group(n, 1)) == pytest.approx(ag)
    assert cm.time("all_reduce", size, Group(1, 1)) == 0.0


def test_multi_node_ring_is_limited_by_the_nodes_nics():
    cl = cluster(nodes=4, intra=200e9, inter=20e9)
    cm = CommModel(cl)
    size = 4e9
    t = cm.time("all_reduce", size, Group(32, 4))
    network = 2 * 31 / 32 * size / (8 * 20e9)  # NCCL's ring over all 32 ranks, 8 NICs per node
    assert network < t < network * 1.01
    assert cm.time("all_reduce", size, Group(4, 4)) > t  # one member per node: one NIC each
    assert cm.time("all_gather", size, Group(32, 4)) == pytest.approx(t / 2, rel=0.01)


@pytest.mark.parametrize("preset,busbw", [("dgx-a100-80gb", 192e9), ("dgx-h100", 370e9)])
def test_four_node_all_reduce_meets_nccl_tests(preset, busbw):
    # nccl-tests all-reduce busbw on 4 nodes, 32 GPUs (NVIDIA GTC25 S72583 slide 12; nccl_measured_bandwidth.csv)
    from hardware_profiles.load import load_cluster
    size = 8 * 2**30
    t = CommModel(load_cluster(preset, nodes=4)).time("all_reduce", size, Group(32, 4))
    assert 2 * 31 / 32 * size / t == pytest.approx(busbw, rel=0.02)


def test_measured_curve_takes_precedence():
    cl = cluster()
    curve = CollectiveCurve(collective="all_reduce", level="intra_node", group_size=8,
                            points=((1000, 1e-5), (1_000_000, 2e-5)))
    cm = CommModel(dataclasses.replace(cl, collectives=(curve,)))
    assert cm.time("all_reduce", 500_500, Group(8, 1)) == pytest.approx(1.5e-5)
    assert cm.time("all_reduce", 1999_000, Group(8, 1)) == pytest.approx(3e-5)
    formula = CommModel(cl).time("all_reduce", 500_500, Group(4, 1))
    assert cm.time("all_reduce", 500_500, Group(4, 1)) == formula  # group size not measured


def test_mesh_groups_layout():
    g = mesh_groups(dp=6, tp=8, pp=64, devices_per_node=8)
    assert (g["tp"].nodes, g["dp"].nodes, g["pp"].nodes) == (1, 6, 64)
    g = mesh_groups(dp=4, tp=2, pp=2, devices_per_node=8)
    assert (g["tp"].nodes, g["dp"].nodes, g["pp"].nodes) == (1, 1, 2)
    assert mesh_groups(dp=8, tp=16, pp=1, devices_per_node=8)["tp"].nodes == 2


def test_interp_log():
    curve = ((1e3, 0.2), (1e6, 0.8))
    assert interp_log(curve, 10) == 0.2 and interp_log(curve, 1e9) == 0.8
    assert interp_log(curve, 10 ** 4.5) == pytest.approx(0.5)


def test_reshard_megatron_operators():
    cm = CostModel(cluster())
    meta = TensorMeta((1, 32, 64), "float32")
    ar = cm.comm.time("all_reduce", 32 * 64 * 2, cm.tp_group(4))
    ag = cm.comm.time("all_gather", 32 * 64 * 2, cm.tp_group(4))
    rs = cm.comm.time("reduce_scatter", 32 * 64 * 2, cm.tp_group(4))
    args = (4, 1, "bf16")
    assert cm.reshard_time(meta, "P", "R", *args) == pytest.approx((ar, 0.0))  # g: all-reduce / identity
    assert cm.reshard_time(meta, "R", "R", *args, consumer_partial_grad=True) == pytest.approx((0.0, ar))  # f
    # a gather or scatter on dim 1 also copies the whole tensor (functional collectives' cat), read and written
    copy = cm.compute.memory_time(2 * 32 * 64 * 2)
    assert copy > 0
    assert cm.reshard_time(meta, "P", "S(1)", *args) == pytest.approx((rs + copy, ag + copy))
    assert cm.reshard_time(meta, "S(1)", "R", *args, consumer_partial_grad=True) == pytest.approx((ag + copy,
                                                                                                  rs + copy))
    assert cm.reshard_time(meta, "P", "S(0)", *args) == pytest.approx((rs, ag))  # on dim 0: no copy
    assert cm.reshard_time(meta, "S(0)", "R", *args) == pytest.approx((ag, 0.0))
    assert cm.reshard_time(meta, "S(2)", "S(2)", *args) == (0.0, 0.0)
    assert cm.reshard_time(meta, "P", "R", 1, 1, "bf16") == (0.0, 0.0)


def test_the_ilp_prices_an_op_as_the_step_prediction_does():
    import os

    from cost_model.dtypes import autocast_dtypes
    from cost_model.backward import input_grads
    from hardware_profiles.load import load_cluster
    from planner.model_file import load_model_file
    from planner.search.placement import PlacementSolver
    from planner.trace import trace_model
    g = trace_model(load_model_file(os.path.join(os.path.dirname(__file__), "..", "examples", "gpt.py")))
    cm = CostModel(load_cluster("dgx-h100"))
    dts, grads = autocast_dtypes(g, "bf16", "fp32"), input_grads(g)
    for op in g.ops:  # the step's per-op price: autocast's dtypes and casts, the gradients the graph needs
        kf, kb, hf, hb = cm.op_parts(op, None, 1, 8, "bf16", dtypes=dts.get(op.name), grads=grads.get(op.name))
        assert cm.op_parts(op, None, 1, 8, "bf16", graph=g) == pytest.approx((kf, kb, hf, hb))
        want = (cm.compute.combine(kf, hf), cm.compute.combine(kb, hb))
        assert cm.op_time(op, None, 1, 8, "bf16", graph=g) == pytest.approx(want)
    lin = next(o for o in g.ops if o.kind == "linear")
    assert sum(cm.op_time(lin, None, 1, 8, "bf16", graph=g)) > sum(cm.op_time(lin, None, 1, 8, "bf16"))  # casts

    class Recording(CostModel):
        def op_parts(self, *args, graph=None, **kwargs):
            seen.add(graph)
            return super().op_parts(*args, graph=graph, **kwargs)

    seen: set = set()
    PlacementSolver(g, Recording(load_cluster("dgx-h100"))).solve(2, 8, "bf16")
    assert seen == {g}  # every ILP price came with the graph


def test_op_time_scales_with_tp_and_microbatch():
    g = megatron_gpt(s=256, h=512, a=8)
    cm = CostModel(cluster())
    plan_ops = default_plan(g, cluster(per_node=2), 2, "bf16", {"tp": 2, "dp": 1}, "m").ops
    fc1 = g.op("h0_fc1")
    f1, b1 = cm.op_time(fc1, None, 1, 1, "bf16")
    f2, b2 = cm.op_time(fc1, plan_ops["h0_fc1"], 2, 1, "bf16")
    assert f2 == pytest.approx(f1 / 2) and b2 == pytest.approx(b1 / 2)
    f4, _ = cm.op_time(fc1, None, 1, 4, "bf16")
    assert f4 == pytest.approx(4 * f1)
    assert cm.op_time(g.op("h0_q_view"), None, 1, 1, "bf16") == (0.0, 0.0)
    par, act = cm.op_memory(fc1, plan_ops["h0_fc1"], 2, 1, "bf16")
    assert par == (4 * 512 * 512 + 4 * 512) * 2 / 2 and act == 256 * 512 * 2


def _predict(graph, cl, batch, forced, precision="bf16"):
    plan = default_plan(graph, cl, batch, precision, forced, "m")
    return CostModel(cl).predict(graph, plan), plan


def test_breakdown_adds_up_and_dp_tp_pp_all_count():
    g = megatron_gpt(s=128, h=256, a=4, layers=4)
    cl = cluster(nodes=2, per_node=4)
    pred, plan = _predict(g, cl, 32, {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "mbs": 2, "recompute": "selective",
                                      "schedule": "interleaved", "vp": 2, "sp": 1})
    b = pred.breakdown
    parts = b["compute_s"] + b["exposed_comm_s"] + b["bubble_s"] + b["optimizer_s"]
    assert parts == pytest.approx(pred.step_time_s)
    assert b["tp_comm_s"] > 0 and b["dp_comm_s"] > 0 and b["pp_comm_s"] > 0 and b["recompute_s"] > 0
    assert len(pred.memory_per_device_bytes) == 2 and pred.fits
    assert 0 < pred.mfu < 1
    d = Plan.from_dict(plan.to_dict())
    assert d == plan


def test_default_plan_errors():
    g = megatron_gpt(layers=2)
    cl = cluster(per_node=8)
    with pytest.raises(PlanError, match="devices"):
        default_plan(g, cl, 8, "bf16", {"dp": 3, "tp": 2, "pp": 1}, "m")
    with pytest.raises(PlanError, match="not divisible"):
        default_plan(g, cl, 12, "bf16", {"dp": 8, "mbs": 1}, "m")
    with pytest.raises(PlanError, match="divide"):
        default_plan(g, cl, 8, "bf16", {"tp": 8, "dp": 1}, "m")  # 4 heads
    with pytest.raises(PlanError, match=r"1f1b needs at least pp=2 micro-batches per step, got 1 \(batch 4 / \(dp 4"):
        default_plan(g, cl, 4, "bf16", {"dp": 4, "pp": 2, "tp": 1}, "m")  # torch's Schedule1F1B refuses it
    notes: list[str] = []
    plan = default_plan(g, cluster(nodes=2, per_node=2), 4, "bf16", {"tp": 4, "dp": 1}, "m", notes=notes)
    assert plan.mesh.tp == 4 and any("spans 2 nodes" in n for n in notes)


def test_default_plan_forced_recompute_blocks_are_real_counts():
    # recompute_blocks=N is N blocks of each stage: capped at what a stage holds (the label said [3/3] for two
    # stages of 2), and refused past the model's own block count, which no pipeline can reach
    g = megatron_gpt(layers=4)
    force = {"dp": 4, "tp": 1, "pp": 2, "recompute": "full"}
    plan = default_plan(g, cluster(per_node=8), 8, "bf16", {**force, "recompute_blocks": 3}, "m")
    assert plan.recompute_blocks == tuple(stage_block_counts(g.layers(), plan.stages)) == (2, 2)
    assert default_plan(g, cluster(per_node=8), 8, "bf16", {**force, "recompute_blocks": 1}, "m").recompute_blocks \
        == (1, 1)
    with pytest.raises(PlanError, match="recompute_blocks=5: the model has 4 blocks in all.*recompute_blocks=4 or"):
        default_plan(g, cluster(per_node=8), 8, "bf16", {**force, "recompute_blocks": 5}, "m")


def test_even_stages_balance():
    g = megatron_gpt(layers=6)
    st_ = even_stages(g, 2, 2)
    assert len(st_) == 4 and [s.rank for s in st_] == [0, 1, 0, 1]
    assert st_[0].start_layer == 0 and st_[-1].end_layer == len(g.layers())
    assert all(a.end_layer == b.start_layer for a, b in zip(st_, st_[1:]))


CONFIGS = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2]), "pp": st.sampled_from([1, 2]), "zero": st.integers(0, 3),
    "recompute": st.sampled_from(["none", "selective", "full"]), "schedule": st.sampled_from(["gpipe", "1f1b"]),
    "mbs": st.sampled_from([1, 2])})


def _scaled(cl, flops=1.0, intra=1.0, inter=1.0, mem=1.0):
    dev = dataclasses.replace(cl.device, peak_flops={k: v * flops for k, v in cl.device.peak_flops.items()},
                              memory_bandwidth=cl.device.memory_bandwidth * mem)
    return dataclasses.replace(
        cl, device=dev, intra_node=dataclasses.replace(cl.intra_node, bandwidth=cl.intra_node.bandwidth * intra),
        inter_node=dataclasses.replace(cl.inter_node, bandwidth=cl.inter_node.bandwidth * inter))


GRAPH = megatron_gpt(s=64, h=128, a=4, layers=4)


@settings(max_examples=25, deadline=None)
@given(cfg=CONFIGS, factor=st.floats(1.0, 8.0), which=st.sampled_from(["flops", "intra", "inter", "mem"]))
def test_more_bandwidth_or_flops_never_slower(cfg, factor, which):
    cl = cluster(nodes=2, per_node=4)
    forced = dict(cfg, dp=8 // (cfg["tp"] * cfg["pp"]))
    base, plan = _predict(GRAPH, cl, 16, forced)
    faster = CostModel(_scaled(cl, **{which: factor})).predict(GRAPH, plan)
    assert faster.step_time_s <= base.step_time_s * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(cfg=CONFIGS)
def test_memory_never_grows_with_zero_stage(cfg):
    cl = cluster(nodes=2, per_node=4)
    forced = dict(cfg, dp=8 // (cfg["tp"] * cfg["pp"]))
    mems = []
    for z in range(4):
        pred, _ = _predict(GRAPH, cl, 16, dict(forced, zero=z))
        mems.append(pred.peak_memory_bytes)
    assert all(b <= a for a, b in zip(mems, mems[1:])), mems


def test_repeated_blocks_reuse_a_cost_only_where_their_inputs_arrive_alike(monkeypatch):
    """Blocks share one priced cost, but the first block reads the vocabulary-parallel embedding's partial sum (a
    reduce-scatter into the sequence shard under sequence parallelism) where later blocks read the previous block's
    shard (nothing to move): the cached prediction must equal pricing every layer afresh."""
    import os

    from cost_model.layers import LayerCoster
    from hardware_profiles.load import load_cluster
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = trace_model(load_model_file(os.path.join(root, "examples", "llama.py")), batch_size=2, progress=False)
    cl = load_cluster("dgx-h100")
    plan = default_plan(graph, cl, 8, "bf16", {"dp": 4, "tp": 2, "pp": 1, "sp": 1, "mbs": 2}, "llama.py")
    cached = CostModel(cl).predict(graph, plan)
    monkeypatch.setattr(LayerCoster, "cost", lambda self, layer: self._compute(layer, self.policy(layer)))
    fresh = CostModel(cl).predict(graph, plan)
    assert cached.breakdown["tp_comm_s"] == pytest.approx(fresh.breakdown["tp_comm_s"])
    assert cached.step_time_s == pytest.approx(fresh.step_time_s)


@pytest.mark.parametrize("async_host", [True, False])
def test_breakdown_splits_each_pass_into_kernels_and_host(async_host):
    # per pass: compute combines, layer by layer, the kernels and the host dispatch (max on GPUs, whose host runs
    # ahead; sum on CPU ranks), so it lies between the larger of the two totals and their sum
    g = megatron_gpt(s=128, h=256, a=4, layers=4)
    cl = cluster(nodes=1, per_node=1)
    dev = dataclasses.replace(cl.device, async_host=async_host,
                              op_overhead=dataclasses.replace(cl.device.op_overhead, forward=20e-6, backward=30e-6))
    cl = dataclasses.replace(cl, device=dev)
    pred, _ = _predict(g, cl, 4, {"dp": 1, "tp": 1, "pp": 1, "mbs": 2, "recompute": "full"})
    b = pred.breakdown
    for name in ("forward", "backward"):
        k, h, c = b[f"{name}_kernels_s"], b[f"{name}_host_s"], b[f"{name}_compute_s"]
        assert k > 0 and h > 0
        if async_host:
            assert max(k, h) - 1e-12 <= c < k + h
        else:
            assert c == pytest.approx(k + h)
    # the backward holds the re-run of full recompute; the passes make up the step's compute
    assert b["backward_kernels_s"] > 2 * b["forward_kernels_s"]
    assert b["forward_compute_s"] + b["backward_compute_s"] == pytest.approx(b["compute_s"], rel=1e-6)
