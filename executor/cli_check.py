"""`plan check PLAN.json MODEL.py`: dry-run a plan on fake tensors under a fake process group (`executor.dry_run`)
and print `ok: ...` (exit 0) or one line naming the rank, module, tp placement and op that failed (exit 2).

`plan MODEL.py ... -o plan.json` runs the same check before it writes (unless `--no-check`).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Sequence


def _parser():
    from planner.cli import ArgParser
    p = ArgParser(prog="plan check", description=(
        "Apply PLAN to MODEL with the executor's own code on fake tensors (no memory, no communication) under a fake "
        "process group at the plan's world size, and run one micro-batch's forward, backward and optimizer step on "
        "rank 0 of each pipeline stage. Prints ok, or one line naming the module, its tp placement and the op that "
        "failed (exit 2). Not checked: pipeline P2P between stages, numerics, real memory."))
    p.add_argument("plan", help="plan.json written by `plan ... -o` or by hand")
    p.add_argument("model", help="the model file (build_model, sample_batch)")
    p.add_argument("--debug", action="store_true", help="print the failing traceback too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`plan check`; returns the exit status (bad input raises PlanError / ModelError for the CLI to print)."""
    from executor.dry_run import dry_run
    from executor.plan_checks import check_plan_matches_model
    from planner.model_file import build, load_model_file
    from planner.plan import Plan
    args = _parser().parse_args(list(argv or []))
    plan = Plan.load(args.plan)
    model_file = load_model_file(args.model)
    # as `plan measure` does: a plan made for another model fails the dry run with a message naming no fix
    check_plan_matches_model(plan, build(model_file, "meta"))
    t0 = time.perf_counter()
    notes: list[str] = []
    ran: list[int] = []
    problems = dry_run(plan, model_file, label=os.path.basename(args.plan), debug=args.debug, notes=notes,
                       on_stage=lambda stage, stages: ran.append(stage))
    if problems:
        print(f"plan check: {problems[0]}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    m = plan.mesh
    total = m.pp * plan.virtual_stages
    if m.pp == 1:
        stages = "rank 0"
    elif len(ran) == total:
        stages = f"rank 0 of each of {total} pipeline stages"
    else:  # middle stages like one already run are skipped (or the check stopped early: see the note)
        stages = f"rank 0 of {len(ran)} of the {total} pipeline stages" + (
            "" if notes else " (each other one holds the same blocks, on the same inputs, as one of those)")
    ok = "ok (partly, see the note)" if notes else "ok"
    print(f"{ok}: {os.path.basename(args.plan)} ran on fake tensors at world {plan.world_size} (dp {m.dp} x tp "
          f"{m.tp} x pp {m.pp}): one micro-batch of {plan.microbatch_size}, forward, backward and optimizer step "
          f"on {stages}, {time.perf_counter() - t0:.1f} s")
    return 0
