"""Dry run: apply a plan with the executor's own `apply_plan` and run one micro-batch's forward, backward and
optimizer step on fake tensors, in this process, under a fake process group at the plan's world size.

    problems = dry_run(plan, "model.py")      # [] when the plan runs; else one line naming module, op, placement

Nothing real is allocated or communicated: the model is built under `FakeTensorMode` (tensors carry shape, dtype
and device, no storage) and `torch.distributed` runs on the `fake` backend (every collective completes at once
without moving data), so a 1.5B-parameter plan is checked in seconds. What runs is what one rank runs under
torchrun: `executor.apply_plan` builds the (pp, dp, tp) DeviceMesh, cuts the pipeline stages and applies TP/SP,
activation checkpointing and FSDP2/DDP; then the runner's own micro-batch loop (`Runner._forward_backward`:
gradient-sync context, autocast, loss), the tied-weight gradient exchange and the optimizer step run once. DDP's
C++ reducer cannot hold fake tensors, so a DDP plan runs under FSDP2's `replicate` (the same gradient all-reduce),
and what DDP alone requires is checked after backward: every parameter got a gradient.

Which ranks run. Rank 0 of each pipeline stage (global rank `pp_rank * dp * tp`): within a stage every dp and tp
rank runs the same program on tensors of the same shapes (equal tp shards, FSDP2 shards padded to one size), so
one rank per stage meets every op and every placement. When tp does not divide a sharded parameter's dim, DTensor
gives the last tp rank smaller shards, so that rank runs too. Above `MAX_DP` the dry run uses dp = `MAX_DP` (see
there), and says so.

Pipelines. The schedules exchange activations point to point, which the fake backend cannot deliver (a received
tensor would carry no shape). Each stage module therefore runs on its own, in stage order: the first stage gets the
micro-batch; each later stage gets fresh tensors of the shapes and dtypes the previous stage's forward returned
(what the schedule would send); a non-last stage's backward gets gradients shaped like its outputs; the last
stage computes the loss. Checked: every stage's forward and backward as parallelized, the boundary shapes, the
tied-weight gradient exchange, the optimizer. Not checked: the schedule's P2P ordering and micro-batch splitting.
Middle stages made of the same module types, on the same input shapes, run the same program: the first runs.
Each rank run builds its own model; a model cut from its torch.export graph is exported once per dry run and the
later ranks' models reuse that export over their own tensors (`executor.pipeline.shared_exports`).

What a dry run cannot check: numerics (fake tensors have no values), real memory and time, and anything after an
op fake tensors cannot run (`UNCHECKABLE`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import traceback
import warnings
from typing import Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                          UnsupportedOperatorException, unset_fake_temporarily)

from executor.errors import ExecutorError, first_line
from executor.pipeline import shared_exports
from planner.errors import ModelError
from planner.model_file import ModelFile, batch, build, frame_in_file, load_model_file, replace_tensors
from planner.plan import Plan

class _Unchecked(RuntimeError):
    """Something the dry run cannot reproduce (not a failure of the plan)."""


UNCHECKABLE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException, _Unchecked)
"""What fake tensors cannot run (values needed, or no fake kernel), or the dry run cannot rebuild: the end of what
a dry run checks, not a failure of the plan."""
ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
"""torchrun's variables `apply_plan` reads; set for the dry run and restored afterwards."""
MAX_DP = 8
"""The dry run's largest dp degree. Every dp replica runs the same program on a micro-batch of the plan's size
whatever dp is, but FSDP2 cuts each parameter into dp views when it wraps, which costs ~25 µs per view on fake
tensors: GPT-3 175B at dp=256 would spend ~25 s there. Above it the dry run runs dp = MAX_DP and says so."""


