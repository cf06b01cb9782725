"""Executor tests: parity of every parallelism with a single-process run (CPU, gloo, world sizes 2 and 4),
checkpoints moving between plans, a crashing rank, and `plan measure`. Process launches are few and each runs many
checks (a 2-rank job costs 5-7 s to start here)."""
import json
import re
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from planner.plan import Mesh, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = os.path.join(ROOT, "tests", "test_executor_ranks.py")
TOL = 1e-5
CLIP = 0.5
"""Gradient clipping (Plan.max_grad_norm) in the specs that carry it: below every step's global norm (the test
checks), so every step clips."""

SPECS_2 = [
    {"name": "dp", "dp": 2},
    {"name": "dp_full_recompute", "dp": 2, "rc": "full"},
    {"name": "dp_partial_recompute", "dp": 2, "rc": "full", "rcb": [2]},
    {"name": "zero1", "dp": 2, "zero": 1, "nmb": 2},
    {"name": "zero2", "dp": 2, "zero": 2, "nmb": 2, "clip": CLIP},
    {"name": "zero1_selective", "dp": 2, "zero": 1, "nmb": 2, "rc": "selective"},
    # the first 2 of 4 blocks under full recomputation, the others under selective
    {"name": "zero1_selective_full_blocks", "dp": 2, "zero": 1, "nmb": 2, "rc": "selective", "rcb": [2]},
    {"name": "dp_attention_recompute", "dp": 2, "rc": "attention", "clip": CLIP},
    {"name": "tp_sp_attention_recompute", "tp": 2, "sp": True, "rc": "attention"},
    {"name": "zero3", "dp": 2, "zero": 3},
    {"name": "tp", "tp": 2},
    {"name": "tp_sp", "tp": 2, "sp": True, "clip": CLIP},
    {"name": "pp_gpipe", "pp": 2, "nmb": 2, "schedule": "gpipe"},
    {"name": "pp_1f1b", "pp": 2, "nmb": 2, "schedule": "1f1b", "clip": CLIP},
    # the tied wte / lm_head weight left out of the optimizer: its copies' gradients accumulate over steps
    {"name": "pp_tied_not_optimized", "pp": 2, "nmb": 2, "schedule": "1f1b", "clip": CLIP, "skip": "wte"},
    {"name": "pp_partial_recompute", "pp": 2, "nmb": 2, "schedule": "1f1b", "rc": "full", "rcb": [1, 0]},
    {"name": "pp_selective_full_blocks", "pp": 2, "nmb": 2, "schedule": "1f1b", "rc": "selective", "rcb": [1, 0]},
    {"name": "save_zero3", "dp": 2, "zero": 3, "stop": 2, "save": True},
    {"name": "tp_bf16", "tp": 2, "precision": "bf16"},
    {"name": "pp_bf16", "pp": 2, "nmb": 2, "precision": "bf16"},
    # padded targets (-100) under the default loss: one process's mean over the whole batch's counted targets,
    # whatever each micro-batch and replica counts; "share": each replica passes only its share of the batch
    {"name": "dp_padded_share", "dp": 2, "nmb": 2, "pad": True, "share": True},
    {"name": "tp_padded", "tp": 2, "nmb": 2, "pad": True},
    {"name": "pp_padded", "pp": 2, "nmb": 2, "schedule": "1f1b", "pad": True},
    {"name": "user_tp", "tp": 2, "nmb": 2, "user": True},
    {"name": "user_pp", "pp": 2, "nmb": 2, "user": True},
]
SPECS_4 = [
    {"name": "dp_tp", "dp": 2, "tp": 2, "clip": CLIP},
    {"name": "dp_pp", "dp": 2, "pp": 2, "nmb": 2},
    {"name": "tp_pp_sp", "tp": 2, "pp": 2, "nmb": 2, "sp": True},
    {"name": "zero3_tp", "dp": 2, "tp": 2, "zero": 3, "rc": "selective", "clip": CLIP},
    {"name": "zero3_tp_partial_recompute", "dp": 2, "tp": 2, "zero": 3, "rc": "full", "rcb": [2]},
    {"name": "pp_interleaved", "dp": 2, "pp": 2, "vs": 2, "nmb": 2, "schedule": "interleaved",
     "clip": CLIP},
    {"name": "load_into_tp_pp", "tp": 2, "pp": 2, "nmb": 2, "load": True},
]


