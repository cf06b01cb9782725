"""One function per parallelism technique, torchtitan style. Each reads only its inputs (a module, a mesh, the plan).

The runner applies them in this fixed order, per pipeline-stage module:

1. `apply_tp`   — DTensor `parallelize_module` (tensor + sequence parallelism) over the tp axis. First, because the
                  later wrappers must see the DTensor parameters it creates.
2. `apply_ac`   — activation checkpointing per `plan.recompute`, on each repeated block. Before data parallelism so
                  FSDP's hooks wrap the checkpointed forward (torchtitan's order).
3. `apply_fsdp` (zero_stage 1, 2, 3) or `apply_ddp` (zero_stage 0) over the dp axis. Last: it shards or replicates
                  whatever parameters the steps above left.

ZeRO stages map onto FSDP2 (`fully_shard`), not `ZeroRedundancyOptimizer`, because FSDP2 composes with DTensor
TP and with `torch.distributed.pipelining`, and its knobs express the stages' semantics exactly:

- ZeRO-3 (params, grads, optimizer state sharded): `reshard_after_forward=True` — params are all-gathered for the
  forward, freed, and all-gathered again for the backward.
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
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from executor.errors import ExecutorError
from planner.plan import Plan
from planner.strategies import TPModule, module_strategies, tp_layout_problems

MODULE_STRATEGIES = ("colwise", "rowwise", "vocab", "sequence")
"""Strategies that map to a DTensor parallel style on a module; the rest (heads, shard, replicate) need no style."""
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads",
              "n_kv_head", "num_kv_heads")
"""Integer attributes holding a head count that hand-written attention uses in `view(b, s, n_head, head_dim)`;
divided by the tp degree on modules whose projections become column shards (what torchtitan does to its models)."""
NORMS = (nn.LayerNorm, nn.RMSNorm) if hasattr(nn, "RMSNorm") else (nn.LayerNorm,)
"""Module types treated as sequence-parallel norms when a plan lists no placements."""


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's repeated-block containers: ModuleLists (or Sequentials) of >= 2 modules of one type."""
    out = []
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kinds = {type(m) for m in mod}
            if len(kinds) == 1 and not isinstance(mod[0], (nn.Linear, nn.Embedding) + NORMS):
                out.append((path, mod))
    return out


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every repeated block (child of a block list), by module path, in model order."""
    return [(f"{p}.{i}" if p else str(i), m) for p, lst in block_lists(model) for i, m in enumerate(lst)]


def module_table(model: nn.Module) -> list[TPModule]:
    """The model's parameter-holding modules as the tp contract (`planner.strategies`) sees them: nn.Linear,
    nn.Embedding, other leaves (norms), or `other`; inside a repeated block, or before / after the blocks (in
    registration order); with canonical parameter names (a tied weight keeps its first name)."""
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    block_paths = [p for p, _ in blocks(model)]
    seen_block = False
    out = []
    for path, mod in model.named_modules():
        inside = any(path == b or path.startswith(b + ".") for b in block_paths)
        seen_block |= inside
        own = list(mod.parameters(recurse=False))
        if not own:
            continue
        kind = ("linear" if isinstance(mod, nn.Linear) else "embedding" if isinstance(mod, nn.Embedding)
                else "other" if list(mod.children()) else "norm")
        out.append(TPModule(path=path, kind=kind, position="block" if inside else "post" if seen_block else "pre",
                            params=tuple(canonical[id(p)] for p in own)))
    return out


def placements_from_plan(plan: Plan, model: nn.Module) -> dict[str, str]:
    """Module path -> tp strategy, exactly as the plan's per-op placements say (`planner.strategies`'
    `module_strategies`), after checking the layout is one this executor applies (`tp_layout_problems`) and that
    tp divides the head counts of the attention modules it shards. Raises ExecutorError naming the first problem.
    Placements of functional ops (views, attention, residual adds) describe activations, not modules: they follow
    from the module layout."""
    mods = module_table(model)
    strategies, problems = module_strategies(plan.ops, mods)
    problems += tp_layout_problems(mods, strategies, plan.sequence_parallel)
    named = dict(model.named_modules())
    for parent in sorted({p.rpartition(".")[0] for p, s in strategies.items() if s == "colwise"}):
        for attr in HEAD_ATTRS:
            n = getattr(named.get(parent), attr, None)
            if isinstance(n, int) and not isinstance(n, bool) and n % plan.mesh.tp:
                problems.append(f"{parent}.{attr} = {n} heads is not divisible by tp = {plan.mesh.tp}; choose a "
                                "tp degree that divides the head count")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ExecutorError(f"plan's tensor-parallel layout cannot be applied: {problems[0]}{more}")
    return strategies


def derive_placements(model: nn.Module, sequence_parallel: bool) -> dict[str, str]:
    """A Megatron mapping for plans that list no per-op placements (hand-written plans with only a mesh).

    In every module with >= 2 direct Linear children whose first input width equals the last one's output width
    (attention: q/k/v then out-projection; MLP: up then down), the last Linear is rowwise and the others colwise. A
    top-level Embedding whose weight is tied to a Linear, or the largest Embedding, is vocab-parallel; a Linear
    outside the blocks whose weight is tied to it (or whose output width is that vocabulary) is colwise. Norms are
    sequence-parallel when the plan asks for it. Fused QKV projections split with hard-coded sizes are not handled.
    """
    out: dict[str, str] = {}
    for path, mod in model.named_modules():
        lins = [(n, c) for n, c in mod.named_children() if isinstance(c, nn.Linear)]
        if len(lins) >= 2 and lins[0][1].in_features == lins[-1][1].out_features and path:
            for n, _ in lins[:-1]:
                out[f"{path}.{n}"] = "colwise"
            out[f"{path}.{lins[-1][0]}"] = "rowwise"
        if sequence_parallel and isinstance(mod, NORMS):
            out[path] = "sequence"
    embs = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if embs:
        weights = {id(m.weight): p for p, m in embs}
        tied = [(p, m) for p, m in model.named_modules()
                if isinstance(m, nn.Linear) and id(m.weight) in weights]
        vocab_path = weights[id(tied[0][1].weight)] if tied else max(embs, key=lambda e: e[1].num_embeddings)[0]
        out[vocab_path] = "vocab"
        vocab = dict(embs)[vocab_path].num_embeddings
        for p, m in model.named_modules():
            if isinstance(m, nn.Linear) and p not in out and (id(m.weight) in weights or m.out_features == vocab):
                out[p] = "colwise"
    return out


def _has_rowwise_sibling(path: str, strategies: Mapping[str, str]) -> bool:
    parent = path.rpartition(".")[0]
    return any(s == "rowwise" and p.rpartition(".")[0] == parent for p, s in strategies.items())


def vocab_heads(model: nn.Module, strategies: Mapping[str, str]) -> frozenset[str]:
    """Lone colwise nn.Linears after the blocks (the LM head): their logits stay sharded over the vocabulary as a
    DTensor (Shard(-1)) for a vocabulary-parallel loss (`torch.distributed.tensor.parallel.loss_parallel`)."""
    return frozenset(m.path for m in module_table(model)
                     if m.kind == "linear" and m.position == "post" and strategies.get(m.path) == "colwise"
                     and not _has_rowwise_sibling(m.path, strategies))


def tp_styles(model: nn.Module, strategies: Mapping[str, str], sequence_parallel: bool,
              block_paths: list[str], heads: frozenset[str] = frozenset()) -> dict[str, object]:
    """Module path -> DTensor parallel style, for the modules of `model` named in `strategies`.

    Without sequence parallelism: colwise -> ColwiseParallel (output kept as local shards when a rowwise sibling
    consumes it; a head in `heads` (`vocab_heads`) returns its logits as a DTensor sharded over the vocabulary,
    which the runner's loss reads vocabulary-parallel; any other lone colwise gathers to Replicate), rowwise ->
    RowwiseParallel, vocab -> RowwiseParallel(input_layouts=Replicate()). With it (Korthikanti et al.; torchtitan's layout): norms are
    SequenceParallel, the residual stream is sharded on the sequence dim (Shard(1)) between blocks, each module
    holding colwise projections all-gathers its input (PrepareModuleInput Shard(1) -> Replicate), rowwise outputs are
    reduce-scattered to Shard(1), the first block shards its replicated input, and a colwise head after the blocks
    all-gathers its Shard(1) input. `block_paths` are the full model's repeated blocks (a pipeline stage holds
    some of them).
    """
    present = dict(model.named_modules())
    styles: dict[str, object] = {}
    for path, strat in strategies.items():
        if path not in present:
            continue
        inside = any(path.startswith(b + ".") for b in block_paths)
        if strat == "colwise":
            if _has_rowwise_sibling(path, strategies):
                styles[path] = ColwiseParallel()
            else:
                sharded = path in heads
                styles[path] = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel and not inside
                                               else Replicate(), output_layouts=Shard(-1) if sharded else Replicate(),
                                               use_local_output=not sharded)
        elif strat == "rowwise":
            styles[path] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
        elif strat == "vocab":
            styles[path] = RowwiseParallel(input_layouts=Replicate())
        elif strat == "sequence" and sequence_parallel:
            styles[path] = SequenceParallel()
    if sequence_parallel:
        for path, strat in strategies.items():
            if strat == "colwise" and _has_rowwise_sibling(path, strategies):
                parent = path.rpartition(".")[0]
                if parent in present:
                    styles.setdefault(parent, PrepareModuleInput(input_layouts=(Shard(1),),
                                                                 desired_input_layouts=(Replicate(),),
                                                                 use_local_output=True))
        if block_paths and block_paths[0] in present:
            styles[block_paths[0]] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                               use_local_output=True)
    return styles


def divide_head_counts(model: nn.Module, styles: Mapping[str, object], tp: int) -> None:
    """Divide the head-count attributes (`HEAD_ATTRS`) of each module whose children are column-sharded by `tp`,
    so hand-written `view(b, s, self.n_head, head_dim)` sees the local heads."""
    parents = {p.rpartition(".")[0] for p, s in styles.items() if isinstance(s, ColwiseParallel)}
    mods = dict(model.named_modules())
    for parent in parents:
        mod = mods.get(parent)
        for attr in HEAD_ATTRS:
            n = getattr(mod, attr, None)
            if isinstance(n, int) and not isinstance(n, bool):
                if n % tp:
                    raise ExecutorError(f"{parent}.{attr} = {n} heads is not divisible by tp = {tp}; "
                                        "choose a tp degree that divides the head count")
                setattr(mod, attr, n // tp)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters shared by several modules (e.g. GPT's wte.weight / lm_head.weight), in model order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _get(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, strategies: Mapping[str, str], sequence_parallel: bool,
             block_paths: list[str], heads: frozenset[str] = frozenset()) -> None:
    """Tensor (and sequence) parallelism with `parallelize_module`; re-ties shared weights afterwards.

    `parallelize_module` replaces each module's parameters with new DTensor parameters, which unties weights that
    two modules share. Tied weights whose styles shard them the same way (vocab-parallel embedding and colwise LM
    head both shard dim 0) are re-tied to one DTensor; differing placements are an error naming both modules.
    """
    groups = [g for g in tied_groups(model) if all(_has(model, n) for n in g)]
    styles = tp_styles(model, strategies, sequence_parallel, block_paths, heads)
    if not styles:
        return
    divide_head_counts(model, styles, tp_mesh.size())
    parallelize_module(model, tp_mesh, styles)
    for names in groups:
        params = [getattr(*_get(model, n)) for n in names]
        lay = [tuple(p.placements) if isinstance(p, DTensor) else None for p in params]
        if len(set(lay)) > 1:
            raise ExecutorError(f"tied parameters {', '.join(names)} get different tp placements ({lay}); "
                                "place the embedding 'vocab' and the head 'colwise' (both shard dim 0) or "
                                "replicate both")
        for n in names[1:]:
            owner, attr = _get(model, n)
            setattr(owner, attr, params[0])


def _has(model: nn.Module, name: str) -> bool:
    try:
        _get(model, name)[0]
        return True
    except AttributeError:
        return False


def _present(model: nn.Module, paths: list[str]) -> list[nn.Module]:
    mods = dict(model.named_modules())
    return [mods[p] for p in paths if p in mods]


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


def apply_ac(model: nn.Module, recompute: str, block_paths: list[str]) -> None:
    """Activation checkpointing on every repeated block, keeping module paths unchanged (the block's forward is
    wrapped in place, so checkpoints and placements keep their names).

    `full` keeps only each block's input and re-runs the whole block forward (attention included) in backward.
    `selective` is torchtitan's op-level selective checkpointing (`selective_context`): it keeps the outputs of
    the attention kernel and of every other matmul and recomputes the rest (norms, activations, residual adds, the
    other matmuls; a hand-written attention's score matmuls and softmax, as in Korthikanti et al.).
    """
    if recompute == "none":
        return
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    for block in _present(model, block_paths):
        inner = block.forward
        if recompute == "full":
            block.forward = partial(checkpoint, inner, use_reentrant=False)  # type: ignore[method-assign]
        else:
            block.forward = partial(checkpoint, inner, use_reentrant=False,  # type: ignore[method-assign]
                                    context_fn=selective_context)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, mp_dtype: torch.dtype | None,
               block_paths: list[str]) -> nn.Module:
    """FSDP2 `fully_shard` on each repeated block, then on the whole module (ZeRO-1/2/3; see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else \
        MixedPrecisionPolicy()
    reshard = zero_stage == 3
    for block in _present(model, block_paths):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, pipelined: bool = False,
              block_paths: list[str] | None = None) -> nn.Module:
    """Plain data parallelism: DDP, or FSDP2 `replicate` when parameters are DTensors (DDP cannot hold them) or the
    module is a pipeline stage (DDP's reducer does not survive the stage's shape-inference backward). `replicate`
    wraps each repeated block, then the whole module, so each block's gradients are all-reduced as soon as its
    backward ends (overlapping the rest of the backward, as DDP's buckets do). FakeTensor parameters (the dry run)
    get `replicate` too, since DDP's C++ reducer needs real storage, marked `stands_for_ddp` so the dry run can
    check what DDP alone requires (every parameter gets a gradient)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._composable.replicate_with_fsdp import replicate
    if pipelined or any(isinstance(p, DTensor) for p in model.parameters()):
        for block in _present(model, block_paths or []):
            replicate(block, mesh=dp_mesh)
        return replicate(model, mesh=dp_mesh)
    if any(isinstance(p, FakeTensor) for p in model.parameters()):
        model = replicate(model, mesh=dp_mesh)
        model.stands_for_ddp = True
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = next(model.parameters()).device
    return DDP(model, process_group=dp_mesh.get_group(),
               device_ids=[dev.index] if dev.type == "cuda" else None)


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
