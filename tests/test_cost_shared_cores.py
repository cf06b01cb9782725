"""Collectives that share the ranks' cores with compute (`comm_shares_compute`: gloo on CPU ranks) hide behind
nothing: every data-parallel collective adds its whole time to the step, and the profile field round-trips."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_model.memory import DDP_BUCKET_BYTES
from cost_model.model import CostModel
from cost_model.simulator import simulate
from cost_model.step import DDP_FIRST_BUCKET_BYTES, StepPredictor
from hardware_profiles.load import cluster_from_dict, cluster_to_dict, load_cluster
from hardware_profiles.schema import ProfileError
from planner.defaults import default_plan
from test_memory_activations import cluster, megatron_gpt


def _with(cl, **dev):
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, **dev))


@pytest.mark.parametrize("zero,mbs", [(0, 1), (1, 1), (2, 1), (3, 1), (3, 2), (1, 2)])
def test_shared_cores_serialise_every_data_parallel_collective(zero, mbs):
    g = megatron_gpt(layers=3)
    base = cluster(per_node=2, intra=2e9)  # slow links: collectives long enough to hide behind compute
    shared = _with(base, comm_shares_compute=True, threads=1)
    plan = default_plan(g, base, 4, "bf16", {"dp": 2, "tp": 1, "pp": 1, "mbs": mbs, "zero": zero}, "m")
    p = CostModel(shared).predict(g, plan)
    b = p.breakdown
    assert b["dp_comm_s"] > 0
    assert b["exposed_comm_s"] == pytest.approx(b["dp_comm_s"])  # nothing hidden
    assert p.step_time_s == pytest.approx(b["compute_s"] + b["dp_comm_s"] + b["optimizer_s"])
    overlapped = CostModel(base).predict(g, plan)  # NCCL on GPUs: collectives overlap compute
    assert overlapped.step_time_s <= p.step_time_s * (1 + 1e-9)
    if zero == 3:
        assert overlapped.breakdown["exposed_comm_s"] < overlapped.breakdown["dp_comm_s"]


def test_shared_cores_keep_a_pipeline_sender_busy():
    g = megatron_gpt(layers=4)
    base = cluster(per_node=2, intra=2e9)
    # GPipe: on GPUs its sends overlap compute (1F1B waits for them everywhere: test_1f1b_waits_for_its_sends)
    plan = default_plan(g, base, 4, "bf16", {"dp": 1, "tp": 1, "pp": 2, "mbs": 1, "schedule": "gpipe"}, "m")
    p0 = CostModel(base).predict(g, plan)
    p1 = CostModel(_with(base, comm_shares_compute=True)).predict(g, plan)
    m = plan.num_microbatches
    p2p = p0.breakdown["pp_comm_s"] / (2 * m)
    assert p2p > 0
    # each stage sends once per micro-batch and pass; the critical path gains at least the last sends
    assert p1.step_time_s > p0.step_time_s
    assert p1.step_time_s <= p0.step_time_s + 2 * m * p2p * (1 + 1e-9)


def test_1f1b_waits_for_its_sends():
    # torch's Schedule1F1B fires each steady-state send with the next receive and waits for both: on GPUs too, a
    # pass that sends is longer by the transfer; GPipe's sends are waited for at the end, overlapped
    from cost_model.step import StepPredictor
    g = megatron_gpt(layers=4)
    gpu = cluster(per_node=2, intra=2e9)
    for schedule, busy in (("1f1b", True), ("gpipe", False)):
        plan = default_plan(g, gpu, 4, "bf16", {"dp": 1, "tp": 1, "pp": 2, "mbs": 1, "schedule": schedule}, "m")
        sp = StepPredictor(CostModel(gpu), g, plan)
        first, last = sp.chunks[0][0], sp.chunks[1][0]
        assert sp.p2p_s > 0
        compute = [sum(l.fwd_compute + l.tp_fwd for l in ch.layers) for ch in (first, last)]
        assert first.fwd_s - compute[0] == pytest.approx(sp.p2p_s if busy else 0.0, abs=1e-12)
        assert last.fwd_s - compute[1] == pytest.approx(0.0, abs=1e-12)  # the last stage sends no activation


def test_fields_round_trip_and_validate():
    c = load_cluster("cpu-local")
    assert c.device.comm_shares_compute and c.device.threads == 1
    assert cluster_from_dict(cluster_to_dict(c)) == c
    gpu = load_cluster("dgx-h100")
    assert not gpu.device.comm_shares_compute and gpu.device.threads == 0
    assert "comm_shares_compute" not in cluster_to_dict(gpu)["device"]
    waiting = _waiting(c, 1e-3)
    assert cluster_from_dict(cluster_to_dict(waiting)) == waiting
    assert "sync_wait" not in cluster_to_dict(gpu)["device"]
    for key, bad, msg in (("comm_shares_compute", "yes", "expected true or false"),
                          ("threads", 0, "must be > 0"), ("threads", 1.5, "expected an integer"),
                          ("sync_wait", [[2e-3, 1e-3], [1e-3, 2e-3]], "strictly increasing"),
                          ("sync_wait", [[2e-3, 5.0]], "implausibly large"), ("sync_wait", 1e-3, "pairs")):
        d = cluster_to_dict(c)
        d["device"][key] = bad
        with pytest.raises(ProfileError) as e:
            cluster_from_dict(d)
        assert f"device.{key}" in str(e.value) and msg in str(e.value)



def test_ddp_first_bucket_closes_at_one_mib():
    g = megatron_gpt(h=256, layers=4)
    base = cluster(per_node=2)
    plan = default_plan(g, base, 2, "bf16", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 0}, "m")
    sp = StepPredictor(CostModel(base), g, plan)
    grads = [e * 4 for e in reversed(sp.unit_elems(sp.chunks[0][0].layers))]  # fp32, backward order, tied once
    first = next(k for k in range(len(grads)) if sum(grads[:k + 1]) >= DDP_FIRST_BUCKET_BYTES)
    assert first < len(grads) - 1 and sum(grads) < DDP_BUCKET_BYTES  # one bucket without the 1 MiB first
    fwd, bwd = (np.array([[getattr(ch, k) for ch in row] for row in sp.chunks]) for k in ("fwd_s", "bwd_s"))
    spans = sp.dp_tail(0, simulate(plan.schedule, fwd, bwd, plan.num_microbatches, 0.0))[1]
    assert len(spans) == 2
    comm = CostModel(base).comm
    assert spans[0][1] == pytest.approx(comm.time("all_reduce", sum(grads[:first + 1]), sp.groups["dp"]))
    assert spans[1][1] == pytest.approx(comm.time("all_reduce", sum(grads[first + 1:]), sp.groups["dp"]))


def _waiting(cl, wait: float):
    """`cl` on shared cores whose ranks wait `wait` seconds at every collective after any compute."""
    return _with(cl, comm_shares_compute=True, threads=1, sync_wait=((1e-9, wait), (0.5, wait)))


def test_sync_wait_interpolates_from_zero_and_holds_beyond():
    from cost_model.communication import CommModel, Group
    cl = _with(cluster(per_node=2), sync_wait=((1e-3, 0.5e-3), (4e-3, 1.5e-3)))
    comm, pair = CommModel(cl), Group(2, 1)
    assert comm.sync_wait(pair, 0.0) == 0.0
    assert comm.sync_wait(pair, 0.5e-3) == pytest.approx(0.25e-3)
    assert comm.sync_wait(pair, 2.5e-3) == pytest.approx(1.0e-3)
    assert comm.sync_wait(pair, 10e-3) == pytest.approx(1.5e-3)
    assert comm.sync_wait(Group(1, 1), 10e-3) == 0.0
    assert CommModel(cluster(per_node=2)).sync_wait(pair, 10e-3) == 0.0  # not measured (GPUs): none


def test_a_resharding_priced_alone_waits_as_after_a_few_ops():
    # the placement ILP does not know the compute between two collectives before the layout exists: it charges
    # each the wait after the profile's shortest measured compute; none at tp 1 or where not measured (GPUs)
    cl = _with(cluster(per_node=2), sync_wait=((0.5e-3, 0.3e-3), (2e-3, 0.7e-3)))
    assert CostModel(cl).reshard_wait(2) == pytest.approx(0.3e-3)
    assert CostModel(cl).reshard_wait(1) == 0.0
    assert CostModel(load_cluster("dgx-h100")).reshard_wait(8) == 0.0


def test_every_blocking_collective_waits_for_the_ranks():
    g = megatron_gpt(layers=3)
    base, w = _with(cluster(per_node=2, intra=2e9), comm_shares_compute=True, threads=1), 1e-3
    waiting = _waiting(base, w)
    # tensor parallelism: a Megatron block all-reduces twice in forward (attention and MLP outputs, g) and twice
    # in backward (their input gradients, f); the vocabulary-parallel loss three times in forward
    plan = default_plan(g, base, 2, "fp32", {"dp": 1, "tp": 2, "pp": 1, "mbs": 1, "sp": 0}, "m")
    a, b = (StepPredictor(CostModel(c), g, plan).chunks[0][0].layers for c in (base, waiting))
    later = [(x, y) for x, y in zip(a, b) if x.block][1:]  # the first block also reduces the embedding's output
    assert later and all(y.tp_fwd - x.tp_fwd == pytest.approx(2 * w) and y.tp_bwd - x.tp_bwd == pytest.approx(2 * w)
                         for x, y in later)
    assert b[-1].tp_fwd - a[-1].tp_fwd == pytest.approx(3 * w)
    # DDP: its bucket all-reduces run on while the backward goes on; the ranks meet once, at the last (two
    # buckets at width 256: the first closes at 1 MiB)
    wide = megatron_gpt(h=256, layers=3)
    plan = default_plan(wide, base, 2, "fp32", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 0}, "m")
    spans = []
    for c in (base, waiting):
        sp = StepPredictor(CostModel(c), wide, plan)
        fwd, bwd = (np.array([[getattr(ch, k) for ch in row] for row in sp.chunks]) for k in ("fwd_s", "bwd_s"))
        spans.append(sp.dp_tail(0, simulate(plan.schedule, fwd, bwd, 1, 0.0))[1])
    assert len(spans[0]) == len(spans[1]) == 2
    assert [y[1] - x[1] for x, y in zip(*spans)] == pytest.approx([0.0] * (len(spans[0]) - 1) + [w])
    # ZeRO-3: a gather before each unit's forward (each block, and the root before the first layer); in backward
    # a gather and a reduce-scatter per block, and the root's reduce-scatter (it stays gathered in between)
    plan = default_plan(g, base, 2, "fp32", {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "zero": 3}, "m")
    a, b = (StepPredictor(CostModel(c), g, plan).chunks[0][0] for c in (base, waiting))
    n = sum(l.block for l in a.layers)
    assert 0 < n < len(a.layers)
    assert b.fwd_s - a.fwd_s == pytest.approx((n + 1) * w)
    assert b.bwd_s - a.bwd_s == pytest.approx((2 * n + 1) * w)