def _torchrun(n, args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _layouts(tmp_path):
    """Megatron placements of the rank program's GPT for tp=2 without and with sequence parallelism, as `plan`
    writes them (ops and parameters): the executor applies only what a plan says."""
    from dataclasses import asdict

    from planner.defaults import megatron_placements
    from planner.layout import parameter_placements
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    model = tmp_path / "gpt4.py"
    model.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
        from gpt import GPT, GPTConfig
        def build_model():
            return GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16))
        def sample_batch(b):
            import torch
            t = torch.randint(0, 64, (b, 17))
            return t[:, :-1], t[:, 1:]
    """))
    graph = trace_model(load_model_file(str(model)), batch_size=2, progress=False)
    out = {}
    for sp in (False, True):
        ops = megatron_placements(graph, 2, sp)
        out[sp] = {"ops": {k: asdict(v) for k, v in ops.items()}, "parameters": parameter_placements(graph, ops)}
    return out


def _launch(tmp_path, n, specs, ckpt):
    spec_file, out = tmp_path / f"specs{n}.json", tmp_path / f"out{n}.json"
    layouts = _layouts(tmp_path)
    specs = [dict(s, layout=layouts[s.get("sp", False)]) if s.get("tp", 1) > 1 else s for s in specs]
    spec_file.write_text(json.dumps(specs))
    proc = _torchrun(n, [RANKS, str(spec_file), str(out), str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("executor")
    ckpt = tmp / "ckpt"
    r2 = _launch(tmp, 2, SPECS_2, ckpt)
    r4 = _launch(tmp, 4, SPECS_4, ckpt)
    return {**r2, **r4, "reference_norms": {**r2["reference_norms"], **r4["reference_norms"]}}


BF16_TOL = 0.05
"""bf16 runs against the fp32 single process: 8 mantissa bits give ~4e-3 relative error per op, ~0.02 on a loss of
4.2 after three steps."""


@pytest.mark.parametrize("name", ["user_tp", "user_pp"])
def test_a_training_script_of_ones_own(results, name):
    """executor.apply_plan as a user's script drives it (tests/test_executor_ranks.py `user_script`)."""
    r = results[name]
    assert "error" not in r, r.get("error")
    assert "the optimizer holds" in r["foreign_refused"] and "optimizer=lambda params, names" in r["foreign_refused"]
    assert r["names"] == r["model_names"] and r["aligned"]  # names in the model, over the ranks
    assert r["rng_same"]  # ranks seeded apart continue from rank 0's random state
    assert "step()'s micro-batch inputs are [4, 16] int64 but example_inputs was [4, 8] int64" in r["short_refused"], \
        r["short_refused"]
    axis = name.split("_")[1]
    assert f"the ranks of one {axis} group got different batches" in r["apart_refused"], r["apart_refused"]
    assert r["frozen_steps"] == 3  # MemTracker hooked every parameter: a frozen one crashed the 2nd step
    assert r["loss_err"] <= TOL, r
    if name == "user_tp":
        assert "the loss function returned tuple; it must return one scalar tensor" in r["tuple_refused"]
        assert r["grads_left"] == 0  # a step that raised after a micro-batch's backward kept its gradients


@pytest.mark.parametrize("name", [s["name"] for s in SPECS_2 + SPECS_4
                                  if s.get("precision", "fp32") == "fp32" and not s.get("user")])
