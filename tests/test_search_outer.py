"""Outer-loop behaviour on hand-sized graphs with the table-driven fake cost model."""
import pytest

from planner.errors import PlanError
from planner.search.outer import OuterSearch
from test_search_fakes import RESHARD, FakeCostModel, fake_cluster, tiny_gpt

PARAM_BYTES = 4 * (32 * 16 + 4 * (16 + 64 * 16 + 64 + 16 * 64) + 32 * 16)
"""tiny_gpt(4)'s parameter bytes as the fake counts them (embedding, 4 blocks, head; fp32)."""


def run(nodes=1, dpn=8, memory=2 ** 40, batch=16, forced=None, inter_bw=25e9, budget=60.0, op_time=1e-3,
        reshard_scale=1.0, **kw):
    cluster = fake_cluster(nodes=nodes, devices_per_node=dpn, memory_bytes=memory, inter_bw=inter_bw)
    reshard = {k: v * reshard_scale for k, v in RESHARD.items()}
    cm = FakeCostModel(cluster=cluster, default_time=op_time, reshard=reshard)
    search = OuterSearch(tiny_gpt(4), cluster, cm, batch_size=batch, forced=forced, time_budget_s=budget, **kw)
    return search.run(), cm


def test_unlimited_memory_gives_plain_data_parallelism():
    res, _ = run(nodes=2)
    best = res.ranked[0].plan
    assert (best.mesh.dp, best.mesh.tp, best.mesh.pp) == (16, 1, 1)
    assert best.zero_stage == 0 and best.recompute == "none" and best.ops == {}
    assert res.stats["bound_violations"] == 0
    assert res.stats["groups_evaluated"] < res.stats["groups"]  # the lower bound pruned the rest


def test_model_larger_than_a_device_gets_zero3_or_model_splits():
    res, _ = run(memory=int(PARAM_BYTES * 0.8))
    for s in res.ranked:
        p = s.plan
        assert s.prediction.fits
        assert p.zero_stage == 3 or p.mesh.tp > 1 or p.mesh.pp > 1


def test_tensor_parallelism_stays_inside_nodes():
    res, _ = run(nodes=2, dpn=4, memory=int(PARAM_BYTES * 0.5), inter_bw=1e9)
    assert all(s.plan.mesh.tp <= 4 for s in res.ranked)
    forced, _ = run(nodes=2, dpn=4, forced={"tp": 8})
    assert forced.ranked[0].plan.mesh.tp == 8
    assert any("spans nodes" in n for n in forced.notes)


def test_forced_keys_are_respected():
    f = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "mbs": 2, "recompute": "selective", "schedule": "gpipe", "sp": 1}
    res, _ = run(forced=f, op_time=1.0)  # ops as slow as a layout change: sharding them pays
    for s in res.ranked:
        p = s.plan
        assert (p.mesh.dp, p.mesh.tp, p.mesh.pp, p.zero_stage, p.microbatch_size) == (2, 2, 2, 1, 2)
        assert (p.recompute, p.schedule, p.sequence_parallel) == ("selective", "gpipe", True)
        assert p.num_microbatches == 16 // (2 * 2)
    best = res.ranked[0].plan
    assert best.ops["h.0_fc"].strategy == "colwise" and best.ops["h.3_proj"].strategy == "rowwise"
    assert best.ops["h.1_ln"].strategy == "sequence"
    assert [s.rank for s in best.stages] == [0, 1]
    assert best.stages[0].start_layer == 0 and best.stages[-1].end_layer == len(tiny_gpt(4).layers())
    assert best.stages[0].modules[0] == "emb"
    inter, _ = run(forced={"pp": 2, "vp": 2})
    assert all(s.plan.schedule == "interleaved" and len(s.plan.stages) == 4 for s in inter.ranked)


def test_bad_force_is_one_line_error():
    with pytest.raises(PlanError, match=r"dp x tp x pp = 8 but the cluster has 16 devices"):
        run(nodes=2, forced={"dp": 2, "tp": 2, "pp": 2})
    with pytest.raises(PlanError, match="does not divide"):
        run(forced={"tp": 3})
    with pytest.raises(PlanError, match="schedule=interleaved"):
        run(forced={"vp": 2, "schedule": "1f1b"})


