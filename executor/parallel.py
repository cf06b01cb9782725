"""One function per parallelism technique, torchtitan style. Each reads only its inputs (a module, a mesh, the plan).

The runner applies them in this fixed order, per pipeline-stage module:

1. `executor.tp.apply_tp` — the plan's tensor (and sequence) parallel layout: DTensor parameters and activations
                  over the tp axis. First, because the later wrappers must see the DTensor parameters it creates.
2. `apply_ac`   — activation checkpointing per `plan.recompute`, on each block (`blocks`). Before data parallelism so
                  FSDP's hooks wrap the checkpointed forward (torchtitan's order).
3. `apply_fsdp` (zero_stage 1, 2, 3) or `apply_ddp` (zero_stage 0) over the dp axis. Last: it shards or replicates
                  whatever parameters the steps above left.

ZeRO stages map onto FSDP2 (`fully_shard`), not `ZeroRedundancyOptimizer`, because FSDP2 composes with DTensor
TP and with `torch.distributed.pipelining`, and its knobs express the stages' semantics exactly:

- ZeRO-3 (params, grads, optimizer state sharded): `reshard_after_forward=True` — params are all-gathered for the
  forward, freed, and all-gathered again for the backward (each block; the root, whose backward comes right after
  its forward, stays gathered in between, as FSDP2's default for a root).
- ZeRO-2 (grads and optimizer state sharded, params kept whole through the step): `reshard_after_forward=False`, and
  gradients are reduce-scattered after every micro-batch's backward, so only a gradient shard is ever accumulated.
- ZeRO-1 (only optimizer state sharded): `reshard_after_forward=False`, and gradient reduction is switched off
  (`set_requires_gradient_sync(False)`) for all but the last micro-batch, so whole unsharded gradients accumulate
  as in DeepSpeed stage 1 and are reduce-scattered once per step. With one micro-batch, stages 1 and 2 coincide.
- ZeRO-1/2 also keep the parameters whole across micro-batches (`set_reshard_after_backward(False)` for all but
  the last, as torch's pipelining stage does), so they are all-gathered once per step, not once per micro-batch.
- Gradients are reduced in fp32 (`MixedPrecisionPolicy(reduce_dtype=float32)`, as Megatron-LM reduces bf16
  models' gradients in fp32); parameters are all-gathered in the compute dtype.
- Under pipelining, torch's stage defers every FSDP/replicate gradient reduction to after the stage's last
  backward (`PipelineStage.perform_reduce_grad`), so gradients stay unsharded until then.

Plain data parallelism uses DDP when no parameter is a DTensor and there is no pipeline, else FSDP2's `replicate`.
16-bit training with tp or pp but without dp also runs under `replicate`, over the one-rank dp mesh, so it computes
with 16-bit weights as every other tp or pp plan does (`Plan.fsdp_mixed_precision`).
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block, by module path, in model order: the planner's own rule (`planner.blocks.layer_blocks`: the
    repeated blocks, or a model's top-level units when it has none), so the blocks the executor checkpoints, shards
    and cuts pipeline stages at are the graph's layers."""
    from planner.blocks import layer_blocks
    found = layer_blocks(model)
    return [(path, mod) for path, mod in model.named_modules() if path in found]


def _present(model: nn.Module, paths: list[str]) -> list[nn.Module]:
    mods = dict(model.named_modules())
    return [mods[p] for p in paths if p in mods]


def _units(model: nn.Module, paths: list[str]) -> list[nn.Module | list[nn.Module]]:
    """The blocks of `paths` present in `model` as FSDP2 units: a block alone, or blocks sharing a parameter
    (a module reused by two blocks) together, as one list in the position of its first block. FSDP2 manages a
    parameter in one unit only ("use fully_shard([module_a, module_b])", its error for a shared parameter)."""
    blocks = _present(model, paths)
    group = list(range(len(blocks)))  # union-find over blocks, joined by a parameter they both hold

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            j = owner.setdefault(id(p), i)
            if root(j) != root(i):
                group[root(i)] = root(j)
    units: dict[int, list[nn.Module]] = {}
    for i, block in enumerate(blocks):
        units.setdefault(root(i), []).append(block)
    return [mods[0] if len(mods) == 1 else mods for mods in units.values()]