@dataclasses.dataclass
class _Where:
    """Where the dry run is, for the failure line."""

    pp_rank: int = 0
    """Pipeline rank being run (its dp coordinate is 0)."""
    tp_rank: int = 0
    """Tensor-parallel rank being run."""
    stage: int | None = None
    """Pipeline stage being run (None without pipelining)."""
    phase: str = "apply_plan"
    """apply_plan, forward, loss/backward, after backward or optimizer step."""
    modules: list[str] = dataclasses.field(default_factory=list)
    """Stack of running modules by path (forward hooks); on an exception the top is the innermost."""
    ops: list[tuple] = dataclasses.field(default_factory=list)
    """Stack of running (aten op, its arguments); on an exception the top is the op that raised."""
    strategies: dict[str, str] = dataclasses.field(default_factory=dict)
    """Module path -> tp strategy the runner applies."""
    uneven: bool = False
    """Set when some tp-sharded parameter dim is not divisible by tp."""
    gathered_logits: str | None = None
    """The runner's note when the loss fell back to gathered logits (`Runner.gather_logits`)."""


def dry_run(plan: Plan | str | os.PathLike, model: ModelFile | str, *, label: str | None = None,
            debug: bool = False, notes: list[str] | None = None, on_stage=None) -> list[str]:
    """Apply `plan` to the model file's model on fake tensors under a fake process group and run one micro-batch's
    forward, backward and optimizer step on each representative rank (see the module docstring).

    Returns [] when all of it ran, else one line naming the rank, the module and its tp placement, the aten op
    and the model-file line, e.g. `dry run of plan.json at world 2 (rank 0: pp 0 dp 0 tp 0): forward of module
    h.0.attn (q_proj, k_proj, v_proj colwise; o_proj rowwise): aten.view.default on local [4, 32, 32]:
    RuntimeError: shape '[4, 32, 4, 16]' is invalid for input of size 4096 at model.py:11`. Leaves no process
    group, environment variable or tensor mode behind; raises ExecutorError when a process group is running, and
    the model file's ModelError when build_model() or sample_batch() fails outside the fake run too.
    `debug` (or SHARDWISE_DEBUG set): also print the failure's traceback. An op fake tensors cannot run (one
    whose result depends on tensor values, `.item()`, `nonzero`, or a kernel without a fake implementation) ends
    the check there without a problem: a line saying what was left unchecked is appended to `notes`.
    `on_stage(stage, stages)` is called before each pipeline stage that runs (not for those skipped as like one
    already run; never without pipelining): each of a large model's stages takes seconds.
    """
    import torch.distributed as dist

    from executor.plan_checks import load_plan
    label = label or ("the plan" if isinstance(plan, Plan) else os.path.basename(str(plan)))
    plan = load_plan(plan)
    mf = load_model_file(model) if isinstance(model, str) else model
    if dist.is_available() and dist.is_initialized():
        raise ExecutorError("dry run: a process group is already running in this process; run it before "
                            "init_process_group (it starts and destroys its own fake one)")
    run = run_plan(plan)
    m = plan.mesh
    head = f"dry run of {label} at world {plan.world_size}"
    if run.mesh.dp != m.dp:
        head += f" (dp {m.dp} run as dp {run.mesh.dp})"
    try:
        stages = _stages(plan, mf)
    except ModelError:  # build_model() itself failed: the model file's error, not the plan's
        raise
    except Exception as e:  # noqa: BLE001 — stage_modules refusing the model: what apply_plan would say
        return [f"{head} (rank 0): {_describe(e, _Where(), mf)}"]
    with shared_exports():  # each pipeline rank builds its own model; one torch.export serves them all
        boundary: tuple | None = None
        done: dict[tuple, tuple | None] = {}  # (stage signature, its inputs) -> its outputs
        for stage, signature in stages:
            key = (signature, boundary)
            if _hashable(key) and key in done:  # a middle stage like one already run, on the same inputs
                boundary = done[key]
                continue
            if on_stage is not None and stage is not None:
                on_stage(stage, len(stages))
            gathered: list[str] = []
            loud = debug or os.environ.get("SHARDWISE_DEBUG")
            # torch.fx prints the generated code's failing lines to stderr before raising; the failure is said below
            with contextlib.nullcontext() if loud else contextlib.redirect_stderr(io.StringIO()):
                out, where, error = _check_stage(run, mf, stage, boundary, gathered)
            if gathered and notes is not None and gathered[0] not in notes:
                notes.append(gathered[0])
            if error is not None:
                if isinstance(error, ModelError):
                    _raise_model_file_error(mf, run.microbatch_size)
                if debug or os.environ.get("SHARDWISE_DEBUG"):
                    traceback.print_exception(error)
                st = "" if stage is None else f", stage {stage}"
                line = (f"{head} (rank {where.pp_rank * m.dp * m.tp + where.tp_rank}: pp {where.pp_rank} dp 0 tp "
                        f"{where.tp_rank}{st}): ")
                if not isinstance(error, UNCHECKABLE):
                    return [line + _describe(error, where, mf)]
                if notes is not None:
                    notes.append(line + f"checked up to {_describe(error, where, mf)}; not beyond: fake tensors carry "
                                 "no values, so this op cannot run in a dry run")
                return []
            if _hashable(key):
                done[key] = out
            boundary = out
        return []


