"""`plan export PLAN --to torchtitan|megatron|deepspeed|accelerate`: a plan as the trainer's own configuration.

Each target gets the options a plan decides (mesh, ZeRO stage, micro-batching, recomputation, schedule, stages,
precision, batch) in its own format, with what it cannot express stated as comments in the file (TOML, YAML, bash)
or as notes printed beside it (JSON has no comments). Option names are checked against each project's source:

- torchtitan: the job TOML read by `torchtitan/config/job_config.py` (v0.2 series; sections [parallelism],
  [training], [activation_checkpoint]; schedule names from torch.distributed.pipelining's `get_schedule_class`);
- Megatron-LM: the flags of `megatron/training/arguments.py` (NVIDIA/Megatron-LM main, 2025), written as a bash
  array in the style of Megatron's own example scripts;
- DeepSpeed: the config JSON (`train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`,
  `zero_optimization.stage`, `bf16`/`fp16`, `activation_checkpointing`) of DeepSpeed's configuration docs;
- Accelerate: the `accelerate launch --config_file` YAML (`commands/config/config_args.py`, FSDP plugin keys of
  `commands/launch.py`, accelerate 1.x with FSDP2).

When a difference matters the export refuses with one line (PlanError: exit 2). "Matters" follows the rule that a
plan runs as written and was chosen because it fits: the export refuses when the target would run

1. another device layout: a parallelism it lacks (tp for DeepSpeed and Accelerate, pp for DeepSpeed and
   Accelerate), pipeline stages it cannot place as the plan cuts them (Megatron: a non-block layer between blocks),
   or a tensor-parallel layout other than the plan's (Megatron and torchtitan split every Linear of a block, the
   vocabulary embedding and the LM head; a plan that replicates one of them is refused);
2. more memory per device than the plan predicts because of the strategy: less sharding of model states (ZeRO-2/3
   through Megatron-FSDP together with pp, which its guide does not cover) or less recomputation (Megatron-LM's
   `--recompute-granularity selective` re-runs only the attention core and keeps every linear's output, where the
   plan's selective recomputation is torchtitan's op-level policy, which keeps only every other one; the plan's
   `attention` recomputation is Megatron-LM's selective);
3. more compute than planned: selective or attention-only recomputation where the target only recomputes whole
   blocks (DeepSpeed's selective, Accelerate) or has no attention-only policy (torchtitan), and full recomputation
   of more blocks than the plan's per-stage counts (torchtitan and Accelerate wrap every block; Megatron-LM takes
   one count for every stage);
4. other training math: a precision the target lacks (fp16 in torchtitan).

It exports with a note when the target runs the same mesh, stages, tp layout, precision and recomputation, holds
no more memory, and differs only in how or when the same collectives run: ZeRO-1 run with ZeRO-2's gradient
sharding (torchtitan, Accelerate: FSDP has no ZeRO-1), plain DP run as FSDP where torchtitan has no DDP beside
tp/pp, GPipe run as 1F1B (Megatron: same bubble, fewer activations held), sequence parallelism always on
(torchtitan), and recomputation the DeepSpeed JSON cannot switch on. Gradients are accumulated and reduced in
fp32, as shardwise's executor does: the exports set it where the trainer would otherwise use the low precision
(DeepSpeed's `communication_data_type`, Megatron-LM's `--accumulate-allreduce-grads-in-fp32` under fp16) and say
so where only code can (Accelerate's FSDP2 plugin). A tp plan's loss is vocabulary-parallel in all of them.

Megatron-LM and torchtitan train transformer language models: a model without a token embedding is refused.

The model file the plan names (or `--model`) is read when it exists, on the meta device: it tells blocks from other
modules, gives the block class (Accelerate's wrap policy), the sequence length and the Linears a tp layout must
split. Without it (missing, or failing to import here) the export still runs for tp=1 and guesses blocks from
module paths (`h.3`); tp>1 to Megatron or torchtitan then refuses, since the layout cannot be checked. The model
facts and the refusals every target shares live in `planner.export_checks`; this module writes each target.
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Sequence

from planner.errors import PlanError
from planner.export_checks import (ModelFacts, check_stage_ranks, model_facts, recompute_count, refuse_tp_layout,
                                   require_language_model, stage_blocks)
from planner.plan import Plan, block_counts, recompute_counts

TARGETS = ("torchtitan", "megatron", "deepspeed", "accelerate")
"""Frameworks `plan export` writes for."""
TT_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
"""Plan schedule -> torch.distributed.pipelining schedule name (what torchtitan's pipeline_parallel_schedule takes)."""


@dataclass(frozen=True)
class Export:
    """One target's configuration text and what it could not express."""

    text: str
    """The file's content."""
    notes: tuple[str, ...]
    """What the target runs differently from the plan."""
    commented: bool = True
    """Whether `text` carries the notes as comments (JSON cannot)."""


def export(plan: Plan, target: str, facts: ModelFacts | None = None) -> Export:
    """The plan as `target`'s configuration; raises PlanError when the difference matters (module docstring)."""
    if target not in TARGETS:
        raise PlanError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    if facts is not None and plan.model.get("fingerprint") and plan.model["fingerprint"] != facts.fingerprint:
        raise PlanError(f"{facts.path} is not the model this plan was made for (parameter names/shapes differ); "
                        "pass the right file with --model")
    exporters = {"torchtitan": to_torchtitan, "megatron": to_megatron, "deepspeed": to_deepspeed,
                 "accelerate": to_accelerate}
    try:
        return exporters[target](plan, facts)
    except PlanError as e:
        # a refusal's "or export to X" names only the other targets that take this very plan
        others = []
        for name, other in exporters.items():
            if name != target:
                try:
                    other(plan, facts)
                    others.append(name)
                except PlanError:
                    pass
        said = re.sub(r" or export to [a-z/]+", f" or export to {'/'.join(others)}" if others else "", str(e))
        raise PlanError(said) from None


# ---- the plan in one line (every header) -----------------------------------------------------------------------

def describe(plan: Plan) -> str:
    """One line naming the plan's configuration."""
    m = plan.mesh
    sched = f" schedule={plan.schedule}" + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
    return (f"dp={m.dp} tp={m.tp} pp={m.pp} zero={plan.zero_stage} mbs={plan.microbatch_size} x "
            f"{plan.num_microbatches} micro-batches (global batch {plan.global_batch_size}) "
            f"recompute={plan.recompute}{recompute_counts(plan)}{sched if m.pp > 1 else ''} "
            f"sp={int(plan.sequence_parallel)} "
            f"{plan.precision}" + (f" max_grad_norm={plan.max_grad_norm:g}" if plan.max_grad_norm > 0 else ""))


# ---- torchtitan ------------------------------------------------------------------------------------------------

def to_torchtitan(plan: Plan, facts: ModelFacts | None) -> Export:
    """The job TOML's [parallelism], [training] and [activation_checkpoint] keys."""
    m, notes = plan.mesh, []
    require_language_model(facts, "torchtitan")
    refuse_tp_layout(plan, facts, "torchtitan")
    if plan.precision == "fp16":
        raise PlanError("cannot export to torchtitan: it trains in bfloat16 or float32 only "
                        "(training.mixed_precision_param); re-plan with --precision bf16")
    check_stage_ranks(plan, "torchtitan")
    par = _torchtitan_data_parallel(plan, notes)
    par.update(tensor_parallel_degree=m.tp, enable_async_tensor_parallel=False)
    if m.tp > 1:
        par["disable_loss_parallel"] = False  # the executor's loss is vocabulary-parallel too (loss_parallel)
        if not plan.sequence_parallel:
            notes.append("torchtitan always runs sequence parallelism with tp: norms run on sequence shards "
                         "(less activation memory; reduce-scatter + all-gather instead of all-reduce, same bytes)")
    par["pipeline_parallel_degree"] = m.pp
    train: dict[str, object] = {"global_batch_size": plan.global_batch_size}
    if m.pp > 1:
        par.update(pipeline_parallel_schedule=TT_SCHEDULES[plan.schedule],
                   pipeline_parallel_microbatch_size=plan.microbatch_size)
        if plan.stages:
            par["module_fqns_per_model_part"] = [list(s.modules) for s in plan.stages]
            notes.append("module_fqns_per_model_part names the plan's model modules; they must be the module "
                         "paths of the model torchtitan trains")
        else:
            notes.append("the plan names no stages: torchtitan splits the layers itself")
        train["local_batch_size"] = plan.microbatch_size * plan.num_microbatches
    else:
        train["local_batch_size"] = plan.microbatch_size
    seq = facts.seq_len if facts is not None else None
    if seq is not None:
        train["seq_len"] = seq
    else:
        why = "the model file was not read" if facts is None else "the model's sample_batch has no 2-D token input"
        notes.append(f"seq_len is left out: {why}; set it to the length the plan was made for")
    train.update(mixed_precision_param="float32" if plan.precision == "fp32" else "bfloat16",
                 mixed_precision_reduce="float32")
    if plan.max_grad_norm > 0:
        train["max_norm"] = plan.max_grad_norm
    else:
        notes.append("torchtitan clips every step to training.max_norm (default 1.0) and the plan does not clip: "
                     "set max_norm above any gradient norm, or re-plan with --max-grad-norm")
    if plan.recompute == "attention":
        raise PlanError("cannot export to torchtitan: its activation checkpointing has no attention-only policy "
                        "(its selective one also re-runs every other linear); re-plan with --force "
                        "recompute=selective (or none, full) or export to megatron")
    if plan.recompute == "selective" and plan.recompute_blocks:
        raise PlanError("cannot export to torchtitan: its activation checkpointing runs one mode on every block, and "
                        f"the plan runs full recomputation on the first blocks of each stage "
                        f"[{block_counts(plan)}] and selective on the others; re-plan with --force "
                        "recompute=selective (or full), or run the plan with shardwise's executor")
    ac: dict[str, object] = {"mode": plan.recompute}
    recompute_count(plan, facts, "torchtitan", uniform=False)  # its full mode wraps every block
    if plan.recompute == "selective":
        ac["selective_ac_option"] = "op"  # torchtitan's op-level policy: the executor's selective recomputation
    head = [f"torchtitan job config for a shardwise plan: {describe(plan)}",
            "keys of torchtitan/config/job_config.py (v0.2); merge into your job TOML",
            f"launch {m.world_size} ranks (e.g. NGPU={m.world_size} ./run_train.sh)"]
    text = "".join(f"# {line}\n" for line in head + [f"note: {n}" for n in notes])
    for name, table in (("parallelism", par), ("training", train), ("activation_checkpoint", ac)):
        text += f"\n[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in table.items())
    return Export(text, tuple(notes))


def _torchtitan_data_parallel(plan: Plan, notes: list[str]) -> dict[str, object]:
    """DDP for ZeRO-0 without tp/pp; FSDP2 otherwise (ZeRO-3 reshards after forward, ZeRO-0/1/2 do not)."""
    m = plan.mesh
    if plan.zero_stage == 0 and m.tp == 1 and m.pp == 1:
        return {"data_parallel_replicate_degree": m.dp, "data_parallel_shard_degree": 1}
    if plan.zero_stage == 0 and m.dp > 1:
        notes.append("plain data parallelism runs as FSDP without resharding (ZeRO-2): torchtitan's DDP does not "
                     "compose with tp/pp; gradients are reduce-scattered and parameters all-gathered (the "
                     "all-reduce's bytes) and less memory is held")
    if plan.zero_stage == 1 and m.dp > 1:
        notes.append("ZeRO-1 runs as FSDP without resharding (ZeRO-2): torchtitan has no ZeRO-1; gradients are "
                     "sharded too, so less memory is held than planned")
    return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": m.dp,
            "fsdp_reshard_after_forward": "always" if plan.zero_stage == 3 else "never"}


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