SAC_SAVED_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math", "max")
"""aten ops (`.default` overloads) whose outputs selective recomputation always keeps: every SDPA kernel (so the
attention forward is never re-run) and `max` — torchtitan's `_op_sac_save_list` (models/llama3/parallelize.py),
plus the CPU flash kernel so the policy behaves the same under gloo."""
SAC_MATMUL_OPS = ("mm", "addmm")
"""Matmul ops of which selective recomputation keeps every other output (the 1st, 3rd, ... of each block's
forward) and recomputes the rest: torchtitan's "save all compute ops except every second mm" (its list has only
`mm`; `addmm` is what a biased nn.Linear dispatches to)."""


def _aten_ops(names) -> set:
    out = set()
    for n in names:
        packet = getattr(torch.ops.aten, n, None)
        if packet is not None and hasattr(packet, "default"):
            out.add(packet.default)
    return out


def selective_context():
    """The selective-checkpoint contexts of one checkpointed call (torchtitan's op-level SAC, see
    `SAC_SAVED_OPS` / `SAC_MATMUL_OPS`; functional reduce-scatters of sequence parallelism are kept too). A fresh
    matmul counter per call, so forward and recompute agree on which outputs were kept."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    saved, matmuls = _aten_ops(SAC_SAVED_OPS), _aten_ops(SAC_MATMUL_OPS)
    rs = getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)
    if rs is not None:
        saved.add(rs.default)
    count = [0]

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            count[0] += 1
            keep = count[0] % 2 == 1
        else:
            keep = op in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


@functools.cache
def _sdpa_functions() -> frozenset:
    """F.scaled_dot_product_attention and the aten SDPA ops a model or its exported graph may call directly
    (`planner.op_kinds.SDPA_CALLS`, public or with their leading underscore)."""
    from planner.op_kinds import SDPA_CALLS
    return frozenset({torch.nn.functional.scaled_dot_product_attention}
                     | _aten_ops(SDPA_CALLS) | _aten_ops("_" + n for n in SDPA_CALLS))


def _dropout_p(func, args: tuple, kwargs: dict) -> float:
    """The dropout probability an SDPA call was given (0 when it gave none)."""
    if "dropout_p" in kwargs:
        return kwargs["dropout_p"]
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else \
        ["query", "key", "value", "attn_mask", "dropout_p"]  # F.scaled_dot_product_attention's order
    if "dropout_p" not in names:
        return 0.0
    i = names.index("dropout_p")
    return args[i] if i < len(args) else 0.0


class _Recomputed(torch.autograd.Function):
    """One SDPA call that keeps only its tensor inputs: forward runs it with autograd off (no log-sum-exp or other
    state kept for a backward), backward re-runs it under the forward's autocast and backpropagates through the
    re-run. What torch's non-reentrant checkpoint does for one call, without its saved-tensor hooks, frame and RNG
    bookkeeping: a fraction of its host time, which on GPUs the backward of a small model cannot hide. Calls with
    dropout keep the checkpoint (it replays the RNG)."""

    @staticmethod
    def forward(ctx, func, kwargs, *args):
        ctx.func, ctx.kwargs = func, kwargs
        ctx.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        device = next(args[i] for i in ctx.positions).device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*(args[i] for i in ctx.positions))
        ctx.set_materialize_grads(False)
        out = func(*args, **kwargs)
        for t in (out if isinstance(out, tuple) else (out,)):
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                ctx.mark_non_differentiable(t)
        return out

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.positions, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.func(*args, **ctx.kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, torch.Tensor)
                 and o.requires_grad]
        wanted = [i for i in ctx.positions if args[i].requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                  allow_unused=True) if pairs and wanted else ()
        result: list = [None] * len(args)
        for i, g in zip(wanted, got):
            result[i] = g
        return (None, None, *result)


def recompute_call(func, args: tuple, kwargs: dict):
    """`func(*args, **kwargs)` (an SDPA call) re-run in backward instead of keeping what its backward reads:
    `_Recomputed` where it can, torch's non-reentrant checkpoint where the call has dropout or a tensor keyword
    argument (an attention mask) that needs a gradient, and in a block torch.compile traces (dynamo traces the
    checkpoint; it breaks on `_Recomputed`)."""
    if not torch.compiler.is_compiling() and _dropout_p(func, args, kwargs) == 0 \
            and not any(isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values()):
        return _Recomputed.apply(func, kwargs, *args)
    from torch.utils.checkpoint import checkpoint
    return checkpoint(func, *args, use_reentrant=False, **kwargs)


class _CheckpointAttention(torch.overrides.TorchFunctionMode):
    """Runs every SDPA call made under it through `recompute_call` (see `checkpoint_attention`); other calls pass
    through."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _sdpa_functions():
            self.calls += 1
            return recompute_call(func, args, kwargs)
        return func(*args, **kwargs)


