"""The assumptions a step prediction prints: which terms priced this plan, in words (`Prediction.assumptions`)."""
from __future__ import annotations

from typing import Any

from cost_model.compute import ComputeModel
from cost_model.memory import DDP_BUCKET_BYTES
from hardware_profiles.schema import UNFUSED_ATTENTION
from planner.plan import block_counts, recompute_counts


def step_assumptions(sp: Any, pk: float, adam_bytes: float) -> tuple[str, ...]:
    """The printed assumptions of `sp` (a `cost_model.step.StepPredictor`) at peak `pk` FLOP/s; `adam_bytes`: the
    Adam update's bytes per parameter when the profile has no measured AdamW cost."""
    plan, cl, g = sp.plan, sp.cm.cluster, sp.groups
    zero = sp.zero
    mb = DDP_BUCKET_BYTES >> 20
    if sp.deferred:
        dp_how = ("all-reduced" if zero == 0 else "reduce-scattered") + " per FSDP2 unit after each chunk's last " \
            "backward (the pipelining stage defers them; exposed" \
            + ("; the interleaved schedule's mid-schedule ones hold the rank's later passes)" if sp.v > 1 else ")")
    else:
        dp_how = {0: f"all-reduced in {mb} MiB buckets (DDP) during the last backward" if sp.tp == 1 else
                     "all-reduced per block (replicate) during the last backward",
                  1: "reduce-scattered per block during the last micro-batch's backward",
                  2: "reduce-scattered per block in every micro-batch's backward",
                  3: "reduce-scattered per block in every micro-batch's backward"}[zero]
    gathers = {0: "", 1: "; parameters all-gathered once per step in the first forward",
               2: "; parameters all-gathered once per step in the first forward",
               3: "; parameters all-gathered per block before its forward and its backward in every micro-batch "
                  "(prefetched one block ahead)"}[zero]
    if sp.unshard_ready() is not None:
        gathers = "; parameters all-gathered once per step, each stage's from the step's start (the interleaved " \
            "schedule's UNSHARD prefetch; a stage's first forward waits for its own)"
    if zero >= 1:
        gathers += "; FSDP2's copies around each gather and reduce-scatter at their bytes"
    dp_how = f"fp32 gradients {dp_how}{gathers}" + (
        "; collectives share the ranks' cores with compute (gloo on CPU): serialised, none hidden"
        if sp.serial else f"; overlapped compute {sp.slow:.1%} slower (NCCL contention)" if sp.slow else "")
    out = [
        _compute_assumption(cl.device, plan.precision, pk),
        f"tp={sp.tp}: collectives on the critical path over {g['tp'].nodes} node(s); one input-gradient "
        "all-reduce per tensor read by several column-parallel linears (as a fused QKV); a gather or scatter on a "
        "dim other than 0 also copies the whole tensor (DTensor's functional collectives)",
        *(["ranks sharing the host's cores arrive apart: every blocking collective also waits the profile's "
           "measured sync_wait for the compute since the ranks last met"] if cl.device.sync_wait else []),
        (f"dp={sp.dp}, ZeRO-{zero}: {dp_how}" + (
            "; DDP's measured reducer cost per step, parameter tensor and gradient byte"
            if zero == 0 and sp.tp == 1 and not sp.deferred and sp.ddp_reducer(0) > 0 else "") + (
            "; FSDP2's measured cost per fully_shard'ed module and parameter tensor"
            if zero >= 1 and (cl.device.op_overhead.fsdp_module or cl.device.op_overhead.fsdp_module_reshard)
            else "")) if sp.dp > 1 else "dp=1: no gradient reduction",
        f"pp={sp.pp}, schedule {plan.schedule}" + (f" with v={sp.v}" if sp.v > 1 else "")
        + f", {sp.m} micro-batches of {plan.microbatch_size}; stage-boundary send/recv "
          f"{sp.p2p_s * 1e6:.1f} us" + (" over the network" if g["pp"].nodes > 1 else "")
        + (" (1F1B waits for each send: on the sending pass)" if plan.schedule == "1f1b" else "")
        + ("; tied first/last-stage weight gradients all-reduced before the optimizer"
           if sp.tied_all_reduce() else ""),
        "communication: ring alpha-beta formulas (NCCL ring latency model); across nodes one ring whose members "
        "share their node's NICs; measured curves in the profile take precedence",
        "dp and tp streams do not contend for links; tp collectives are not overlapped with compute; "
        + ("every tensor in fp32 (no autocast)" if plan.precision not in ("bf16", "fp16") else
           f"under {plan.precision} autocast each tensor in the dtype autocast gives it ("
           + ("losses in fp32 (CPU autocast's list)" if cl.cpu_ranks else "norms, softmax, losses, pow/rsqrt in fp32")
           + "; linears, matmuls, SDPA in the autocast dtype after a cast of each fp32 input; the rest in the widest "
           "input dtype: fp32 parameters give an fp32 residual stream)")
        + ("; a cross-entropy over a column-parallel head runs vocabulary-parallel (no logits all-gather)"
           if sp.tp > 1 else ""),
        ("optimizer: AdamW over the local shard at the profile's measured cost per element and per tensor"
         if "adamw" in cl.device.kernel_costs else
         f"optimizer: Adam over the local shard, memory-bound ({adam_bytes:.0f} "
         "bytes per parameter)")
        + (f"; gradients clipped to norm {plan.max_grad_norm:g} first (a norm and a multiply over the local "
           "gradients at their bytes, one scalar all-reduce over every rank, NCCL's LL protocol where it runs)"
           if plan.max_grad_norm > 0 else ""),
        f"activations: the traced graph's saved tensors at {plan.precision}"
        + (" or fp32 as autocast gives them" if plan.precision in ("bf16", "fp16") else "")
        + " (masks 1 byte" + ("; each op that casts a shared input keeps its own copy; autocast's 16-bit weight "
                              "copies outside checkpointed blocks" if plan.precision in ("bf16", "fp16") else "")
        + "), recompute "
        f"{plan.recompute}"
        + (" (each SDPA call re-run on its own in backward: its internals are not kept)"
           if plan.recompute == "attention" else "")
        + ((f", full on the first blocks of each stage [{block_counts(plan)}]" if plan.recompute == "selective"
            else f" on the first blocks of each stage only {recompute_counts(plan)}") if plan.recompute_blocks
           else "")
        + ", sequence parallel "
        + ("on (outside checkpointed blocks gathered inputs are saved as their shard, gathered again in "
           "backward)" if plan.sequence_parallel else "off") + "; in-flight "
        f"micro-batches per {plan.schedule}" + (
            ("; the measured host cost of each SDPA call's re-run and of every op under the function mode"
             if plan.recompute == "attention" else "; checkpointing's measured host cost per op of a checkpointed "
             "block") if plan.recompute != "none" and _checkpoint_priced(cl.device.op_overhead, plan.recompute)
            else ""),
        f"memory: usable {cl.device.usable_memory_fraction:.0%} of {cl.device.memory_bytes / 2**30:.0f} GiB "
        "per device (the profile's allocator headroom)",
    ]
    return tuple(out)


