"""Pipeline stages: cut an ordinary model into the plan's stages and run them with torch.distributed.pipelining.

The model's own forward is traced (torch.export for a plan naming the export graph's ops, the planner's default;
else torch.fx, or export where fx fails: `split_model`), treating each module a stage holds (`StageSpec.modules`,
e.g. `wte`, `h.3`, `lm_head`) as a leaf, so the blocks keep their real Python forward (and the attributes the TP step
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

import contextlib
import contextvars
import copy
import inspect
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_map

from executor.errors import ExecutorError, shorten
from executor.parallel import blocks
from planner.blocks import layer_modules, structure_signature
from planner.exporting import export_training
from planner.layout import boundary_placements as block_output_placements
from planner.plan import Plan, StageSpec


def check_stage_modules(model: nn.Module, modules: list[list[str]]) -> list[list[str]]:
    """`modules` (each stage's module paths), or ExecutorError naming the first one `model` does not have."""
    present = dict(model.named_modules())
    for i, mods in enumerate(modules):
        missing = next((m for m in mods if m not in present), None)
        if missing is not None:
            top = [n for n, _ in model.named_children()]
            shown = ", ".join(top[:8]) + (f", ... ({len(top)} in all)" if len(top) > 8 else "")
            raise ExecutorError(f"stage {i} of the plan lists module {missing!r}, which this model does not have "
                                f"(its top-level modules: {shown}); plan this model again, or correct the stage's "
                                "modules")
    return modules


def stage_modules(model: nn.Module, plan: Plan) -> list[list[str]]:
    """The module paths of each stage: `StageSpec.modules` when given, else derived from the layer ranges over
    `planner.blocks.layer_modules` (each block alone, the modules between blocks together), else blocks split
    evenly, the modules before a block going with it and those after the last block with the last stage."""
    n = plan.mesh.pp * plan.virtual_stages
    block_paths = [p for p, _ in blocks(model)]
    if not block_paths:
        raise ExecutorError("pipeline parallelism cuts a model between its blocks, and this one has neither "
                            "repeated blocks (a ModuleList of layers) nor two top-level modules with parameters; "
                            "use pp = 1")
    stages: tuple[StageSpec, ...] = plan.stages
    layers = layer_modules(model)
    if stages:
        if all(s.modules for s in stages):  # the modules cut the model; the layer ranges price the plan, over
            # `OpGraph.layers()`, which also has layers of the root's own ops (no module): at most one between two
            # blocks, one before the first and one after the last
            most = 2 * len(block_paths) + 1
            if stages[-1].end_layer > most:
                raise ExecutorError(f"plan stages end at layer {stages[-1].end_layer} but the model has at most "
                                    f"{most} layers ({len(block_paths)} blocks, and the modules or ops between "
                                    "them); re-plan for this model")
            return check_stage_modules(model, [list(s.modules) for s in stages])
        if layers and layers[-1][0] in block_paths:
            layers.append([])  # `OpGraph.layers()` ends with the loss (root ops after the last block): no module
        if stages[-1].end_layer > len(layers):
            raise ExecutorError(f"plan stages end at layer {stages[-1].end_layer} but the model has {len(layers)} "
                                "layers (blocks and the modules between them); re-plan for this model")
        return [[m for layer in layers[s.start_layer:s.end_layer] for m in layer] for s in stages]
    if len(block_paths) < n:
        raise ExecutorError(f"{n} pipeline stages need >= {n} blocks; the model has {len(block_paths)}")
    cuts = [round(i * len(block_paths) / n) for i in range(n + 1)]
    stage_of = {b: next(k for k in range(n) if j < cuts[k + 1]) for j, b in enumerate(block_paths)}
    out: list[list[str]] = [[] for _ in range(n)]
    pending: list[str] = []
    for layer in layers:
        if layer[0] in stage_of:  # a block: the modules before it go with it
            out[stage_of[layer[0]]] += pending + layer
            pending = []
        else:
            pending += layer
    out[-1] += pending
    return out


class _LeafTracer(fx.Tracer):
    proxy_buffer_attributes = True  # buffers become graph values, so `self.rope_cos[:s]` traces (as planner.trace)

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def split_model(model: nn.Module, modules: list[list[str]], example: object = None,
                export: bool = False) -> list[fx.GraphModule]:
    """Cut `model` into one GraphModule per stage (see the module docstring); raises ExecutorError when the model
    cannot be traced or a stage's modules do not run in model order.

    With `export` (a plan naming the torch.export graph's ops), or for a forward torch.fx cannot trace, the model
    is exported instead, with `example` (one micro-batch of
    inputs, as `model` is called: a tensor, a tuple, or a dict of keyword arguments): torch.export's training IR,
    unflattened to the model's module tree (`torch.export.unflatten`, parameter names kept), with the modules
    above the stage modules inlined into one graph. Its first stage then takes the inputs flattened
    (`flat_inputs`), as the exported graph does."""
    owner = {m: i for i, mods in enumerate(check_stage_modules(model, modules)) for m in mods}
    root: nn.Module = model
    graph, fx_error = None, None
    if not export:  # (`export`: cut the graph the plan names, torch.export's, as `example` runs)
        try:
            graph = _LeafTracer(set(owner)).trace(model)
        except Exception as e:  # fx cannot trace data-dependent control flow
            fx_error = e
    if graph is None:
        if example is None:
            why = f" (torch.fx failed: {_said(fx_error)})" if fx_error is not None else ""
            raise ExecutorError(f"pipeline parallelism cuts this model's torch.export graph{why}; pass example_inputs= "
                                "(one micro-batch) to apply_plan so it can export the model, or use pp = 1")
        root, graph = _exported(model, set(owner), example, fx_error)
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
    stages = [_stage_graph(root, graph, stage, k) for k in range(len(modules))]
    if root is not model:
        stages[0].flat_inputs = True  # type: ignore[attr-defined]
        stages[0].__dict__["exported_root"] = root  # a plain attribute: not a submodule of the stage
        stages[-1].out_spec = root.out_spec  # type: ignore[attr-defined]
    return stages


def flat_inputs(inputs: object) -> tuple:
    """A micro-batch as an exported stage 0 takes it: tensor -> (x,), tuple -> itself, dict -> its leaves in
    torch.export's (args, kwargs) flattening order."""
    from torch.utils._pytree import tree_flatten
    if isinstance(inputs, dict):
        return tuple(tree_flatten(((), inputs))[0])
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(tree_flatten(tuple(inputs))[0])


def _said(e: BaseException) -> str:
    """`Type: first line of the message` (shortened), for one-line errors."""
    return f"{type(e).__name__}: {shorten(str(e), 120)}"


def export_call(example: object) -> tuple[tuple, dict]:
    """(args, kwargs) for `torch.export.export` from one micro-batch as the model is called: a tensor, a tuple, or a
    dict of keyword arguments."""
    if isinstance(example, dict):
        return (), dict(example)
    return ((example,) if isinstance(example, torch.Tensor) else tuple(example)), {}


def _exported(model: nn.Module, keep: set[str], example: object,
              fx_error: Exception | None) -> tuple[nn.Module, fx.Graph]:
    """The model exported with `example` and unflattened, and one graph over it in which every module above the
    stage modules is inlined (see `split_model`)."""
    from torch.export.unflatten import InterpreterModule

    from executor.graph_ops import unflatten
    args, kwargs = export_call(example)
    try:
        ep = _export(model, args, kwargs)
        root = unflatten(ep)
    except Exception as e:  # noqa: BLE001 — said in one line below
        failed = f"torch.fx failed ({_said(fx_error)}) and so did torch.export" if fx_error is not None \
            else "torch.export failed"
        raise ExecutorError(f"pipeline parallelism cannot cut this model: {failed} ({_said(e)}); use pp = 1") \
            from None
    g = fx.Graph()

    def inline(prefix: str, sub: fx.Graph, args: tuple, kwargs: dict) -> object:
        env: dict[fx.Node, object] = {}
        holders = [n for n in sub.nodes if n.op == "placeholder"]
        for i, n in enumerate(holders):
            if i < len(args):
                env[n] = args[i]
            elif n.target in kwargs:
                env[n] = kwargs[n.target]
            else:
                raise ExecutorError(f"pipeline split of the exported model: input {n.target!r} of {prefix!r} is "
                                    "not bound; use pp = 1")
        for n in sub.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                return fx.node.map_arg(n.args[0], lambda a: env[a])
            path = f"{prefix}.{n.target}" if prefix and n.op in ("call_module", "get_attr") else n.target
            if n.op == "call_module":
                a = fx.node.map_arg(n.args, lambda x: env[x])
                k = fx.node.map_arg(n.kwargs, lambda x: env[x])
                mod = root.get_submodule(path)
                if isinstance(mod, InterpreterModule) and any(m.startswith(path + ".") for m in keep):
                    # above (or listed beside) the stage modules, e.g. HF's `transformer`: its glue ops go to
                    # the stages as any other glue does
                    env[n] = inline(path, mod.graph, a, k)
                else:
                    env[n] = g.create_node("call_module", path, a, k)
            elif n.op == "get_attr":
                env[n] = g.get_attr(path)
            elif n.op == "call_function" and not n.users and str(n.target).startswith("aten._assert"):
                continue  # export's own shape/dtype assertions: nothing to run, and DTensor has no rule for them
            else:
                env[n] = g.node_copy(n, lambda x: env[x])
        raise ExecutorError("pipeline split of the exported model: a graph without an output; use pp = 1")
    ins = tuple(g.placeholder(n.name) for n in root.graph.nodes if n.op == "placeholder")
    g.output(inline("", root.graph, ins, {}))
    root.flat_graph = ep.graph  # the graph the plan's op names come from (`executor.graph_ops.place_exported_ops`)
    root.out_spec = ep.call_spec.out_spec  # how the last stage's flat outputs make the model's output
    return root, g


_SHARED_EXPORTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shardwise_shared_exports",
                                                                            default=None)