DROPOUT_OPS = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
"""aten dropout ops a torch.export training graph calls with train=True fixed in (what nn.Dropout* export to)."""


class _ExportedEval(torch.overrides.TorchFunctionMode):
    """Eval-mode behaviour for a torch.export training graph, which fixed the model's training-mode ops into it:
    its dropout ops return their input, its SDPA calls run without dropout, RReLU uses its mean slope, its batch
    norms normalise with their running statistics and leave them and their `num_batches_tracked` counters as they
    are (the graph adds 1 to each counter in place before its batch norm): what `module.eval()` gives the model's
    own code."""

    def __init__(self, counters=()):
        super().__init__()
        self.counters = {id(t) for t in counters}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _dropout_ops():
            return args[0]
        if func is torch.ops.aten.add_.Tensor and id(args[0]) in self.counters:
            return args[0]
        if func in _sdpa_functions() and _dropout_p(func, args, kwargs):
            if "dropout_p" in kwargs or len(args) <= 4:
                kwargs = {**kwargs, "dropout_p": 0.0}
            else:
                args = args[:4] + (0.0,) + args[5:]  # (query, key, value, attn_mask, dropout_p, ...)
        elif func is torch.ops.aten.rrelu.default:  # (input, lower, upper, training, generator)
            if len(args) > 3:
                args = args[:3] + (False,) + args[4:]
            else:
                kwargs = {**kwargs, "training": False}
        elif func is torch.ops.aten.batch_norm.default and args[3] is not None:
            # (input, weight, bias, running_mean, running_var, training, ...); one without running statistics
            # (track_running_stats=False) normalises with the batch's in eval mode too
            args = args[:5] + (False,) + args[6:]
        return func(*args, **kwargs)


@functools.cache
def _dropout_ops() -> frozenset:
    return frozenset(_aten_ops(DROPOUT_OPS))


def exported_eval(modules=()) -> torch.overrides.TorchFunctionMode:
    """`Runner.evaluate`'s mode over a model that runs as its torch.export training graph (see `_ExportedEval`);
    `modules`: the graph modules, whose batch norms' `num_batches_tracked` buffers it leaves unchanged."""
    counters = [b for m in modules for name, b in m.named_buffers() if name.rsplit(".", 1)[-1] == "num_batches_tracked"]
    return _ExportedEval(counters)


def checkpoint_attention() -> torch.overrides.TorchFunctionMode:
    """`recompute: attention` (Megatron-LM's `--recompute-granularity selective`, Korthikanti et al.): within it
    each `F.scaled_dot_product_attention` call (or the aten SDPA kernel an exported graph calls) keeps only its
    inputs q, k, v and re-runs in backward; everything else saves what autograd saves. A TorchFunctionMode, so it
    finds the calls in any model code and in the placed graphs tp runs."""
    return _CheckpointAttention()


def _attention_checkpointed(inner, path: str):
    """`inner` (a block's forward) under `checkpoint_attention`; a forward that made no SDPA call the mode could see
    (one made inside another torch function, as nn.MultiheadAttention's, runs with the mode off) is an error, which
    the dry run reports before a plan is written, rather than a plan that recomputes less than it was priced at."""
    from executor.errors import ExecutorError

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # a forward without autograd (Runner.evaluate) keeps nothing
            return inner(*args, **kwargs)
        mode = checkpoint_attention()
        with mode:
            out = inner(*args, **kwargs)
        if not mode.calls:
            raise ExecutorError(f"recompute=attention: block {path} made no F.scaled_dot_product_attention call "
                                "the executor can checkpoint (a call inside another torch function, as "
                                "nn.MultiheadAttention's, is out of its reach); use recompute=selective or full")
        return out
    return forward


def _recomputable(inner):
    """`inner` (a block's forward), which, run as a recomputation in backward, leaves no shared redistribution
    behind when it ends, also when checkpointing stops it early (`tp.forget_recomputed`)."""
    from executor import tp

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        finally:
            tp.forget_recomputed()
    return forward


