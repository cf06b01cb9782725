"""A pipelined model with batch norms keeps one process's running statistics: torch's pipelining runs each stage's
module once before the first step to infer its shapes (`executor.pipeline.RecvOnDemandStage`)."""
import json
import os
import subprocess
import sys
import textwrap

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = os.path.join(ROOT, "examples", "resnet.py")
STEPS, BATCH, MICRO = 2, 8, 2

RANK = textwrap.dedent(f"""
    import json, sys
    import torch
    sys.path.insert(0, {ROOT!r})
    from executor import apply_plan
    from planner.model_file import load_model_file
    from planner.plan import Plan
    torch.set_num_threads(1)
    mf, plan = load_model_file({RESNET!r}), Plan.load(sys.argv[1])
    torch.manual_seed(0)
    model = mf.build_model()
    runner = apply_plan(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                        example_inputs=mf.sample_batch({MICRO})[0])
    torch.manual_seed(1)
    data = [mf.sample_batch({BATCH}) for _ in range({STEPS + 1})]
    losses = [runner.step(x, y) for x, y in data[:-1]]
    evaluated = runner.evaluate(*data[-1])
    if torch.distributed.get_rank() == 0:
        json.dump({{"losses": losses, "eval": evaluated}}, open(sys.argv[2], "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a gloo process left to exit with its group can abort in teardown
""")


def _reference():
    """One process: the same micro-batches in order (each updating the running statistics), gradients summed over
    them, SGD; then the eval-mode loss on a held-out batch."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from planner.model_file import default_loss, load_model_file
    mf = load_model_file(RESNET)
    torch.manual_seed(0)
    model = mf.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    data = [mf.sample_batch(BATCH) for _ in range(STEPS + 1)]
    losses = []
    for x, y in data[:-1]:
        total = 0.0
        for k in range(0, BATCH, MICRO):
            loss = default_loss(model(x[k:k + MICRO]), y[k:k + MICRO]) / (BATCH // MICRO)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        return losses, default_loss(model(data[-1][0]), data[-1][1]).item()


def test_pipelined_batch_norms_keep_one_process_running_statistics(tmp_path):
    from planner.cli import main as plan_main
    plan = tmp_path / "plan.json"
    assert plan_main([RESNET, "--cluster", "cpu-local", "--batch-size", str(BATCH), "--precision", "fp32",
                      "--force", f"pp=2,mbs={MICRO},schedule=1f1b", "--no-check", "-o", str(plan)]) == 0
    rank, out = tmp_path / "rank.py", tmp_path / "out.json"
    rank.write_text(RANK)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(rank), str(plan), str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    losses, evaluated = _reference()
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) <= 1e-4, (got["losses"], losses)
    # before: the last stage's statistics had taken in a forward of uninitialised tensors (eval loss nan)
    assert abs(got["eval"] - evaluated) <= 1e-4, (got["eval"], evaluated)


def test_a_stage_output_or_gradient_that_is_not_contiguous_is_sent(tmp_path):
    """A batch-first LSTM's output (a transposed view) crosses the pp=2 boundary, and a Conv1d tagger's output
    gradient arrives in a buffer torch gives channels-last strides: every send and receive is contiguous, and each
    run's losses are one process's (the LSTM's first send died, the tagger's first backward receive: 'input tensor
    has to be contiguous', after plan and plan check had passed)."""
    from shared import reference_losses, train_in_one_launch

    from planner.cli import main
    jobs = []
    for name, force in (("batch_first_lstm", "pp=2,mbs=2,schedule=gpipe"), ("conv1d_tagger", "pp=2,mbs=2,schedule=1f1b")):
        model = os.path.join(ROOT, "tests", "zoo", f"{name}.py")
        plan = tmp_path / f"{name}.json"
        assert main([model, "--cluster", "cpu-local", "--batch-size", "4", "--precision", "fp32", "--force", force,
                     "-o", str(plan)]) == 0
        jobs.append({"name": name, "model": model, "plan": str(plan)})
    stages = [s["modules"] for s in json.loads((tmp_path / "batch_first_lstm.json").read_text())["stages"]]
    assert stages == [["encoder", "rnn"], ["decoder"]]
    got = train_in_one_launch(jobs, 2, str(tmp_path), 3)
    for job in jobs:
        run = got[job["name"]]
        assert "error" not in run, run
        ref = reference_losses(job["model"], 3, 4)
        assert max(abs(a - b) for a, b in zip(run["losses"], ref)) < 1e-5, (job["name"], run["losses"], ref)