@contextlib.contextmanager
def shared_exports():
    """Within this block `split_model` exports each model structure once: a later model with the same parameters,
    buffers and example shapes (another rank of the same plan, as the dry run builds one per pipeline rank) reuses
    that export over its own tensors. torch.export is most of a pipeline rank's set-up (~20 s for a 405B Llama)."""
    token = _SHARED_EXPORTS.set({})
    try:
        yield
    finally:
        _SHARED_EXPORTS.reset(token)


def _export(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """`torch.export.export(model, ...)`, or inside `shared_exports` the export of a model like it, rebound."""
    cache = _SHARED_EXPORTS.get()
    key = None if cache is None else _export_key(model, args, kwargs)
    if key is not None and key in cache:
        ep = _rebound(cache[key], model)
        if ep is not None:
            return ep
    ep = export_training(model, args, kwargs)
    if key is not None:
        cache[key] = ep
    return ep


def _export_key(model: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """What an export depends on, as far as models built by one model file can differ: the model's structure
    (`planner.blocks.structure_signature`: class, parameters and buffers), the classes and plain attributes
    (flags, sizes, eps, dropout p, `training`) of every module, the inputs' structure, shapes and dtypes. None when
    an input is neither a tensor nor a hashable value."""
    from torch.utils._pytree import tree_flatten
    leaves, spec = tree_flatten((args, kwargs))
    ins = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            ins.append((tuple(x.shape), x.dtype, x.requires_grad))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            ins.append(("value", type(x), x))
    plain = (bool, int, float, str, type(None))
    modules = tuple((n, type(m), tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, plain))))
                    for n, m in model.named_modules(remove_duplicate=False))
    return structure_signature(model), modules, str(spec), tuple(ins)


