"""Memory per device: model states under ZeRO, activations in flight per pipeline schedule, buffers, transients.

`peak_memory` is what the step predictor uses: the bytes the executor allocates (torch.autocast, FSDP2, DDP,
torch.distributed.pipelining, torch.optim.AdamW, read from their sources), at the worst phase of a step.
`model_state_bytes` is the ZeRO paper's accounting (Rajbhandari et al., ZeRO, Fig. 1; formulas.csv zero_*), kept
as the reference it is checked against: with mixed precision each parameter costs 2 (16-bit weight) + 2 (16-bit
gradient) + K = 12 (fp32 master weight, Adam m and v) bytes, so per device 16 Psi (stage 0), 4 Psi + 12 Psi/N
(stage 1), 2 Psi + 14 Psi/N (stage 2), 16 Psi/N (stage 3) for N data-parallel ranks; in fp32 the weight and
gradient take 4 bytes each and K = 8. The executor keeps fp32 weights and gradients under autocast (4 + 4 + 8, the
same 16 Psi at stage 0) and FSDP2 gathers 16-bit copies.

Activations: `in_flight` counts the micro-batches (of each chunk) whose activations one pipeline rank holds at its
peak, read off the schedule itself: GPipe holds all m, 1F1B min(p - r, m) on rank r (p on the first stage), the
interleaved schedule (p-1-r)*2 + (v-1)*p + 1 chunk-micro-batches, i.e. a (1 + (p-1)/(p v)) factor over 1F1B on the
first stage (Korthikanti et al. 2022 Sec 4.2.3; formulas.csv activation_memory_total_first_stage_1f1b).
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from cost_model.ops import loss_op
from planner.graph import OpGraph
from planner.plan import Plan

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default gradient bucket (bucket_cap_mb=25, torch.nn.parallel.DistributedDataParallel docs)."""


