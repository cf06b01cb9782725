"""`plan export`: every output parses in its own format (tomllib, a Megatron-style argparse, json, yaml) and says
what the plan says; the targets refuse what they cannot run as planned; the CLI fails with one line and exit 2."""
import argparse
import json
import os
import shlex
import tomllib

import pytest
import yaml

from planner.cli import main as cli
from planner.errors import PlanError
from planner.export import ModelFacts, export, model_facts
from planner.plan import Mesh, OpPlacement, Plan, StageSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Field names of torchtitan/config/job_config.py (v0.2): the sections an export writes.
TORCHTITAN_KEYS = {
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param",
                 "mixed_precision_reduce", "max_norm"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
}
# Top-level keys of accelerate's ClusterConfig (commands/config/config_args.py) an export may write.
ACCELERATE_KEYS = {"compute_environment", "distributed_type", "mixed_precision", "num_processes", "num_machines",
                   "machine_rank", "main_training_function", "rdzv_backend", "same_network", "use_cpu",
                   "fsdp_config", "main_process_ip", "main_process_port"}
DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "zero_optimization", "bf16", "fp16", "activation_checkpointing", "communication_data_type",
                  "data_types", "gradient_clipping"}


def megatron_args(text):
    """Parse the exported bash array with flags named as in megatron/training/arguments.py (unknown ones fail)."""
    body = text.split("SHARDWISE_ARGS=(", 1)[1].rsplit(")", 1)[0]
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        p.add_argument(flag, type=int, default=1)
    for flag in ("--num-layers", "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
                 "--global-batch-size", "--recompute-num-layers", "--seq-length"):
        p.add_argument(flag, type=int, default=None)
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp",
                 "--overlap-grad-reduce", "--bf16", "--fp16", "--accumulate-allreduce-grads-in-fp32"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    p.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    p.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"])
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    return p.parse_args(shlex.split(body, comments=True))


# ---- a 4-block GPT (examples/gpt.py's module names) ------------------------------------------------------------

BLOCK_LINEARS = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                 "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
FACTS = ModelFacts(path="gpt.py", fingerprint="f00d", blocks=tuple(f"h.{i}" for i in range(4)),
                   block_classes=("Block",),
                   block_linears=tuple(f"h.{i}.{n}" for i in range(4) for n in BLOCK_LINEARS),
                   embeddings=(("wte", 50304), ("wpe", 1024)), head="lm_head", seq_len=1024)


def megatron_ops(skip=()):
    ops = {f"h_{i}_{n}": OpPlacement(strategy=s, module=f"h.{i}.{n}")
           for i in range(4) for n, s in BLOCK_LINEARS.items() if n not in skip}
    ops["wte"] = OpPlacement(strategy="vocab", module="wte")
    ops["lm_head"] = OpPlacement(strategy="colwise", module="lm_head")
    return ops


def stages(counts, v=1, pp=None):
    """Stages holding `counts` blocks each, embeddings on the first and ln_f/lm_head on the last."""
    pp = pp or len(counts) // v
    out, start = [], 0
    for k, c in enumerate(counts):
        mods = (["wte", "wpe"] if k == 0 else []) + [f"h.{start + j}" for j in range(c)]
        mods += ["ln_f", "lm_head"] if k == len(counts) - 1 else []
        out.append(StageSpec(start_layer=start, end_layer=start + c, modules=tuple(mods), rank=k % pp))
        start += c
    return tuple(out)