def test_matches_single_process(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["loss_err"] <= TOL, r
    if "param_err" in r:
        assert r["param_err"] <= TOL, r
    assert r["report_ok"]


CLIPPED = [s["name"] for s in SPECS_2 + SPECS_4 if s.get("clip")]


@pytest.mark.parametrize("name", CLIPPED)
def test_gradient_clipping_matches_torchs_over_one_process(results, name):
    """Plan.max_grad_norm: the global norm over every rank's share (DDP's whole gradients, FSDP2 and tp shards, two
    pipeline stages with a tied weight on both) equals torch.nn.utils.clip_grad_norm_'s in one process, and the
    clipped run trains that process's clipped losses (test_matches_single_process checks them too)."""
    ref = results["reference"][str(CLIP)]
    plain = results["reference"]["0.0"]["losses"]
    assert min(ref["norms"]) > CLIP  # every step clips
    assert max(abs(a - b) for a, b in zip(ref["losses"], plain)) > 100 * TOL  # clipping changes the training
    r = results[name]
    assert "error" not in r, r.get("error")
    norms = results["reference_norms"][name]  # this spec's own reference (a skipped weight changes it)
    assert abs(r["grad_norm"] - norms[-1]) <= TOL * norms[-1], (r["grad_norm"], norms)
    assert r["loss_err"] <= TOL, r


@pytest.mark.parametrize("name", [s["name"] for s in SPECS_2 + SPECS_4 if not s.get("user") and not s.get("stop")])
def test_evaluate_gives_one_process_eval_loss_and_leaves_training_as_it_was(results, name):
    """Runner.evaluate after every step: the loss one process gets in eval mode, forward only (pipelines through the
    schedule's eval), every module back in train mode after, and the later steps' losses unchanged (checked by
    test_matches_single_process on the same run)."""
    r = results[name]
    assert "error" not in r, r.get("error")
    tol = BF16_TOL if "bf16" in name else TOL
    assert r["eval_err"] <= tol, r
    assert not r["evaluated_in_train_mode"] and r["train_mode_after"]


def test_no_clipping_leaves_no_norm(results):
    assert results["dp"]["grad_norm"] is None


@pytest.mark.parametrize("name", ["tp_bf16", "pp_bf16"])
def test_bf16_tp_or_pp_without_dp_computes_with_bf16_weights_over_fp32_ones(results, name):
    """16-bit training without dp runs under FSDP2's replicate over the one-rank dp mesh, as every tp or pp plan with
    dp does (`Plan.fsdp_mixed_precision`): bf16 compute weights, fp32 ones kept for the optimizer. Plain autocast
    would keep the fp32 residual stream and cast each weight again in every micro-batch's forward."""
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["compute_dtypes"] == ["torch.bfloat16"] and r["kept_dtypes"] == ["torch.float32"], r
    assert r["loss_err"] <= BF16_TOL, r


def test_fp32_runs_are_not_wrapped_without_dp(results):
    assert results["tp"]["compute_dtypes"] == results["pp_1f1b"]["compute_dtypes"] == ["unwrapped"]


def test_sequence_parallel_shards_norms_and_recompute_saves_memory(results):
    assert results["tp_sp"]["norm_is_dtensor"] and not results["tp"]["norm_is_dtensor"]
    assert 0 < results["dp_full_recompute"]["activations"] < results["dp"]["activations"] / 2


def test_replicate_holds_an_unsharded_copy_of_every_parameter_at_fp32_too(results):
    # dp with tp or pp at ZeRO-0 runs FSDP2's replicate: its all-gather output is a buffer of its own even over a
    # one-rank shard group, so the parameters live twice at the peak (the cost model priced this only at 16 bits);
    # DDP (dp alone) and FSDP2's ZeRO-3 hold other amounts
    for name in ("dp_tp", "dp_pp"):
        r = results[name]
        assert r["param_bytes_at_peak"] == 2 * r["local_param_bytes"], (name, r["param_bytes_at_peak"])
    r = results["dp"]
    assert r["param_bytes_at_peak"] == r["local_param_bytes"]
    from cost_model.memory import peak_memory
    from test_memory_measured import _layer, _work
    mem = peak_memory(_work(params=100.0, layers=((_layer(100.0),),), dp=2, replicate=True))
    assert mem["parameters"] == 2 * 100.0 * 4


def test_partial_recompute_checkpoints_the_first_blocks_of_each_stage(results):
    # Plan.recompute_blocks: the first 2 of 4 blocks without pipelining; with two stages of two blocks, the first
    # block of stage 0 and none of stage 1. The bytes autograd saves lie between full recompute's and none's
    blocks = [f"h.{i}" for i in range(4)]
    def wrapped(name):  # module paths under DDP / the pipeline's stage modules end in the block's own
        return [".".join(path.split(".")[-2:]) for path in results[name]["checkpointed"]]
    assert wrapped("dp_full_recompute") == blocks
    assert wrapped("dp_partial_recompute") == blocks[:2]
    assert wrapped("pp_partial_recompute") == blocks[:1]
    assert wrapped("pp_1f1b") == []
    assert wrapped("zero3_tp_partial_recompute") == blocks[:2]  # under FSDP2 and tp too
    assert results["dp_full_recompute"]["saved"] < results["dp_partial_recompute"]["saved"] < results["dp"]["saved"]
    assert results["pp_partial_recompute"]["saved"] < results["pp_1f1b"]["saved"]
    # under selective the counted blocks run full recomputation and the others selective: it holds fewer
    # activations than selective on every block (the allocator's measure: checkpointing's own saved-tensor hooks
    # hide a checkpointed block's kept tensors from the saved-bytes count); parity with one process is checked
    # with the others
    hybrid, sel = results["zero1_selective_full_blocks"], results["zero1_selective"]
    assert wrapped("zero1_selective_full_blocks") == blocks and wrapped("zero1_selective") == blocks
    assert [".".join(p.split(".")[-2:]) for p in hybrid["selective_checkpointed"]] == blocks[2:]
    assert [".".join(p.split(".")[-2:]) for p in sel["selective_checkpointed"]] == blocks
    # with two stages of two blocks: the first block of stage 0 full, the other three selective
    assert wrapped("pp_selective_full_blocks") == blocks
    assert [".".join(p.split(".")[-2:]) for p in results["pp_selective_full_blocks"]["selective_checkpointed"]] \
        == blocks[1:]
    assert hybrid["activations"] < sel["activations"], (hybrid["activations"], sel["activations"])


def test_attention_recompute_reruns_each_sdpa_call(results):
    # recompute: attention re-runs each block's SDPA call on its own in backward (4 blocks; under tp the exported
    # graph's aten SDPA op), wraps no block, and saves less than no recompute (not the kernel's internals)
    assert results["dp_attention_recompute"]["recomputed_sdpa_calls_per_step"] == 4
    assert results["tp_sp_attention_recompute"]["recomputed_sdpa_calls_per_step"] == 4
    assert results["dp"]["recomputed_sdpa_calls_per_step"] == 0
    assert results["dp_attention_recompute"]["checkpointed"] == []
    assert results["dp_attention_recompute"]["saved"] < results["dp"]["saved"]


def test_colwise_head_feeds_a_vocabulary_parallel_loss(results):
    # the LM head's logits stay sharded over the vocabulary and cross-entropy runs under loss_parallel, with and
    # without sequence parallelism and pipelining; parity with one process is checked above
    for name in ("tp", "tp_sp", "dp_tp", "tp_pp_sp", "zero3_tp"):
        assert results[name]["vocab_parallel_loss"], name
    assert not results["dp"]["vocab_parallel_loss"]


def test_pipeline_stages_hold_no_receive_buffer_between_steps(results):
    # torch's stage keeps one activation and one gradient buffer per micro-batch for the whole step; ours
    # allocates each when its receive is posted and lets it go after that micro-batch's backward
    for name in ("pp_gpipe", "pp_1f1b", "dp_pp", "tp_pp_sp", "pp_interleaved"):
        assert results[name]["recv_slots"] >= 2 and results[name]["recv_held"] == 0, (name, results[name])
    assert results["dp"]["recv_slots"] == 0


def test_a_sequence_parallel_stage_boundary_sends_each_ranks_shard(results):
    # tp = 2 with sequence parallelism: a stage sends its block's sequence shard, half the boundary tensor, to the
    # same tp rank of the next stage (executor.tp.stage_boundary_hooks, as the cost model prices it); without
    # sequence parallelism the block's output is replicated and crosses whole
    assert results["tp_pp_sp"]["sent_per_microbatch"] == results["tp_pp_sp"]["boundary_elems"] / 2
    assert results["load_into_tp_pp"]["sent_per_microbatch"] == results["load_into_tp_pp"]["boundary_elems"]
    assert results["pp_1f1b"]["sent_per_microbatch"] == results["pp_1f1b"]["boundary_elems"]


def test_replicated_subtrees_run_generated_code(results):
    # a module tp leaves replicated runs its unflattened graph's generated code (torch.fx.Interpreter, the
    # default of torch.export.unflatten, costs ~0.15 ms a call on a CPU rank)
    for name in ("tp", "dp_tp"):
        assert results[name]["local_modules"] > 0 and results[name]["local_interpreted"] == 0, results[name]


def test_no_plan_runs_torch_fx_interpreter(results):
    # placed ops run as generated code with their placement calls inline (executor.graph_ops._placed_code), the
    # rest of an unflattened model as its generated code: fx's Interpreter walks the graph in Python on every call
    for name, r in results.items():
        if "interpreter_runs" in r:  # (the "reference" entry has none)
            assert r["interpreter_runs"] == 0, (name, r["interpreter_runs"])


def test_zero12_gather_parameters_once_per_step(results):
    # 2 micro-batches; FSDP2 units = 4 blocks + the root: ZeRO-1/2 keep parameters whole between micro-batches
    # (one all-gather per unit per step); ZeRO-3 (1 micro-batch) gathers every block before its forward and again
    # before its backward, the root once (apply_fsdp keeps it gathered from its forward to its backward)
    assert results["zero1"]["all_gathers_last_step"] == 5
    assert results["zero2"]["all_gathers_last_step"] == 5
    assert results["zero3"]["all_gathers_last_step"] == 2 * 4 + 1


def test_checkpoint_moves_between_plans(results):
    r = results["load_into_tp_pp"]
    assert r["start"] == 2 and r["n_losses"] == 1  # resumed at step 2 under a different plan
    assert r["scheduler_loaded"] == 2 and results["dp"]["scheduler_loaded"] == 0  # the script's scheduler too
    assert r["lr_loaded"] == 0.025  # the learning rate the saving run had (a scheduler's), not the factory's
    assert r["wrong_key"].endswith("ckpt: the checkpoint holds no extra 'sched' (it holds 'scheduler'); pass the keys "
                                   "runner.save(extra=...) was given"), r["wrong_key"]
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL


SMALL_MODEL = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {examples!r})
    import torch
    from gpt import GPT, GPTConfig, sample_batch as _sample
    CFG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    class Crashing(GPT):
        calls = 0
        def forward(self, idx):
            Crashing.calls += 1
            if {crash} and os.environ.get("RANK") == "1" and Crashing.calls > 2:
                raise RuntimeError("injected failure on rank 1")
            return super().forward(idx)
    def build_model():
        return Crashing(CFG)
    def sample_batch(b):
        return _sample(b, CFG)