# ---- Megatron-LM -----------------------------------------------------------------------------------------------

def to_megatron(plan: Plan, facts: ModelFacts | None) -> Export:
    """Megatron-LM command-line flags, as a bash array `SHARDWISE_ARGS=( ... )`."""
    m, notes = plan.mesh, []
    require_language_model(facts, "Megatron-LM")
    refuse_tp_layout(plan, facts, "Megatron-LM")
    flags: list[tuple[str, object]] = [("--tensor-model-parallel-size", m.tp),
                                       ("--pipeline-model-parallel-size", m.pp)]
    flags += _megatron_pipeline(plan, facts, notes)
    if plan.sequence_parallel and m.tp > 1:
        flags.append(("--sequence-parallel", None))
    flags += [("--micro-batch-size", plan.microbatch_size), ("--global-batch-size", plan.global_batch_size)]
    flags += _megatron_zero(plan)
    if m.dp > 1:
        flags.append(("--overlap-grad-reduce", None))
    if plan.recompute == "selective":
        raise PlanError("cannot export to Megatron-LM: its selective recomputation re-runs only the attention core "
                        "and keeps every linear's output, more memory than the plan's op-level policy (every other "
                        "linear kept); re-plan with --force recompute=attention (Megatron-LM's selective), full or "
                        "none, or export to torchtitan")
    # Megatron-LM's block method re-runs the first N layers of every pipeline stage (model chunk): one N
    n = recompute_count(plan, facts, "Megatron-LM", uniform=True)
    if n is not None:
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "block"), ("--recompute-num-layers", n)]
    elif plan.recompute == "full":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                  ("--recompute-num-layers", 1)]
    elif plan.recompute == "attention":  # Megatron-Core's selective re-runs the core attention (core_attn)
        flags.append(("--recompute-granularity", "selective"))
    if plan.precision != "fp32":
        flags.append((f"--{plan.precision}", None))
    if plan.precision == "fp16":  # bf16 turns it on itself (arguments.py); the plan reduces gradients in fp32
        flags.append(("--accumulate-allreduce-grads-in-fp32", None))
    flags.append(("--clip-grad", plan.max_grad_norm))  # Megatron-LM clips to 1.0 unless told; 0: no clipping
    if facts is not None and facts.seq_len is not None:
        flags.append(("--seq-length", facts.seq_len))
    head = [f"Megatron-LM flags for a shardwise plan: {describe(plan)}",
            "flag names of megatron/training/arguments.py; add your model, data and optimizer flags:",
            f'  torchrun --nproc-per-node ... pretrain_gpt.py "${{SHARDWISE_ARGS[@]}}" ...  ({m.world_size} ranks)']
    text = "".join(f"# {line}\n" for line in head + [f"note: {n}" for n in notes])
    text += "SHARDWISE_ARGS=(\n" + "".join(
        f"    {flag}\n" if value is None else f"    {flag} {value}\n" for flag, value in flags) + ")\n"
    return Export(text, tuple(notes))