def model_state_bytes(num_params: float, zero_stage: int, dp: int, precision: str) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state for `num_params` local parameters.

    Returns {"parameters", "gradients", "optimizer"}; their sum is 16 Psi / 4 Psi + 12 Psi/N / 2 Psi + 14 Psi/N /
    16 Psi/N for ZeRO stage 0 / 1 / 2 / 3 in mixed precision."""
    if precision == "fp32":
        w, g, k = 4.0, 4.0, 8.0
    else:
        w, g, k = 2.0, 2.0, 12.0
    n = max(1, dp)
    return {
        "parameters": num_params * w / (n if zero_stage >= 3 else 1),
        "gradients": num_params * g / (n if zero_stage >= 2 else 1),
        "optimizer": num_params * k / (n if zero_stage >= 1 else 1),
    }


@functools.lru_cache(maxsize=4096)
def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> Counter:
    """Micro-batches of each chunk whose activations `rank` holds at its peak (forwards run before its first
    backward, plus the one that backward frees). Cached: callers must not change the Counter."""
    from cost_model.simulator import schedule_sequence
    if schedule == "1f1b" and v == 1:
        return Counter({0: min(p - rank, m)})
    if schedule == "gpipe":
        return Counter({0: m})
    held: Counter = Counter()
    for is_b, chunk, _ in schedule_sequence(schedule, p, v, m, rank):
        if is_b:
            break
        held[chunk] += 1
    return held


class Mixes(NamedTuple):
    """A rank's backwards (`backward_mixes`), one row each: `chunk` (n,), and per chunk (n, chunks) the
    micro-batches `held` as the backward starts (its own included) and the forwards `fwds` and backwards `bwds`
    run before it."""
    chunk: np.ndarray
    held: np.ndarray
    fwds: np.ndarray
    bwds: np.ndarray


@functools.lru_cache(maxsize=4096)
def backward_mixes(schedule: str, p: int, v: int, m: int, rank: int, passes: bool = False) -> Mixes:
    """The backwards of `rank` in schedule order. Under the interleaved schedule the micro-batches a rank holds
    shift between its chunks as the step goes on (a pp2 rank of two chunks, 4 micro-batches: {0: 2, 1: 1} at its
    first backward, of chunk 1, and {0: 3} at its first of chunk 0). Without `passes` (no sends to count: GPUs) the
    first backward, then each later (chunk, held) once: the search prices thousands of plans, and a 1T mesh's rank
    runs 1024 backwards a step, of a few hundred mixes. Cached: callers must not change the arrays."""
    from cost_model.simulator import schedule_sequence
    held, fwds, bwds = [0] * v, [0] * v, [0] * v
    rows: list[tuple] = []
    seen: set[tuple] = set()  # later backwards' (chunk, held) already listed
    for is_b, chunk, _ in schedule_sequence(schedule, p, v, m, rank):
        if is_b:
            key = (chunk, *held)
            if passes or not rows or key not in seen:
                if rows:  # (the first backward is listed apart from later ones of its mix)
                    seen.add(key)
                rows.append((chunk, tuple(held), tuple(fwds), tuple(bwds)))
            held[chunk] -= 1
            bwds[chunk] += 1
        else:
            held[chunk] += 1
            fwds[chunk] += 1
    per_chunk = (np.array([r[i] for r in rows], dtype=np.int64).reshape(len(rows), v) for i in (1, 2, 3))
    return Mixes(np.array([r[0] for r in rows], dtype=np.int64), *per_chunk)


ADAM_STATE_BYTES = 8.0
"""fp32 exp_avg and exp_avg_sq per local parameter element (torch.optim.AdamW's state; the parameters themselves
stay fp32 under autocast and FSDP2 keeps fp32 shards)."""
FP32 = 4.0


@dataclass(frozen=True, kw_only=True)
class DeviceWork:
    """What one device of a pipeline rank holds and runs, as the executor applies the plan (executor.parallel)."""

    params: float
    """Local parameter elements (after tp; a tied weight once)."""
    layers: tuple
    """Per chunk, the `LayerCost`s of its layers in model order."""
    held: Counter
    """Micro-batches of each chunk whose activations the device holds at its peak (`in_flight`)."""
    mixes: Mixes | None = None
    """Interleaved schedules: the rank's backwards, each with the micro-batches of each chunk held as it starts and
    the passes run before it (`backward_mixes`); None: every backward holds `held` (one chunk a rank)."""
    microbatches: int
    """Micro-batches per step."""
    dp: int
    """Data-parallel degree."""
    zero_stage: int
    """ZeRO stage (0 with dp = 1)."""
    precision: str
    """Plan precision; bf16/fp16 train under autocast with fp32 parameters."""
    pipelined: bool
    """pp > 1 (torch.distributed.pipelining stages)."""
    ddp: bool
    """Plain DP through torch DDP (its flat gradient buckets); False for FSDP2 `replicate` (per-block
    all-reduce buffers)."""
    replicate: bool = False
    """ZeRO-0 through FSDP2's `replicate` (tp or pp: with dp > 1, and at dp = 1 under 16-bit training,
    `Plan.fsdp_mixed_precision`): 16-bit copies of the whole parameters, and per-unit gradient reduction buffers."""
    logits: float
    """Elements of the loss's input (the logits, this device's share) when the device holds the loss, else 0."""
    grad_recv: tuple = ()
    """Per chunk, bytes of the output gradient one micro-batch's backward receives from the next stage (held for
    that backward: executor.pipeline.RecvOnDemandStage). A received activation is the stage's input, counted with
    the activations."""
    stage_outputs: tuple = ()
    """Per chunk (pipelining), bytes of one micro-batch's stage output, which the schedule keeps from that forward
    to the end of its backward (torch.distributed.pipelining's `fwd_cache`: the root of that backward) and
    autograd does not save: the boundary activation sent on; none on the last stage, whose backward starts from
    the loss."""
    schedule_output: float = 0.0
    """Bytes of the model's output (the logits of one micro-batch) that the pipeline schedule holds on the last
    stage from a forward to the next one (the `output` it computes the loss from), backwards included."""
    sends: tuple = ()
    """Per chunk, bytes of the stage output one micro-batch's forward sends and of the input gradient its backward
    sends, each held to the step's end where the schedule keeps every send's Work until then (torch's runtime
    schedule: interleaved, with `mixes`) and the Work keeps its tensor (gloo; a completed NCCL send's tensors are
    released without a wait): CPU ranks."""
    adam_temp_elems: float = 0.0
    """Elements of the single-tensor AdamW's temporaries at its worst parameter (`adam_temp_elems`)."""
    units: tuple = ()
    """Per chunk, the parameter elements of each layer's FSDP2 unit (`StepPredictor.unit_elems`: blocks sharing a
    module are one unit, at the first); empty: each block its own."""
    fused: bool = True
    """Whether AdamW runs torch's fused kernel (the executor's default on GPUs, `executor.runner.default_optimizer`);
    CPU tensors take torch's single-tensor path."""


def _phase(**parts: float) -> dict[str, float]:
    out = {k: parts.get(k, 0.0) for k in ("parameters", "gradients", "optimizer", "activations", "buffers",
                                          "temporaries")}
    out["total"] = sum(out.values())
    return out


def peak_memory(w: DeviceWork) -> dict[str, float]:
    """Peak bytes on one device by part — parameters, gradients, optimizer, activations, buffers (persistent:
    DDP's buckets) and temporaries — at the worst of three phases, not a sum of maxima:

    - backward start (forward end): activations of every in-flight micro-batch (pipelined: with its stage output,
      `DeviceWork.stage_outputs`), plus the fp32 logits' gradient
      and the log-softmax input's gradient (2 x logits x 4 bytes: cross-entropy runs in fp32 under autocast;
      aten::_log_softmax_backward_data reads the output gradient nll_loss_backward wrote); the first backward has
      no gradients yet (zero_grad(set_to_none=True)), a later one (gradient accumulation, pipeline steady state)
      has all of them and one micro-batch fewer held under GPipe;
    - each layer's backward, last to first: that layer's full working set (recomputed activations), the earlier
      layers' activations, the gradients produced so far, the output gradient the stage received for this
      backward, a tied weight's second gradient before it is added to the first, and under ZeRO-2/3 its unsharded
      gradient and the fp32 reduce-scatter input (FSDP2
      foreach_reduce);
    - the optimizer step: gradients and AdamW's temporaries (the fused kernel on GPUs: none;
      `_single_tensor_adam` on CPU: `exp_avg_sq.sqrt() / bias_correction` while the previous tensor's denominator
      is alive: the previous tensor + 2 x this one at the worst, on the dp shard under ZeRO; `adam_temp_elems`).

    Parameters are fp32 (torch.autocast keeps them; FSDP2 keeps fp32 shards, `MixedPrecisionPolicy(param_dtype)`
    gathers bf16 copies): ZeRO-1/2 hold the unsharded parameters from forward to the last backward
    (reshard_after_forward=False), ZeRO-3 the root module's (not resharded after forward:
    executor.parallel.apply_fsdp) and a block being computed plus the next one's all-gather output; ZeRO-0 through
    FSDP2's `replicate` (tp or pp, with dp or over a one-rank mesh) its unsharded copies of all parameters (16-bit,
    or fp32 copies at fp32: `plan measure` on 4 CPU ranks measured twice the parameters). Without FSDP2
    (DDP, one device), autocast keeps a bf16 copy of the linears' weights per forward (counted with the activations):
    cached while the forward runs, saved for backward outside checkpointed blocks, made again by a checkpointed
    block's re-run, all kept under pipelining (one autocast region for the schedule step). So under recomputation the
    forward's end is a phase of its own.
    """
    n = max(1, w.dp)
    z = w.zero_stage if n > 1 else 0
    fsdp, amp = z >= 1, w.precision != "fp32"
    unsharded = 2.0 if amp else FP32  # bytes of a gathered (FSDP2 param_dtype) parameter
    psi = w.params
    resident = psi * FP32 / (n if fsdp else 1)
    opt = psi * ADAM_STATE_BYTES / (n if fsdp else 1)
    grads_step = psi * FP32 / (n if fsdp else 1)
    # each block's unit (blocks sharing a module: one unit, its parameters once)
    blocks = [u for c, ch in enumerate(w.layers) for i, l in enumerate(ch) if l.block
              for u in [w.units[c][i] if w.units else l.param_elems]]
    biggest_block = max(blocks, default=0.0)
    root = psi - sum(blocks)  # outside the blocks; a tied weight once
    gathered = 0.0  # unsharded parameters held in forward and backward
    gather_buffer = 0.0  # ZeRO-3: the next block's all-gather output
    if z in (1, 2) or (z == 3 and w.pipelined):  # pipelined ZeRO-3 keeps them whole after the first backward
        gathered = psi * unsharded
    elif z == 3:
        gathered, gather_buffer = (root + biggest_block) * unsharded, biggest_block * unsharded
    elif w.replicate:  # FSDP2's replicate (tp or pp): unsharded copies of the whole parameters, 16-bit or, at
        # fp32, fp32 (FSDPParam all-gathers into a buffer of its own even over a one-rank shard group)
        gathered = psi * unsharded
    # autocast's 16-bit weight copies (fp32 parameters): cached until the autocast region ends (the forward and loss;
    # under pipelining the whole schedule step) and saved for backward by each linear outside checkpointed blocks
    every = [l for ch in w.layers for l in ch]
    all_casts = sum(l.cast_weight_bytes for l in every)
    cast_weights = all_casts if w.pipelined else sum(l.cast_weight_bytes for l in every if not l.checkpointed)
    buffers = psi * FP32 if w.ddp and n > 1 and z == 0 else 0.0
    # gradients accumulated over micro-batches: whole fp32 (DDP, ZeRO-0), unsharded until the last micro-batch
    # (ZeRO-1, or any FSDP2 stage under pipelining: its reduction waits for the stage's last backward; FSDP2
    # accumulates them in the fp32 reduce dtype, FSDPParam.to_accumulated_grad_if_needed), or shards
    if z == 0 or z == 1 or w.pipelined:
        accumulated = psi * FP32
    else:
        accumulated = grads_step
    static = dict(parameters=resident + gathered, optimizer=opt, buffers=buffers)
    acts_mb = [sum(l.act_bytes for l in ch) + (w.stage_outputs[c] if c < len(w.stage_outputs) else 0.0)
               for c, ch in enumerate(w.layers)]
    held = sum(k * acts_mb[c] for c, k in w.held.items()) + w.schedule_output
    starts = _backward_starts(w, held, acts_mb)
    phases = []
    if all_casts > cast_weights:  # forward end, inside autocast: the checkpointed blocks' copies still cached
        phases.append(_phase(**static, activations=held + all_casts, temporaries=gather_buffer))
    # each backward's start; the loss's (the rank's last chunk) adds the fp32 logits' and log-softmax input's
    # gradients
    loss_chunk, loss_tmp = len(w.layers) - 1, 2 * w.logits * FP32
    phases += [_phase(**static, gradients=accumulated if later else 0.0, activations=total + cast_weights,
                      temporaries=(loss_tmp if c == loss_chunk else 0.0) + gather_buffer + sent)
               for (c, later), (total, sent) in starts.items()]
    phases += _backward_phases(w, static, starts, acts_mb, accumulated, cast_weights, gather_buffer, unsharded, z)
    opt_tmp = 0.0 if w.fused else w.adam_temp_elems * FP32
    phases.append(_phase(parameters=resident, optimizer=opt, buffers=buffers, gradients=grads_step,
                         temporaries=opt_tmp))
    return max(phases, key=lambda p: p["total"])


def _backward_starts(w: DeviceWork, held: float, acts_mb: list[float]) -> dict[tuple, tuple[float, float]]:
    """(chunk, later) -> (activation bytes held as a backward of that chunk starts, its own micro-batch included;
    bytes of sent tensors still held then), at the worst such backward. `later`: gradients summed from earlier
    micro-batches are there. Interleaved: walked backward by backward (`DeviceWork.mixes`). Else one chunk: a
    later backward holds as much as the first without pipelining (one micro-batch at a time) and in the 1F1B
    steady state; GPipe's first holds every micro-batch and no gradient yet, its second one fewer and the sum."""
    mx = w.mixes
    if mx is not None:
        totals = mx.held @ np.asarray(acts_mb, dtype=float) + w.schedule_output
        sends = np.asarray(w.sends, dtype=float).reshape(-1, 2)
        sent = mx.fwds @ sends[:, 0] + mx.bwds @ sends[:, 1] if len(sends) else np.zeros(len(totals))
        later = np.arange(len(totals)) > 0 if w.microbatches > 1 else np.zeros(len(totals), dtype=bool)
        out: dict[tuple, tuple[float, float]] = {}
        for c in np.unique(mx.chunk):
            for flag in (False, True):
                rows = np.flatnonzero((mx.chunk == c) & (later == flag))
                if len(rows):
                    i = rows[np.argmax(totals[rows] + sent[rows])]
                    out[int(c), flag] = (float(totals[i]), float(sent[i]))
        for (c, flag), (total, s) in list(out.items()):  # a later backward holding as much, with the gradients'
            # sum, dominates the first
            if not flag and (c, True) in out and out[c, True][0] >= total and out[c, True][1] >= s:
                del out[c, flag]
        return out
    chunks = [c for c in range(len(w.layers)) if w.held.get(c)]
    if w.microbatches == 1:
        rounds = [(held, False)]
    elif _steady(w):
        rounds = [(held, True)]
    else:
        rounds = [(held, False), (held - max(acts_mb, default=0.0), True)]
    return {(c, later): (total, 0.0) for total, later in rounds for c in chunks}


def _steady(w: DeviceWork) -> bool:
    """Whether a backward after the first holds as many micro-batches as the first (one chunk a rank; the
    interleaved schedule is walked backward by backward): without pipelining (one at a time), and in 1F1B's steady
    state, where each backward is followed by another forward. Else (GPipe, or a 1F1B rank that holds every
    micro-batch) each backward holds one micro-batch fewer than the one before."""
    return not w.pipelined or w.microbatches * len(w.layers) > sum(w.held.values())


def _backward_phases(w: DeviceWork, static, starts, acts_mb, accumulated, cast_weights, gather_buffer, unsharded,
                     z) -> list[dict[str, float]]:
    """Two phases per layer of each chunk's backward (see `peak_memory`): while it runs (its full working set and
    its fresh gradient) and while its gradients are reduced (its activations freed; FSDP2's foreach_reduce copies
    the unsharded gradients into an fp32 reduce-scatter input, replicate into an all-reduce buffer). With several
    micro-batches a backward after the first holds the gradients summed so far and the layer's fresh ones until
    they are added: autograd adds each tensor's as it is made (one tensor at a time), FSDP2 at 16 bits a unit's at
    its post-backward (FSDPParam.accumulate_unsharded_grad_if_needed). What each chunk's backward holds as it
    starts: `starts` (`_backward_starts`)."""
    n = max(1, w.dp)
    # reduced layer by layer in every micro-batch (ZeRO-2/3; ZeRO-1 with one micro-batch), else whole gradients
    # (DDP, replicate) or unsharded ones until the last micro-batch
    per_layer = not w.pipelined and (z >= 2 or (z == 1 and w.microbatches == 1))
    reduces = z >= 1 or w.replicate
    unit_grads = reduces and w.precision != "fp32"  # FSDP2 at 16 bits: a unit's fresh gradients wait together
    out = []
    for (c, later), (total, sent) in starts.items():
        layers = w.layers[c]
        others = total - acts_mb[c]
        below = acts_mb[c]
        recv = w.grad_recv[c] if c < len(w.grad_recv) else 0.0  # the output gradient this backward received
        fresh = 0.0  # gradients held once the layers after this one are done
        done: set[str] = set()  # parameters whose gradient a later layer's backward already made
        for i in reversed(range(len(layers))):
            l = layers[i]
            below -= l.act_bytes
            # a weight tied to a later layer (GPT's embedding, read again by the LM head): its second gradient
            # is a dense tensor of its own until autograd adds it to the first
            again = sum(e for name, e in l.params.items() if name in done)
            tied = again * (FP32 if z == 0 else unsharded)
            done.update(l.params)
            new = l.param_elems - again if l.block else l.param_elems  # a shared module's gradient is there
            own = new * (FP32 if z == 0 else unsharded)
            # a block's FSDP2 unit is reduced at its first block (blocks sharing a module together)
            rs_input = (w.units[c][i] if w.units and l.block else l.param_elems) * FP32 if reduces else 0.0
            adding = 0.0  # a later backward's fresh gradients not yet added (autograd's: temporaries)
            if later and per_layer:
                during, after = accumulated + own, accumulated
            elif later:  # the sum so far, and this layer's fresh gradient (see the docstring)
                during = after = accumulated
                one = max((e for _, e in l.param_sizes), default=0.0) * (FP32 if z == 0 else unsharded)
                adding = new * unsharded if unit_grads else min(own, one)
            elif per_layer:
                during, after = fresh + own, fresh
            else:
                during = after = min(fresh + own, accumulated)
            recast = l.cast_weight_bytes if l.checkpointed and not w.pipelined else 0.0  # its re-run's copies
            out.append(_phase(**static, gradients=during, activations=others + below + l.act_full_bytes
                              + cast_weights + recast, temporaries=gather_buffer + recv + tied + adding + sent))
            out.append(_phase(**static, gradients=after, activations=others + below + cast_weights,
                              temporaries=gather_buffer + recv + rs_input + (own if per_layer else 0.0) + sent))
            fresh = fresh + new * FP32 / n if per_layer else min(fresh + own, accumulated)
    return out


def adam_temp_elems(sizes: list[float]) -> float:
    """Elements torch's single-tensor AdamW (`_single_tensor_adam`, what CPU tensors take) holds as temporaries at
    its worst parameter, for local parameter `sizes` in the order it steps through them: `exp_avg_sq.sqrt()` and
    its quotient by the bias correction (2 x the tensor), while the previous tensor's `denom` is still bound."""
    return max((prev + 2 * cur for prev, cur in zip([0.0] + sizes, sizes)), default=0.0)


def memory_per_rank(sp: Any, r: int, psi: float) -> dict[str, float]:
    """Peak bytes on one device of pipeline rank r of a step (`cost_model.step.StepPredictor` `sp`), by part
    (`peak_memory`)."""
    plan, cl = sp.plan, sp.cm.cluster
    chunks = sp.chunks[r]
    n_stages = len(sp.stage_ranges)
    stage = [c * sp.pp + r for c in range(len(chunks))]
    # the gradient of the chunk's output, received for each backward (none on the last stage)
    grad_recv = [chunks[c].layers[-1].out_full_bytes if i < n_stages - 1 else 0.0 for c, i in enumerate(stage)]
    logits = loss_input_elems(sp.graph, plan) if (n_stages - 1) in stage else 0.0
    # (the last stage's output, the logits, is not kept: executor.pipeline.RecvOnDemandStage.forward_one_chunk)
    outputs = [_stage_output_bytes(sp, i, chunks[c].layers[-1].out_full_bytes) if i < n_stages - 1 else 0.0
               for c, i in enumerate(stage)] if sp.pp > 1 else []
    adam = 0.0  # CPU ranks' single-tensor AdamW temporaries (GPUs run the fused AdamW: none)
    if cl.cpu_ranks:
        order, seen = [], set()  # the rank's parameters in model order, a tied one once (as its optimizer has them)
        for ch in chunks:
            for l in ch.layers:
                order += [e for name, e in l.param_sizes if name not in seen]
                seen.update(name for name, _ in l.param_sizes)
        shards = sp.dp if sp.dp > 1 and plan.zero_stage >= 1 else 1  # FSDP2 steps each parameter's dim-0 shard
        adam = adam_temp_elems([e / shards for e in order])
    interleaved = plan.schedule == "interleaved"
    sends = ()  # per chunk, the stage output and input gradient one micro-batch sends (`DeviceWork.sends`)
    if cl.cpu_ranks and interleaved:
        def sent(i: int) -> float:  # stage i's output, as it is sent (its gradient: the next stage's input's)
            return sp.chunks[i % sp.pp][i // sp.pp].layers[-1].out_full_bytes
        sends = tuple((sent(i) if i < n_stages - 1 else 0.0, sent(i - 1) if i > 0 else 0.0) for i in stage)
    work = DeviceWork(
        params=psi, layers=tuple(tuple(ch.layers) for ch in chunks),
        held=in_flight(plan.schedule, sp.pp, sp.v, sp.m, r), microbatches=sp.m, dp=sp.dp,
        mixes=backward_mixes(plan.schedule, sp.pp, sp.v, sp.m, r, bool(sends)) if interleaved else None,
        zero_stage=plan.zero_stage if sp.dp > 1 else 0, precision=plan.precision, pipelined=sp.pp > 1,
        # executor.parallel.apply_ddp: DDP unless parameters are DTensors (tp) or the module is a pipeline stage
        ddp=sp.dp > 1 and sp.tp == 1 and sp.pp == 1,
        replicate=(sp.dp > 1 and plan.zero_stage == 0 and (sp.tp > 1 or sp.pp > 1))
        or (sp.dp == 1 and plan.fsdp_mixed_precision),
        logits=logits, grad_recv=tuple(grad_recv), stage_outputs=tuple(outputs),
        # (torch's runtime schedule, interleaved, computes the loss inside `_perform_action`, whose `output` goes
        # when it returns; the single-stage schedules keep theirs to the next forward)
        schedule_output=logits * _logit_bytes(sp) if sp.pp > 1 and logits and not interleaved else 0.0,
        sends=sends, adam_temp_elems=adam,
        units=tuple(tuple(sp.unit_elems(ch.layers)) for ch in chunks),
        # GPUs run the executor's fused AdamW; CPU ranks (gloo over loopback) torch's default, which is the
        # single-tensor path there (torch.optim.optimizer._default_to_fused_or_foreach: foreach only on CUDA-like
        # devices)
        fused=not cl.cpu_ranks)
    out = peak_memory(work)
    out["headroom"] = cl.device.memory_bytes - cl.device.usable_memory_bytes
    return out


def _stage_output_bytes(sp: Any, stage: int, sent: float) -> float:
    """Bytes of a non-last stage's output per micro-batch (`DeviceWork.stage_outputs`): `sent`, what it sends
    (whole when a sharded output is gathered before the send); 0 where its producing op saves a tensor of the
    output's shape and dtype for its own backward (then it is counted with the activations already)."""
    layer = sp.layers[sp.stage_ranges[stage][1] - 1]
    op = sp.graph.ops[layer.ops[-1]] if layer.ops else None
    if op is not None and op.output_meta and any(t.shape == op.output_meta[0].shape and t.dtype ==
                                                 op.output_meta[0].dtype for t in op.saved):
        return 0.0
    return sent


def _logit_bytes(sp: Any) -> float:
    """Bytes per element of the model's output the loss reads, in the precision autocast leaves it."""
    from cost_model.dtypes import autocast_dtypes
    from cost_model.kernels import PRECISION_BYTES
    plan, graph = sp.plan, sp.graph
    loss = loss_op(graph)
    d = autocast_dtypes(graph, plan.precision, plan.precision if plan.fsdp_mixed_precision else "fp32",
                        sp.cm.cluster.cpu_ranks).get(loss.inputs[0]) if loss is not None and loss.inputs else None
    return float(PRECISION_BYTES[d.output]) if d is not None else FP32


def loss_input_elems(graph: OpGraph, plan: Plan) -> float:
    """Elements per device of the loss's input (the logits) for one micro-batch: the vocabulary shard when a
    column-parallel head's sharded logits go to a cross-entropy on class indices (the executor's
    `loss_parallel`), else the whole tensor; 0 when the graph has no loss op."""
    loss = loss_op(graph)
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