def _rebound(ep: torch.export.ExportedProgram, model: nn.Module) -> torch.export.ExportedProgram | None:
    """`ep`, exported from a model of `model`'s structure, over `model`'s own parameters and buffers (which
    `torch.export.unflatten` clones into the modules it builds); None when `ep` holds a constant `model` does not
    (a tensor made in the forward, of the other model's tensor mode): then export `model` itself."""
    state = model.state_dict(keep_vars=True)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    if not all(k in state for k in ep.state_dict) or not all(k in buffers for k in ep.constants):
        return None
    # graph, signature and call graph shared: unflatten deep-copies what it keeps, and its one in-place pass
    # (removing effect tokens, then dead code) leaves nothing to do when run again on the same graph
    new = copy.copy(ep)
    new._state_dict = {k: state[k] for k in ep.state_dict}
    new._constants = {k: buffers[k] for k in ep.constants}
    return new


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


def dense_outputs(module: nn.Module, args: tuple, output: object) -> object:
    """A stage's outputs, the tensors made contiguous (a batch-first LSTM's output is not): a forward hook on every
    stage but the last, registered after any other (tp's local shards), since gloo and NCCL send and receive only
    contiguous tensors and the receiver allocates its buffer with the strides the sender's output had."""
    return tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, output)


def boundary_placements(graphs: list[fx.GraphModule], plan: Plan, block_paths: list[str]) -> list[list[str]]:
    """Per stage boundary k (stage k to stage k + 1), the placement each value crossing it travels in
    (`executor.tp.stage_boundary_hooks`): a block's output (the call of a block module, or the first item of the
    tuple it returns) as `planner.layout.boundary_placements` says, which the cost model prices; anything else
    "R" (whole). Every rank computes the same lists from the same stage graphs, so sender and receiver agree."""
    is_block = frozenset(block_paths)
    sharded = block_output_placements(plan, is_block)
    out = []
    for g in graphs[:-1]:
        ret = next(n for n in g.graph.nodes if n.op == "output").args[0]
        out.append([sharded.get(_block_called(v), "R") for v in (ret if isinstance(ret, tuple) else (ret,))])
    return out


