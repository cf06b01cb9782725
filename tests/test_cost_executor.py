"""The cost model prices what the executor does, on hand-computable cases: fp32 gradient reduction, ZeRO gathers
per micro-batch, dp reduction deferred to the pipeline flush, the tied-weight all-reduce, torchtitan's selective
recompute, the vocabulary-parallel loss, autocast's fp32 ops and NCCL contention. The executor side of the same
behaviours is checked in tests/test_executor.py (parity) and here (the recompute policy on one block)."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from cost_model.communication import NCCL_OVERLAP_COMPUTE_SLOWDOWN, Group
from cost_model.layers import LOSS_PARALLEL_ALL_REDUCES, LayerCoster
from cost_model.model import CostModel, op_precision
from cost_model.step import GRAD_REDUCE_BYTES, StepPredictor, _with_reduce
from planner.defaults import default_plan
from planner.layout import boundary_placements
from planner.graph import OpGraph, OpNode, TensorMeta
from planner.plan import OpPlacement
from test_memory_activations import cluster, megatron_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_latency(cl):
    links = {k: dataclasses.replace(getattr(cl, k), latency=0.0) for k in ("intra_node", "inter_node")}
    return dataclasses.replace(cl, **links)


def _plan(g, cl, batch, **force):
    base = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1}
    return default_plan(g, cl, batch, force.pop("precision", "bf16"), {**base, **force}, "m")


@pytest.fixture(scope="module")
def gpt():
    """examples/gpt.py traced (SDPA attention, tied embedding and LM head)."""
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    return trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt.py")), batch_size=1, progress=False)


def _fsdp_copies(sp, units, accumulated=False):
    """FSDP2's copies around one gather and one reduce-scatter of `units` (parameter elements each), by hand:
    (all-gather copy-in: the fp32 shard cast to bf16, 6 bytes, then copied, 4; copy-out: the gathered bf16 buffer
    read and written, 4 bytes per element; reduce-scatter copy-in: bf16 gradients read, fp32 written, 6 bytes, or
    8 from an fp32 sum that micro-batches `accumulated`)."""
    mem = sp.cm.compute.memory_time
    return (sum(mem(e / sp.dp * 10) for e in units if e), sum(mem(e * 4) for e in units if e),
            sum(mem(e * (8 if accumulated else 6)) for e in units if e))


def test_zero3_gathers_every_micro_batch_and_zero12_once_per_step():
    g, cl = megatron_gpt(layers=3), _no_latency(cluster(per_node=2))
    for m in (1, 4):
        sp3 = StepPredictor(CostModel(cl), g, _plan(g, cl, 2 * m, dp=2, zero=3))
        sp1 = StepPredictor(CostModel(cl), g, _plan(g, cl, 2 * m, dp=2, zero=1))
        layers = sp3.chunks[0][0].layers
        # FSDP2 units: each block, and the root (the layers outside the blocks, one unit with the first of them)
        units = sp3.unit_elems(layers)
        blocks = [e for e, l in zip(units, layers) if l.block]
        assert units[0] == sum(l.param_elems for l in layers if not l.block) and 0 in units and blocks
        gather = sum(sp3._coll("all_gather", e * 2) for e in units if e)
        gather_b = sum(sp3._coll("all_gather", e * 2) for e in blocks)
        rs = sum(sp3._coll("reduce_scatter", e * 4) for e in units if e)
        copy_in, copy_out, rs_copy = _fsdp_copies(sp3, units)
        copy_in_b, copy_out_b, _ = _fsdp_copies(sp3, blocks)
        p3, p1 = sp3.run(False), sp1.run(False)
        loss = sp3.cm.comm.scalar_all_reduce(sp3.groups["dp"])  # the step's loss, over dp after the optimizer
        assert sp3.loss_all_reduces(0.0) == (0.0, pytest.approx(loss))
        # ZeRO-3: per micro-batch a gather before forward, one before backward (blocks only: the root stays
        # gathered), a reduce-scatter after backward; each gather's copy-in runs on its stream, the copy-out after
        # it and each reduce-scatter's copy-in (FSDP2's foreach_reduce) on the compute stream
        assert p3.breakdown["dp_comm_s"] == pytest.approx(m * (gather + copy_in + gather_b + copy_in_b + rs) + loss)
        plain = sum(l.fwd_compute + l.bwd_compute + l.recompute - l.recompute_tp for l in layers)
        assert sp3.chunks[0][0].compute_s - sum(sp3.fsdp_overhead(layers)) == \
            pytest.approx(plain + copy_out + copy_out_b + rs_copy)
        # ZeRO-1: parameters gathered once per step, gradients reduce-scattered once (fp32) per FSDP2 unit (each
        # block, and the root holding the embedding, final norm and head) in the last backward
        units = [b for _, b in sp1._units(sp1.chunks[0][0])]
        assert len(units) == 4 and sum(units) == pytest.approx(4 * sum(l.param_elems for l in sp1.chunks[0][0].layers))
        assert sp1.chunks[0][0].gather_once_s == pytest.approx(gather + copy_in + copy_out)
        rs_units = sum(sp1._coll("reduce_scatter", b) for b in units)
        assert p1.breakdown["dp_comm_s"] == pytest.approx(gather + copy_in + copy_out + rs_units + loss)
        l1 = sp1.chunks[0][0].layers  # no copy on ZeRO-1's compute stream inside a micro-batch
        assert sp1.chunks[0][0].compute_s - sum(sp1.fsdp_overhead(l1)) == \
            pytest.approx(sum(l.fwd_compute + l.bwd_compute + l.recompute - l.recompute_tp for l in l1))
        # the last backward's copy-ins (of the fp32 sums when micro-batches accumulated) join the compute stream
        ins = _fsdp_copies(sp1, [b / 4 for b in units], accumulated=m > 1)[2]
        assert sp1.dp_tail(0, sp1.pass_times())[3] == pytest.approx(ins) and ins > 0
        assert p1.breakdown["compute_s"] == pytest.approx(
            m * sp1.chunks[0][0].compute_s + sp1.step_host() + ins)


def test_pipelined_zero3_gathers_once_per_micro_batch_and_reduces_after_the_flush(gpt):
    cl = _no_latency(cluster(nodes=2, per_node=2))
    m = 4
    sp = StepPredictor(CostModel(cl), gpt, _plan(gpt, cl, 2 * m, dp=2, pp=2, zero=3))
    for ch in (sp.chunks[0][0], sp.chunks[1][0]):
        gather = sum(sp._coll("all_gather", l.param_elems * 2) for l in ch.layers)
        copy_in, copy_out, _ = _fsdp_copies(sp, sp.unit_elems(ch.layers))
        assert ch.zero_comm_s == pytest.approx(gather + copy_in)  # no reduce-scatter inside a micro-batch
        # and once more a step: the first backward finds the parameters resharded by the forward before it
        assert ch.gather_once_s == pytest.approx(gather + copy_in + copy_out) and ch.first_gather_s > 0
        plain = sum(l.fwd_compute + l.bwd_compute + l.recompute - l.recompute_tp for l in ch.layers)
        assert ch.compute_s - sum(sp.fsdp_overhead(ch.layers)) == pytest.approx(plain + copy_out)  # one gather
    _, spans, _, _ = sp.dp_tail(0, sp_times(sp))
    assert spans and all(n.startswith("reduce-scatter") for _, _, n in spans)


def test_a_column_parallel_reader_after_a_replicated_one_still_reduces_its_input_gradient(gpt):
    """q_proj left replicated, k_proj column-parallel, both reading ln_1's output: the forward redistribution is
    shared, but k_proj's partial input gradient is all-reduced once in backward (the executor runs it; the step
    once dropped it because a replicated linear had read the tensor first)."""
    from planner.plan import OpPlacement
    cl = _no_latency(cluster(per_node=2))
    plan = _plan(gpt, cl, 2, tp=2, sp=0)
    col = OpPlacement(strategy="colwise", module="h.0.attn.k_proj", inputs=("R",), output="S(2)",
                      params=("S(0)", "S(0)"))
    k_proj = next(o for o in gpt.ops if o.module_path == "h.0.attn.k_proj")
    plan = dataclasses.replace(plan, ops={k_proj.name: col})
    cm = CostModel(cl)
    coster = LayerCoster(cm, gpt, plan, Group(2, 1))
    block = next(layer for layer in gpt.layers() if layer.name == "h.0")
    ln = gpt.op(k_proj.inputs[0])
    ar = cm.reshard_time(ln.output_meta[0], "R", "R", 2, 1, "bf16", consumer_partial_grad=True)[1]
    assert ar > 0
    # backward's only tp collective: the all-reduce of ln_1's output gradient (k's forward all-gather for the
    # replicated view after it has no backward dual: the view's gradient is sliced)
    assert coster.cost(block).tp_bwd == pytest.approx(ar)


def test_gradients_reduce_in_fp32_at_twice_the_bf16_bytes():
    assert GRAD_REDUCE_BYTES == 4.0
    g, cl = megatron_gpt(layers=2), _no_latency(cluster(per_node=2))
    cl = dataclasses.replace(cl, intra_node=dataclasses.replace(cl.intra_node, kind="shm"))  # no NCCL base latency
    sp = StepPredictor(CostModel(cl), g, _plan(g, cl, 2, dp=2, zero=0, precision="bf16"))
    _, spans, _, _ = sp.dp_tail(0, sp_times(sp))
    elems = sum(l.param_elems for l in sp.chunks[0][0].layers)
    assert sum(d for _, d, _ in spans) == pytest.approx(2 * sp._coll("all_reduce", elems * 2))


def sp_times(sp):
    return sp.pass_times()


def test_pipelined_dp_reduction_waits_for_the_flush_and_tied_weights_all_reduce(gpt):
    cl = _no_latency(cluster(nodes=2, per_node=2))
    plan = _plan(gpt, cl, 8, dp=2, pp=2, zero=0)
    sp = StepPredictor(CostModel(cl), gpt, plan)
    times = sp_times(sp)
    end, spans, slowed, _ = sp.dp_tail(0, times)
    units = [b for ch in sp.chunks[0] for _, b in sp._units(ch)]
    assert slowed == 0 and spans[0][0] == pytest.approx(times.rank_end()[0])  # nothing overlaps the backward
    assert end - spans[0][0] == pytest.approx(sum(sp._coll("all_reduce", b) for b in units))
    # the tied wte / lm_head gradient (fp32) is all-reduced between the first and the last stage, across nodes
    tied = gpt.module_op("wte").params[0]
    assert sp.tied_all_reduce() == pytest.approx(CostModel(cl).comm.time("all_reduce", tied.numel * 4, Group(2, 2)))
    pred = sp.run(False)
    assert pred.breakdown["exposed_comm_s"] >= sum(d for _, d, _ in spans) + sp.tied_all_reduce()
    assert StepPredictor(CostModel(cl), gpt, _plan(gpt, cl, 8, dp=4, zero=0)).tied_all_reduce() == 0.0


def test_a_sequence_parallel_stage_boundary_sends_each_ranks_shard(gpt):
    # executor.tp.stage_boundary_hooks sends a block's sequence-sharded output as each tp rank's shard and the
    # receiver reads it sharded (planner.layout.boundary_placements): no gather on either side, half the bytes of
    # the replicated output at tp = 2, and the receiver keeps only the shard
    cl = _no_latency(cluster(nodes=1, per_node=4))
    plain, seq = (StepPredictor(CostModel(cl), gpt, _plan(gpt, cl, 4, tp=2, pp=2, sp=s, schedule="1f1b"))
                  for s in (0, 1))
    (s0, e0), _ = seq.stage_ranges
    assert seq.layers[e0 - 1].block_type is not None
    sender, receiver = seq.chunks[0][0].layers[-1], seq.chunks[1][0].layers[0]
    assert sender.out_full_bytes == sender.out_bytes == pytest.approx(
        plain.chunks[0][0].layers[-1].out_bytes / 2)
    assert 0 < seq.p2p_s < plain.p2p_s
    assert seq.p2p_s == pytest.approx(CostModel(cl).comm.time("send_recv", sender.out_bytes, seq.groups["pp"]))
    assert sender.boundary_gather == (0.0, 0.0)
    alone = LayerCoster(CostModel(cl), gpt, seq.plan, seq.groups["tp"])
    assert sender.tp_fwd == pytest.approx(alone.cost(seq.layers[e0 - 1]).tp_fwd)
    assert receiver.tp_bwd == pytest.approx(alone.cost(seq.layers[e0]).tp_bwd)
    assert receiver.act_bytes == pytest.approx(alone.cost(seq.layers[e0]).act_bytes)


def test_without_sequence_parallelism_a_block_crosses_whole(gpt):
    # a block's last placed op (the plan lists no replicated op) need not be its last op: attention split by heads
    # and the rest replicated leaves the heads' S(1) last, while the block returns a replicated tensor. Without
    # sequence parallelism no block is sent as a shard (planner.layout.boundary_placements, which the executor
    # reads too); with it, the blocks' sequence shards are
    cl = _no_latency(cluster(nodes=1, per_node=4))
    plain = _plan(gpt, cl, 4, tp=2, pp=2, sp=0, schedule="1f1b")
    attention = next(op for op in gpt.ops if op.kind == "attention" and op.module_path.startswith("h.0"))
    heads = OpPlacement(strategy="heads", module=attention.module_path, inputs=("S(1)",) * 3, output="S(1)")
    ops = {k: v for k, v in plain.ops.items() if not v.module.startswith("h.0")} | {attention.name: heads}
    blocks = {b for names in gpt.block_types.values() for b in names}
    assert boundary_placements(dataclasses.replace(plain, ops=ops), blocks) == {}
    assert boundary_placements(dataclasses.replace(plain, ops=ops, sequence_parallel=True), blocks)["h.0"] == "S(1)"
    seq = _plan(gpt, cl, 4, tp=2, pp=2, sp=1, schedule="1f1b")
    assert {b: boundary_placements(seq, blocks).get(b) for b in ("h.0", "h.1")} == {"h.0": "S(1)", "h.1": "S(1)"}


def test_a_sharded_output_that_is_not_a_blocks_crosses_whole(gpt):
    # only a block's output travels as its shard (executor.pipeline.boundary_placements); a sharded output of the
    # ops between blocks is gathered and sent whole, its gradient all-gathered in the receiver's backward
    cl = _no_latency(cluster(nodes=1, per_node=4))
    plan = _plan(gpt, cl, 4, tp=2, pp=2, sp=1, schedule="1f1b")
    pre = next(l for l in gpt.layers() if l.block_type is None)  # the embeddings, before the first block
    last = gpt.ops[pre.ops[-1]].name
    ops = {**plan.ops, last: OpPlacement(strategy="sequence", inputs=("R", "R"), output="S(1)")}  # as if sharded
    coster = LayerCoster(CostModel(cl), gpt, dataclasses.replace(plan, ops=ops), Group(2, 1))
    glue = [pre]
    cost = coster.cost(glue[0])
    assert cost.out_full_bytes == pytest.approx(2 * cost.out_bytes) and min(cost.boundary_gather) > 0


def test_interleaved_dp_reduction_runs_after_each_chunks_last_backward(gpt):
    # torch's ScheduleInterleaved1F1B runs each chunk's REDUCE_GRAD right after that chunk's last backward and the
    # compute stream waits for it: chunk 1 (whose last backward comes first) is reduced mid-schedule, chunk 0's
    # after the rank's last pass; all of it is exposed communication
    cl = _no_latency(cluster(nodes=2, per_node=2))
    plan = _plan(gpt, cl, 8, dp=2, pp=2, zero=1, schedule="interleaved", vp=2)
    sp = StepPredictor(CostModel(cl), gpt, plan)
    times = sp.pass_times()
    end, spans, slowed, _ = sp.dp_tail(0, times)
    first, last = (float(times.b_end[0, c].max()) for c in (1, 0))
    assert slowed == 0 and first < last == pytest.approx(float(times.rank_end()[0]))
    mid = [d for s, d, n in spans if " c1 " in n]
    assert [s for s, _, n in spans if " c1 " in n][0] == pytest.approx(first) and sum(mid) > 0
    assert end == pytest.approx(float(times.stream_end[0]))
    later = [s for s, _, n in spans if " c0 " in n]
    assert later[0] >= first + sum(mid) - 1e-12 and later[0] == pytest.approx(last)
    pred = sp.run(False)
    assert pred.breakdown["exposed_comm_s"] >= sum(d for _, d, _ in spans) - 1e-12


def test_interleaved_zero1_gathers_each_stage_ahead_from_the_steps_start(gpt):
    # torch's multi-stage schedule unshards the next stages ahead of their passes (UNSHARD actions, async, from the
    # step's start); a forward waits for its stage's gather, so rank 1 gathers while it waits for its first input
    # and only rank 0's first gather holds the pipeline up. One-stage schedules gather in FSDP2's pre-forward hook
    # once the input has arrived: every stage's first gather on the first micro-batch's way (a lead)
    cl = _no_latency(cluster(nodes=2, per_node=2, inter=1e9))
    plan = _plan(gpt, cl, 8, dp=2, pp=2, zero=1, schedule="interleaved", vp=2)
    sp = StepPredictor(CostModel(cl), gpt, plan)
    g = [[ch.gather_once_s for ch in row] for row in sp.chunks]
    ready = sp.unshard_ready()
    assert not sp.serial and min(min(row) for row in g) > 0
    assert ready[1].tolist() == pytest.approx([g[1][0], g[1][0] + g[1][1]])
    times = sp.pass_times()
    assert times.f_start[0, 0, 0] == pytest.approx(g[0][0])
    for r in range(2):
        for c in range(2):
            assert times.f_start[r, c].min() >= ready[r][c] - 1e-12
    pred = sp.run(False)
    assert pred.breakdown["exposed_comm_s"] >= g[0][0] - 1e-12
    # against every stage's first gather on the first micro-batch's way (the one-stage schedules' lead)
    serial_gathers = StepPredictor(CostModel(cl), gpt, plan)
    serial_gathers.unshard_ready = lambda: None
    assert pred.step_time_s < serial_gathers.run(False).step_time_s
    one = StepPredictor(CostModel(cl), gpt, _plan(gpt, cl, 8, dp=2, pp=2, zero=1, schedule="1f1b"))
    assert one.unshard_ready() is None
    assert StepPredictor(CostModel(cl), gpt, _plan(gpt, cl, 8, dp=2, pp=2, zero=0, schedule="interleaved",
                                                  vp=2)).unshard_ready() is None


def test_pipeline_memory_does_not_grow_with_micro_batches(gpt):
    # executor.pipeline.RecvOnDemandStage holds a receive buffer only while its micro-batch needs it (torch's
    # stage keeps one per micro-batch for the whole step); 1F1B holds min(pp - rank, m) micro-batches
    cl = cluster(per_node=2)
    few, many = (CostModel(cl).predict(gpt, _plan(gpt, cl, m, pp=2, schedule="1f1b")) for m in (4, 64))
    assert few.memory_per_device_bytes == many.memory_per_device_bytes
    assert few.memory_breakdown["buffers"] == 0


def test_modules_left_replicated_under_tp_pay_their_unwrapping(gpt):
    # executor.tp runs each wholly replicated module on plain tensors through hooks that unwrap its DTensor inputs
    # and rewrap its outputs: per call, the profile's dtensor_local_call_* (Megatron's layout leaves ln_1 and ln_2
    # of each block replicated; one call each)
    base = cluster(per_node=2)
    ov = dataclasses.replace(base.device.op_overhead, dtensor_local_call_forward=1e-3,
                             dtensor_local_call_backward=2e-3)
    priced = dataclasses.replace(base, device=dataclasses.replace(base.device, op_overhead=ov, async_host=False))
    plain = dataclasses.replace(base, device=dataclasses.replace(base.device, async_host=False))
    block = next(layer for layer in gpt.layers() if layer.block_type)
    a, b = (LayerCoster(CostModel(c), gpt, _plan(gpt, c, 1, tp=2), CostModel(c).tp_group(2)).cost(block)
            for c in (plain, priced))
    assert b.fwd_compute - a.fwd_compute == pytest.approx(2e-3)
    assert b.bwd_compute - a.bwd_compute == pytest.approx(4e-3)
    dp = [LayerCoster(CostModel(c), gpt, _plan(gpt, c, 2, dp=2), CostModel(c).tp_group(1)).cost(block)
          for c in (plain, priced)]
    assert dp[0].fwd_compute == dp[1].fwd_compute  # without tp nothing is a DTensor


def test_selective_recompute_reruns_every_other_linear_and_never_the_attention(gpt):
    cl = cluster(per_node=1)
    cm = CostModel(cl)
    block = next(l for l in gpt.layers() if l.block_type)
    ops = [gpt.ops[i] for i in block.ops]
    costs = {}
    for rc in ("none", "selective", "full"):
        plan = _plan(gpt, cl, 1, recompute=rc)
        costs[rc] = LayerCoster(cm, gpt, plan, cm.tp_group(1)).cost(block)
    coster = LayerCoster(cm, gpt, _plan(gpt, cl, 1), cm.tp_group(1))
    parts = [cm.op_parts(op, None, 1, 1, "bf16", traced_batch_size=gpt.batch_size, dtypes=coster.dtypes.get(op.name))
             for op in ops]  # each op at its dtypes under autocast, with its casts
    fwd = [cm.compute.combine(p[0], p[2]) + coster._autocast_copies(op, None)[0] for op, p in zip(ops, parts)]
    linears = [op.name for op in ops if op.kind == "linear"]
    assert len(linears) == 6 and any(op.kind == "attention" for op in ops)
    # the replay stops once the MLP's output projection has its input (gelu's output): the 6th linear and the
    # last residual add never re-run (torch checkpoint's early stop)
    stop = [op.name for op in ops].index(linears[5])
    assert [op.kind for op in ops[stop:]] == ["linear", "elementwise"]
    full = sum(fwd[:stop])
    selective = sum(f for op, f in zip(ops[:stop], fwd) if op.kind not in ("attention", "reshape")
                    and op.name not in linears[0::2])
    assert costs["full"].recompute == pytest.approx(full)
    assert costs["selective"].recompute == pytest.approx(selective)
    attn = sum(f for op, f in zip(ops, fwd) if op.kind == "attention")
    assert 0 < costs["selective"].recompute < costs["full"].recompute - attn
    assert costs["none"].recompute == 0.0


def test_attention_recompute_reruns_only_the_sdpa_call_and_drops_what_it_saves(gpt):
    # recompute=attention (Megatron-LM's selective): each block's SDPA call is checkpointed on its own, so its
    # forward re-runs in backward (nothing else does); q, k, v stay (the checkpoint's inputs) and so does its
    # output (the output projection saves it), so a flash kernel frees only its log-sum-exp, and under unfused
    # attention the s x s probabilities (and dropout mask) go too
    cl = cluster(per_node=1)
    block = next(l for l in gpt.layers() if l.block_type)
    sdpa = next(gpt.ops[i] for i in block.ops if gpt.ops[i].kind == "attention")
    drops = {}
    for kernel in (None, "unfused"):
        c = cl.with_attention_kernel(kernel) if kernel else cl
        cm = CostModel(c)
        costs = {rc: LayerCoster(cm, gpt, _plan(gpt, c, 1, recompute=rc), cm.tp_group(1)).cost(block)
                 for rc in ("none", "attention", "selective")}
        coster = LayerCoster(cm, gpt, _plan(gpt, c, 1), cm.tp_group(1))
        kf, _, hf, _ = cm.op_parts(sdpa, None, 1, 1, "bf16", traced_batch_size=gpt.batch_size,
                                   dtypes=coster.dtypes.get(sdpa.name))
        assert costs["attention"].recompute == pytest.approx(cm.compute.combine(kf, hf))
        assert costs["none"].fwd_compute == pytest.approx(costs["attention"].fwd_compute)  # no profile costs here
        mem = [cm.op_memory(sdpa, None, 1, 1, "bf16", traced_batch_size=gpt.batch_size,
                            dtypes=coster.dtypes.get(sdpa.name), inputs_only=only)[1] for only in (False, True)]
        drops[kernel] = costs["none"].act_bytes - costs["attention"].act_bytes
        assert drops[kernel] == pytest.approx(mem[0] - mem[1]) and drops[kernel] > 0
    assert drops["unfused"] > 10 * drops[None]  # the s x s probabilities, against the log-sum-exp


def test_attention_recompute_needs_sdpa_calls_in_every_block():
    from cost_model.ops import attention_recompute_problem
    from planner.errors import PlanError
    from planner.search import search
    g = megatron_gpt(layers=2)  # hand-written attention: matmul, softmax, dropout, matmul
    problem = attention_recompute_problem(g)
    assert "hand-written" in problem and "recompute=selective or full" in problem
    cl = cluster(per_node=2)
    with pytest.raises(PlanError, match="recompute=attention re-runs F.scaled_dot_product_attention"):
        search(g, cl, CostModel(cl), batch_size=2, forced={"recompute": "attention"})
    result = search(g, cl, CostModel(cl), batch_size=2, top_k=50)  # not offered unforced
    assert result.evaluated and all("attn" not in e.label for e in result.evaluated)


def test_executor_attention_recompute_refuses_a_block_whose_sdpa_call_it_cannot_reach():
    # nn.MultiheadAttention calls SDPA inside F.multi_head_attention_forward, where a TorchFunctionMode is off: the
    # block's forward raises (the dry run reports it before a plan is written) instead of recomputing nothing
    from executor import parallel
    from executor.errors import ExecutorError

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return x + self.attn(x, x, x, need_weights=False)[0]
    model = torch.nn.Sequential(Block())
    parallel.apply_ac(model, "attention", ["0"])
    with pytest.raises(ExecutorError, match="block 0 made no F.scaled_dot_product_attention call"):
        model(torch.randn(2, 4, 8))


def test_a_recomputed_blocks_host_work_joins_its_backward_on_gpus(gpt):
    # on GPUs (async host) the re-run's kernels and host work (its dispatches, checkpointing's hooks) are set
    # against the backward's as a whole: hidden while the kernels outlast the host, all of it once the host is
    # the bottleneck; on CPU ranks (one thread) everything adds up
    from cost_model.backward import recompute_stop
    block = next(l for l in gpt.layers() if l.block_type)
    ops = [gpt.ops[i] for i in block.ops]
    stop = recompute_stop(gpt, block)

    def costs(cl):
        cm = CostModel(cl)
        coster = LayerCoster(cm, gpt, _plan(gpt, cl, 1), cm.tp_group(1))
        parts = [cm.op_parts(op, None, 1, 1, "bf16", traced_batch_size=gpt.batch_size,
                             dtypes=coster.dtypes.get(op.name)) for op in ops[:stop + 1]]
        kernels = sum(p[0] + coster._autocast_copies(op, None)[0] for op, p in zip(ops, parts))
        host = sum(p[2] + coster._autocast_copy_dispatch(op)[0] for op, p in zip(ops, parts))
        full = LayerCoster(cm, gpt, _plan(gpt, cl, 1, recompute="full"), cm.tp_group(1)).cost(block)
        return full.recompute, kernels, host

    def device(slow: float, hook: float, gpu: bool = True):
        base = cluster(per_node=1, flops=100e12 / slow, mem_bw=2e12 / slow)
        ov = dataclasses.replace(base.device.op_overhead, forward=8e-6, backward=8e-6, checkpoint_backward=hook,
                                 checkpoint_linear_backward=hook)
        return dataclasses.replace(base, device=dataclasses.replace(base.device, op_overhead=ov, async_host=gpu))
    # kernels far slower than the host: the re-run costs its kernels, its host work hidden
    rec, kernels, host = costs(device(1e4, 1e-5))
    assert rec == pytest.approx(kernels) and kernels > 10 * (host + (stop + 1) * 1e-5)
    # checkpointing's hooks far above every kernel: the host sets the pace, and the re-run adds all its host work
    rec, kernels, host = costs(device(1.0, 1.0))
    assert rec == pytest.approx((stop + 1) * 1.0, rel=1e-3)
    # CPU ranks: kernels, dispatch and hooks add up
    rec, kernels, host = costs(device(1.0, 1e-4, gpu=False))
    assert rec == pytest.approx(kernels + host + (stop + 1) * 1e-4)


def test_executor_selective_policy_recomputes_no_attention_and_half_the_matmuls():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import Block, GPTConfig
    from torch.utils._python_dispatch import TorchDispatchMode

    from executor.parallel import apply_ac

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    counts = {}
    for rc in ("selective", "full"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(GPTConfig(n_embd=32, n_head=4)), Block(GPTConfig(n_embd=32, n_head=4)))
        apply_ac(model, rc, ["0", "1"])
        y = model(torch.randn(2, 8, 32, requires_grad=True)).sum()
        with Record() as rec:
            y.backward()
        counts[rc] = rec.ops
    sdpa = [o for o in counts["full"] if o.startswith("_scaled_dot_product") and "backward" not in o]
    assert len(sdpa) == 2  # full recompute re-runs each block's attention forward
    assert not [o for o in counts["selective"] if o.startswith("_scaled_dot_product") and "backward" not in o]
    # 6 linears per block (backward matmuls are mm, not addmm); the replay stops before the 6th (early stop):
    # full re-runs linears 1-5, selective the 2nd and 4th
    assert counts["selective"].count("addmm") == 2 * 2 and counts["full"].count("addmm") == 2 * 5


def test_vocabulary_parallel_loss_has_no_logits_gather(gpt):
    cl = cluster(per_node=2)
    cm = CostModel(cl)
    plan = _plan(gpt, cl, 1, tp=2)
    post = gpt.layers()[-1]
    cost = LayerCoster(cm, gpt, plan, cm.tp_group(2)).cost(post)
    logits = gpt.module_op("lm_head").output_meta[0]
    rows = logits.numel / logits.shape[-1]
    want = LOSS_PARALLEL_ALL_REDUCES * cm.comm.time("all_reduce", rows * 4, cm.tp_group(2))
    gather = cm.reshard_time(logits, "S(2)", "R", 2, 1, "bf16", traced_batch_size=gpt.batch_size)[0]
    assert cost.tp_fwd == pytest.approx(want)  # what the logits' all-gather would have cost is not charged
    assert cost.tp_fwd != pytest.approx(gather)


def test_autocast_prices_norms_softmax_and_losses_in_fp32():
    assert op_precision("norm", "bf16") == op_precision("loss", "bf16") == op_precision("softmax", "fp16") == "fp32"
    assert op_precision("linear", "bf16") == "bf16" and op_precision("norm", "fp32") == "fp32"
    cm = CostModel(cluster())
    norm = OpNode(name="n", kind="norm", target="norm", module_path="n", inputs=(),
                  input_meta=(TensorMeta((8, 1024, 1024), "float32"),),
                  output_meta=(TensorMeta((8, 1024, 1024), "float32"),), fwd_flops=0, bwd_flops=0,
                  bytes_read=0, bytes_written=0)
    assert cm.op_time(norm, None, 1, 1, "bf16") == cm.op_time(norm, None, 1, 1, "fp32")


def test_autocast_casts_fp32_weights_and_accumulates_fp32_gradients(gpt):
    cl, cl2 = cluster(per_node=1), cluster(per_node=2)
    cm = CostModel(cl)
    lin = gpt.module_op("h.0.mlp.c_fc")
    elems = sum(p.numel for p in lin.params)
    mem = cm.compute.memory_time

    def copies(batch, precision="bf16", **force):
        plan = _plan(gpt, cl2 if force else cl, batch, precision=precision, **force)
        return LayerCoster(cm, gpt, plan, cm.tp_group(1))._autocast_copies(lin, plan.ops.get(lin.name))
    # fp32 master weights cast to bf16 in each micro-batch's forward; the gradient cast back, then summed over
    # micro-batches (6 bytes, plus 12 per later micro-batch)
    assert copies(1) == pytest.approx((mem(6 * elems), mem(6 * elems)))
    assert copies(4) == pytest.approx((mem(6 * elems), mem((6 + 12 * 3 / 4) * elems)))
    # FSDP2 gathers bf16 parameters (no cast) and autograd gives their bf16 gradients (no cast back); ZeRO-2/3
    # reduce every micro-batch (nothing accumulated), as ZeRO-1 does its only one
    assert copies(8, dp=2, zero=3, mbs=1) == (0.0, 0.0) and copies(8, dp=2, zero=2, mbs=1) == (0.0, 0.0)
    assert copies(2, dp=2, zero=1, mbs=1) == (0.0, 0.0)
    # tp without dp: the same bf16 weights, through replicate over a one-rank mesh (Plan.fsdp_mixed_precision)
    assert copies(1, tp=2) == (0.0, 0.0)
    # ZeRO-1 over 4 micro-batches: FSDP2 converts the first gradient to fp32 once (6 bytes) and adds each later
    # bf16 one to that sum (read 4 + 2, write 4), per micro-batch on average
    assert copies(8, dp=2, zero=1, mbs=1) == pytest.approx((0.0, mem(6 * elems) / 4 + mem(10 * 3 / 4 * elems)))
    # fp32: no casts, but autograd still sums each later micro-batch's gradient into the first (12 bytes)
    assert copies(4, precision="fp32") == pytest.approx((0.0, mem(12 * 3 / 4 * elems)))
    assert copies(1, precision="fp32") == (0.0, 0.0) and copies(8, precision="fp32", dp=2, zero=2, mbs=1) == (0.0, 0.0)
    assert copies(1, precision="bf16")[0] > 0 and LayerCoster(cm, gpt, _plan(gpt, cl, 1), cm.tp_group(1)) \
        ._autocast_copies(gpt.module_op("h.0.ln_1"), None) == (0.0, 0.0)


def test_overlapped_collectives_slow_compute_on_nccl_only():
    # hand case: layer 0 (1 s) overlaps gather 1 (0.5 s) -> 1 + 0.2 * 0.5; layer 1 overlaps nothing
    assert _with_reduce([1.0, 1.0], [0.5, 0.5], [0.0, 0.0], 0.2) == pytest.approx(0.5 + 1.1 + 1.0)
    assert _with_reduce([1.0, 1.0], [0.5, 0.5], [0.0, 0.0]) == pytest.approx(2.5)
    g = megatron_gpt(layers=3)
    gpu = cluster(per_node=2)
    cpu = dataclasses.replace(gpu, intra_node=dataclasses.replace(gpu.intra_node, kind="shm"))
    assert CostModel(gpu).comm.overlap_slowdown(Group(2, 1)) == NCCL_OVERLAP_COMPUTE_SLOWDOWN
    p_gpu = CostModel(gpu).predict(g, _plan(g, gpu, 2, dp=2, zero=3))
    p_cpu = CostModel(cpu).predict(g, _plan(g, cpu, 2, dp=2, zero=3))
    assert p_gpu.breakdown["contention_s"] > 0 and p_cpu.breakdown["contention_s"] == 0


def test_graph_helpers_are_real_ops(gpt):
    assert isinstance(gpt, OpGraph) and gpt.op("loss").kind == "loss"


def test_selective_recompute_repeats_one_sequence_gather_and_no_reduce_scatter(gpt):
    # with sequence parallelism the re-run k projection needs ln_1's output gathered again (once); the
    # reduce-scatters after the row-parallel linears are kept by the policy, so none re-runs
    cl = cluster(per_node=2)
    cm = CostModel(cl)
    plan = _plan(gpt, cl, 1, tp=2, sp=1, recompute="selective")
    block = next(l for l in gpt.layers() if l.block_type)
    cost = LayerCoster(cm, gpt, plan, cm.tp_group(2)).cost(block)
    ln1 = next(gpt.ops[i] for i in block.ops if gpt.ops[i].kind == "norm")
    # autocast writes the LayerNorm's output in fp32, but the executor casts it to bf16 before gathering it for the
    # linears (which would cast it anyway): the gather moves bf16
    gather = cm.reshard_time(ln1.output_meta[0], "S(1)", "R", 2, 1, "bf16", traced_batch_size=gpt.batch_size)[0]
    assert gather > 0 and cost.recompute_tp == pytest.approx(gather)


def test_pipelined_zero1_first_forward_gathers_add_up_along_the_pipeline(gpt):
    cl = _no_latency(cluster(nodes=2, per_node=2))
    sp = StepPredictor(CostModel(cl), gpt, _plan(gpt, cl, 8, dp=2, pp=2, zero=1))
    first = [row[0].first_gather_s for row in sp.chunks]
    assert all(f > 0 for f in first)
    with_gathers = sp.run(False).step_time_s
    for row in sp.chunks:
        row[0].first_gather_s = 0.0
    assert with_gathers - sp.run(False).step_time_s == pytest.approx(sum(first))


def test_partial_full_recompute_prices_only_the_blocks_it_names(gpt):
    # Plan.recompute_blocks: 2 of the 4 blocks re-run (the first ones of the single stage); the others keep their
    # activations. Each block costs what it costs under full or no recomputation, and the step's recompute seconds
    # and kept activations lie between the two (the peak too, or equals full's: on this small model it comes in
    # the first block's backward, where both hold the same, as the executor measures: test_executor)
    cl = cluster(per_node=1)
    cm = CostModel(cl)
    blocks = [l for l in gpt.layers() if l.block_type]
    assert len(blocks) == 4
    plans = {rc: _plan(gpt, cl, 1, recompute=rc) for rc in ("none", "full")}
    plans["part"] = dataclasses.replace(plans["full"], recompute_blocks=(2,))
    costs = {k: [LayerCoster(cm, gpt, p, cm.tp_group(1)).cost(b) for b in blocks] for k, p in plans.items()}
    assert costs["part"][:2] == costs["full"][:2] and costs["part"][2:] == costs["none"][2:]
    assert costs["full"][0].recompute > 0 and costs["full"][0].act_bytes < costs["none"][0].act_bytes
    pred = {k: cm.predict(gpt, p) for k, p in plans.items()}
    rec = {k: p.breakdown["recompute_s"] for k, p in pred.items()}
    assert rec["part"] == pytest.approx(rec["full"] / 2) and rec["none"] == 0
    assert pred["full"].step_time_s < pred["part"].step_time_s * 1.5
    assert pred["none"].step_time_s < pred["part"].step_time_s < pred["full"].step_time_s
    kept = {k: sum(c.act_bytes for c in cs) for k, cs in costs.items()}
    assert kept["full"] < kept["part"] < kept["none"]
    assert pred["full"].peak_memory_bytes <= pred["part"].peak_memory_bytes <= pred["none"].peak_memory_bytes


def test_selective_with_full_blocks_prices_full_on_those_blocks_and_selective_on_the_rest(gpt):
    # recompute=selective with Plan.recompute_blocks: the first 2 of 4 blocks run full recomputation, the others
    # selective. Each block costs what it costs under that policy; recompute seconds, kept activations and the
    # step lie between all-selective and all-full
    cl = cluster(per_node=1)
    cm = CostModel(cl)
    blocks = [l for l in gpt.layers() if l.block_type]
    plans = {rc: _plan(gpt, cl, 1, recompute=rc) for rc in ("selective", "full")}
    plans["hybrid"] = dataclasses.replace(plans["selective"], recompute_blocks=(2,))
    costs = {k: [LayerCoster(cm, gpt, p, cm.tp_group(1)).cost(b) for b in blocks] for k, p in plans.items()}
    assert costs["hybrid"][:2] == costs["full"][:2] and costs["hybrid"][2:] == costs["selective"][2:]
    assert costs["full"][0].act_bytes < costs["selective"][0].act_bytes
    assert costs["selective"][0].recompute < costs["full"][0].recompute
    pred = {k: cm.predict(gpt, p) for k, p in plans.items()}
    rec = {k: p.breakdown["recompute_s"] for k, p in pred.items()}
    assert rec["hybrid"] == pytest.approx((rec["full"] + rec["selective"]) / 2)
    assert pred["selective"].step_time_s < pred["hybrid"].step_time_s < pred["full"].step_time_s
    kept = {k: sum(c.act_bytes for c in cs) for k, cs in costs.items()}
    assert kept["full"] < kept["hybrid"] < kept["selective"]


@pytest.mark.parametrize("case", ["causal", "autocast", "gqa", "aten", "dropout"])
def test_attention_recompute_call_gives_the_plain_calls_outputs_and_gradients(case):
    # recompute=attention's call (executor.parallel.recompute_call): forward keeps only the tensor inputs, backward
    # re-runs the call (under the forward's autocast) and backpropagates through it: bit for bit the plain call's
    # results, on F.scaled_dot_product_attention and on the aten kernel an exported graph calls; a call with dropout
    # goes through torch's checkpoint instead, which replays the RNG
    import torch.nn.functional as F
    from executor.parallel import recompute_call
    torch.manual_seed(0)
    func, kwargs, post = F.scaled_dot_product_attention, {"is_causal": True}, (lambda o: o)
    shapes = [(2, 8, 3, 16)] * 3
    if case == "gqa":
        shapes, kwargs = [(2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)], {"is_causal": True, "enable_gqa": True}
    if case == "aten":
        func, post = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (lambda o: o[0])
    if case == "dropout":
        kwargs = {"dropout_p": 0.5}
    base = [torch.randn(*s).transpose(1, 2) for s in shapes]  # non-contiguous [b, h, s, d], as a fused qkv gives
    outs, grads = [], []
    for rerun in (False, True):
        ins = [t.detach().clone().requires_grad_() for t in base]
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
            out = post(recompute_call(func, tuple(ins), kwargs) if rerun else func(*ins, **kwargs))
        out.backward(torch.ones_like(out))
        outs.append(out)
        grads.append([t.grad for t in ins])
        recomputed = type(out.grad_fn).__name__
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
    assert (recomputed == "_RecomputedBackward") == (case != "dropout")
    assert outs[1].dtype == (torch.bfloat16 if case == "autocast" else torch.float32)


def test_a_scalar_all_reduce_is_priced_as_nccls_ll_ring_or_tree():
    # NCCL picks LL for a few bytes: ring 6.6 + 2(n-1) x 0.6 us in a node; across k nodes a tree,
    # 6.8 + 2 ((g-1) x max(0.6, 1.0) + log2(k) x 5.0) us, where the ring's 2(n-1) steps would cost far more
    cm = CostModel(cluster(nodes=2048, per_node=8))
    assert cm.comm.scalar_all_reduce(Group(8, 1)) == pytest.approx((6.6 + 14 * 0.6) * 1e-6)
    assert cm.comm.scalar_all_reduce(Group(16384, 2048)) == pytest.approx((6.8 + 2 * (7 * 1.0 + 11 * 5.0)) * 1e-6)
    assert cm.comm.scalar_all_reduce(Group(16384, 2048)) < cm.comm.time("all_reduce", 4.0, Group(16384, 2048)) / 100
    assert cm.comm.scalar_all_reduce(Group(1, 1)) == 0.0
    from hardware_profiles import load_cluster
    cpu = CostModel(load_cluster("cpu-local"))  # gloo: the measured curve / ring formula
    assert cpu.comm.scalar_all_reduce(Group(2, 1)) == cpu.comm.time("all_reduce", 4.0, Group(2, 1))


@pytest.mark.parametrize("force", [{"dp": 4, "zero": 1}, {"dp": 2, "pp": 2, "zero": 0}])
def test_gradient_clipping_adds_its_passes_and_one_all_reduce_over_every_rank(gpt, force):
    # Plan.max_grad_norm (executor.grad_clip): a norm reading the local fp32 gradients, one scalar all-reduce over
    # all ranks, a multiply rewriting them, before the optimizer; nothing without it
    cl = cluster(nodes=2, per_node=2)
    plain = _plan(gpt, cl, 8, **force)
    clipped = dataclasses.replace(plain, max_grad_norm=1.0)
    cm = CostModel(cl)
    sp = StepPredictor(cm, gpt, clipped)
    a, b = StepPredictor(cm, gpt, plain).run(True), sp.run(True)
    shard = sp.rank_params(0) / (sp.dp if sp.zero >= 1 else 1)
    norm, scale = sp.clip_times(0, shard)
    assert norm >= cm.compute.memory_time(4 * shard) and scale >= cm.compute.memory_time(8 * shard)
    ar = cm.comm.scalar_all_reduce(Group(clipped.world_size, 2))
    assert b.step_time_s >= a.step_time_s + norm + scale + ar - 1e-12
    assert b.breakdown["optimizer_s"] == pytest.approx(a.breakdown["optimizer_s"] + norm + scale)
    assert b.breakdown["exposed_comm_s"] >= a.breakdown["exposed_comm_s"] + ar - 1e-12
    clip = ("gradient norm", "all-reduce gradient norm", "clip gradients")
    assert [e.name for e in b.timeline if e.name in clip and e.device == 0] == list(clip)
    assert not [e for e in a.timeline if "gradient norm" in e.name]
    assert any("gradients clipped to norm 1" in line for line in b.assumptions)
    assert not any("clipped" in line for line in a.assumptions)
