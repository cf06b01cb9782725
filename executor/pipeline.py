"""Pipeline stages: cut an ordinary model into the plan's stages and run them with torch.distributed.pipelining.

The model's own forward is traced with torch.fx, treating each module a stage holds (`StageSpec.modules`, e.g.
`wte`, `h.3`, `lm_head`) as a leaf, so the blocks keep their real Python forward (and the attributes the TP step
adjusts). Every graph node is assigned a stage: a leaf call goes to the stage holding the module; any other node
(the `wte(idx) + wpe(arange(s))` glue) goes to the latest stage among its inputs; a `get_attr` goes to its first
user. Each stage becomes an `fx.GraphModule` built over the original model, so parameter names inside a stage are
the model's own (`h.3.attn.q_proj.weight`) — checkpoints and placements need no renaming. Values live across a
boundary become the stage's outputs and the next stage's inputs (passed through intermediate stages if needed).

Tied weights across stages (GPT's `wte.weight` used again by `lm_head` in the last stage): each stage keeps its own
copy, initialised equal; after backward their gradients are summed with one `all_reduce` over a process group of
exactly the ranks holding the copies (same dp and tp coordinates), so the copies receive identical updates and stay
equal — Megatron-LM's treatment of shared embeddings.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from executor.errors import ExecutorError
from executor.parallel import blocks
from planner.plan import Plan, StageSpec


def stage_modules(model: nn.Module, plan: Plan) -> list[list[str]]:
    """The module paths of each stage: `StageSpec.modules` when given, else derived from the layer ranges (layer 0
    = the modules before the blocks, 1..L = blocks, L+1 = the modules after), else blocks split evenly."""
    n = plan.mesh.pp * plan.virtual_stages
    block_paths = [p for p, _ in blocks(model)]
    if not block_paths:
        raise ExecutorError("pipeline parallelism needs a model with repeated blocks (a ModuleList of layers); "
                            "none found — use pp = 1")
    top = [name for name, _ in model.named_children()]
    root_of_blocks = block_paths[0].rpartition(".")[0].split(".")[0]
    pre = [t for t in top[:top.index(root_of_blocks)] if any(True for _ in model.get_submodule(t).parameters())]
    post = [t for t in top[top.index(root_of_blocks) + 1:] if any(True for _ in model.get_submodule(t).parameters())]
    layers = [pre] + [[b] for b in block_paths] + [post]
    stages: tuple[StageSpec, ...] = plan.stages
    if stages and all(s.modules for s in stages):
        return [list(s.modules) for s in stages]
    if stages:
        if stages[-1].end_layer > len(layers):
            raise ExecutorError(f"plan stages end at layer {stages[-1].end_layer} but the model has {len(layers)} "
                                "layers (pre, blocks, post); re-plan for this model")
        return [[m for layer in layers[s.start_layer:s.end_layer] for m in layer] for s in stages]
    if len(block_paths) < n:
        raise ExecutorError(f"{n} pipeline stages need >= {n} blocks; the model has {len(block_paths)}")
    cuts = [round(i * len(block_paths) / n) for i in range(n + 1)]
    out = [list(block_paths[cuts[i]:cuts[i + 1]]) for i in range(n)]
    out[0] = pre + out[0]
    out[-1] = out[-1] + post
    return out


class _LeafTracer(fx.Tracer):
    proxy_buffer_attributes = True  # buffers become graph values, so `self.rope_cos[:s]` traces (as planner.trace)

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def split_model(model: nn.Module, modules: list[list[str]]) -> list[fx.GraphModule]:
    """Cut `model` into one GraphModule per stage (see the module docstring); raises ExecutorError when the model
    cannot be traced or a stage's modules do not run in model order."""
    owner = {m: i for i, mods in enumerate(modules) for m in mods}
    named = dict(model.named_modules())
    missing = [m for m in owner if m not in named]
    if missing:
        raise ExecutorError(f"plan stage module {missing[0]!r} is not a module of this model; re-plan for it")
    try:
        graph = _LeafTracer(set(owner)).trace(model)
    except Exception as e:  # fx cannot trace data-dependent control flow
        raise ExecutorError(f"pipeline parallelism traces the model's forward with torch.fx, which failed "
                            f"({type(e).__name__}: {e}); use pp = 1 for this model") from None
    stage: dict[fx.Node, int] = {}
    nodes = list(graph.nodes)
    for node in nodes:
        if node.op == "call_module":
            if node.target not in owner:
                raise ExecutorError(f"module {node.target!r} runs in the forward but no pipeline stage holds it; "
                                    "list it in a stage's modules")
            stage[node] = owner[node.target]
        elif node.op == "get_attr":
            stage[node] = -1  # decided by its users below
        elif node.op == "output":
            stage[node] = len(modules) - 1
        else:
            stage[node] = max([stage[a] for a in node.all_input_nodes if stage[a] >= 0], default=0)
        if node.op == "call_module" and any(stage[a] > stage[node] for a in node.all_input_nodes):
            raise ExecutorError(f"module {node.target!r} (stage {stage[node]}) needs a value computed in a later "
                                "stage; stages must follow the forward's order")
    for node in nodes:
        if stage[node] < 0:
            stage[node] = min((stage[u] for u in node.users), default=0)
    return [_stage_graph(model, graph, stage, k) for k in range(len(modules))]