def plan(dp=8, tp=1, pp=1, v=1, zero=1, mbs=2, m=4, **kw):
    base = dict(mesh=Mesh(dp=dp, tp=tp, pp=pp), zero_stage=zero, virtual_stages=v,
                schedule="interleaved" if v > 1 else "1f1b", global_batch_size=dp * mbs * m,
                microbatch_size=mbs, num_microbatches=m, precision="bf16",
                stages=stages([4 // (pp * v)] * (pp * v), v=v, pp=pp),
                ops=megatron_ops() if tp > 1 else {}, cluster={"name": "x", "nodes": dp * tp * pp // 8 or 1,
                                                               "devices_per_node": 8})
    base.update(kw)
    return Plan(**base)


# ---- each format parses and says what the plan says ------------------------------------------------------------

@pytest.mark.parametrize("p", [plan(), plan(zero=3, recompute="full"), plan(dp=1, tp=4, pp=2, zero=0, mbs=1),
                               plan(dp=2, tp=2, pp=2, v=2, zero=2, recompute="full", sequence_parallel=True),
                               plan(dp=8, zero=0, precision="fp32")])
def test_torchtitan_toml(p):
    out = export(p, "torchtitan", FACTS)
    cfg = tomllib.loads(out.text)
    for section, keys in cfg.items():
        assert set(keys) <= TORCHTITAN_KEYS[section], section
    par, train = cfg["parallelism"], cfg["training"]
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert dp * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] == p.world_size
    assert (dp, par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (p.mesh.dp, p.mesh.tp, p.mesh.pp)
    assert train["global_batch_size"] == p.global_batch_size and train["seq_len"] == 1024
    if p.mesh.pp > 1:  # micro-batches are the pipeline's; no gradient accumulation
        assert train["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == p.num_microbatches
        assert par["pipeline_parallel_microbatch_size"] == p.microbatch_size
        assert train["global_batch_size"] == train["local_batch_size"] * dp
        assert [list(s.modules) for s in p.stages] == par["module_fqns_per_model_part"]
        assert par["pipeline_parallel_schedule"] == {"1f1b": "1F1B", "interleaved": "Interleaved1F1B"}[p.schedule]
    else:  # micro-batches are gradient accumulation steps
        assert train["local_batch_size"] == p.microbatch_size
        assert train["global_batch_size"] // (train["local_batch_size"] * dp) == p.num_microbatches
    if p.zero_stage == 3:
        assert par["fsdp_reshard_after_forward"] == "always" and par["data_parallel_shard_degree"] == p.mesh.dp
    assert cfg["activation_checkpoint"]["mode"] == p.recompute
    assert train["mixed_precision_param"] == {"bf16": "bfloat16", "fp32": "float32"}[p.precision]
    assert all(f"# note: {n}" in out.text for n in out.notes)


def test_torchtitan_says_what_it_changes():
    assert any("no ZeRO-1" in n for n in export(plan(zero=1), "torchtitan", FACTS).notes)
    notes = export(plan(dp=1, tp=2, pp=1, zero=0, sequence_parallel=False), "torchtitan", FACTS).notes
    assert any("sequence parallelism" in n for n in notes)
    ddp = tomllib.loads(export(plan(zero=0), "torchtitan", FACTS).text)["parallelism"]
    assert ddp["data_parallel_replicate_degree"] == 8 and ddp["data_parallel_shard_degree"] == 1


@pytest.mark.parametrize("p", [plan(), plan(zero=0, recompute="full", precision="fp16"),
                               plan(dp=2, tp=2, pp=2, v=2, zero=1, recompute="full", sequence_parallel=True),
                               plan(dp=8, zero=3), plan(dp=8, zero=2), plan(dp=1, tp=2, pp=4, zero=0, mbs=1)])
def test_megatron_flags(p):
    a = megatron_args(export(p, "megatron", FACTS).text)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (p.mesh.tp, p.mesh.pp)
    dp = p.world_size // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size)
    assert dp == p.mesh.dp and a.micro_batch_size == p.microbatch_size
    assert a.global_batch_size // (a.micro_batch_size * dp) == p.num_microbatches  # Megatron's micro-batch count
    assert a.num_layers == 4 and a.seq_length == 1024
    if p.virtual_stages > 1:
        assert a.num_layers // p.mesh.pp // a.num_layers_per_virtual_pipeline_stage == p.virtual_stages
    assert a.sequence_parallel == (p.sequence_parallel and p.mesh.tp > 1)
    assert a.use_distributed_optimizer == (p.zero_stage >= 1)
    assert a.data_parallel_sharding_strategy == {0: "no_shard", 1: "no_shard", 2: "optim_grads",
                                                 3: "optim_grads_params"}[p.zero_stage]
    assert a.recompute_granularity == (None if p.recompute == "none" else p.recompute)
    if p.recompute == "full":
        assert (a.recompute_method, a.recompute_num_layers) == ("uniform", 1)
    assert (a.bf16, a.fp16) == (p.precision == "bf16", p.precision == "fp16")


def test_megatron_needs_no_note_for_gradients_or_loss():
    # fp32 gradient reduction and a vocabulary-parallel loss: what shardwise's executor does too
    assert not export(plan(dp=4, tp=2), "megatron", FACTS).notes
    assert not export(plan(precision="fp32"), "megatron", FACTS).notes


def test_partial_recompute_exports_only_where_the_trainer_recomputes_as_planned():
    # Megatron-LM's block method re-runs the first N layers of every stage: exact for equal counts; uneven counts
    # would recompute more than planned on some stage, and torchtitan and Accelerate's FSDP wrap every block:
    # refused (more compute than planned), naming the forced count that exports; DeepSpeed and DDP are told which
    # blocks to wrap; counts that cover every block are plain full recomputation everywhere
    even = megatron_args(export(plan(dp=2, pp=2, recompute="full", recompute_blocks=(1, 1)), "megatron", FACTS).text)
    assert (even.recompute_granularity, even.recompute_method, even.recompute_num_layers) == ("full", "block", 1)
    with pytest.raises(PlanError, match=r"recompute_blocks=2 \(the same count"):
        export(plan(dp=2, pp=2, recompute="full", recompute_blocks=(2, 1)), "megatron", FACTS)
    one = plan(recompute="full", recompute_blocks=(3,))
    for target in ("torchtitan", "accelerate"):
        with pytest.raises(PlanError, match="would recompute every block.*recompute_blocks=4"):
            export(one, target, FACTS)
    assert any("the first 3 blocks" in n for n in export(one, "deepspeed", FACTS).notes)
    assert any("the first 3 blocks" in n for n in export(plan(zero=0, recompute="full", recompute_blocks=(3,)),
                                                           "accelerate", FACTS).notes)
    every = plan(dp=2, pp=2, recompute="full", recompute_blocks=(2, 2))
    titan = export(every, "torchtitan", FACTS)
    assert tomllib.loads(titan.text)["activation_checkpoint"] == {"mode": "full"}
    assert not any("recompute" in n for n in titan.notes)
    a = megatron_args(export(every, "megatron", FACTS).text)
    assert (a.recompute_method, a.recompute_num_layers) == ("uniform", 1)
    # selective with full recomputation of the first blocks of each stage: no trainer runs that mix
    hybrid = plan(dp=2, pp=2, recompute="selective", recompute_blocks=(1, 0))
    with pytest.raises(PlanError, match=r"torchtitan: .*full recomputation on the first blocks of each stage \[1/0\] "
                                        r"and selective on the others; re-plan with --force recompute=selective"):
        export(hybrid, "torchtitan", FACTS)
    for target in ("megatron", "deepspeed", "accelerate"):
        with pytest.raises(PlanError, match="selective"):
            export(plan(dp=2, recompute="selective", recompute_blocks=(1,)), target, FACTS)


def test_torchtitan_selective_is_the_executors_op_policy():
    ac = tomllib.loads(export(plan(recompute="selective"), "torchtitan", FACTS).text)["activation_checkpoint"]
    assert ac == {"mode": "selective", "selective_ac_option": "op"}


def test_attention_recompute_is_megatrons_selective():
    # recompute=attention re-runs only each SDPA call: Megatron-LM's --recompute-granularity selective (core
    # attention); DeepSpeed is told what to wrap; torchtitan and Accelerate have no such policy and refuse
    a = megatron_args(export(plan(recompute="attention"), "megatron", FACTS).text)
    assert a.recompute_granularity == "selective" and a.recompute_method is None
    ds = export(plan(recompute="attention"), "deepspeed", FACTS)
    assert any("scaled_dot_product_attention" in n for n in ds.notes)
    for target in ("torchtitan", "accelerate"):
        with pytest.raises(PlanError, match="attention"):
            export(plan(recompute="attention"), target, FACTS)
    with pytest.raises(PlanError, match="recompute=attention"):  # the plan's selective points to it
        export(plan(recompute="selective"), "megatron", FACTS)


def test_megatron_unequal_stages_get_a_layout():
    p = plan(dp=4, pp=2, stages=stages([1, 3]))
    a = megatron_args(export(p, "megatron", FACTS).text)
    assert a.pipeline_model_parallel_layout == "Et|tttL"
    layout = [s for s in a.pipeline_model_parallel_layout.split("|")]
    assert [s.count("t") for s in layout] == [1, 3] and len(layout) == p.mesh.pp * p.virtual_stages
    gpipe = export(plan(dp=4, pp=2, schedule="gpipe", stages=stages([2, 2])), "megatron", FACTS)
    assert any("no GPipe" in n for n in gpipe.notes)


@pytest.mark.parametrize("p", [plan(), plan(zero=0, recompute="full", precision="fp16"), plan(zero=3, mbs=8, m=1),
                               plan(zero=2, precision="fp32")])
def test_deepspeed_json(p):
    cfg = json.loads(export(p, "deepspeed", FACTS).text)
    assert set(cfg) <= DEEPSPEED_KEYS
    # DeepSpeed's own check: train_batch_size = micro-batch x accumulation x data-parallel world
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] \
        * p.mesh.dp == p.global_batch_size
    assert cfg["train_micro_batch_size_per_gpu"] == p.microbatch_size
    assert cfg["zero_optimization"]["stage"] == p.zero_stage
    assert (cfg["bf16"]["enabled"], cfg["fp16"]["enabled"]) == (p.precision == "bf16", p.precision == "fp16")
    assert ("activation_checkpointing" in cfg) == (p.recompute == "full")


@pytest.mark.parametrize("p", [plan(), plan(zero=3, recompute="full"), plan(zero=0, precision="fp32"),
                               plan(dp=16, zero=2, precision="fp16")])
def test_accelerate_yaml(p, tmp_path):
    text = export(p, "accelerate", FACTS).text
    cfg = yaml.safe_load(text)
    assert set(cfg) <= ACCELERATE_KEYS
    assert cfg["num_processes"] == p.world_size and cfg["num_machines"] == p.cluster["nodes"]
    assert cfg["mixed_precision"] == {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[p.precision]
    if p.zero_stage == 0:
        assert cfg["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in cfg
    else:
        fsdp = cfg["fsdp_config"]
        assert cfg["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] is (p.zero_stage == 3)
        assert fsdp["fsdp_activation_checkpointing"] is (p.recompute == "full")
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert f"gradient_accumulation_steps={p.num_microbatches}" in text


def test_accelerate_reads_its_own_config(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType
    path = tmp_path / "accelerate.yaml"
    path.write_text(export(plan(zero=3), "accelerate", FACTS).text)
    cfg = ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys
    assert cfg.distributed_type == DistributedType.FSDP and cfg.fsdp_config["fsdp_version"] == 2


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target,p,match", [
    ("deepspeed", plan(dp=4, tp=2), "tp=2"),
    ("deepspeed", plan(dp=4, pp=2, stages=stages([2, 2])), "PipelineModule"),
    ("deepspeed", plan(recompute="selective"), "selective"),
    ("accelerate", plan(dp=4, tp=2), "tp=2"),
    ("accelerate", plan(dp=4, pp=2, stages=stages([2, 2])), "pp=2"),
    ("accelerate", plan(recompute="selective"), "selective"),
    ("torchtitan", plan(precision="fp16"), "bfloat16 or float32"),
    ("megatron", plan(recompute="selective"), "attention core"),
    ("torchtitan", plan(dp=4, pp=2, stages=tuple(StageSpec(start_layer=s.start_layer, end_layer=s.end_layer,
                                                           modules=s.modules, rank=1 - s.rank)
                                                 for s in stages([2, 2]))), "rank k % pp"),
    ("megatron", plan(dp=4, pp=2, zero=3, stages=stages([2, 2])), "Megatron-FSDP"),
])
def test_refusals(target, p, match):
    with pytest.raises(PlanError, match=match):
        export(p, target, FACTS)


def test_a_refusal_suggests_only_the_targets_that_take_the_plan():
    """A pp plan of a model without a token embedding: DeepSpeed and Accelerate said 'export to megatron/torchtitan',
    which refuse it too (no embedding); a selective plan: DeepSpeed's refusal names only the targets that take it."""
    mlp = model_facts(os.path.join(ROOT, "examples", "mlp.py"))
    piped = plan(dp=4, pp=2, stages=stages([2, 2]))
    for target in ("deepspeed", "accelerate"):
        with pytest.raises(PlanError) as e:
            export(piped, target, mlp)
        assert " or export to" not in str(e.value) and "re-plan with --force" in str(e.value)
    with pytest.raises(PlanError) as e:
        export(plan(recompute="selective"), "deepspeed", FACTS)
    assert str(e.value).endswith("or export to torchtitan"), str(e.value)


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_tp_layout_other_than_megatrons_is_refused(target):
    with pytest.raises(PlanError, match=r"h\.0\.mlp\.c_fc .*replicated"):
        export(plan(dp=4, tp=2, ops=megatron_ops(skip=("mlp.c_fc", "mlp.c_proj"))), target, FACTS)
    ops = dict(megatron_ops())
    del ops["wte"]
    with pytest.raises(PlanError, match="embedding wte is replicated"):
        export(plan(dp=4, tp=2, ops=ops), target, FACTS)
    with pytest.raises(PlanError, match="--model"):
        export(plan(dp=4, tp=2), target, None)


def test_megatron_refuses_layers_between_blocks():
    odd = stages([2, 2])
    odd = (odd[0], StageSpec(start_layer=2, end_layer=4, modules=("h.2", "adapter", "h.3", "ln_f", "lm_head"),
                             rank=1))
    with pytest.raises(PlanError, match="between its blocks"):
        export(plan(dp=4, pp=2, stages=odd), "megatron", FACTS)
    assert tomllib.loads(export(plan(dp=4, pp=2, stages=odd), "torchtitan", FACTS).text)


def test_blocks_are_guessed_from_paths_without_the_model():
    a = megatron_args(export(plan(dp=4, pp=2, stages=stages([1, 3])), "megatron", None).text)
    assert a.pipeline_model_parallel_layout == "Et|tttL" and a.seq_length is None


def test_plan_for_another_model_is_refused():
    with pytest.raises(PlanError, match="not the model this plan was made for"):
        export(plan(model={"fingerprint": "beef"}), "deepspeed", FACTS)


# ---- the real model file and the CLI ---------------------------------------------------------------------------

def test_model_facts_of_gpt_example():
    f = model_facts(os.path.join(ROOT, "examples", "gpt.py"))
    assert f.blocks == tuple(f"h.{i}" for i in range(4)) and f.block_classes == ("Block",)
    assert "h.0.mlp.c_fc" in f.block_linears and f.head == "lm_head" and f.seq_len == 64
    assert {p for p, _ in f.embeddings} == {"wte", "wpe"}


@pytest.fixture(scope="module")
def gpt2_xl_plan(tmp_path_factory):
    """The bundled GPT-2 XL plan, searched as the README shows it, written without the dry run (10 s of a 48-layer
    model on fake tensors; the export reads the plan alone)."""
    path = tmp_path_factory.mktemp("xl") / "plan.json"
    assert cli([os.path.join(ROOT, "examples", "gpt2_xl.py"), "--cluster", "dgx-a100-80gb", "--batch-size", "512",
                "--no-check", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed", "accelerate"])
def test_gpt2_xl_plan_exports(gpt2_xl_plan, target, tmp_path, capsys):
    p = Plan.load(gpt2_xl_plan)
    out = tmp_path / "out"
    assert cli(["export", str(gpt2_xl_plan), "--to", target, "-o", str(out)]) == 0
    text = out.read_text()
    if target == "torchtitan":
        cfg = tomllib.loads(text)
        assert cfg["training"]["global_batch_size"] == 512 and cfg["training"]["seq_len"] == 1024
    elif target == "megatron":
        a = megatron_args(text)
        assert a.num_layers == 48 and a.global_batch_size == 512 and a.micro_batch_size == p.microbatch_size
    elif target == "deepspeed":
        cfg = json.loads(text)
        assert cfg["zero_optimization"]["stage"] == p.zero_stage and cfg["train_batch_size"] == 512
    else:
        cfg = yaml.safe_load(text)
        assert cfg["num_processes"] == p.world_size == 8
    assert cli(["export", str(gpt2_xl_plan), "--to", target]) == 0
    assert capsys.readouterr().out == text  # stdout and -o write the same text


def test_unreadable_model_file_named_by_the_plan_is_skipped(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    path = tmp_path / "plan.json"
    plan(model={"path": str(broken)}).save(path)
    assert cli(["export", str(path), "--to", "torchtitan"]) == 0
    captured = capsys.readouterr()
    assert "seq_len is left out" in captured.out and "was not read" in captured.err
    assert cli(["export", str(path), "--to", "torchtitan", "--model", str(broken)]) == 2


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli(["export", str(bad), "--to", "megatron"]) == 2
    assert cli(["export", str(tmp_path / "missing.json"), "--to", "megatron"]) == 2
    good = tmp_path / "plan.json"
    plan(dp=4, tp=2).save(good)
    kept = tmp_path / "kept.json"
    kept.write_text("mine")
    assert cli(["export", str(good), "--to", "deepspeed", "-o", str(kept)]) == 2
    assert kept.read_text() == "mine"  # a refusal leaves the output alone
    assert cli(["export", str(good), "--to", "megatron", "--model", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("plan: error: ") for line in err)
    assert "cannot export to DeepSpeed" in err[2] and "nope.py" in err[3]
    with pytest.raises(SystemExit) as e:
        cli(["export", str(good), "--to", "jax"])
    assert e.value.code == 2


def test_gradients_are_reduced_in_fp32_in_every_export():
    # the plan (shardwise's executor) reduces gradients in fp32: DeepSpeed and Megatron-LM's fp16 are told so,
    # Megatron's bf16 does it itself, Accelerate's FSDP2 can only be told in code (a note gives the call)
    ds = json.loads(export(plan(precision="bf16"), "deepspeed", FACTS).text)
    assert ds["communication_data_type"] == "fp32" and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "communication_data_type" not in json.loads(export(plan(precision="fp32"), "deepspeed", FACTS).text)
    assert megatron_args(export(plan(precision="fp16"), "megatron", FACTS).text).accumulate_allreduce_grads_in_fp32
    assert not megatron_args(export(plan(), "megatron", FACTS).text).accumulate_allreduce_grads_in_fp32
    acc = export(plan(zero=3), "accelerate", FACTS)
    assert any("reduce_dtype=torch.float32" in n for n in acc.notes) and "reduce_dtype=torch.float32" in acc.text
    assert not any("reduce_dtype" in n for n in export(plan(zero=0), "accelerate", FACTS).notes)  # DDP: fp32


def test_gradient_clipping_in_every_export():
    # Plan.max_grad_norm: Megatron-LM and torchtitan clip to 1.0 unless told, DeepSpeed not at all, Accelerate in code
    clipped, plain = plan(max_grad_norm=0.5), plan()
    assert megatron_args(export(clipped, "megatron", FACTS).text).clip_grad == 0.5
    assert megatron_args(export(plain, "megatron", FACTS).text).clip_grad == 0.0
    assert tomllib.loads(export(clipped, "torchtitan", FACTS).text)["training"]["max_norm"] == 0.5
    unclipped = export(plain, "torchtitan", FACTS)
    assert "max_norm" not in tomllib.loads(unclipped.text)["training"]
    assert any("training.max_norm (default 1.0) and the plan does not clip" in n for n in unclipped.notes)
    assert json.loads(export(clipped, "deepspeed", FACTS).text)["gradient_clipping"] == 0.5
    assert json.loads(export(plain, "deepspeed", FACTS).text)["gradient_clipping"] == 0.0
    assert any("clip_grad_norm_(model.parameters(), 0.5)" in n for n in export(clipped, "accelerate", FACTS).notes)
    assert not any("clip_grad_norm_" in n for n in export(plain, "accelerate", FACTS).notes)


def test_accelerate_multi_node_names_the_main_node(tmp_path):
    two = plan(dp=16, zero=1)
    assert two.cluster["nodes"] == 2
    exp = export(two, "accelerate", FACTS)
    cfg = yaml.safe_load(exp.text)
    assert cfg["num_machines"] == 2 and cfg["main_process_ip"] == "MAIN_NODE_ADDRESS" and cfg["main_process_port"]
    assert any("--machine_rank N" in n for n in exp.notes)
    assert "main_process_ip" not in yaml.safe_load(export(plan(), "accelerate", FACTS).text)
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig
    path = tmp_path / "two.yaml"
    path.write_text(exp.text)
    assert ClusterConfig.from_yaml_file(str(path)).main_process_ip == "MAIN_NODE_ADDRESS"


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_split_linears_must_pair_as_megatrons(target):
    # every Linear split, but the attention's input projections rowwise and its output projection colwise: not
    # the column-then-row pairs these trainers run
    ops = megatron_ops()
    for i in range(4):
        for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
            ops[f"h_{i}_{n}"] = OpPlacement(strategy="rowwise", module=f"h.{i}.{n}")
        ops[f"h_{i}_attn.c_proj"] = OpPlacement(strategy="colwise", module=f"h.{i}.attn.c_proj")
    with pytest.raises(PlanError, match=r"module h\.0\.attn\.q_proj is rowwise with no column-parallel"):
        export(plan(dp=4, tp=2, ops=ops), target, FACTS)
    export(plan(dp=4, tp=2), target, FACTS)  # Megatron's own pairs pass


def test_models_without_a_token_embedding_go_to_megatron_or_torchtitan_never():
    cnn = ModelFacts(path="resnet.py", fingerprint="f00d", blocks=("layer1", "layer2"), block_classes=("Block",),
                     block_linears=(), embeddings=(), head="fc", seq_len=None)
    for target in ("megatron", "torchtitan"):
        with pytest.raises(PlanError, match="no token embedding"):
            export(plan(dp=8, zero=0), target, cnn)
    assert json.loads(export(plan(dp=8, zero=0), "deepspeed", cnn).text)["train_batch_size"] == 64


def test_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    good = tmp_path / "plan.json"
    plan().save(good)
    folder = tmp_path / "folder"
    folder.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert cli(["export", str(good), "--to", "megatron", "-o", str(folder)]) == 2
    assert cli(["export", str(good), "--to", "megatron", "-o", str(afile / "x.sh")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "it is a directory" in err[0] and "is a file, not a folder" in err[1], err
    assert afile.read_text() == "mine" and not list(folder.iterdir())