""")


def _model_file(tmp_path, crash):
    p = tmp_path / ("crash.py" if crash else "small.py")
    p.write_text(SMALL_MODEL.format(examples=os.path.join(ROOT, "examples"), crash=crash))
    return p


def _plan(tmp_path, model_file, **kw):
    from planner.model_file import build, load_model_file
    from planner.plan import model_fingerprint
    m = build(load_model_file(str(model_file)), "meta")
    fp = model_fingerprint((n, p.shape) for n, p in m.named_parameters())
    plan = Plan(mesh=Mesh(dp=2), global_batch_size=8, microbatch_size=4, num_microbatches=1, precision="fp32",
                model={"fingerprint": fp, "parameters": sum(p.numel() for p in m.parameters())},
                predicted={"step_time_s": 0.01}, **kw)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def _plan_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "planner.cli", "measure", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_plan_measure_end_to_end_and_calibration(tmp_path):
    model = _model_file(tmp_path, crash=False)
    plan = _plan(tmp_path, model)
    out, cal = tmp_path / "measured.json", tmp_path / "calibration.json"
    proc = _plan_cli(plan, model, "--steps", 5, "--warmup", 2, "-o", out, "--calibrate", cal)
    assert proc.returncode == 0, proc.stderr
    assert "predicted" in proc.stdout and "measured" in proc.stdout
    tags = [line.split("ms", 1)[1].strip() for line in proc.stdout.splitlines() if re.match(r"step \d+/", line)]
    # the 2nd step is both (it said only "warm-up", where the README says tracked steps say so)
    assert tags == ["(warm-up)", "(warm-up, memory tracked)", "(memory tracked)", "", ""], proc.stdout
    d = json.loads(out.read_text())
    assert d["measured"]["step_time_s"] == max(d["measured"]["step_time_s_per_rank"])  # the slowest rank's
    assert d["predicted"]["step_time_s"] == 0.01
    assert len(d["measured"]["step_times_s"]) == 5 and d["measured"]["step_time_s"] > 0
    assert d["measured"]["peak_memory_bytes"] > 0
    assert d["error"]["step_time"] == pytest.approx(d["measured"]["step_time_s"] / 0.01 - 1)
    assert json.loads(cal.read_text())["step_time_scale"] > 0
    # on CPU ranks each pass's host time is the pass itself; device times need CUDA events
    m = d["measured"]
    assert 0 < m["forward_host_s"] and 0 < m["backward_host_s"]
    assert m["forward_host_s"] + m["backward_host_s"] <= m["forward_backward_s"] * 1.01
    assert m["forward_device_s"] is None and m["backward_device_s"] is None and d["passes"] == {}


def test_crashing_rank_ends_job_quickly(tmp_path):
    model = _model_file(tmp_path, crash=True)
    plan = _plan(tmp_path, model)
    t0 = time.monotonic()
    proc = _plan_cli(plan, model, "--steps", 6)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "rank 1" in proc.stderr and "injected failure" in proc.stderr


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from planner.cli import main as plan_main

    def run(*args):  # in-process: the checks happen before anything is launched
        rc = plan_main(["measure", *map(str, args)])
        return rc, capsys.readouterr().err
    model = _model_file(tmp_path, crash=False)
    plan = _plan(tmp_path, model)
    other = tmp_path / "other.py"
    other.write_text(SMALL_MODEL.format(examples=os.path.join(ROOT, "examples"), crash=False)
                     .replace("n_layer=2", "n_layer=3"))
    for args, words in [((plan, other), "another model"),
                        ((tmp_path / "nope.json", model), "cannot read plan")]:
        rc, err = run(*args)
        assert rc == 2, err
        assert len(err.strip().splitlines()) == 1 and words in err
    d = json.loads(plan.read_text())
    d["mesh"]["dq"] = 1
    plan.write_text(json.dumps(d))
    rc, err = run(plan, model)
    assert rc == 2 and "unknown key 'dq'" in err


def test_world_size_mismatch_before_process_group(monkeypatch):
    from executor import apply_plan
    from executor.errors import ExecutorError
    monkeypatch.setenv("WORLD_SIZE", "3")
    plan = Plan(mesh=Mesh(dp=2), global_batch_size=2, microbatch_size=1, num_microbatches=1)
    with pytest.raises(ExecutorError, match="needs 2 ranks"):
        apply_plan(torch.nn.Linear(2, 2), plan)
    assert not torch.distributed.is_initialized()


def test_a_schedule_torch_would_refuse_stops_before_process_group(monkeypatch):
    # the rule the search and plan files use (`planner.plan.schedule_problem`), in the executor's words
    from executor import apply_plan
    from executor.errors import ExecutorError
    monkeypatch.setenv("WORLD_SIZE", "2")
    plan = Plan(mesh=Mesh(pp=2), schedule="1f1b", global_batch_size=2, microbatch_size=2, num_microbatches=1)
    with pytest.raises(ExecutorError, match=r"^schedule 1f1b needs at least pp=2 micro-batches per step, got 1; raise "
                                            r"num_microbatches .* or use schedule gpipe$"):
        apply_plan(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), plan)
    assert not torch.distributed.is_initialized()


def test_split_model_matches_whole_model():
    """The fx stage cut computes exactly the model's forward, keeps parameter names, and finds the tied weight."""
    from gpt import GPT, GPTConfig
    from executor.pipeline import split_model, stage_modules, tied_pairs
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    plan = Plan(mesh=Mesh(pp=2), global_batch_size=2, microbatch_size=1, num_microbatches=2)
    mods = stage_modules(model, plan)
    assert mods == [["wte", "wpe", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]
    stages = split_model(model, mods)
    x = torch.randint(0, 64, (2, 16))
    out = x
    for s in stages:
        out = s(out)
    torch.testing.assert_close(out, model(x))
    assert "h.2.attn.q_proj.weight" in dict(stages[1].named_parameters())
    assert tied_pairs(model, mods) == [("wte.weight", [0, 1])]


class _RootTiedHead(torch.nn.Module):
    """The LM head as the root's `F.linear(x, self.wte.weight)`: no module of the last stage owns the weight."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
                                          for _ in range(2))
        self.ln_f = torch.nn.LayerNorm(16)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = x + b(x)
        return torch.nn.functional.linear(self.ln_f(x), self.wte.weight)


def test_a_weight_the_root_reads_in_another_stage_is_tied():
    """The last stage's graph reads wte.weight itself (a get_attr), so it holds a copy whose gradient must be summed
    with stage 0's; tied_pairs looked only at the modules, and pp=2 trained it untied (losses off from step 3)."""
    from executor.pipeline import split_model, tied_pairs
    model = _RootTiedHead()
    mods = [["wte", "blocks.0", "blocks.1"], ["ln_f"]]
    stages = split_model(model, mods)
    assert "wte.weight" in dict(stages[1].named_parameters())
    assert tied_pairs(model, mods, stages) == [("wte.weight", [0, 1])]
    x = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))