def _block_called(v: object) -> str | None:
    """The module path a stage's output value is the result of (a `call_module` node, or item 0 of one)."""
    if isinstance(v, fx.Node) and v.op == "call_function" and v.target is operator.getitem and v.args[1] == 0:
        v = v.args[0]
    return v.target if isinstance(v, fx.Node) and v.op == "call_module" else None


def tied_pairs(model: nn.Module, modules: list[list[str]],
               graphs: list[fx.GraphModule] = ()) -> list[tuple[str, list[int]]]:
    """Parameters held by more than one stage: (canonical name, the stages holding a copy). A stage holds a
    parameter through a module it lists (a tied embedding and LM head), or through a stage graph's own read of it
    (`F.linear(x, self.wte.weight)` in the root's forward: a `get_attr` in the last stage's graph)."""
    owner = {m: i for i, mods in enumerate(modules) for m in mods}
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    canonical = {n: names[0] for names in by_id.values() for n in names}
    held: dict[str, set[int]] = {names[0]: {_owner_stage(n, owner) for n in names} - {None}
                                 for names in by_id.values()}
    for k, g in enumerate(graphs):  # stage graphs name parameters as the model does
        for n, _ in g.named_parameters(remove_duplicate=False):
            if n in canonical:
                held[canonical[n]].add(k)
    return [(name, sorted(stages)) for name, stages in held.items() if len(stages) > 1]


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


NO_OUTPUTS = {"return_outputs": False} if "return_outputs" in inspect.signature(
    torch.distributed.pipelining.schedules.PipelineScheduleSingle.step).parameters else {}
"""`schedule.step` keeps no outputs (where torch has the flag): it otherwise holds the last stage's output of every
micro-batch (the logits) until the step ends, to concatenate them on dim 0 (a 0-dim output, an auxiliary loss,
cannot be), and nothing reads them: the losses come from the loss function."""


def make_schedule(plan: Plan, stages: list, loss_fn):
    """The plan's pipeline schedule over this rank's stage(s). Each micro-batch's loss is divided by
    num_microbatches, as the runner does without pipelining, so that the step matches a full-batch mean loss and
    the schedule's losses sum to it; torch's `scale_grads=True` would instead divide every gradient after the flush
    (one `div_` per parameter tensor, a DTensor op under FSDP2 and tp), work the cost model does not price."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    n = plan.num_microbatches

    def scaled(out, target):
        return loss_fn(out, target) / n
    if plan.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n, loss_fn=scaled, scale_grads=False)
    cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=n, loss_fn=scaled, scale_grads=False)


class _Released:
    """What a released receive buffer was: enough to allocate it again (shape, dtype, requires_grad)."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.requires_grad = t.shape, t.dtype, t.requires_grad


def _dense_sends(ops: list) -> list:
    """torch's send ops with each tensor contiguous (a copy where it is not: gloo and NCCL send only contiguous
    tensors; the op holds the copy until the send completes)."""
    for op in ops:
        if isinstance(op.tensor, torch.Tensor) and not op.tensor.is_contiguous():
            op.tensor = op.tensor.contiguous()
    return ops


