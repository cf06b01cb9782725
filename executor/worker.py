"""The per-rank program `plan measure` launches under torchrun: build the model, apply the plan, train, measure.

    python -m torch.distributed.run --standalone --nproc-per-node N -m executor.worker PLAN MODEL.py --steps S \
        --warmup W --result RESULT.json

Every rank builds the model from the same seed and draws the same `sample_batch` data (each dp replica trains on its
share). Rank 0 writes the `measured` block to RESULT.json (with every step's loss, `losses`). A rank that raises prints one line
`shardwise rank R: <error>` on stderr and exits 1 at once, so torchrun stops the other ranks. With `--trace DIR`
the steps after warm-up run under torch.profiler and each rank writes DIR/profiler_rankR.json (the raw trace) and
DIR/measured_rankR.json (one step on the predicted timeline's tracks, see executor.trace).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from executor.errors import first_line

BUILD_SEED = 0
"""Seed every rank builds the model with (the runner also broadcasts rank 0's weights)."""
DATA_SEED = 1234
"""Seed of sample_batch's own random stream (`planner.model_file.Batches`), the same on every rank."""
STEP_SEED = 4321
"""Seed of the random numbers the model draws while it trains (dropout), the same on every rank."""


def _run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from executor import trace
    from executor.runner import apply_plan
    from planner.model_file import Batches, batch, build, load_model_file
    from planner.plan import Plan, write_atomic

    torch.set_num_threads(args.threads)
    plan = Plan.load(args.plan)
    mf = load_model_file(args.model)
    torch.manual_seed(BUILD_SEED)
    model = build(mf)
    example = batch(mf, plan.microbatch_size)[0]  # tp exports the model with it (the graph the plan names)
    runner = apply_plan(model, plan, loss_fn=mf.loss_fn, example_inputs=example, compile=args.compile)
    rank = dist.get_rank()
    torch.manual_seed(STEP_SEED)
    batches = Batches(mf, DATA_SEED)
    losses = []
    prof, pg_names = None, {}
    for i in range(args.steps):
        if args.trace and i == args.warmup:  # profile the steps after warm-up
            prof = trace.start_profiler()
            pg_names = trace.mark_groups(trace.process_groups(runner))
        inputs, targets = batches(plan.global_batch_size)
        with trace.record(f"{trace.STEP_SPAN} {i + 1}"):
            loss = runner.step(inputs, targets)
        losses.append(loss)
        if rank == 0:
            t = runner.timings.step[-1]
            tracked = len(runner.timings.step) - 1 in runner.timings.tracked
            labels = [name for name, on in (("warm-up", i < args.warmup), ("memory tracked", tracked)) if on]
            tag = f" ({', '.join(labels)})" if labels else ""
            print(f"step {i + 1}/{args.steps}  loss {loss:.4f}  {t * 1e3:.1f} ms{tag}", flush=True)
    if prof is not None:
        prof.stop()
        _write_trace(args, runner, prof, pg_names)
    measured = runner.measurement(args.warmup)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"step_time_s": measured["step_time_s"],
                                      "peak_memory_bytes": measured["peak_memory_bytes"],
                                      "memory_bytes": measured["memory_bytes"]})
    if rank == 0:
        measured["step_time_s"] = max(r["step_time_s"] for r in per_rank)  # the slowest rank's median
        measured["step_time_s_per_rank"] = [r["step_time_s"] for r in per_rank]
        measured["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in per_rank)
        measured["memory_bytes"] = max((r["memory_bytes"] for r in per_rank), key=lambda m: m["peak"])
        measured["peak_memory_bytes_per_rank"] = [r["peak_memory_bytes"] for r in per_rank]
        measured["world_size"] = dist.get_world_size()
        measured["device"] = str(runner.device.type)
        measured["threads_per_rank"] = args.threads
        measured["final_loss"] = loss if args.steps else None
        measured["losses"] = losses
        write_atomic(args.result, json.dumps(measured) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _write_trace(args: argparse.Namespace, runner, prof, pg_names: dict[str, str]) -> None:
    """Write this rank's raw profiler trace (profiler_rankR.json) and its measured step on the predicted
    timeline's tracks (measured_rankR.json): the profiled step whose time on rank 0 is the median."""
    import torch.distributed as dist

    from executor import trace
    from hardware_profiles.files import atomic_output
    from planner.plan import write_atomic
    rank = dist.get_rank()
    profiled = runner.timings.step[args.warmup:]
    pick = [sorted(range(len(profiled)), key=profiled.__getitem__)[(len(profiled) - 1) // 2]]
    dist.broadcast_object_list(pick, src=0)
    raw_path = os.path.join(args.trace, f"profiler_rank{rank}.json")
    with atomic_output(raw_path, suffix=".json") as tmp:
        prof.export_chrome_trace(tmp)
    with open(raw_path) as f:
        raw = json.load(f)
    m = runner.mesh
    where = f" (pp {m['pp'].get_local_rank()}, dp {m['dp'].get_local_rank()}, tp {m['tp'].get_local_rank()})"
    plan = runner.plan
    fallback = "dp comm" if plan.mesh.dp > 1 else "tp comm" if plan.mesh.tp > 1 else "pp comm"
    doc = trace.measured_trace(raw, rank, pick[0], pipelined=plan.mesh.pp > 1, pg_names=pg_names,
                               fallback=fallback, label=where)
    write_atomic(os.path.join(args.trace, f"measured_rank{rank}.json"), json.dumps(doc) + "\n")


MODEL_CODE = " [raised in the model's code: "
"""Marks a rank's error line whose exception came out of the model file's own code (`plan measure` then exits 2:
bad input, as a model file that fails to load)."""


DEFAULT_LOSS_FRAMES = ("default_loss", "summed_cross_entropy", "logits_of")
"""planner.model_file's functions that run the default loss on the model's outputs (a padded batch's summed
cross-entropy: `Runner._token_scale`)."""


def model_file_frame(e: BaseException, model_path: str) -> str:
    """`MODEL_CODE` + where (` [raised in the model's code: MODEL.py line N, in FUNC: ...]`) when the innermost
    frame of `e`'s traceback in the model file's folder (or in the default loss) has nothing of DTensor, FSDP or
    shardwise below it, else ""."""
    folder = os.path.dirname(os.path.abspath(model_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = tuple(os.path.join(root, pkg) + os.sep for pkg in ("executor", "planner", "cost_model", "hardware_profiles"))
    default = os.path.join(root, "planner", "model_file.py")  # the default loss reads the model's own outputs
    tb = traceback.extract_tb(e.__traceback__)
    files = [os.path.abspath(f.filename) for f in tb]
    is_default = [p == default and f.name in DEFAULT_LOSS_FRAMES for p, f in zip(files, tb)]
    mine = [i for i, p in enumerate(files) if os.path.dirname(p) == folder or is_default[i]]
    if not mine:
        return ""
    if any(p.startswith(ours) or f"{os.sep}torch{os.sep}distributed{os.sep}" in p for p in files[mine[-1] + 1:]):
        return ""  # raised under DTensor, FSDP or the executor: the plan's doing, not the model's
    f = tb[mine[-1]]
    where = "the default loss (cross-entropy or MSE of the model's outputs against sample_batch's targets)" \
        if is_default[mine[-1]] else f"{os.path.basename(f.filename)} line {f.lineno}, in {f.name}"
    return (f"{MODEL_CODE}{where}: the dry run checks shapes on fake tensors, not values such as class ids; fix "
            "the model file]")


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank."""
    p = argparse.ArgumentParser(prog="executor.worker")
    p.add_argument("plan")
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--result", required=True)
    p.add_argument("--trace", help="folder for the profiler traces of the steps after warm-up")
    p.add_argument("--compile", metavar="BACKEND", help="torch.compile each block with this backend")
    args = p.parse_args(argv)
    try:
        _run(args)
    except BaseException as e:  # one line, then die at once so torchrun tears the job down
        rank = os.environ.get("RANK", "?")
        msg = first_line(str(e))
        # one write: the ranks share stderr, and print's separate newline let two ranks' lines run together
        sys.stderr.write(f"shardwise rank {rank}: {type(e).__name__}: {msg}{model_file_frame(e, args.model)}\n")
        sys.stderr.flush()
        if os.environ.get("SHARDWISE_DEBUG"):
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