def _raise_model_file_error(mf: ModelFile, batch_size: int) -> None:
    """Raise the ModelError that build_model() (on meta) or sample_batch(batch_size) gives outside the fake run,
    if any: then the model file is at fault, and says so as `plan MODEL.py` would, not as a plan's failure."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as in the run: its warnings belong to the real run
        build(mf, "meta")
        batch(mf, batch_size)


def _hashable(x) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _check_stage(run: Plan, mf: ModelFile, stage: int | None, boundary: tuple | None, gathered: list[str]):
    """Run rank 0 of pipeline stage `stage` (the whole model when None), and its last tp rank when tp shards
    unevenly. Returns (rank 0's stage outputs, the failing rank's _Where, the exception), the last two None when
    it ran; appends to `gathered` the runner's note when the loss fell back to gathered logits."""
    m = run.mesh
    pp_rank = 0 if stage is None else stage % m.pp
    out, tp_ranks = None, [0]
    while tp_ranks:
        tp_rank = tp_ranks.pop(0)
        where = _Where(pp_rank=pp_rank, tp_rank=tp_rank, stage=stage)
        try:
            got = _run_rank(run, mf, where, boundary)
        except Exception as e:  # noqa: BLE001 — every failure becomes one line
            return None, where, e
        if where.gathered_logits:
            gathered.append(where.gathered_logits)
        if tp_rank == 0:
            out = got
            if where.uneven and m.tp > 1:
                tp_ranks.append(m.tp - 1)
    return out, None, None


def run_plan(plan: Plan) -> Plan:
    """The plan as the dry run applies it: one micro-batch without pipelining (the runner's loop then runs once,
    as the plan's last micro-batch), and dp at most `MAX_DP`."""
    dp = min(plan.mesh.dp, MAX_DP)
    nmb = plan.num_microbatches if plan.mesh.pp > 1 else 1  # the schedules need their micro-batch count
    return dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, dp=dp), num_microbatches=nmb,
                               global_batch_size=dp * plan.microbatch_size * nmb)