class RecvOnDemandStage(PipelineStage):
    """torch.distributed.pipelining's `PipelineStage` holding each receive buffer only while its micro-batch needs
    it.

    torch allocates an activation and a gradient receive buffer for every micro-batch when the schedule starts and
    keeps all of them for the whole step (`PipelineStage._setup_forward_recv_info`, `_create_grad_recv_info`):
    m x the boundary tensors, tens of GiB at Megatron-sized m (512 micro-batches of 2048 x 25600 bf16 are 2 x 50
    GiB). Here a buffer is allocated when its receive is posted (`get_fwd_recv_ops`, `get_bwd_recv_ops`) and let
    go after its micro-batch's backward, as Megatron-LM's p2p_communication allocates its receive tensors: a
    received activation lives while its micro-batch is in flight (it is the stage's input, saved for backward), a
    received gradient for one backward. Each allocation is a new tensor, so nothing torch still holds is
    overwritten; a released slot keeps a 0-element placeholder (torch's step-end `clear_runtime_states` touches
    every slot)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._released: dict[int, _Released] = {}

    def _release(self, infos) -> None:
        for info in infos or ():
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor) and buf.numel() and not getattr(info, "is_root_arg", False):
                self._released[id(info)] = _Released(buf)
                info.buffer = buf.new_empty(0)

    def _allocate(self, infos) -> None:
        """Each receive buffer of `infos` allocated again if released, and contiguous: gloo and NCCL receive only
        into contiguous tensors, and torch gives a gradient's buffer the strides of the stage output it is the
        gradient of (a Conv1d's (B, C, T) output in channels-last strides: 'input tensor has to be contiguous' at
        the first backward receive). The sender sends contiguous tensors (`_dense_sends`), so the elements land in
        order."""
        for info in infos or ():
            r = self._released.pop(id(info), None)
            buf = getattr(info, "buffer", None)
            if r is None and isinstance(buf, torch.Tensor) and buf.numel() and not buf.is_contiguous():
                r = _Released(buf)
            if r is not None:
                info.buffer = torch.empty(r.shape, dtype=r.dtype, device=self.device).requires_grad_(r.requires_grad)

    def _release_all(self) -> None:
        for table in (getattr(self, "args_recv_info", {}), getattr(self, "grad_recv_info", {})):
            for infos in table.values():
                self._release(infos)

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        self._release_all()
        return out

    def _forward_metadata_inference(self, *args, **kwargs):
        """torch's metadata inference runs the stage's module once before the first step, on the first micro-batch
        (first stage) or on uninitialised tensors of the received shapes (the others): in training mode a batch
        norm's running statistics took that forward in (one update too many on the first stage, nan or garbage on
        the last). Every buffer is put back as it was after it."""
        saved = [(b, b.detach().clone()) for b in self.submod.buffers()]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            with torch.no_grad():
                for b, value in saved:
                    b.copy_(value)

    def _to_tensor(self, arg):
        """An input of torch's metadata inference: a received one is made of its metadata, uninitialised; an
        integer one (position ids, targets passed through the model) is zeroed, a valid index wherever it indexes
        (uninitialised, it sent garbage ids into the stage's embeddings and losses: IndexError)."""
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
            with torch.no_grad():
                t.zero_()
        return t

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        self._release_all()
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info.get(fwd_chunk_id))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        self._allocate(getattr(self, "grad_recv_info", {}).get(bwd_chunk_id))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return _dense_sends(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return _dense_sends(super().get_bwd_send_ops(bwd_chunk_id))

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last and fwd_chunk_id in self.fwd_cache:
            # the last stage's backward starts from the loss (`backward_one_chunk` reads the loss, never the stage
            # output), so its output — the logits — need not wait there for the backward: kept, every micro-batch
            # in flight held its logits (all of them at once under GPipe); the schedule computes the loss from
            # the `output` returned here
            _, inputs = self.fwd_cache[fwd_chunk_id]
            self.fwd_cache[fwd_chunk_id] = ((), inputs)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._release(self.args_recv_info.get(bwd_chunk_id))
        self._release(getattr(self, "grad_recv_info", {}).get(bwd_chunk_id))
        return out


def carry_tied_grads(params: list[nn.Parameter | None], carried: dict[int, tuple]) -> None:
    """After a step: what each tied weight no optimizer clears holds now (after any clipping), for `sum_tied_grads`."""
    from torch.distributed.tensor import DTensor
    for i in carried:
        g = params[i].grad
        g = g.to_local() if isinstance(g, DTensor) else g
        carried[i] = (g, g.detach().clone()) if g is not None else None


def sum_tied_grads(params: list[nn.Parameter | None], groups: list[dist.ProcessGroup | None],
                   carried: dict[int, tuple] | None = None) -> None:
    """Sum the gradients of the copies of each tied weight over the ranks holding them (see module docstring).
    `carried`: for the weights no optimizer clears (left out of the factory's parameters), index -> (the gradient
    tensor, what it held after the last step, `carry_tied_grads`): a gradient still holding that sums only what
    was added since, so the copies keep one process's accumulated gradient instead of adding it again from every
    copy."""
    from torch.distributed.tensor import DTensor
    for i, (p, g) in enumerate(zip(params, groups)):
        if p is None or g is None:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
            # e.g. a vocab-parallel embedding's gradient can come back Replicate/Partial; match the parameter's
            # sharding so both copies exchange the same slice
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        last = carried.get(i) if carried is not None else None
        if last is not None and last[0] is grad:  # not cleared since its last sum
            grad.sub_(last[1])
            dist.all_reduce(grad, group=g)
            grad.add_(last[1])
        else:
            dist.all_reduce(grad, group=g)