def _stage_graph(model: nn.Module, graph: fx.Graph, stage: dict[fx.Node, int], k: int) -> fx.GraphModule:
    """The GraphModule of stage k: inputs are the values live across boundary k-1, outputs those live across k."""
    def live(b: int) -> list[fx.Node]:
        return [n for n in graph.nodes if n.op != "output" and stage[n] <= b
                and any(stage[u] > b for u in n.users)]
    ins = [n for n in graph.nodes if n.op == "placeholder"] if k == 0 else live(k - 1)
    last = k == max(stage.values())
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ins:
        env[n] = g.placeholder(n.name)
    for n in graph.nodes:
        if stage[n] == k and n not in env and n.op not in ("placeholder", "output"):
            env[n] = g.node_copy(n, lambda a: env[a])
    if last:
        out = next(n for n in graph.nodes if n.op == "output")
        g.output(fx.node.map_arg(out.args[0], lambda a: env[a]))
    else:
        outs = live(k)
        g.output(env[outs[0]] if len(outs) == 1 else tuple(env[n] for n in outs))
    return fx.GraphModule(model, g)


def tied_pairs(model: nn.Module, modules: list[list[str]]) -> list[tuple[str, list[int]]]:
    """Parameters shared by modules in different stages: (canonical name, the stages holding a copy)."""
    owner = {m: i for i, mods in enumerate(modules) for m in mods}
    out = []
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for names in by_id.values():
        stages = sorted({_owner_stage(n, owner) for n in names} - {None})
        if len(stages) > 1:
            out.append((names[0], stages))
    return out


def _owner_stage(param_name: str, owner: dict[str, int]) -> int | None:
    parts = param_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in owner:
            return owner[".".join(parts[:i])]
    return None


def tied_groups_for_rank(mesh, pp_ranks_of_stages: list[list[int]]) -> list[dist.ProcessGroup | None]:
    """One process group per set of pp ranks that hold copies of a tied weight, for this rank's (dp, tp) line.

    Every rank must call `dist.new_group` for every group in the same order, so all lines are created everywhere;
    each rank keeps the group it belongs to (None when it holds no copy)."""
    grid = mesh.mesh  # shape (pp, dp, tp): global ranks
    me = dist.get_rank()
    mine: list[dist.ProcessGroup | None] = []
    for pp_ranks in pp_ranks_of_stages:
        keep = None
        for d in range(grid.shape[1]):
            for t in range(grid.shape[2]):
                ranks = sorted({int(grid[p, d, t]) for p in pp_ranks})
                g = dist.new_group(ranks)
                if me in ranks:
                    keep = g
        mine.append(keep)
    return mine


def make_schedule(plan: Plan, stages: list, loss_fn):
    """The plan's pipeline schedule over this rank's stage(s), with gradients scaled by 1/num_microbatches so the
    step matches a full-batch mean loss."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    n = plan.num_microbatches
    if plan.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n, loss_fn=loss_fn, scale_grads=True)
    cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=True)


def sum_tied_grads(params: list[nn.Parameter | None], groups: list[dist.ProcessGroup | None]) -> None:
    """Sum the gradients of the copies of each tied weight over the ranks holding them (see module docstring)."""
    from torch.distributed.tensor import DTensor
    for p, g in zip(params, groups):
        if p is None or g is None:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
            # e.g. a vocab-parallel embedding's gradient can come back Replicate/Partial; match the parameter's
            # sharding so both copies exchange the same slice
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=g)