def _megatron_pipeline(plan: Plan, facts: ModelFacts | None, notes: list[str]) -> list[tuple[str, object]]:
    """Stage flags: equal blocks per stage -> layers per virtual stage; otherwise an explicit layout."""
    m = plan.mesh
    if not plan.stages:
        if m.pp > 1:
            notes.append("the plan names no stages: Megatron-LM splits the transformer layers evenly")
        return []
    check_stage_ranks(plan, "Megatron-LM")
    counts, between = stage_blocks(plan, facts)
    total = sum(counts)
    out: list[tuple[str, object]] = [("--num-layers", total)] if total else []
    if m.pp == 1:
        return out
    if between:
        raise PlanError("cannot export to Megatron-LM: the plan's model has layers between its blocks, which a "
                        "Megatron pipeline layout (embedding, transformer layers, loss) cannot place; export to "
                        "torchtitan or re-plan with --force pp=1")
    if plan.schedule == "gpipe":
        notes.append("Megatron-LM has no GPipe schedule: it runs 1F1B (same bubble, fewer micro-batches' "
                     "activations held than planned)")
    if len(set(counts)) == 1 and counts[0] > 0:
        if plan.virtual_stages > 1:
            out.append(("--num-layers-per-virtual-pipeline-stage", counts[0]))
        return out
    layout = "|".join(("E" if i == 0 else "") + "t" * c + ("L" if i == len(counts) - 1 else "")
                      for i, c in enumerate(counts))
    notes.append(f"unequal stages ({', '.join(map(str, counts))} transformer layers) need a Megatron-LM with "
                 "--pipeline-model-parallel-layout")
    return out + [("--pipeline-model-parallel-layout", f'"{layout}"')]


