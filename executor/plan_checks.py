"""What the executor refuses before it applies a plan: a plan for another model, a schedule its micro-batches cannot
run, a tp plan that places no parameter, a missing or mis-sized example micro-batch, a launch of the wrong world
size. Each is one `ExecutorError` naming the fix, raised before any process group starts (`apply_plan`) or, in the
launching process, before any rank is started (`plan measure`, `plan check`)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from executor import tp
from executor.errors import ExecutorError
from planner.plan import Plan, model_fingerprint, schedule_problem


def load_plan(plan_or_path: Plan | str | os.PathLike) -> Plan:
    """A Plan, or one read from plan.json (PlanError on bad content)."""
    return plan_or_path if isinstance(plan_or_path, Plan) else Plan.load(plan_or_path)


def check_plan_matches_model(plan: Plan, model: nn.Module) -> None:
    """Refuse a plan made for another model: parameter count and name/shape fingerprint must agree."""
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    want_fp = plan.model.get("fingerprint")
    if want_fp and want_fp != model_fingerprint(named):
        raise ExecutorError(f"plan was made for another model (parameter names/shapes differ: fingerprint "
                            f"{want_fp} vs {model_fingerprint(named)}); re-plan for this model")
    want_n = plan.model.get("parameters")
    have_n = sum(p.numel() for p in model.parameters())
    if want_n and int(want_n) != have_n:
        raise ExecutorError(f"plan was made for a model with {int(want_n):,} parameters, this one has {have_n:,}; "
                            "re-plan for this model")
    check_stages_match_model(plan, model)


def check_stages_match_model(plan: Plan, model: nn.Module) -> None:
    """The plan's stages name modules this model has (whatever pp: a plan without its fingerprint is still caught
    naming another model's modules), and with pipelining end within its layers (`executor.pipeline.stage_modules`)."""
    from executor.pipeline import check_stage_modules, stage_modules
    if plan.mesh.pp > 1 and plan.stages:
        stage_modules(model, plan)  # checks the modules too, where listed
    elif any(s.modules for s in plan.stages):
        check_stage_modules(model, [list(s.modules) for s in plan.stages])


def plan_graph(plan: Plan) -> str:
    """Which graph the plan's ops name: `export` (torch.export's; also a plan that does not say) or `fx`."""
    return plan.model.get("graph", "export")


def check_example(plan: Plan, example_inputs: Any) -> None:
    """The micro-batch a tp plan's model is exported with: given, and of the plan's micro-batch size (export fixes
    the shapes it sees: a `view(b, t, ...)` traced at another batch fails at the first step)."""
    from torch.utils._pytree import tree_flatten
    if example_inputs is None:
        raise ExecutorError("the plan's ops name the model's torch.export graph, which the executor runs under tp; "
                            "pass example_inputs= (one micro-batch, as the model is called) to apply_plan")
    sizes = {t.shape[0] for t in tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor) and t.dim() > 0}
    if sizes and plan.microbatch_size not in sizes:
        raise ExecutorError(f"example_inputs holds {min(sizes)} samples, the plan's micro-batch {plan.microbatch_size}"
                            f": the model is exported with it and keeps its shapes; pass one micro-batch of "
                            f"{plan.microbatch_size}")


def check_runnable(plan: Plan) -> None:
    """Plan properties the executor needs beyond `Plan.validate`: the pipeline schedule's micro-batch count
    (`planner.plan.schedule_problem`)."""
    problem = schedule_problem(plan.schedule, plan.mesh.pp, plan.num_microbatches)
    if problem:
        raise ExecutorError(f"{problem}; raise num_microbatches (a larger global batch or a smaller micro-batch) or "
                            "use schedule gpipe")


def check_tp_plan(plan: Plan, model: nn.Module) -> None:
    """A tp > 1 plan must say where its parameters live (`Plan.parameters`, written by `plan`); the executor never
    derives a layout of its own. ExecutorError naming the fix otherwise, or when a placed parameter is missing or
    not divisible by tp."""
    if plan.mesh.tp <= 1:
        return
    if not plan.parameters:
        raise ExecutorError(f"plan has tp={plan.mesh.tp} but places no parameter over it (no `parameters`); make "
                            f"the plan with `plan MODEL --force tp={plan.mesh.tp} -o plan.json`, which writes them")
    tp.check_parameters(plan, model)


def check_world(plan: Plan) -> tuple[int, int]:
    """(rank, world size) from the torchrun environment; the plan's world size must match."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world != plan.world_size:
        raise ExecutorError(f"plan needs {plan.world_size} ranks (dp {plan.mesh.dp} x tp {plan.mesh.tp} x pp "
                            f"{plan.mesh.pp}) but {world} were launched; run torchrun --nproc-per-node "
                            f"{plan.world_size} (or `plan measure`, which launches them)")
    return rank, world