def apply_ac(model: nn.Module, recompute: str, block_paths: list[str]) -> None:
    """Activation checkpointing on every repeated block, keeping module paths unchanged (the block's forward is
    wrapped in place, so checkpoints and placements keep their names).

    `full` keeps only each block's input and re-runs the whole block forward (attention included) in backward.
    `attention` re-runs only each SDPA call of the block (`checkpoint_attention`).
    `selective` is torchtitan's op-level selective checkpointing (`selective_context`): it keeps the outputs of
    the attention kernel and of every other matmul and recomputes the rest (norms, activations, residual adds, the
    other matmuls; a hand-written attention's score matmuls and softmax, as in Korthikanti et al.).
    """
    if recompute == "none":
        return
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    mods = dict(model.named_modules())
    for path in [p for p in block_paths if p in mods]:
        block = mods[path]
        inner = block.forward
        if recompute in ("full", "selective"):
            inner = _recomputable(inner)
        if recompute == "full":
            block.forward = partial(checkpoint, inner, use_reentrant=False)  # type: ignore[method-assign]
        elif recompute == "attention":
            block.forward = _attention_checkpointed(inner, path)  # type: ignore[method-assign]
        else:
            block.forward = partial(checkpoint, inner, use_reentrant=False,  # type: ignore[method-assign]
                                    context_fn=selective_context)


def apply_compile(model: nn.Module, block_paths: list[str], backend: str = "inductor") -> None:
    """`torch.compile` each repeated block in place (torchtitan's per-block compile: blocks of one type share one
    compiled graph), after TP and activation checkpointing and before FSDP/DDP wrap them, so the hooks those add
    stay outside the compiled code. A model without blocks is compiled whole. The cost model prices eager kernels,
    not the compiler's fusions."""
    present = _present(model, block_paths)
    for block in present or [model]:
        block.compile(backend=backend)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, mp_dtype: torch.dtype | None,
               block_paths: list[str], pipelined: bool = False) -> nn.Module:
    """FSDP2 `fully_shard` on each repeated block (blocks sharing a parameter together, `_units`), then on the whole
    module (ZeRO-1/2/3; see the module docstring). Under ZeRO-3 the root (embedding, final norm, head) stays
    gathered from its forward to its backward, as FSDP2 does by default for a root: its backward, which starts the
    model's, would gather it again at once. A pipeline stage's root reshards like its blocks (the schedule keeps
    parameters whole across its backwards)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else \
        MixedPrecisionPolicy()
    reshard = zero_stage == 3
    for unit in _units(model, block_paths):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard and pipelined, mp_policy=mp)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, pipelined: bool = False,
              block_paths: list[str] | None = None, mp_dtype: torch.dtype | None = None) -> nn.Module:
    """Plain data parallelism: DDP, or FSDP2 `replicate` when parameters are DTensors (DDP cannot hold them) or the
    module is a pipeline stage (DDP's reducer does not survive the stage's shape-inference backward). `replicate`
    wraps each repeated block, then the whole module, so each block's gradients are all-reduced as soon as its
    backward ends (overlapping the rest of the backward, as DDP's buckets do). FakeTensor parameters (the dry run)
    get `replicate` too, since DDP's C++ reducer needs real storage, marked `stands_for_ddp` so the dry run can
    check what DDP alone requires (every parameter gets a gradient). With `mp_dtype` (bf16 training), `replicate`
    computes with parameters cast to it once per unshard and reduces gradients in fp32, as `apply_fsdp` does (the
    activations then stay in the compute dtype; autocast alone would keep fp32 weights and an fp32 residual
    stream); DDP keeps fp32 parameters under autocast."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._composable.replicate_with_fsdp import replicate
    if pipelined or any(isinstance(p, DTensor) for p in model.parameters()):
        return apply_replicate(model, dp_mesh, block_paths or [], mp_dtype)
    if any(isinstance(p, FakeTensor) for p in model.parameters()):
        model = replicate(model, mesh=dp_mesh)
        model.stands_for_ddp = True
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = next(model.parameters()).device
    return DDP(model, process_group=dp_mesh.get_group(),
               device_ids=[dev.index] if dev.type == "cuda" else None)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, block_paths: list[str],
                    mp_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2 `replicate` on each repeated block, then on the whole module, computing with parameters cast to
    `mp_dtype` once per unshard and reducing gradients in fp32 (`apply_ddp`'s path for tp and pp). Also the runner's
    wrapper for 16-bit training at dp = 1 with tp or pp (`Plan.fsdp_mixed_precision`): over a one-rank mesh FSDP2
    copies where it would communicate, and the model computes with 16-bit weights (and a 16-bit residual stream)
    over fp32 ones, where autocast alone would cast each weight again for every micro-batch."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else \
        MixedPrecisionPolicy()
    for unit in _units(model, block_paths):
        replicate(unit, mesh=dp_mesh, mp_policy=mp)
    return replicate(model, mesh=dp_mesh, mp_policy=mp)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for these tensors (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total