def _megatron_zero(plan: Plan) -> list[tuple[str, object]]:
    """ZeRO-1: the distributed optimizer; ZeRO-2/3: Megatron-FSDP (its user guide's required flags)."""
    if plan.mesh.dp == 1 or plan.zero_stage == 0:
        return []
    if plan.zero_stage == 1:
        return [("--use-distributed-optimizer", None)]
    if plan.mesh.pp > 1:
        raise PlanError(f"cannot export to Megatron-LM: ZeRO-{plan.zero_stage} needs Megatron-FSDP, whose guide "
                        "covers no pipeline parallelism, and the distributed optimizer (ZeRO-1) would hold more "
                        "memory than planned; re-plan with --force zero=1 or export to torchtitan")
    strategy = "optim_grads" if plan.zero_stage == 2 else "optim_grads_params"
    return [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", strategy),
            ("--use-distributed-optimizer", None), ("--no-gradient-accumulation-fusion", None),
            ("--ckpt-format", "fsdp_dtensor")]


# ---- DeepSpeed -------------------------------------------------------------------------------------------------

def to_deepspeed(plan: Plan, facts: ModelFacts | None) -> Export:
    """The DeepSpeed config JSON (ZeRO is DeepSpeed's data parallelism; notes go beside it, JSON has no comments)."""
    m, notes = plan.mesh, []
    if m.tp > 1:
        raise PlanError(f"cannot export to DeepSpeed: tp={m.tp} has no DeepSpeed config for an arbitrary model "
                        "(AutoTP derives its own layout for Hugging Face models); re-plan with --force tp=1 or "
                        "export to megatron/torchtitan")
    if m.pp > 1:
        raise PlanError(f"cannot export to DeepSpeed: pp={m.pp} needs the model rewritten as a "
                        "deepspeed.pipe.PipelineModule, which a config cannot do; re-plan with --force pp=1 or "
                        "export to megatron/torchtitan")
    if plan.recompute == "selective":
        raise PlanError("cannot export to DeepSpeed: it recomputes whole checkpointed blocks only, no selective "
                        "recomputation; re-plan with --force recompute=full (or none) or export to "
                        "megatron/torchtitan")
    config: dict[str, object] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.microbatch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "gradient_clipping": plan.max_grad_norm,
        "zero_optimization": {"stage": plan.zero_stage, "overlap_comm": True, "contiguous_gradients": True},
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"} | ({"loss_scale": 0} if plan.precision == "fp16" else {}),
    }
    if plan.precision != "fp32":  # DeepSpeed reduces in the training dtype unless told; the plan reduces in fp32
        config.update(communication_data_type="fp32", data_types={"grad_accum_dtype": "fp32"})
    if plan.recompute == "full":
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False}
        n = recompute_count(plan, facts, "DeepSpeed", uniform=True)
        which = f"the first {n} blocks" if n is not None else "each block"
        notes.append("recompute=full: DeepSpeed recomputes only what the model wraps; call "
                     f"deepspeed.checkpointing.checkpoint (or torch.utils.checkpoint) on {which}")
    elif plan.recompute == "attention":
        notes.append("recompute=attention: DeepSpeed recomputes only what the model wraps; call "
                     "torch.utils.checkpoint.checkpoint on each F.scaled_dot_product_attention call of the blocks")
    notes.append(f"launch {m.world_size} ranks: DeepSpeed checks train_batch_size = micro-batch x accumulation "
                 "x data-parallel ranks")
    return Export(json.dumps(config, indent=2) + "\n", tuple(notes), commented=False)