def test_a_model_fx_cannot_trace_is_cut_from_its_export():
    """transformers' GPT-2 defeats torch.fx; with one micro-batch of example inputs its stages are cut from the
    unflattened torch.export graph, keep the model's parameter names, and chained compute the model's logits."""
    pytest.importorskip("transformers")
    from executor.errors import ExecutorError
    from executor.pipeline import flat_inputs, split_model
    from planner.model_file import batch, build, load_model_file
    mf = load_model_file(os.path.join(ROOT, "examples", "hf_gpt2.py"))
    torch.manual_seed(0)
    model = build(mf).eval()  # no dropout: the chained stages must equal the model exactly
    mods = [["transformer", "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"],
            ["transformer.h.1", "transformer.ln_f", "lm_head"]]  # as `plan` lists them (HF's glue in transformer)
    x, _ = batch(mf, 2)
    with pytest.raises(ExecutorError, match="example_inputs"):
        split_model(model, mods)
    stages = split_model(model, mods, x)
    out = flat_inputs(x)
    for s in stages:
        out = s(*out)
        out = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(out[0], model(**x).logits)
    assert "transformer.h.1.attn.c_attn.weight" in dict(stages[-1].named_parameters())
    # without tp nothing is placed: the runner has the stages' unflattened modules run their generated code
    # (torch.fx.Interpreter, unflatten's default, cost a pp2 step of the benchmark's GPT ~25 % on CPU ranks)
    from executor.graph_ops import run_generated
    interpreted = lambda: [n for s in stages for n, m in s.named_modules()  # noqa: E731
                           if getattr(m, "_run_with_interpreter", False)]
    assert interpreted()
    run_generated(stages[0].exported_root)
    assert not interpreted()
    out = flat_inputs(x)
    for s in stages:
        out = s(*out)
        out = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(out[0], model(**x).logits)


