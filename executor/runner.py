"""`apply_plan`: turn an ordinary model and a plan into a `Runner` that trains with the plan's parallelism.

    runner = apply_plan(build_model(), "plan.json", optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
                        loss_fn=loss_fn, example_inputs=one_micro_batch)  # tp exports the model with it
    loss = runner.step(inputs, targets)

`optimizer` is a factory called with the parameters this rank ends up holding (sharding replaces them, so an
optimizer built beforehand would point at stale tensors). `step` takes the global batch (the same on every rank;
each dp replica slices its share) or this replica's share (global_batch_size / dp samples).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from executor import grad_clip, graph_ops, parallel, pipeline, tp
from executor.errors import ExecutorError, shorten
from executor.batches import as_args, batch_len, slice_batch, to_device
from executor.input_checks import check_example_shapes, check_optimizer, check_same_batch, takes_names
from executor.measure import StepMemory
from executor.measure import PassClock, SavedActivations, Timings, format_report, measurement
from executor.plan_checks import (check_example, check_plan_matches_model, check_runnable, check_tp_plan,
                                  check_world, load_plan, plan_graph)
from executor.trace import annotate_stage, pass_name, record
from planner.model_file import (IGNORE_INDEX, class_targets, default_loss, logits_of, prepare_for_training,
                                summed_cross_entropy, widen_floats)
from planner.plan import Plan

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""Builds the optimizer over the parameters one rank holds after sharding: `factory(params)`, or, when it takes
two arguments, `factory(params, names)` with each parameter's name in the model (for groups by name, as a
weight-decay exclusion)."""
PG_TIMEOUT_S = float(os.environ.get("SHARDWISE_PG_TIMEOUT_S", "120"))
"""Process-group timeout: a collective waiting longer than this on a dead peer fails instead of hanging."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def default_optimizer(params: list) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3): torch's default implementation on CPU, the fused kernel on CUDA (one pass over each
    parameter, as torchtitan's default; torch's own default there, foreach, makes about nine passes). `plan profile`
    times this same optimizer (hardware_profiles.measure_overheads.adamw)."""
    params = list(params)
    cuda = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if cuda else {}))


def init_distributed(rank: int, world: int) -> torch.device:
    """Start the default process group (nccl on GPUs, gloo on CPU) unless already started; returns the device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
        backend = "nccl" if cuda else "gloo"
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return device


def build_mesh(plan: Plan, device: torch.device) -> DeviceMesh:
    """The plan's (pp, dp, tp) DeviceMesh over the default process group."""
    m = plan.mesh
    return init_device_mesh(device.type, (m.pp, m.dp, m.tp), mesh_dim_names=("pp", "dp", "tp"))


def apply_plan(model: nn.Module, plan_or_path: Plan | str | os.PathLike,
               optimizer: OptimizerFactory | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
               *, sync_init: bool = True, mesh: DeviceMesh | None = None,
               example_inputs: Any = None, compile: str | None = None, track_memory: bool = True) -> "Runner":
    """Apply a plan to `model` on this rank (under torchrun) and return a Runner.

    Checks (before any process group starts): the plan loads, matches the model, its tensor-parallel layout is
    places its parameters when tp > 1 (`check_tp_plan`), and the launched world size equals the plan's. Then builds
    the (pp, dp, tp) DeviceMesh, broadcasts rank 0's initial weights
    (`sync_init`), cuts pipeline stages, and applies TP, activation checkpointing and FSDP/DDP in
    `executor.parallel`'s order. `optimizer` defaults to AdamW(lr=1e-3) (`default_optimizer`); `loss_fn` to
    cross-entropy/MSE. `mesh`: a (pp, dp, tp) DeviceMesh built beforehand (the dry run builds it outside
    FakeTensorMode); default: built here.
    `example_inputs`: one micro-batch of inputs, as the model is called; needed under tp for a plan whose ops name
    the model's torch.export graph (`plan`'s default): the model is exported with it and runs as that graph, each
    op placed as planned (`executor.graph_ops.exported`); pipeline stages are cut from it too
    (`executor.pipeline.split_model`; without tp and without it, from the model's fx trace: no op is placed).
    `compile`: a torch.compile backend ("inductor") to compile each repeated block with
    (`executor.parallel.apply_compile`); None runs eager.
    The model is first prepared as the planner traced it (`planner.model_file.prepare_for_training`): 16-bit
    parameters become new fp32 Parameters, so build parameter groups inside `optimizer`, not before.
    `track_memory`: run the 2nd and 3rd steps under torch's MemTracker to measure peak memory by category
    (`Runner.memory_bytes`; they are left out of the median step time); False tracks none unless
    `Runner.track_memory_next_step` asks.
    """
    plan = load_plan(plan_or_path)
    check_plan_matches_model(plan, model)
    check_runnable(plan)
    check_tp_plan(plan, model)  # refuse before any process group starts
    if plan.mesh.tp > 1 and plan_graph(plan) == "export":
        check_example(plan, example_inputs)
    rank, world = check_world(plan)
    device = init_distributed(rank, world)
    return Runner(model, plan, optimizer or default_optimizer, loss_fn or default_loss,
                  device, sync_init, mesh, example_inputs, compile, track_memory)


