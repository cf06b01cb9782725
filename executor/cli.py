"""`plan measure PLAN.json MODEL.py [--steps N] [-o measured.json]`: launch the ranks a plan needs, train N steps on
`sample_batch` data, and print predicted vs measured side by side.

Everything that can be checked without starting processes is checked first (the plan loads and is runnable, the
model file loads, the plan was made for this model, its tp layout is one the executor applies, enough
GPUs): bad input is one line and exit status 2. Ranks
run under `torchrun --standalone` (a free port per job, so parallel runs never collide), one thread each by default;
when a rank raises, it prints one line and exits, torchrun stops the others, and this command prints that line and
exits 1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from executor.errors import ExecutorError


def _parser():
    from planner.cli import ArgParser
    p = ArgParser(prog="plan measure", description=(
        "Launch the ranks PLAN needs (torchrun), train STEPS steps of MODEL on sample_batch data with the plan's "
        "parallelism, and print the predicted step time and memory (from the plan) next to the measured ones."))
    p.add_argument("plan", help="plan.json written by `plan ... -o`")
    p.add_argument("model", help="the model file the plan was made for (build_model, sample_batch)")
    p.add_argument("--steps", type=int, default=10, help="training steps, warm-up included (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (default 2)")
    p.add_argument("-o", "--output", help="write predicted/measured/error as JSON here (atomically)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (default 1: ranks share the cores)")
    p.add_argument("--calibrate", metavar="CALIBRATION.json",
                   help="also record the measured step time next to the predicted one in this calibration file "
                        "(its step_time_scale is the median measured/predicted ratio for the plan's cluster)")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p


def check_inputs(plan_path: str, model_path: str):
    """Load and cross-check plan and model file before anything is launched; returns the Plan."""
    from executor.runner import check_plan_matches_model, check_runnable, tp_strategies
    from planner.model_file import build, load_model_file
    from planner.plan import Plan
    plan = Plan.load(plan_path)
    check_runnable(plan)
    model_file = load_model_file(model_path)
    model = build(model_file, "meta")
    check_plan_matches_model(plan, model)
    strategies, _ = tp_strategies(plan, model)
    check_tp_function(plan, model_file, strategies)
    import torch
    if torch.cuda.is_available() and plan.world_size > torch.cuda.device_count():
        raise ExecutorError(f"plan needs {plan.world_size} GPUs, this machine has {torch.cuda.device_count()}; "
                            "multi-node plans run with torchrun on each node and executor.apply_plan")
    return plan


def check_tp_function(plan, model_file, strategies) -> None:
    """ExecutorError when an op of the model would misread the local shards of this tp layout (a `chunk` of a fused
    gate/up projection, a `split` of a fused qkv: `planner.shard_flow`), so the run would train another function."""
    if plan.mesh.tp <= 1 or not strategies:
        return
    from planner.strategies import graph_split_problems, graph_tp_modules
    from planner.trace import trace_model
    graph = trace_model(model_file, batch_size=1, progress=False)
    problems = graph_split_problems(graph, graph_tp_modules(graph), strategies, plan.mesh.tp)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ExecutorError(f"plan's tensor-parallel layout would train a different function: {problems[0]}{more}; "
                            "re-plan with `plan` (it keeps such modules replicated)")


def launch(plan_path: str, model_path: str, world: int, steps: int, warmup: int, threads: int,
           result: str, timeout: float | None = None) -> tuple[int, str]:
    """Run executor.worker on `world` ranks under torchrun; returns (exit status, captured stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "executor.worker", os.path.abspath(plan_path), os.path.abspath(model_path),
           "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads), "--result", result]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHELASTIC_ERROR_FILE="")
    env.pop("TORCHELASTIC_ERROR_FILE")
    proc = subprocess.Popen(cmd, stdout=None, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return 124, err
    return proc.returncode, err


def main(argv: Sequence[str] | None = None) -> int:
    """`plan measure`; returns the exit status."""
    args = _parser().parse_args(list(argv or []))
    if args.steps < 1 or args.warmup < 0:
        raise ExecutorError("--steps must be >= 1 and --warmup >= 0")
    plan = check_inputs(args.plan, args.model)
    from executor.measure import compare, format_report, write_calibration
    from planner.plan import write_atomic
    print(f"plan measure: {plan.world_size} rank(s) (dp {plan.mesh.dp} x tp {plan.mesh.tp} x pp {plan.mesh.pp}), "
          f"{args.steps} steps ({args.warmup} warm-up)", flush=True)
    with tempfile.TemporaryDirectory(prefix="shardwise-measure-") as tmp:
        result = os.path.join(tmp, "measured.json")
        t0 = time.perf_counter()
        rc, err = launch(args.plan, args.model, plan.world_size, args.steps, args.warmup, args.threads, result,
                         args.timeout)
        if rc != 0 or not os.path.exists(result):
            lines = [l for l in err.splitlines() if l.startswith("shardwise rank")]
            why = lines[0] if lines else (err.strip().splitlines()[-1] if err.strip() else f"exit status {rc}")
            print(f"plan measure: the job failed after {time.perf_counter() - t0:.1f} s: {why}", file=sys.stderr)
            if args.debug:
                print(err, file=sys.stderr)
            return 1
        with open(result) as f:
            measured = json.load(f)
    out = compare(plan, measured)
    print(format_report(plan, measured))
    if args.output:
        write_atomic(args.output, json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.output}")
    if args.calibrate:
        data = write_calibration(args.calibrate, plan, out)
        print(f"calibration: {args.calibrate} step_time_scale = {data['step_time_scale']}")
    return 0
