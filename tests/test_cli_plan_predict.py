"""`plan MODEL.py --force ...` predicts exactly the forced configuration, writes plan.json and a Chrome trace that
follows the Trace Event Format (the keys and types Perfetto / chrome://tracing require)."""
from __future__ import annotations

import json
import os

from planner.cli import main
from planner.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py")
FORCE = "dp=2,tp=2,pp=2,zero=1,mbs=2,recompute=selective,schedule=interleaved,vp=2,sp=1"


def validate_chrome_trace(doc) -> None:
    """Assert `doc` is a JSON-object-format Chrome trace: traceEvents of complete ('X') and metadata ('M')
    events with the required keys and types."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    names = {}
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["ph"], str)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["ts"] >= 0 and e["dur"] >= 0
        else:
            assert e["ph"] == "M" and e["name"] in ("process_name", "thread_name")
            assert isinstance(e["args"]["name"], str)
            names[(e["name"], e["pid"], e["tid"] if e["name"] == "thread_name" else None)] = e["args"]["name"]
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert spans
    assert all(("process_name", e["pid"], None) in names for e in spans)
    assert all(("thread_name", e["pid"], e["tid"]) in names for e in spans)


def test_force_predicts_exactly_that_configuration(tmp_path, capsys):
    out, trace = tmp_path / "plan.json", tmp_path / "trace.json"
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", FORCE, "-o", str(out),
               "--timeline", str(trace)])
    text = capsys.readouterr().out
    assert rc == 0
    plan = Plan.load(out)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2)
    assert (plan.zero_stage, plan.microbatch_size, plan.num_microbatches) == (1, 2, 4)
    assert (plan.recompute, plan.schedule, plan.virtual_stages, plan.sequence_parallel) == \
        ("selective", "interleaved", 2, True)
    assert len(plan.stages) == 4 and plan.model["fingerprint"] and plan.cluster["name"] == "dgx-a100-80gb"
    for part in ("dp=2", "tp=2", "pp=2", "zero=1", "mbs=2", "recompute=selective", "interleaved", "sp=1"):
        assert part in text
    pred = plan.predicted
    assert f"predicted step time: {pred['step_time_s'] * 1e3:.2f} ms" in text
    b = pred["breakdown"]
    assert abs(b["compute_s"] + b["exposed_comm_s"] + b["bubble_s"] + b["optimizer_s"] - pred["step_time_s"]) \
        < 1e-9 * pred["step_time_s"] + 1e-15
    assert pred["assumptions"] and "assumptions:" in text
    doc = json.loads(trace.read_text())
    validate_chrome_trace(doc)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    # 2 chunks x 4 micro-batches x (F, B) per rank
    assert sum(1 for e in spans if e["name"].startswith(("F ", "B "))) == 2 * 2 * 4 * 2
    assert max(e["ts"] + e["dur"] for e in spans) <= pred["step_time_s"] * 1e6 * (1 + 1e-9)


def test_bad_force_is_one_line(capsys):
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", "dp=3,tp=2,pp=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "devices" in err
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "12", "--force", "dp=8,mbs=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "batch" in err


def test_force_recompute_blocks_recomputes_that_many_blocks_per_stage(tmp_path, capsys):
    # Megatron-LM's --recompute-method block --recompute-num-layers 1: one block of each stage re-run
    out = tmp_path / "plan.json"
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force",
               "dp=4,tp=1,pp=2,mbs=2,schedule=1f1b,recompute_blocks=1", "-o", str(out), "--no-check"])
    text = capsys.readouterr().out
    plan = Plan.load(out)
    assert rc == 0 and (plan.recompute, plan.recompute_blocks) == ("full", (1, 1))
    assert "recompute=full (the first blocks of each stage: 1/1)" in text
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", "recompute=none,recompute_blocks=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "needs recompute=full or selective" in err


def test_attention_flag_picks_the_profiles_kernel_or_unfused(tmp_path, capsys):
    """`--attention unfused` prices SDPA as separate kernels (slower than FlashAttention-2 on a 2048-token GPT);
    a kernel the profile does not list is one line and exit 2."""
    model = tmp_path / "gpt2k.py"
    model.write_text(f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'examples')!r})\n"
                     "from gpt import GPT, GPTConfig, sample_batch as _s\n"
                     "CFG = GPTConfig(n_layer=2, n_embd=1024, n_head=8, vocab_size=512, block_size=2048)\n"
                     "def build_model():\n    return GPT(CFG)\n"
                     "def sample_batch(b):\n    return _s(b, CFG)\n")
    steps = {}
    for kernel in ("flash2", "unfused"):
        rc = main([str(model), "--cluster", "dgx-a100-80gb", "--batch-size", "32", "--attention", kernel,
                   "--force", "dp=8,tp=1,pp=1,zero=0,mbs=4,recompute=none", "--json"])
        assert rc == 0
        steps[kernel] = json.loads(capsys.readouterr().out)["plan"]["predicted"]["step_time_s"]
    assert steps["unfused"] > 1.1 * steps["flash2"]
    assert main([str(model), "--cluster", "dgx-a100-80gb", "--batch-size", "8", "--attention", "flash3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attention flash3" in err[0] and "flash2, unfused" in err[0]


def test_ignore_memory_predicts_a_forced_plan_that_fits_nowhere_and_writes_nothing(tmp_path, capsys):
    # 65536 samples per micro-batch need ~100 GiB of activations on an 80 GB A100: an error naming --ignore-memory,
    # which then predicts the forced plan, says it does not fit, and refuses -o
    args = [GPT, "--cluster", "dgx-a100-80gb", "--nodes", "1", "--batch-size", "524288",
            "--force", "dp=8,mbs=65536,recompute=none"]
    assert main(args) == 2
    assert "predict it anyway with --ignore-memory" in capsys.readouterr().err
    assert main(args + ["--ignore-memory"]) == 0
    text = capsys.readouterr().out
    assert "(DOES NOT FIT)" in text and "recompute=none" in text and "mbs=65536" in text
    assert "note: --ignore-memory: this plan needs" in text and "no plan is written" in text
    out = tmp_path / "plan.json"
    assert main(args + ["--ignore-memory", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--ignore-memory" in err and "-o" in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_force_recompute_blocks_counts_real_blocks(tmp_path, capsys):
    # more blocks than the model has is one line; a count above a stage's blocks is capped (the label says what runs)
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", "recompute_blocks=99"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "the model has 4 blocks in all" in err, err
    out = tmp_path / "plan.json"
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force",
               "dp=4,tp=1,pp=2,mbs=2,schedule=1f1b,recompute_blocks=3", "-o", str(out), "--no-check"])
    assert rc == 0 and Plan.load(out).recompute_blocks == (2, 2)
    assert "full[2/2]" in capsys.readouterr().out


def test_a_forced_sp_the_model_cannot_use_is_an_error_not_dropped(tmp_path, capsys):
    # an MLP has no sequence dim: the plan came out sp=0 (exit 0) with a note that said sp=1 was forced
    mlp, out = os.path.join(ROOT, "examples", "mlp.py"), tmp_path / "plan.json"
    assert main([mlp, "--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32", "--force", "sp=1",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "sp=1 is forced, but no op of this model can run on sequence shards" in err and "drop sp=1" in err
    assert not out.exists()
    # a GPT whose sequence (17: 16 patches and a class token, as a ViT's) tp=2 does not divide: the note says so
    odd = tmp_path / "odd_seq.py"
    odd.write_text(f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'examples')!r})\n"
                   "import torch\nfrom gpt import GPT, GPTConfig\nCFG = GPTConfig(n_layer=2, n_embd=32, n_head=4, "
                   "vocab_size=64, block_size=17)\ndef build_model():\n    return GPT(CFG)\n"
                   "def sample_batch(n):\n    x = torch.randint(0, 64, (n, 17))\n    return x, x\n")
    assert main([str(odd), "--cluster", "cpu-local", "--batch-size", "4", "--precision", "fp32", "--force",
                 "tp=2,sp=1"]) == 2
    err = capsys.readouterr().err
    assert "its norms' sequence length 17 is not a multiple of tp=2: pad the sequence to one; or drop sp=1" in err


def test_the_report_names_the_model_as_given_and_the_plan_keeps_its_absolute_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    args = ["--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32", "--no-check", "-o", str(out)]
    assert main([os.path.join("examples", "mlp.py"), *args]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("plan for examples/mlp.py on cpu-local")
    assert Plan.load(out).model["path"] == os.path.join(ROOT, "examples", "mlp.py")
    monkeypatch.chdir(tmp_path)  # outside the working folder: the whole path
    assert main([os.path.join(ROOT, "examples", "mlp.py"), *args]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"plan for {ROOT}/examples/mlp.py on")


def test_max_grad_norm_is_planned_priced_and_checked(tmp_path, capsys):
    # the plan records the clipping, the prediction prices it (slower than the same plan without), and the dry
    # run that -o runs first applies it (tp x pp x dp, under the fake process group)
    out = tmp_path / "plan.json"
    rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", FORCE, "--json"])
    plain = json.loads(capsys.readouterr().out)["prediction"]
    rc2 = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", FORCE, "--max-grad-norm", "1",
                "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == rc2 == 0
    plan = Plan.load(out)
    assert plan.max_grad_norm == 1.0 and plan.predicted["step_time_s"] > plain["step_time_s"]
    assert "gradients clipped to norm 1 first" in text and "bf16  max_grad_norm=1\n" in text
    for bad in ("0", "-1", "nan", "inf"):
        rc = main([GPT, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--max-grad-norm", bad])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "--max-grad-norm must be a positive number" in err, err


def test_a_forced_tp_over_computed_weights_says_why_nothing_shards(tmp_path, capsys):
    # weight_norm computes each Linear's weight in forward: the audit was told only that no Linear can be sharded
    path = tmp_path / "wn.py"
    path.write_text("import torch, torch.nn as nn\nfrom torch.nn.utils.parametrizations import weight_norm\n"
                    "def build_model():\n    return nn.Sequential(weight_norm(nn.Linear(16, 64)), nn.ReLU(), "
                    "weight_norm(nn.Linear(64, 4)))\ndef sample_batch(n):\n    return torch.randn(n, 16), "
                    "torch.randn(n, 4)\n")
    assert main([str(path), "--cluster", "cpu-local", "--batch-size", "4", "--precision", "fp32", "--force",
                 "tp=2"]) == 2
    err = capsys.readouterr().err
    assert "no Linear of this model can be sharded over tp=2 (the weights of 2 of its 2 Linears are computed in " \
           "forward, as torch.nn.utils.parametrize and weight_norm do, and tp shards parameters only)" in err, err