def _checkpoint_priced(ov, recompute: str) -> bool:
    """Whether the profile has checkpointing's measured per-op host cost for this recompute policy."""
    if recompute == "attention":
        return bool(ov.checkpoint_call_forward or ov.checkpoint_call_backward or ov.function_mode_op)
    key = "sac" if recompute == "selective" else "checkpoint"
    return any(getattr(ov, f"{key}_{k}") for k in ("forward", "backward", "linear_forward", "linear_backward"))


def _compute_assumption(dev, precision: str, peak: float) -> str:
    """The compute line of the printed assumptions: which of the profile's compute terms priced this plan."""
    rate = f"{peak / 1e12:.0f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.0f} GFLOP/s"
    parts = [f"compute: per op at {precision} (peak {rate}, {dev.memory_bandwidth / 1e9:.0f} GB/s)"]
    if dev.matmul is not None and dev.sms:
        parts.append(f"GEMMs by (M, N, K) after sharding: tile and wave quantization on {dev.sms} SMs x "
                     f"{dev.matmul.best_efficiency:.1%} best efficiency"
                     + (f" x K/(K + {dev.matmul.k_overhead:.0f})" if dev.matmul.k_overhead else "")
                     + (f" ({dev.matmul.unaligned_efficiency:.0%} with a dimension not a multiple of 16 bytes)"
                        if dev.matmul.unaligned_efficiency is not None else "")
                     + "; K split when the output tiles do not fill a wave (weight gradients)")
    else:
        parts.append("GEMMs by the profile's efficiency curves by size")
    if dev.matmul_shapes or dev.attention_shapes or dev.norm_shapes or dev.reduce_shapes:
        parts.append("the model's own measured GEMM/attention/norm/bias-gradient shapes first")
    if not ComputeModel(dev).linear_curves(precision):  # else nn.Linear's measured rates
        parts.append("a linear's bias gradient as one reduction over its output gradient")
    if dev.rates(precision) is not None:
        parts.append(f"linears, matmuls and elementwise kernels at the rates measured at {precision}")
    if dev.attention is not None and dev.attention.kernel == UNFUSED_ATTENTION:
        parts.append("SDPA unfused: batched GEMMs over the dense scores plus softmax (and dropout) passes")
    elif dev.attention is not None:
        parts.append("SDPA at the profile's attention kernel efficiency on its real (causal) work")
    parts.append("copies cost their bytes, views nothing")
    if dev.kernel_floor:
        parts.append(f"at least {dev.kernel_floor * 1e6:.1f} us per kernel")
    if dev.op_overhead.forward:
        parts.append("host dispatch per op " + ("overlapped with kernels (max per layer)" if dev.async_host
                                                else "added to the kernels"))
    if set(dev.kernel_costs) - {"adamw"}:
        parts.append("measured elementwise kernel costs")
    return "; ".join(parts)