def test_infeasible_says_what_is_needed_and_what_helps():
    with pytest.raises(PlanError) as e:
        run(memory=2000)
    msg = str(e.value)
    assert "fits nowhere" in msg and "per device" in msg and "2.0 KiB usable" in msg
    assert "more nodes (try --nodes" in msg
    assert "\n" not in msg


def test_ignore_memory_ranks_what_does_not_fit_as_the_unlimited_search_does():
    # a forced mesh and recompute=none that fit nowhere: --ignore-memory predicts them anyway, marked as not fitting,
    # the same plans and step times as on a device large enough for them
    forced = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "recompute": "none"}
    with pytest.raises(PlanError, match=r"; or predict it anyway with --ignore-memory"):
        run(memory=2000, forced=forced)
    small, _ = run(memory=2000, forced=forced, ignore_memory=True)
    big, _ = run(forced=forced)
    assert [s.prediction.step_time_s for s in small.ranked] == [s.prediction.step_time_s for s in big.ranked]
    assert [s.plan.zero_stage for s in small.ranked] == [s.plan.zero_stage for s in big.ranked]
    assert not any(s.prediction.fits for s in small.ranked) and all(s.prediction.fits for s in big.ranked)
    assert all(s.plan.recompute == "none" for s in small.ranked)


def test_infeasible_names_the_forced_keys_that_hold_memory_up():
    # a forced mesh fills the cluster: more nodes would contradict it, so the message must not offer them
    with pytest.raises(PlanError) as e:
        run(memory=2000, forced={"dp": 2, "tp": 2, "pp": 2, "zero": 1, "recompute": "none"})
    msg = str(e.value)
    assert "zero=3 instead of the forced zero=1" in msg and "recompute=full instead of the forced recompute=none" in msg
    assert "a larger tp or pp than the forced tp=2, pp=2" in msg and "nodes" not in msg and "ZeRO-3" not in msg
    # a forced dp leaves room for more nodes, in a count the forced axes still divide
    with pytest.raises(PlanError) as e:
        run(memory=2000, nodes=2, dpn=4, forced={"dp": 8, "recompute": "full"})
    msg = str(e.value)
    nodes = int(msg.split("--nodes ")[1].split(")")[0])
    assert nodes > 2 and nodes % 2 == 0 and "recompute=" not in msg.split("try ")[1]
    with pytest.raises(PlanError) as e:
        run(memory=2000, nodes=1, dpn=2, forced={"dp": 1, "tp": 2})
    msg = str(e.value)
    assert "ZeRO-3" not in msg  # dp = 1: nothing for ZeRO to shard over
    assert "more nodes (try --nodes" in msg


def test_time_budget_returns_best_so_far():
    res, cm = run(nodes=2, budget=0.0)
    assert res.ranked and any("time budget" in n for n in res.notes)
    assert res.stats["groups_evaluated"] == 1


def test_bounded_groups_leave_the_top_k_unchanged():
    # groups whose placed bound exceeds the k-th best are swept only to their first fitting candidate; the k best
    # candidates must be those of the full sweep (top_k huge: nothing is ever bounded). Layout changes cheap enough
    # that the tp groups' ILP shards something (a tp whose ILP shards nothing is skipped, not swept)
    kw = dict(nodes=2, memory=int(PARAM_BYTES * 0.8), reshard_scale=1e-3)
    short, _ = run(top_k=3, **kw)
    full, _ = run(top_k=10 ** 9, **kw)
    assert full.stats["groups_bounded"] == 0 < short.stats["groups_bounded"]
    assert short.stats["predictions"] < full.stats["predictions"]
    assert short.stats["bound_violations"] == full.stats["bound_violations"] == 0
    key = [(s.plan, s.prediction.step_time_s) for s in full.ranked[:3]]
    assert [(s.plan, s.prediction.step_time_s) for s in short.ranked[:3]] == key


def test_forced_tp_that_divides_no_heads_keeps_qkv_off_colwise(capsys):
    # GPT example: 4 heads; tp=16 cannot split them, so q/k/v are never colwise (the MLP still shards)
    # and the report names the module and why
    import os
    from planner.cli import main as plan_main
    gpt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt.py")
    assert plan_main([gpt, "--cluster", "dgx-a100-80gb", "--nodes", "2", "--batch-size", "8",
                      "--force", "tp=16,dp=1"]) == 0
    out = capsys.readouterr().out
    assert "kept from column-parallel" in out and "h.0.attn.q_proj" in out and "tp=16 does not divide" in out
    assert "Megatron" not in out