class Runner:
    """Trains one rank's share of the model under a plan. Build with `apply_plan`."""

    _scale: float | None = None  # the batch's weighting of default_loss's summed targets (`_token_scale`)

    def __init__(self, model: nn.Module, plan: Plan, optimizer: OptimizerFactory, loss_fn, device: torch.device,
                 sync_init: bool = True, mesh: DeviceMesh | None = None, example_inputs: Any = None,
                 compile: str | None = None, track_memory: bool = True):
        self.plan, self.loss_fn, self.device = plan, loss_fn, device
        self.compile = compile
        prepared = prepare_for_training(model)  # as the planner traced and priced it (fp32 master weights, no KV cache)
        self.widened = prepared.widened is not None
        self.example_inputs = self.on_device(example_inputs)  # exported with the model, on the model's device
        self.flat_inputs = False  # set when pipeline stages were cut from the exported model (`stage_args`)
        self.out_spec = None  # then: the model output's structure, which the last stage returns flattened (`_loss`)
        self.flat_graph = None  # then: the exported model's flat graph (the ops it calls)
        # the plan's ops name the torch.export graph's nodes (the planner's default): under tp run that graph, and
        # cut pipeline stages from it (without tp and without an example, from the fx trace: no op is placed)
        self.export_graph = plan_graph(plan) == "export" and (
            plan.mesh.tp > 1 or (plan.mesh.pp > 1 and example_inputs is not None))
        m = plan.mesh
        self.mesh = mesh or build_mesh(plan, device)
        # each step's dp and pp groups, sliced once: `mesh[axis]` builds a new DeviceMesh on every call (torch 2.13;
        # 89 us per slice on 2 gloo ranks here, two slices per step)
        self.step_meshes = {axis: self.mesh[axis] for axis in ("dp", "pp")}
        if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
            model.to(device)  # only when needed: the dry run's FakeTensor parameters cannot be swapped by .to()
        if sync_init and dist.get_world_size() > 1:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, src=0)
            _sync_random_state(device)
        self.block_paths = [p for p, _ in parallel.blocks(model)]
        self.recomputed_paths = self._recomputed_paths(model)
        self.canonical = _canonical_names(model)
        self.gather_logits = False  # set when the loss cannot read vocabulary-sharded logits (see `_loss`)
        self.vocab_parallel_loss = False  # set once a loss ran on vocabulary-sharded logits
        self.notes: list[str] = prepared.notes  # said in the measurement (`executor.measure`)
        self.saved = SavedActivations()
        self.timings = Timings()
        self.memory = StepMemory(track_memory)  # peak memory by category, from torch's MemTracker
        self.step_count = 0
        self._grad_norm = None  # the last step's, when the plan clips (`grad_norm`)
        self.tied_counted_elsewhere: set[str] = set()  # tied weights another stage counts in the norm
        self.amp = DTYPES[plan.precision]
        self._target_chunks = None  # a pipelined step's targets when they are not one tensor (`_stage_loss`)
        if m.pp > 1:
            self._build_pipeline(model)
        else:
            self.parts = [self._parallelize(model)]
            self.schedule = None
            self.tied, self.tied_groups = [], []
        from torch.nn.parallel import DistributedDataParallel as DDP
        named = [(self.canonical.get(n, n), p) for part in self.parts
                 for n, p in (part.module if isinstance(part, DDP) else part).named_parameters()]
        params = [p for _, p in named]
        self.optimizer = optimizer(params, [n for n, _ in named]) if takes_names(optimizer) else optimizer(params)
        check_optimizer(self.optimizer, params)
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        # tied weights the optimizer does not hold keep their gradients between steps (`sum_tied_grads`)
        self._tied_kept = {i: None for i, p in enumerate(self.tied) if p is not None and id(p) not in held}

    # ---- construction ------------------------------------------------------------------------------------------
    def _parallelize(self, module: nn.Module) -> nn.Module:
        """TP, then activation checkpointing, then torch.compile (if asked), then FSDP or DDP (the order
        `executor.parallel` documents)."""
        plan = self.plan
        if plan.mesh.tp > 1:
            flat = None
            if plan.mesh.pp == 1:  # (a pipeline's stages were placed when they were cut: `_build_pipeline`)
                if self.export_graph:
                    module, flat = graph_ops.exported(module, self.example_inputs, plan)  # the graph the plan names
                else:
                    self._note(self._place_ops(module, root=True))
            tp.apply_tp(module, plan, self.mesh["tp"], self.canonical)
            if flat is not None:
                graph_ops.place_exported_ops(module, flat, plan, self.mesh["tp"], tp.local_modules(plan, module))
            note = tp.replicated_ops_note(flat if flat is not None else self.flat_graph)
            if note and note not in self.notes:
                self.notes.append(note)
        for policy, paths in self.recomputed_paths.items():
            parallel.apply_ac(module, policy, paths)
        if self.compile:
            parallel.apply_compile(module, self.block_paths, self.compile)
            note = (f"blocks compiled (torch.compile, backend {self.compile}); the prediction prices eager kernels, "
                    "not the compiler's fusions")
            if note not in self.notes:
                self.notes.append(note)
        if plan.mesh.dp > 1 and plan.zero_stage > 0:
            return parallel.apply_fsdp(module, self.mesh["dp"], plan.zero_stage, self.amp, self.block_paths,
                                       pipelined=plan.mesh.pp > 1)
        if plan.mesh.dp > 1:
            return parallel.apply_ddp(module, self.mesh["dp"], pipelined=plan.mesh.pp > 1, block_paths=self.block_paths,
                                      mp_dtype=self.amp)
        if plan.fsdp_mixed_precision:  # dp = 1 with tp or pp: 16-bit compute weights, over a one-rank mesh
            return parallel.apply_replicate(module, self.mesh["dp"], self.block_paths, self.amp)
        return module

    def on_device(self, batch: Any) -> Any:
        """A batch on this rank's device, its 16-bit tensors widened where the model's were (`hold_fp32`)."""
        return to_device(widen_floats(batch) if self.widened else batch, self.device)

    def _recomputed_paths(self, model: nn.Module) -> dict[str, list[str]]:
        """The blocks activation checkpointing wraps, by policy: every block under the plan's; with
        `Plan.recompute_blocks`, the first ones of each pipeline stage under full (as `Plan.recomputed_blocks`
        says) and, under selective, the others under selective."""
        plan = self.plan
        if not plan.recompute_blocks:
            return {plan.recompute: self.block_paths}
        mods = pipeline.stage_modules(model, plan) if plan.mesh.pp * plan.virtual_stages > 1 else [self.block_paths]
        chosen = plan.recomputed_blocks([[b for b in self.block_paths if b in held] for held in map(set, mods)])
        out = {"full": [b for b in self.block_paths if b in chosen]}
        if plan.recompute == "selective":
            out["selective"] = [b for b in self.block_paths if b not in chosen]
        return out

    def _place_ops(self, model: nn.Module, root: bool, root_specs: dict | None = None) -> str | None:
        """`graph_ops.place_ops` on `model` (pipelining: the whole model, before the cut: its blocks are what the
        stages hold); returns why not (a note)."""
        plan = self.plan
        return graph_ops.place_ops(model, plan, self.mesh["tp"], self.block_paths, tp.local_modules(plan, model),
                                   set(tp.module_calls(plan, model)), root=root, root_specs=root_specs)

    def _note(self, text: str | None) -> None:
        if text is not None and text not in self.notes:
            self.notes.append(text)

    def _build_pipeline(self, model: nn.Module) -> None:
        plan = self.plan
        # the blocks run as placed graphs: placed before the cut (the stages keep the block modules), or, for a
        # model cut from its torch.export graph, its unflattened blocks after it
        by_name: dict = {}  # the stages' own ops (between their modules) by node name
        why = self._place_ops(model, root=False, root_specs=by_name) \
            if plan.mesh.tp > 1 and not self.export_graph else None
        mods = pipeline.stage_modules(model, plan)
        graphs = pipeline.split_model(model, mods, self.example_inputs, export=self.export_graph)
        self.flat_inputs = bool(getattr(graphs[0], "flat_inputs", False))
        self.out_spec = getattr(graphs[-1], "out_spec", None)
        root = getattr(graphs[0], "exported_root", None)
        self.flat_graph = None if root is None else root.flat_graph
        if root is not None and plan.mesh.tp == 1:  # nothing to place: the stages' modules run as eager code
            graph_ops.run_generated(root)
        if root is not None and plan.mesh.tp > 1:
            graph_ops.require_ops(plan, root.flat_graph)
            named = dict(root.named_modules())
            graph_ops.place_exported_ops(root, root.flat_graph, plan, self.mesh["tp"], tp.local_modules(plan, root),
                                         within=[b for b in self.block_paths if b in named])
            why, by_name = None, graph_ops.exported_specs(root.flat_graph, plan)
        if plan.mesh.tp > 1 and why is None:
            placed = [graph_ops.place_stage_ops(graphs[i], by_name, self.mesh["tp"])
                      for i in range(len(graphs)) if i % plan.mesh.pp == self.mesh["pp"].get_local_rank()]
            why = None if all(placed) else graph_ops.PIPELINED
        self._note(why)
        pairs = pipeline.tied_pairs(model, mods, graphs)  # before sharding replaces (and unties) parameters
        pp_rank, pp = self.mesh["pp"].get_local_rank(), plan.mesh.pp
        mine = [i for i in range(len(graphs)) if i % pp == pp_rank]
        self.stage_ids = mine
        self.parts = []
        crossing = pipeline.boundary_placements(graphs, plan, self.block_paths) if plan.mesh.tp > 1 else []
        for i in mine:
            part = self._parallelize(graphs[i])
            if plan.mesh.tp > 1:
                tp.stage_boundary_hooks(part, self.mesh["tp"], last=i == len(graphs) - 1,
                                        received=crossing[i - 1] if i else None,
                                        sent=crossing[i] if i < len(crossing) else None)
                part.register_forward_pre_hook(lambda *_: tp.forget_gathered())  # a stage's forward begins
                part.register_forward_hook(lambda *_: tp.forget_gathered())  # and ends
            if i < len(graphs) - 1:
                part.register_forward_hook(pipeline.dense_outputs)
            self.parts.append(part)

        def make_stages():
            out = []
            for i, part in zip(mine, self.parts):
                out.append(pipeline.RecvOnDemandStage(part, i, len(graphs), self.device,
                                                      group=self.mesh["pp"].get_group()))
                annotate_stage(out[-1], i // pp if plan.virtual_stages > 1 else None)
            return out
        self.stages = stages = make_stages()
        self.schedule = pipeline.make_schedule(plan, stages, self._stage_loss)
        # `evaluate` runs stages of its own over the same modules: torch's schedules re-initialise their stages on
        # every switch between step and eval (and the backward's re-initialisation fails under MemTracker)
        self._eval_schedule = None
        self._make_eval_schedule = lambda: pipeline.make_schedule(plan, make_stages(), self._stage_loss)
        # tied weights whose copies sit on different pp ranks: one group per weight
        groups = pipeline.tied_groups_for_rank(self.mesh, [sorted({s % pp for s in st}) for _, st in pairs])
        self.tied, self.tied_groups = [], []
        self.tied_counted_elsewhere = {name for name, st in pairs if min(s % pp for s in st) != pp_rank}
        for (name, st), g in zip(pairs, groups):
            held = [p for part in self.parts for n, p in part.named_parameters(remove_duplicate=False)
                    if self.canonical.get(n) == name]
            self.tied.append(held[0] if held else None)
            self.tied_groups.append(g if held and len({s % pp for s in st}) > 1 else None)

    def _stage_loss(self, out, target):
        """The last pipeline stage's loss of one micro-batch: targets that are not one tensor (a dict, a tuple)
        travel through the schedule as their micro-batch index (`_forward_backward`), which torch splits as a
        tensor."""
        if self._target_chunks is not None:
            target = self._target_chunks[int(target[0])]
        return self._loss(out, target)

    def _loss(self, out, target):
        """The loss of one micro-batch (`_loss_value`), which must be one number."""
        loss = self._loss_value(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ExecutorError(f"the loss function returned {what}; it must return one scalar tensor (the loss "
                                "to minimise: return other metrics another way, e.g. store them on an object)")
        return loss

    def _loss_value(self, out, target):
        """The loss of one micro-batch. Under tp the model's outputs are DTensors: logits sharded over the
        vocabulary (a colwise LM head) go to the loss as they are when the targets are class indices (cross-entropy
        then runs vocabulary-parallel under `loss_parallel`, no logits all-gather); every other output, or logits a
        loss function fails on, is gathered to a plain tensor first."""
        from torch.distributed.tensor import DTensor
        if self.out_spec is not None:
            from torch.utils._pytree import tree_unflatten
            out = tree_unflatten(list(out) if isinstance(out, (tuple, list)) else [out], self.out_spec)
        if self.plan.mesh.tp <= 1:
            return self._loss_call(out, target)
        logits = logits_of(out)
        if isinstance(logits, DTensor) and not self.gather_logits and class_targets(logits, target) \
                and logits.placements[0] == tp.Shard(logits.dim() - 1):
            try:
                loss = self._loss_call(tp.to_plain(out, keep_vocab_sharded=True), target)
                self.vocab_parallel_loss = True
                return loss.full_tensor() if isinstance(loss, DTensor) else loss
            except Exception as e:  # a loss that does not run on DTensor logits: gather them from now on
                self.gather_logits = True
                said = shorten(str(e), 200)
                self._note(f"the loss function does not run on vocabulary-sharded logits ({type(e).__name__}"
                           f"{': ' + said if said else ''}), so the logits are gathered over tp: an all-gather "
                           "per micro-batch and the whole logits in memory, which the plan's prediction (a "
                           "vocabulary-parallel loss) leaves out")
        return self._loss_call(tp.to_plain(out), target)

    def _loss_call(self, out, target):
        """The loss function on one micro-batch, or, for a batch whose targets `default_loss` partly leaves out
        (`_token_scale`), its summed cross-entropy over the share of the global batch's counted targets that makes
        the micro-batches' mean the mean over every counted target."""
        if self._scale is None or not class_targets(logits_of(out), target):
            return self.loss_fn(out, target)
        return summed_cross_entropy(out, target) * self._scale

    def _token_scale(self, inputs, targets) -> float | None:
        """`default_loss` over class targets some of which it leaves out (IGNORE_INDEX: padding): dp x micro-batches
        / the counted targets of the global batch, so that each micro-batch's summed cross-entropy times it, averaged
        over micro-batches and dp as every loss is, gives one process's mean over every counted target of the whole
        batch; averaging each micro-batch's own mean would weight a micro-batch's targets by how few it counts. None
        for any other loss or batch (every target counted: the mean of means is the mean). Counted here from the
        global batch; a replica's share needs the other replicas' counts: one all-reduce of two numbers over dp."""
        if self.loss_fn is not default_loss or not isinstance(targets, torch.Tensor) \
                or torch.is_floating_point(targets):
            return None
        m = self.plan.mesh
        counts = torch.stack([(targets != IGNORE_INDEX).sum(), (targets == IGNORE_INDEX).sum()]).to(self.device)
        if batch_len(inputs) != self.plan.global_batch_size and m.dp > 1:
            dist.all_reduce(counts, group=self.step_meshes["dp"].get_group())
        counted, ignored = (int(c) for c in counts.tolist())
        if not ignored:
            return None
        # no target counted: one process's mean is 0/0 (nan), and so is this
        return m.dp * self.plan.num_microbatches / counted if counted else float("nan")

    def _tp_context(self):
        """Under tp, forward and backward run with plain tensors the model creates treated as replicated
        (`implicit_replication`) and cross-entropy over vocabulary-sharded logits vocabulary-parallel
        (`loss_parallel`, which must also cover the backward; cross-entropy over replicated logits, as a loss inside
        the model's forward has them, by DTensor's own rules: `tp.loss_parallel_where_sharded`)."""
        if self.plan.mesh.tp <= 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication
        stack = contextlib.ExitStack()
        stack.enter_context(implicit_replication())
        stack.enter_context(tp.loss_parallel_where_sharded())
        if self.plan.sequence_parallel:
            stack.enter_context(tp.keep_shards())
        return stack

    # ---- training ----------------------------------------------------------------------------------------------
    def local_batch(self, inputs, targets):
        """This dp replica's share of the batch (the global batch is sliced; a share passes through)."""
        plan = self.plan
        n = batch_len(inputs)
        share = plan.global_batch_size // plan.mesh.dp
        if n == share:
            return inputs, targets
        if n != plan.global_batch_size:
            raise ExecutorError(f"step() got a batch of {n} samples; the plan needs the global batch "
                                f"({plan.global_batch_size}) or this replica's share ({share})")
        i = self.step_meshes["dp"].get_local_rank()
        return slice_batch(inputs, i * share, share), slice_batch(targets, i * share, share)

    def step(self, inputs, targets) -> float:
        """One optimizer step: forward and backward over the plan's micro-batches, then the optimizer. Returns the
        mean of the micro-batches' losses over the global batch (the same on every rank). A step that raises leaves
        no gradient behind: the next step starts from none, as if this one had not run."""
        try:
            return self._step(inputs, targets)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise

    def _step(self, inputs, targets) -> float:
        if self.memory.wants_step():  # the 2nd and 3rd (executor.measure.StepMemory)
            return self.memory.tracked_step(self, inputs, targets)
        self._scale = self._token_scale(inputs, targets)
        inputs, targets = self.on_device(self.local_batch(inputs, targets))
        if not self.timings.step:
            check_same_batch(self, inputs, targets)
            if self.export_graph and self.example_inputs is not None:
                check_example_shapes(slice_batch(inputs, 0, self.plan.microbatch_size), self.example_inputs)
        track = not self.timings.step or getattr(self, "_track_next", False)  # first step this runner takes
        self._track_next = False
        clock = PassClock(self.device) if self.schedule is None else None
        t0 = _now(self.device)
        with (self.saved.track() if track else contextlib.nullcontext()):
            loss = self._forward_backward(inputs, targets, clock)
        t1 = _now(self.device)
        if track:
            self._grad_bytes = parallel.local_bytes(p.grad for part in self.parts for p in part.parameters())
        self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = _now(self.device)
        loss = self._reduce_loss(loss)  # part of the step: its all-reduces and, on GPUs, a wait for the device
        self.timings.add(_now(self.device) - t0, t1 - t0, t2 - t1, clock.totals() if clock else None)
        self.step_count += 1
        return loss

    def evaluate(self, inputs, targets) -> float:
        """The mean loss over the global batch, forward only: the model in eval mode (dropout off; every module's
        mode restored after), no gradients, no optimizer step, the plan's micro-batches (through the pipeline
        schedule's forward-only `eval` under pp). Takes the batch as `step` does."""
        self._scale = self._token_scale(inputs, targets)
        inputs, targets = self.on_device(self.local_batch(inputs, targets))
        modes = [(m, m.training) for part in self.parts for m in part.modules()]
        for part in self.parts:
            part.eval()
        # a model running as its torch.export training graph (tp; pp cut from it) has training-mode ops fixed in
        eval_ops = parallel.exported_eval(self.parts) if self.export_graph else contextlib.nullcontext()
        try:
            with torch.no_grad(), eval_ops:
                loss = self._forward_backward(inputs, targets, backward=False)
        finally:
            for m, training in modes:
                m.training = training
            tp.forget_gathered()
        from torch.distributed.fsdp import FSDPModule
        for m, _ in modes:  # FSDP2 units that keep their parameters gathered after a forward (ZeRO-1/2, the root)
            if isinstance(m, FSDPModule):  # hold them sharded between steps again, as a step leaves them
                m.reshard()
        return self._reduce_loss(loss)

    def stage_args(self, inputs) -> tuple:
        """A batch as the first pipeline stage takes it (flattened for an exported model): tensors only, which is
        all torch.distributed.pipelining passes between stages."""
        args = pipeline.flat_inputs(inputs) if self.flat_inputs else as_args(inputs)
        bad = next((a for a in args if not isinstance(a, torch.Tensor)), None)
        if bad is not None or not args:
            what = f"a {type(bad).__name__} ({bad!r:.40})" if bad is not None else "no tensor"
            raise ExecutorError(f"pipeline stages take tensors only, and the model's inputs hold {what}: make "
                                "sample_batch pass it as a tensor (or leave it to the model's default), or use pp=1")
        return args

    def optimizer_step(self) -> None:
        """Tied-weight gradients summed across stages, partial tp gradients summed once, the plan's gradient
        clipping (`max_grad_norm`), then the optimizer."""
        if self.tied:
            pipeline.sum_tied_grads(self.tied, self.tied_groups, self._tied_kept)
        if self.plan.mesh.tp > 1:
            tp.reduce_partial_grads(p for part in self.parts for p in part.parameters())
        if self.plan.max_grad_norm > 0:
            m = self.plan.mesh
            self._grad_norm = grad_clip.clip_grad_norm(self._clipped_grads(), self.plan.max_grad_norm, m.dp * m.tp,
                                                       self.device)
        self.optimizer.step()
        if self._tied_kept:
            pipeline.carry_tied_grads(self.tied, self._tied_kept)

    def _clipped_grads(self):
        """(gradient, counted) for every parameter this rank holds: a name once per rank, and a tied weight's copy
        counted on the first stage holding it only (`executor.grad_clip`)."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        seen = set()
        for part in self.parts:
            for n, p in (part.module if isinstance(part, DDP) else part).named_parameters():
                name = self.canonical.get(n, n)
                yield p.grad, name not in seen and name not in self.tied_counted_elsewhere
                seen.add(name)

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping; None when the plan does not clip
        (`max_grad_norm` 0)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _autocast(self):
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def _forward_backward(self, inputs, targets, clock: PassClock | None = None,
                          backward: bool = True) -> torch.Tensor:
        """The summed micro-batch losses (each over the micro-batch count) of this rank's share; `backward` False:
        forward only (`evaluate`)."""
        plan = self.plan
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            mb, n = plan.microbatch_size, plan.num_microbatches
            self._target_chunks = None if isinstance(targets, torch.Tensor) else \
                [slice_batch(targets, k * mb, mb) for k in range(n)]
            index = torch.arange(n, device=self.device) if self._target_chunks is not None else targets
            with self._tp_context(), self._autocast():
                first = 0 in self.stage_ids
                if backward:
                    run = self.schedule.step
                else:
                    self._eval_schedule = self._eval_schedule or self._make_eval_schedule()
                    run = self._eval_schedule.eval
                run(*(self.stage_args(inputs) if first else ()), target=index, losses=losses, **pipeline.NO_OUTPUTS)
            if losses:  # each divided by the micro-batch count (pipeline.make_schedule): their sum is the mean
                return torch.stack([l.detach().float() for l in losses]).sum()
            return torch.zeros((), device=self.device)
        model, n = self.parts[0], plan.num_microbatches
        total = torch.zeros((), device=self.device)
        mb = plan.microbatch_size
        for k in range(n):
            x, y = slice_batch(inputs, k * mb, mb), slice_batch(targets, k * mb, mb)
            if not backward:
                with self._tp_context(), self._autocast():
                    out = model(**x) if isinstance(x, dict) else model(*as_args(x))
                    total += (self._loss(out, y) / n).detach().float()
                tp.forget_gathered()
                continue
            with self._tp_context():
                _mark(clock, "F")
                with self._sync(model, last=k == n - 1), self._autocast(), record(pass_name("F", k)):
                    out = model(**x) if isinstance(x, dict) else model(*as_args(x))
                    loss = self._loss(out, y) / n
                del out  # the model's outputs (the logits): what backward needs of them the loss's graph holds
                tp.forget_gathered()
                _mark(clock, "B")
                with self._sync(model, last=k == n - 1), record(pass_name("B", k)):
                    loss.backward()
            tp.forget_gathered()  # a recomputation's last shared gather
            total += loss.detach().float()
        _mark(clock, "end")
        return total

    def _sync(self, model: nn.Module, last: bool):
        """Gradient reduction only on the last micro-batch for DDP / replicate / ZeRO-1; parameters kept whole
        between micro-batches except under ZeRO-3 (see executor.parallel)."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel as DDP
        if isinstance(model, DDP) and not last:
            return model.no_sync()
        if isinstance(model, FSDPModule):
            accumulate_whole = self.plan.zero_stage in (0, 1)
            model.set_requires_gradient_sync(last or not accumulate_whole)
            if self.plan.zero_stage < 3:
                model.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def _reduce_loss(self, loss: torch.Tensor) -> float:
        """Mean loss over the global batch: from the last pipeline stage, averaged over dp."""
        if self.plan.mesh.pp > 1:
            dist.all_reduce(loss, group=self.step_meshes["pp"].get_group())
        if self.plan.mesh.dp > 1:
            dist.all_reduce(loss, group=self.step_meshes["dp"].get_group())
            loss = loss / self.plan.mesh.dp
        return float(loss)

    # ---- reporting ---------------------------------------------------------------------------------------------
    def track_memory_next_step(self) -> None:
        """Measure memory again on the next two steps (done automatically on the second and third): they run under
        torch's MemTracker and are left out of the median step time (executor.measure.StepMemory)."""
        self.memory.track_next()

    def memory_bytes(self) -> dict[str, int | None]:
        """This rank's measured memory: the tracked step's peak (`peak`; the CUDA allocator's peak on GPU) and the
        bytes of parameters, gradients, optimizer state, activations and temporaries (buffers, gradients of
        activations, optimizer temporaries) live at that peak, from torch's MemTracker; None before a tracked
        step has run. `saved_activations`: the peak bytes autograd saved for backward in the first step."""
        out = dict(self.memory.result)
        out["saved_activations"] = self.saved.peak
        return out

    def measurement(self, warmup: int = 1) -> dict[str, Any]:
        """Measured figures over the steps so far, warm-up steps excluded (see executor.measure)."""
        return measurement(self, warmup)

    def report(self, warmup: int = 1) -> str:
        """Predicted (from the plan) vs measured step time and memory, with relative errors, as text."""
        return format_report(self.plan, self.measurement(warmup))

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Save model and optimizer state with torch.distributed.checkpoint, under the model's own parameter
        names, so any other plan can load it (see executor.checkpoint); `extra`: more objects with state_dict()
        and load_state_dict() to save beside it, by key (e.g. {"scheduler": scheduler})."""
        from executor.checkpoint import save
        save(self, folder, extra)

    def load(self, folder: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Load a checkpoint written by `save` under any plan; `extra`: the objects to load the state saved under
        the same keys into."""
        from executor.checkpoint import load
        load(self, folder, extra)


def _sync_random_state(device: torch.device) -> None:
    """Every rank continues from rank 0's random state (torch's CPU generator and, on CUDA, the device's), as if
    each had been seeded alike: ranks of one tp group must draw the same dropout masks over the tensors they
    hold whole, which per-rank seeds broke silently (their replicated weights drifted apart)."""
    state = torch.get_rng_state()
    on = device if device.type == "cuda" else torch.device("cpu")
    t = state.to(on)
    dist.broadcast(t, src=0)
    torch.set_rng_state(t.cpu())
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device).to(device)
        dist.broadcast(cuda, src=0)
        torch.cuda.set_rng_state(cuda.cpu(), device)


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied aliases included) -> the first name of that parameter in `named_parameters()`."""
    first: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = first.setdefault(id(p), n)
    return out


def _mark(clock: PassClock | None, kind: str) -> None:
    if clock is not None:
        clock.mark(kind)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
