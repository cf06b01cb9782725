"""Trains every (model file, plan) pair of a jobs file in one torchrun launch, for tests/test_zoo.py.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/zoo_worker.py JOBS.json OUT_DIR

JOBS.json: {"steps": S, "jobs": [{"name", "model", "plan"}, ...]}, every plan for N ranks; a job's
"track_memory": false applies its plan with `apply_plan(..., track_memory=False)` (no step under MemTracker). Each model trains as
`plan measure`'s worker (executor/worker.py) trains it: the same build and data seeds, `executor.apply_plan`,
`runner.step` on `sample_batch(plan.global_batch_size)`. Rank 0 writes OUT_DIR/NAME.json per job:
{"losses": [...]} or {"error": "rank R: Type: first line", "where": "file:line in function"} (the error of the
rank that failed first; the other ranks' follow-on errors are dropped), plus "seconds" (and for a job that ran,
rank 0's "apply_seconds" to build and apply the plan, "step_seconds", "eval_seconds"); and OUT_DIR/NAME.started
when the job starts.

A failing model does not stop the launch: each job gets its own process groups (the default group is destroyed
and re-created over a fresh store prefix after every job, after a barrier on the store), so nothing of one job
leaks into the next; a rank left waiting in a collective of a failed job fails it after PG_TIMEOUT_S.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG_TIMEOUT_S = 30
"""A collective still waiting after this long fails its job instead of hanging the launch: a rank whose peer
failed outside a collective waits this long (the peer's groups are destroyed, but something in torch keeps their
gloo connections open until the process exits). Healthy ranks here never wait on each other for seconds."""
STATUS_TIMEOUT_S = 240
"""How long rank 0 waits for another rank's status of one job (past PG_TIMEOUT_S: that rank's collective times
out first)."""


def _where(exc: BaseException) -> str:
    """'file:line in function' of the deepest frame in this repository (model file or shardwise code), else the
    deepest frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(ROOT + os.sep)
            and not os.path.abspath(f.filename).startswith(os.path.abspath(__file__))]
    f = (ours or frames or [None])[-1]
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} in {f.name}" if f else ""


def _train(job: dict, steps: int) -> dict:
    import torch

    from executor import apply_plan
    from executor.worker import BUILD_SEED, DATA_SEED, STEP_SEED
    from planner.model_file import Batches, batch, build, load_model_file
    from planner.plan import Plan

    start = time.perf_counter()
    plan = Plan.load(job["plan"])
    mf = load_model_file(job["model"])
    torch.manual_seed(BUILD_SEED)
    model = build(mf)
    example = batch(mf, plan.microbatch_size)[0]  # to export what fx cannot trace (pp, tp)
    runner = apply_plan(model, plan, loss_fn=mf.loss_fn, example_inputs=example,
                        track_memory=job.get("track_memory", True))
    applied = time.perf_counter()
    torch.manual_seed(STEP_SEED)
    batches = Batches(mf, DATA_SEED)
    losses, first, step_seconds = [], None, []
    for _ in range(steps):
        t0 = time.perf_counter()
        inputs, targets = batches(plan.global_batch_size)
        first = first or (inputs, targets)
        losses.append(float(runner.step(inputs, targets)))
        step_seconds.append(round(time.perf_counter() - t0, 2))
    t0 = time.perf_counter()
    evals = [runner.evaluate(*first) for _ in range(2)]  # forward only, eval mode, on the first batch, twice
    return {"losses": losses, "eval": evals[0], "eval_again": evals[1], "apply_seconds": round(applied - start, 2),
            "step_seconds": step_seconds, "eval_seconds": round(time.perf_counter() - t0, 2)}


def _status(job: dict, steps: int) -> dict:
    """This rank's result of one job: its losses, or its error (one line) with where and when it was raised."""
    t0 = time.perf_counter()
    try:
        out = _train(job, steps)
    except Exception as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        out = {"error": f"{type(e).__name__}: {line}", "where": _where(e), "failed_at": time.time()}
        if os.environ.get("SHARDWISE_DEBUG"):
            traceback.print_exc()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _merge(statuses: list[dict]) -> dict:
    """One job's result from every rank's status: rank 0's losses, or the first error raised."""
    failed = [(s["failed_at"], r, s) for r, s in enumerate(statuses) if "error" in s]
    if not failed:
        return {k: statuses[0][k] for k in ("losses", "eval", "eval_again", "seconds", "apply_seconds", "step_seconds",
                                            "eval_seconds")}
    _, rank, s = min(failed, key=lambda f: f[:2])
    return {"error": f"rank {rank}: {s['error']}", "where": s["where"], "seconds": s["seconds"]}


def main(argv: list[str]) -> int:
    """Run the jobs of argv[0] on this rank; rank 0 writes one result file per job into argv[1]."""
    import torch
    import torch.distributed as dist

    jobs_path, out_dir = argv
    with open(jobs_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world))
    store.set_timeout(datetime.timedelta(seconds=STATUS_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    import executor.worker, planner.model_file, planner.plan  # noqa: F401 - what every job imports, before the freeze
    gc.collect()
    gc.freeze()  # the collections between jobs then skip torch's and shardwise's own objects
    for i, job in enumerate(spec["jobs"]):
        if rank == 0:  # tells the launcher which job a launch died in
            open(os.path.join(out_dir, job["name"] + ".started"), "w").close()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"zoo/{i}", store), rank=rank, world_size=world,
                                timeout=timeout)
        status = _status(job, spec["steps"])
        gc.collect()
        dist.destroy_process_group()
        store.set(f"zoo/{i}/status/{rank}", json.dumps(status))
        try:  # also the barrier before the next job's groups: every rank is out of this job
            result = _merge([json.loads(store.get(f"zoo/{i}/status/{r}")) for r in range(world)])
        except Exception as e:  # a rank hangs outside any collective: the launch cannot go on
            result = {"error": f"a rank reported no result within {STATUS_TIMEOUT_S} s ({e})", "where": ""}
        if rank == 0:
            _write(out_dir, job["name"], result)
        if "seconds" not in result:
            return 1
    return 0


def _write(out_dir: str, name: str, result: dict) -> None:
    tmp = os.path.join(out_dir, name + ".json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, name + ".json"))
    print(f"zoo {name}: {result.get('error') or result['losses']} ({result.get('seconds')} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