# ---- Accelerate ------------------------------------------------------------------------------------------------

def to_accelerate(plan: Plan, facts: ModelFacts | None) -> Export:
    """The `accelerate launch --config_file` YAML: FSDP2 for ZeRO 1-3, multi-GPU DDP for ZeRO 0."""
    m, notes = plan.mesh, []
    if m.tp > 1 or m.pp > 1:
        axis = f"tp={m.tp}" if m.tp > 1 else f"pp={m.pp}"
        raise PlanError(f"cannot export to Accelerate: {axis} is not an FSDP/DDP option (Accelerate's tensor "
                        "parallelism applies a Hugging Face model's own tp plan; it has no pipeline schedule); "
                        "re-plan with --force tp=1,pp=1 or export to megatron/torchtitan")
    if plan.recompute in ("selective", "attention"):
        raise PlanError(f"cannot export to Accelerate: fsdp_activation_checkpointing recomputes whole blocks, no "
                        f"{plan.recompute} recomputation; re-plan with --force recompute=full (or none) or export to "
                        "megatron/torchtitan")
    nodes = int(plan.cluster.get("nodes", 1)) if plan.cluster else 1
    # 'no' is quoted: YAML 1.1 reads a bare no as false
    lines = ["compute_environment: LOCAL_MACHINE",
             f"distributed_type: {'FSDP' if plan.zero_stage else 'MULTI_GPU'}",
             f"mixed_precision: {repr('no') if plan.precision == 'fp32' else plan.precision}",
             f"num_processes: {m.world_size}", f"num_machines: {nodes}", "machine_rank: 0",
             "main_training_function: main", "rdzv_backend: static", "same_network: true", "use_cpu: false"]
    if nodes > 1:  # every node needs the rank-0 node's address and its own rank; a placeholder fails loudly
        lines += ["main_process_ip: MAIN_NODE_ADDRESS", "main_process_port: 29500"]
        notes.append(f"{nodes} machines: set main_process_ip to the rank-0 node's address, and on node N launch "
                     "with --machine_rank N")
    if plan.zero_stage:
        if plan.zero_stage == 1:
            notes.append("ZeRO-1 runs as FSDP2 without resharding (ZeRO-2): FSDP has no ZeRO-1; gradients are "
                         "sharded too, so less memory is held than planned")
        cls = ",".join(facts.block_classes) if facts is not None and facts.block_classes else None
        fsdp = ["fsdp_version: 2", f"fsdp_reshard_after_forward: {'true' if plan.zero_stage == 3 else 'false'}",
                "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"]
        if cls:
            fsdp.append(f"fsdp_transformer_layer_cls_to_wrap: {cls}")
        else:
            notes.append("fsdp_transformer_layer_cls_to_wrap is left out (model file not read): Accelerate then "
                         "wraps the classes in the model's _no_split_modules")
        recompute_count(plan, facts, "Accelerate", uniform=False)  # fsdp_activation_checkpointing: every block
        if plan.precision != "fp32":
            notes.append(f"Accelerate's FSDP2 reduces gradients in {plan.precision} unless its plugin says "
                         "otherwise, which no config key does; the plan reduces them in fp32: pass "
                         "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, "
                         "mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch."
                         f"{'bfloat16' if plan.precision == 'bf16' else 'float16'}, reduce_dtype=torch.float32)))")
        fsdp += [f"fsdp_activation_checkpointing: {'true' if plan.recompute == 'full' else 'false'}",
                 "fsdp_offload_params: false", "fsdp_state_dict_type: SHARDED_STATE_DICT"]
        lines += ["fsdp_config:"] + [f"  {x}" for x in fsdp]
    elif plan.recompute == "full":
        n = recompute_count(plan, facts, "Accelerate", uniform=True)
        which = f"the first {n} blocks" if n is not None else "each block"
        notes.append(f"recompute=full under DDP: wrap {which} with torch.utils.checkpoint in the model")
    notes.append(f"micro-batching is set in your script: DataLoader(batch_size={plan.microbatch_size}) and "
                 f"Accelerator(gradient_accumulation_steps={plan.num_microbatches})")
    if plan.max_grad_norm > 0:
        notes.append("gradient clipping is set in your script: accelerator.clip_grad_norm_(model.parameters(), "
                     f"{plan.max_grad_norm:g}) before optimizer.step(), when accelerator.sync_gradients")
    head = [f"Accelerate config for a shardwise plan: {describe(plan)}",
            "keys of accelerate's config_args.py / launch.py (accelerate 1.x, FSDP2);"
            " run: accelerate launch --config_file THIS.yaml train.py"]
    text = "".join(f"# {line}\n" for line in head + [f"note: {n}" for n in notes])
    return Export(text + "\n".join(lines) + "\n", tuple(notes))