def test_a_parameter_placement_past_its_dims_names_the_parameter():
    from executor.errors import ExecutorError
    from executor.tp import check_parameters
    plan = Plan(mesh=Mesh(tp=2), global_batch_size=2, microbatch_size=2, num_microbatches=1,
                parameters={"weight": "S(5)"})
    with pytest.raises(ExecutorError, match=r"parameter weight \(2 dims\) as S\(5\)"):
        check_parameters(plan, torch.nn.Linear(4, 4))


def test_placed_code_runs_the_graph_and_names_the_op_that_fails():
    """A placed module's graph runs as generated code (`graph_ops._placed_code`) with its placement calls inline;
    an op that raises there carries its module path and model-file line, as the dry run's message needs."""
    import torch.fx
    import torch.nn as nn

    from executor.graph_ops import _placed_code

    class Block(nn.Module):
        def __init__(self, cols: int):
            super().__init__()
            self.fc, self.cols = nn.Linear(4, 6), cols

        def forward(self, x):
            y = self.fc(x) + 1
            return y.reshape(-1, self.cols)

    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True
    ok, bad = Block(3), Block(5)
    for model in (ok, bad):
        graph = tracer.trace(model)
        reshape = next(n for n in graph.nodes if n.op == "call_method")
        reshape.meta["nn_module_stack"] = {"h.0.mlp": ("h.0.mlp", Block)}
        specs = {n: (n, None) for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")}
        run = _placed_code(graph, specs, mesh=None, prefix="h.0")
        x = torch.randn(2, 4)
        if model is ok:
            assert torch.equal(run(model, x), model(x))
            continue
        with pytest.raises(RuntimeError) as e:
            run(model, x)
        assert e.value.source_module == "h.0.mlp"
        assert "test_executor.py" in e.value.source_stack and "reshape" in e.value.source_stack


def test_pass_clock_sums_each_kind_over_micro_batches(monkeypatch):
    from executor import measure
    ticks = iter([0.0, 1.0, 3.0, 3.5, 6.0, 6.25])  # F 1, B 2, F 0.5, B 2.5, end
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(ticks))
    clock = measure.PassClock(torch.device("cpu"))
    for kind in ("F", "B", "F", "B", "end"):
        clock.mark(kind)
    assert clock.totals() == {"forward_host_s": 1.5, "backward_host_s": 4.5}


def test_report_shows_each_pass_on_the_device_and_its_host_issue_time():
    from executor.measure import compare, format_report
    b = {"forward_compute_s": 0.040, "forward_kernels_s": 0.039, "forward_host_s": 0.018,
         "backward_compute_s": 0.080, "backward_kernels_s": 0.073, "backward_host_s": 0.046}
    plan = Plan(mesh=Mesh(), global_batch_size=4, microbatch_size=4, num_microbatches=1,
                predicted={"step_time_s": 0.129, "breakdown": b})
    measured = {"step_time_s": 0.155, "forward_device_s": 0.044, "forward_host_s": 0.030,
                "backward_device_s": 0.092, "backward_host_s": 0.090}
    p = compare(plan, measured)["passes"]
    assert p["forward"]["device"]["error"] == pytest.approx(0.1)
    assert p["backward"]["host"]["error"] == pytest.approx(0.090 / 0.046 - 1)
    assert p["backward"]["kernels"]["measured"] is None
    text = format_report(plan, measured)
    assert "forward pass on the device" in text and "host issue time" in text and "+95.7 %" in text
    # without CUDA timings (CPU ranks) the rows are left out
    assert "pass on the device" not in format_report(plan, {"step_time_s": 0.155, "forward_host_s": 0.03})