def _stages(plan: Plan, mf: ModelFile) -> list[tuple[int | None, tuple]]:
    """(stage, signature) to run in order: [(None, ())] without pipelining. A signature is the stage's module
    types, plus its index when it is the first or last stage (they hold the embedding, head and tied weights) or
    the one before the last (its outputs are exactly what the last stage takes: a stage cut from an exported graph
    passes on only the values later stages still read), so middle stages of the same blocks share one."""
    if plan.mesh.pp == 1:
        return [(None, ())]
    from executor.pipeline import stage_modules
    model = build(mf, "meta")
    mods = stage_modules(model, plan)
    last = len(mods) - 1
    kinds = [tuple(type(model.get_submodule(p)).__qualname__ for p in paths) for paths in mods]
    return [(i, (k, i) if i in (0, last - 1, last) else (k,)) for i, k in enumerate(kinds)]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size` on the `fake` backend (collectives complete without moving
    data), with torchrun's environment variables set; the group is destroyed and the variables restored on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0")
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        yield
    finally:
        _clear_dtensor_caches()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions: they hold the meshes (and so the process-group names) of this
    fake world, which a later one (the next stage, or a real run in this process) would otherwise reuse, since
    meshes of equal shape compare equal."""
    from torch.distributed.tensor import debug
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    debug._clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def _run_rank(plan: Plan, mf: ModelFile, where: _Where, boundary: tuple | None) -> tuple | None:
    """Build the model on fake tensors, apply `plan` (a `run_plan`) as the rank `where` names and run one micro-batch;
    returns a pipeline stage's outputs for the next stage, ("tensor", shape, dtype) or ("value", v) each (None
    without pipelining)."""
    from executor.runner import build_mesh, init_distributed
    rank = where.pp_rank * plan.mesh.dp * plan.mesh.tp + where.tp_rank
    with fake_world(plan.world_size, rank), torch.random.fork_rng(devices=[]), warnings.catch_warnings(), \
            _quiet(QUIET_LOGGERS):
        warnings.simplefilter("ignore")  # the run's own warnings belong to the real run, not to `plan`
        device = init_distributed(rank, plan.world_size)
        mesh = build_mesh(plan, device)  # its rank grid is real: built before fake mode starts
        with FakeTensorMode(allow_non_fake_inputs=True), _OpRecorder(where):
            model = _build(mf, device)
            hooks = _track_modules(model, where)
            try:
                return _apply_and_run(plan, mf, mesh, model, where, boundary)
            finally:
                for h in hooks:
                    h.remove()


QUIET_LOGGERS = ("torch.distributed.tensor._collective_utils",)
"""torch loggers whose warnings are the real run's, not the dry run's (DTensor's 'CPU process group does not
support alltoall yet, falling back with allgather + chunk!' under sequence parallelism on a CPU host)."""


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    """The named loggers at ERROR while the block runs, then as they were."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _apply_and_run(plan: Plan, mf: ModelFile, mesh, model: nn.Module, where: _Where,
                   boundary: tuple | None) -> tuple | None:
    """`apply_plan`, then forward, backward, tied-gradient sum and optimizer step of one micro-batch."""
    from executor.runner import apply_plan
    where.strategies = {p.module: p.strategy for p in plan.ops.values() if p.module}
    inputs, targets = _sample(mf, plan.microbatch_size)
    runner = apply_plan(model, plan, loss_fn=mf.loss_fn, sync_init=False, mesh=mesh,  # default AdamW
                        example_inputs=inputs)
    inputs, targets = runner.on_device((inputs, targets))  # as Runner.step does (planning on a GPU host: cuda)
    where.uneven = _uneven(runner)
    out = None
    if plan.mesh.pp == 1:
        where.phase = "forward"  # until the model's forward returns (`_track_modules`)
        runner._forward_backward(inputs, targets)
        if getattr(runner.parts[0], "stands_for_ddp", False):
            where.phase = "after backward"
            _check_ddp_gradients(runner.parts[0])
    else:
        out = _run_stage(runner, where, inputs, targets, boundary)
    where.phase = "optimizer step"
    runner.optimizer_step()
    if runner.gather_logits:
        where.gathered_logits = next((n for n in runner.notes if "logits are gathered" in n), None)
    return out


def _build(mf: ModelFile, device) -> nn.Module:
    """build_model() on fake tensors. A build that converts its parameters (`.to(torch.bfloat16)`) fails there:
    torch's `Module._apply` swaps every fake parameter for its converted one, which the fake mode's weak
    reference to it forbids ("Couldn't swap"); one that reads a tensor's values (`.item()`) fails too. Such a model
    is built on meta (`build`: on the CPU where meta fails too) and given fake storage on `device`, a parameter or
    buffer shared by several modules staying shared."""
    try:
        return build(mf, device)
    except ModelError as e:
        failed = e
    with unset_fake_temporarily():
        try:
            model = build(mf, "meta")
        except ModelError:
            raise failed from None
    replace_tensors(model, lambda t: torch.empty_like(t, device=device))
    return model


def _sample(mf: ModelFile, batch_size: int):
    """sample_batch(batch_size) on fake tensors, or on real ones where fake ones fail (its ops need values:
    masked-LM labels drawn by boolean indexing run `nonzero`); the fake run takes real inputs as constants."""
    try:
        return batch(mf, batch_size)
    except ModelError:  # a sample_batch that fails for real too raises again here, as the model file's error
        with unset_fake_temporarily():
            return batch(mf, batch_size)


def _run_stage(runner, where: _Where, inputs, targets, boundary: tuple | None) -> tuple | None:
    """Forward and backward of pipeline stage `where.stage` alone (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    plan = runner.plan
    part = runner.parts[runner.stage_ids.index(where.stage)]
    last = where.stage == plan.mesh.pp * plan.virtual_stages - 1
    args = runner.stage_args(inputs) if boundary is None else tuple(
        torch.empty(b[1], dtype=b[2], device=runner.device, requires_grad=b[2].is_floating_point)
        if b[0] == "tensor" else b[1] for b in boundary)
    where.phase = "forward"
    with runner._tp_context():
        with runner._autocast():
            out = part(*args)
            loss = runner._loss(out, targets) if last else None
        where.phase = "backward"
        if loss is not None:
            loss.backward()
            return None
        outs = out if isinstance(out, tuple) else (out,)
        need = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(need, [torch.empty_like(o) for o in need])
    if any(isinstance(o, DTensor) for o in outs):
        raise _Unchecked(f"stage {where.stage} passes a DTensor to the next stage, which this dry run cannot rebuild "
                         "in the next stage's fake world")
    return tuple(("tensor", tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else ("value", o) for o in outs)


def _check_ddp_gradients(model: nn.Module) -> None:
    """DDP (find_unused_parameters=False, as `executor.parallel.apply_ddp` builds it) waits for a gradient of
    every parameter and stops at the next step's forward when one never came: ExecutorError naming them."""
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise ExecutorError(f"parameter {unused[0]}{more} got no gradient, so DDP stops at the second step "
                            "(\"Expected to have finished reduction in the prior iteration\"): use it in the loss, "
                            "set requires_grad=False on it, or plan with ZeRO (--force zero=1)")


def _uneven(runner) -> bool:
    """Whether some parameter is sharded over tp along a dim tp does not divide."""
    from torch.distributed.tensor import DTensor, Shard
    tp = runner.plan.mesh.tp
    for part in runner.parts:
        for p in part.parameters():
            if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
                pl = p.placements[p.device_mesh.mesh_dim_names.index("tp")]
                if isinstance(pl, Shard) and p.shape[pl.dim] % tp:
                    return True
    return False


def _track_modules(model: nn.Module, where: _Where) -> list:
    """Forward hooks keeping `where.modules` as the stack of running modules (a forward that raises leaves its
    module on top). Registered before `apply_plan`; parallelizing keeps module objects, so the hooks stay."""
    def enter(path: str) -> None:
        where.modules.append(path)

    def leave() -> None:
        if where.modules and where.modules.pop() == "" and where.phase == "forward":
            where.phase = "loss/backward"  # the whole model's forward returned

    hooks = []
    for path, mod in model.named_modules():
        hooks.append(mod.register_forward_pre_hook(lambda *_, p=path: enter(p)))
        hooks.append(mod.register_forward_hook(lambda *_: leave()))
    return hooks


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Keeps `where.ops` as the stack of aten ops being run (the model's ops on DTensors or local tensors): on an
    exception the top is the op that raised. Sits above FakeTensorMode; an op whose tensor arguments are all real
    (the DeviceMesh's rank grid, a constant of the model file) runs for real, as it would on the rank: such tensors
    exist already and are small."""

    def __init__(self, where: _Where):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _all_real(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        self.where.ops.append((func, args))
        out = func(*args, **kwargs)
        self.where.ops.pop()
        return out


def _all_real(args, kwargs) -> bool:
    """Whether an op has tensor arguments and all of them are plain real tensors (lists looked into once)."""
    seen = False
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                if type(t) is not torch.Tensor:  # FakeTensor, DTensor, other subclasses
                    return False
                seen = True
    return seen


def _args_text(args) -> str:
    """The tensor arguments of an op: `local [4, 32, 32]` for a plain tensor (this rank's), `[4, 64, 128] S(2)` for
    a DTensor (global shape, placement per mesh axis)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    parts = []
    for a in args:
        if isinstance(a, DTensor):
            pl = "".join(f"S({p.dim})" if isinstance(p, Shard) else "R" if isinstance(p, Replicate) else "P"
                         for p in a.placements)
            parts.append(f"{list(a.shape)} {pl}")
        elif isinstance(a, torch.Tensor):
            parts.append(f"local {list(a.shape)}")
    return ", ".join(parts)


def _describe(e: BaseException, where: _Where, mf: ModelFile) -> str:
    """`forward of module P (placements): op on shapes: Error: message at model.py:L`, parts known only."""
    parts = []
    if where.phase == "apply_plan":
        parts.append("apply_plan")
    elif where.modules or (where.phase == "forward" and getattr(e, "source_module", None) is not None):
        # an op of a traced graph (executor.graph_ops) runs inside its module without calling it (and an exported
        # model's unflattened modules are not the ones `_track_modules` hooks)
        path = getattr(e, "source_module", None) if where.phase == "forward" else None
        path = where.modules[-1] if path is None else path
        parts.append(f"{where.phase} of module {path or '(the model)'}{_placement_text(path, where.strategies)}")
    else:
        parts.append(where.phase)
    if where.ops and where.phase != "apply_plan":
        op, args = where.ops[-1]
        shapes = _args_text(args)
        parts.append(str(op) + (f" on {shapes}" if shapes else ""))
    msg = first_line(str(e)) or _no_message(e, where)
    text = f"{type(e).__name__}: {msg}"
    if isinstance(e, NotImplementedError) and "sharding strategy" in msg and where.ops:
        text = (f"NotImplementedError: DTensor has no sharding rule for {where.ops[-1][0]} (a custom kernel?); "
                "keep this module replicated, or register a rule with "
                "torch.distributed.tensor.experimental.register_sharding")
    found = frame_in_file(e, mf.path)
    if found:
        text += f" at {os.path.basename(mf.path)}:{found[0]}"
    return ": ".join(parts + [text])


def _no_message(e: BaseException, where: _Where) -> str:
    """What an exception raised without a message (a bare assert in torch) can still say: where it was raised,
    and for DTensor's in-place check, what it checks."""
    from torch.distributed.tensor import DTensor
    frames = traceback.extract_tb(e.__traceback__)
    at = f"raised without a message at {_short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else \
        "raised without a message"
    if where.ops:
        op, args = where.ops[-1]
        schema = getattr(op, "_schema", None)
        if schema is not None and schema.is_mutable and args and not isinstance(args[0], DTensor) and any(
                isinstance(a, DTensor) for a in args[1:]):
            return (f"{at}: DTensor cannot update a plain tensor in place from a DTensor ({op} writes its plain "
                    "first argument, say a state the module made itself, with a DTensor one)")
    return at


def _short_path(path: str) -> str:
    """A file path from its package down (`torch/distributed/tensor/_dispatch.py`), else its name."""
    parts = path.replace(os.sep, "/").split("/")
    for top in ("torch", "executor", "planner", "transformers"):
        if top in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(top):])
    return os.path.basename(path)


def _placement_text(path: str, strategies: dict[str, str]) -> str:
    """` (q_proj, k_proj colwise; o_proj rowwise)`: the tp strategies of the module and its direct children,
    ` (replicated over tp)` when none of them is sharded, `` without tp."""
    if not strategies:
        return ""
    if path in strategies:
        return f" ({strategies[path]})"
    by: dict[str, list[str]] = {}
    for p, s in strategies.items():
        parent, _, name = p.rpartition(".")
        if parent == path:
            by.setdefault(s, []).append(name)
    if not by:
        return " (replicated over tp)"
    return " (" + "; ".join(f"{', '.join(names)} {s}" for s, names in by.items()) + ")"


def first_that_runs(plans: list[Plan], model: ModelFile | str, label: str, notes: list[str] | None = None,
                    on_start=None, on_stage=None) -> tuple[int | None, list[str]]:
    """Dry-run `plans` in order until one passes: (its index, or None when none does; the failure lines of the
    plans tried before it). `notes` as in `dry_run`; `on_start(i, plan)` is called before each, and
    `on_stage(i, plan, stage, stages)` before each pipeline stage it runs (`dry_run`'s `on_stage`)."""
    failures: list[str] = []
    for i, plan in enumerate(plans):
        if on_start is not None:
            on_start(i, plan)
        staged = None if on_stage is None else (lambda st, n, i=i, plan=plan: on_stage(i, plan, st, n))
        problems = dry_run(plan, model, label=label if i == 0 else f"{label} (candidate {i + 1})", notes=notes,
                           on_stage=staged)
        if not problems:
            return i, failures
        failures += problems
    return None, failures