# ---- the command -----------------------------------------------------------------------------------------------

def _parser():
    from planner.cli import ArgParser
    p = ArgParser(prog="plan export", description=(
        "Write a plan.json as a trainer's own configuration: torchtitan (job TOML keys), megatron (Megatron-LM "
        "flags as a bash array), deepspeed (config JSON) or accelerate (accelerate launch YAML with FSDP2). What "
        "the trainer cannot express is written as comments (or printed as notes); when the difference would make "
        "the run use more memory, more compute or another layout than the plan, export refuses (exit 2)."),
        epilog="example: plan export plan.json --to megatron -o megatron_args.sh")
    p.add_argument("plan", help="plan.json written by `plan ... -o`")
    p.add_argument("--to", required=True, choices=TARGETS, help="the trainer to write for")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) instead of to stdout")
    p.add_argument("--model", metavar="MODEL.py",
                   help="the model file (default: the one the plan names, if it exists); gives the sequence "
                        "length, the block class and the Linears a tp layout must split")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`plan export`; returns the exit status (user errors raise PlanError / ModelError for the CLI to print)."""
    import os

    from planner.errors import ModelError
    from planner.plan import check_output, write_atomic
    args = _parser().parse_args(argv)
    if args.output is not None:
        check_output(args.output, "-o", inputs=[args.plan, args.model])
    plan = Plan.load(args.plan)
    facts, path = None, plan.model.get("path")
    if args.output is not None and not args.model:  # the model file the plan names is read too
        check_output(args.output, "-o", inputs=[path])
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the export alone: what the model file prints goes aside
        if args.model:
            facts = model_facts(args.model)
        elif path and os.path.exists(path):
            try:
                facts = model_facts(path)
            except ModelError as e:  # the plan's own reference: export without it, and say so
                print(f"note: the plan's model file was not read ({e}); pass --model to use it", file=sys.stderr)
        elif path:
            print(f"note: the plan's model file {path} does not exist, so the export has no sequence length, "
                  "block class or Linears from it; pass --model MODEL.py", file=sys.stderr)
    out = export(plan, args.to, facts)
    if args.output:
        write_atomic(args.output, out.text)  # PlanError (one line) when the path cannot be written
    else:
        sys.stdout.write(out.text)
    if args.output or not out.commented:  # on stdout the comments already say it
        for note in out.notes:
            print(f"note: {note}", file=sys.stderr)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
