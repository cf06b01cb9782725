"""`apply_plan(compile=...)` / `plan measure --compile`: each block torch.compile'd in place, after activation
checkpointing, trains the eager function (one process, a one-rank gloo group; backend aot_eager: no C compiler)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from planner.plan import Mesh, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.mark.parametrize("recompute", ["full", "attention"])
def test_compiled_blocks_train_the_eager_function(recompute):
    # under attention recompute a compiled block checkpoints its SDPA call with torch's checkpoint, which dynamo
    # traces (the executor's own re-run Function is for eager blocks)
    from gpt import GPT, GPTConfig, sample_batch

    from executor import apply_plan
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    plan = Plan(mesh=Mesh(), global_batch_size=2, microbatch_size=2, num_microbatches=1, precision="fp32",
                recompute=recompute)
    started = not dist.is_initialized()
    losses, runners = {}, {}
    try:
        for backend in (None, "aot_eager"):
            torch.manual_seed(0)
            model = GPT(cfg)
            runners[backend] = apply_plan(model, plan, compile=backend)
            torch.manual_seed(1)
            losses[backend] = [runners[backend].step(*sample_batch(2, cfg)) for _ in range(3)]
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
    compiled = runners["aot_eager"].parts[0]
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.h)
    assert getattr(runners[None].parts[0].h[0], "_compiled_call_impl", None) is None
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses[None], losses["aot_eager"])), losses
    assert any("compiled" in n for n in runners["aot_eager"].notes)


def test_an_unknown_backend_is_one_line_exit_2(tmp_path, capsys):
    from planner.cli import main
    plan = Plan(mesh=Mesh(), global_batch_size=2, microbatch_size=2, num_microbatches=1, precision="fp32")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    code = main(["measure", str(path), os.path.join(ROOT, "examples", "gpt.py"), "--compile", "nosuch"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nosuch" in err[0] and "inductor" in err[0], err


def test_compile_before_the_files_says_it_took_the_plan(tmp_path, capsys):
    # `--compile plan.json model.py`: argparse gave --compile the plan and said only "required: model"
    from planner.cli import main
    plan = Plan(mesh=Mesh(), global_batch_size=2, microbatch_size=2, num_microbatches=1, precision="fp32")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    with pytest.raises(SystemExit) as exit_:  # argparse's own exit, status 2
        main(["measure", "--compile", str(path), os.path.join(ROOT, "examples", "gpt.py")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "is a file, not a torch.compile backend: put --compile after" in err[0]
