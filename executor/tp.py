"""Tensor parallelism as the plan writes it: DTensor parameters, DTensor activations, the model's own code.

The plan says where every parameter lives over the tp axis (`Plan.parameters`) and, per op, where its inputs and
output live (`Plan.ops`). `apply_tp` makes that true on one rank without touching the model's code or attributes:

1. Parameters: each becomes a DTensor on the tp mesh with the plan's placement (Replicate when unlisted); a tied
   weight stays one parameter.
2. Module calls: an op the plan places that is the only placed op of a built-in leaf module (nn.Linear,
   nn.Embedding, nn.LayerNorm, ...) gets a forward pre-hook that redistributes its tensor inputs to the plan's
   input placements and a post-hook that asserts the output placement DTensor propagated is the plan's `output`
   (ExecutorError naming the op and both placements otherwise: the planner's candidates are DTensor's own
   propagation, so a mismatch is a plan that does not describe what runs), then reduces a vocabulary-parallel
   embedding's masked partial sum.
3. Everything else (views, split/chunk, attention, RoPE, residual adds, a custom module's own ops) runs on DTensors:
   as the plan places each op, in the graph the plan names (`executor.graph_ops`: the model's torch.export graph,
   or its fx graph where export failed). Shapes are global: `view(B, T, n_head, C // n_head)` with the
   model's full head count is right on every rank, and an op that needs another layout (a `split` across a
   column shard) gets it by redistribution, never by computing something else. Tensors the forward creates
   itself (`arange`, masks, constants) are replicated (`implicit_replication`).
4. Replicated subtrees: a module none of whose ops or parameters the plan places runs on plain local tensors
   (inputs gathered to Replicate and unwrapped, output wrapped back as Replicate): no DTensor dispatch there, and
   ops without a DTensor sharding rule (BatchNorm, custom kernels) run as they are. Its parameters stay plain
   tensors (FSDP/DDP shard or replicate them over dp as usual).

The autograd of `redistribute`/`from_local` gives Megatron's f and g: a Replicate input read by column shards
gets its gradient all-reduced, a Partial output is all-reduced (or reduce-scattered) in forward.
"""
from __future__ import annotations

import contextlib
import functools
import re
import weakref
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from executor.errors import ExecutorError
from planner.autocast import AUTOCAST_LOWER_KINDS
from planner.op_kinds import module_kind
from planner.plan import OpPlacement, Plan

_SHARD = re.compile(r"^S\((-?\d+)\)$")


@functools.lru_cache(maxsize=None)
def parsed_placement(text: str, ndim: int):
    """`parse_placement`, remembered (the placed code asks it for every op input on every call)."""
    return parse_placement(text, ndim)


def parse_placement(text: str, ndim: int):
    """`R` -> Replicate, `P` -> Partial, `S(d)` -> Shard(d) with a negative d counted from the end of `ndim`."""
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    m = _SHARD.match(text)
    if not m:
        raise ExecutorError(f"placement {text!r} is not R, P or S(dim); fix the plan")
    d = int(m.group(1))
    d = d + ndim if d < 0 else d
    if not 0 <= d < max(ndim, 1):
        raise ExecutorError(f"placement {text} names dim {d} of a {ndim}-dim tensor; fix the plan")
    return Shard(d)


def _builtin_leaf(mod: nn.Module) -> bool:
    return mod.__module__.startswith(("torch.nn", "torch.ao.nn")) and next(mod.children(), None) is None


def module_calls(plan: Plan, model: nn.Module) -> dict[str, OpPlacement]:
    """Module path -> the placement of its one op, for placed ops that are a built-in leaf module's only placed op
    (what the module hooks apply); other placed ops follow from DTensor propagation."""
    named = dict(model.named_modules())
    count: dict[str, int] = {}
    for p in plan.ops.values():
        count[p.module] = count.get(p.module, 0) + 1
    return {p.module: p for p in plan.ops.values()
            if p.module in named and count[p.module] == 1 and _builtin_leaf(named[p.module])}


def local_modules(plan: Plan, model: nn.Module) -> list[str]:
    """The largest subtrees the plan leaves wholly replicated: no placed op runs in them and no parameter of
    theirs is placed. They run on plain tensors."""
    placed_paths = {p.module for p in plan.ops.values() if p.strategy != "replicate"}
    placed_paths |= {name.rpartition(".")[0] for name in plan.parameters}
    busy = set()
    for path in placed_paths:
        parts = path.split(".") if path else []
        busy.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    out: list[str] = []
    for path, mod in model.named_modules():
        if not path or path in busy or any(path.startswith(o + ".") for o in out):
            continue  # the root, a placed module or an ancestor of one, or inside a subtree already taken
        if type(mod) is nn.Module or isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.ParameterList,
                                                      nn.ParameterDict)) or _uncalled_unflattened(mod):
            continue  # never called itself (a container, or one fx made for a pipeline stage): its children are
        out.append(path)
    return out


def _uncalled_unflattened(mod: nn.Module) -> bool:
    """A container as torch.export unflattens it (an nn.ModuleList becomes an InterpreterModule with an empty
    graph): never called, so hooks on it never run; its children are called."""
    graph = getattr(mod, "graph", None)
    return isinstance(graph, torch.fx.Graph) and len(graph.nodes) == 0


def check_parameters(plan: Plan, model: nn.Module) -> None:
    """Every parameter the plan places exists and is placed R or S(dim) (ExecutorError otherwise). A dim tp does
    not divide is sharded unevenly (DTensor's rule: the last ranks hold one row fewer)."""
    params = dict(model.named_parameters())
    for name, where in plan.parameters.items():
        p = params.get(name)
        if p is None:
            raise ExecutorError(f"plan places parameter {name!r}, which this model does not have; re-plan for it")
        try:
            placement = parse_placement(where, p.dim())
        except ExecutorError as e:
            raise ExecutorError(f"plan places parameter {name} ({p.dim()} dims) as {where}: {e}") from None
        if isinstance(placement, Partial):
            raise ExecutorError(f"plan places parameter {name} as P (partial); a parameter is R or S(dim)")


_RULES_ADDED = False


def add_missing_rules() -> None:
    """DTensor sharding rules for ops torch ships without one (`register_sharding`, DTensor's public extension
    point): the CPU flash-attention kernel and its backward, which SDPA dispatches to on CPU. Like DTensor's own
    CUDA flash rule: replicated, or sharded on batch (dim 0) or heads (dim 1) with every tensor alike (a mask
    broadcast over that dim replicated)."""
    global _RULES_ADDED
    if _RULES_ADDED:
        return
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    def mask_placement(mask, p):
        """An additive/boolean mask [B or 1, H or 1, L, S] follows the batch or head shard where it has that dim,
        else stays replicated; absent, it takes no entry."""
        if mask is None:
            return []
        if isinstance(p, Shard) and mask.shape[p.dim] > 1:
            return [p]
        return [Replicate()]

    if fwd is not None:
        @register_sharding(fwd.default)
        def _flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
            return [([p, p], [p, p, p, None, None] + mask_placement(attn_mask, p))
                    for p in (Replicate(), Shard(0), Shard(1))]
    if bwd is not None:
        @register_sharding(bwd.default)
        def _flash_cpu_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None,
                           scale=None):
            return [([p, p, p], [p, p, p, p, p, p, None, None] + mask_placement(attn_mask, p))
                    for p in (Replicate(), Shard(0), Shard(1))]
    _RULES_ADDED = True


REPLICATED_OPS: list[str] = []
"""Custom ops that had no DTensor sharding rule and were given the replicate-everything rule (for reports)."""


def replicate_custom_ops() -> list[str]:
    """Give every custom op the model defines (`torch.library.custom_op` from code outside torch) that DTensor
    has no rule for the rule "all inputs and outputs replicated": its DTensor inputs are gathered, every tp rank
    runs the whole op, its outputs are replicated. Returns the ops newly given the rule (kept in
    `REPLICATED_OPS`)."""
    from torch._library.custom_ops import OPDEFS
    from torch.distributed.tensor import DTensor as _DT
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.experimental import register_sharding
    prop = _DT._op_dispatcher.sharding_propagator
    new = []
    for opdef in list(OPDEFS.values()):
        fn = getattr(opdef, "_init_fn", None)
        if getattr(fn, "__module__", "torch").split(".")[0] == "torch":
            continue
        op = opdef._opoverload
        if op in prop.op_strategy_funcs or op in getattr(prop, "op_to_rules", {}) or str(op) in REPLICATED_OPS:
            continue
        n_out = len(op._schema.returns)

        def replicate_all(*args, _n=n_out, **kwargs):
            ins = [Replicate() if isinstance(a, DTensorSpec) else None for a in args]
            ins += [Replicate() for a in kwargs.values() if isinstance(a, DTensorSpec)]
            return [([Replicate()] * _n, ins)]
        register_sharding(op)(replicate_all)
        REPLICATED_OPS.append(str(op))
        new.append(str(op))
    return new


def replicated_ops_note(graph: torch.fx.Graph | None) -> str | None:
    """The note naming the `REPLICATED_OPS` the model calls: those `graph` (its exported flat graph) calls, or,
    without one (a model run from its torch.fx trace), every custom op given the rule in this process (a library
    such as transformers registers its own on import, called or not)."""
    called = None if graph is None else {str(n.target) for n in graph.nodes if n.op == "call_function"}
    ops = [op for op in REPLICATED_OPS if called is None or op in called]
    return ("custom ops without a DTensor sharding rule run replicated over tp where called (inputs gathered): "
            + ", ".join(ops)) if ops else None


def apply_tp(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh, canonical: Mapping[str, str] | None = None) -> None:
    """Distribute `model`'s parameters per the plan and install the hooks (see the module docstring). `model` may
    be a pipeline stage holding some of the plan's parameters (checked on the whole model by `check_parameters`);
    `canonical` maps each parameter name of the whole model to the first name of its tensor (a tied weight's name
    in the plan), since a stage may hold only the second holder of a tied weight.
    The model must be called under `implicit_replication()` (the Runner does)."""
    add_missing_rules()
    replicate_custom_ops()
    local = local_modules(plan, model)
    named = dict(model.named_modules())
    in_local = {id(p) for path in local for p in named[path].parameters()}
    new: dict[int, nn.Parameter] = {}
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), (canonical or {}).get(name, name))
    for mod_path, mod in named.items():
        for attr, p in list(mod._parameters.items()):
            if p is None or id(p) in in_local:
                continue
            if id(p) not in new:
                where = plan.parameters.get(first_name[id(p)], "R")
                dt = distribute_tensor(p.data, tp_mesh, [parse_placement(where, p.dim())], src_data_rank=None)
                new[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod._parameters[attr] = new[id(p)]
    for path in local:
        _run_locally(named[path], tp_mesh)
    op_names = {p.module: name for name, p in plan.ops.items()}
    for path, placement in module_calls(plan, model).items():
        _place_call(named[path], path, placement, tp_mesh, op_names.get(path, path))


def _run_locally(mod: nn.Module, mesh: DeviceMesh) -> None:
    """Hooks that run `mod` on plain tensors: DTensor inputs gathered to Replicate and unwrapped, outputs wrapped
    as Replicate DTensors (differentiable both ways, so the gradients of its plain parameters stay plain)."""
    writes = _writes_inputs(mod)

    def pre(module, args, kwargs):
        # an in-place module (ReLU(inplace=True)) must not write into the alias `to_local` returns
        conv = (lambda t: _to_local(t, mesh).clone() if isinstance(t, DTensor) else t) \
            if writes else (lambda t: _to_local(t, mesh))
        return tree_map(conv, args), tree_map(conv, kwargs)

    def post(module, args, kwargs, output):
        return tree_map(lambda t: _from_local(t, mesh), output)
    mod.register_forward_pre_hook(pre, with_kwargs=True)
    mod.register_forward_hook(post, with_kwargs=True)


def _writes_inputs(mod: nn.Module) -> bool:
    """Whether a module may write into a tensor it is given: `inplace=True` (nn.ReLU), or, for a module unflattened
    from torch.export (its own graph), an aten op in that graph that mutates an argument (`relu_`)."""
    if getattr(mod, "inplace", False):
        return True
    graph = getattr(mod, "graph", None)
    return isinstance(graph, torch.fx.Graph) and any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in graph.nodes)


def _to_local(t: Any, mesh: DeviceMesh | None = None) -> Any:
    """A DTensor gathered and unwrapped (with `mesh`: shared by the replicated modules reading one tensor, as q, k
    and v do, and kept as its shard for their backward under sequence parallelism: `keep_shards`)."""
    if isinstance(t, DTensor):
        if mesh is not None:
            return _shared_redistribute(t, "R", mesh, "replicated module input").to_local()
        return t.redistribute(placements=[Replicate()]).to_local()
    return t


def _from_local(t: Any, mesh: DeviceMesh) -> Any:
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return t


def _redistribute(t: Any, text: str, mesh: DeviceMesh, where: str) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    want = parsed_placement(text, t.dim())
    have = t.placements[0]
    if have == want or (isinstance(want, Partial) and type(have) is Partial):
        return t
    if isinstance(want, Partial) and have.is_partial():
        # a masked partial (vocabulary-parallel embedding) cannot meet other partial sums: reduce it where the
        # op ends, as Megatron's VocabParallelEmbedding does (the consumer edge P -> R the plan prices)
        return _ReduceMasked.apply(t)
    if isinstance(want, Partial):
        raise ExecutorError(f"{where}: the plan wants a partial sum but DTensor produced {have}; re-plan")
    if t.requires_grad and not t.is_leaf:  # an activation: its hook goes with it (a leaf's would pile up per step)
        t.register_hook(_consistent_grad)
    out = t.redistribute(placements=[want])
    if isinstance(have, Shard) and have.dim != t.dim() - 1 and isinstance(want, Replicate):
        _note_gather(t, out)  # a sequence (not feature) shard gathered: saved as the shard (`keep_shards`)
    return out


def _consistent_grad(g: Any) -> Any:
    """The gradient DTensor's backward of a redistribution hands on can say strides its gathered (or split) local
    tensor does not have (a contiguous DTensor over a transposed local); a view of it further back (the
    `q.view(b, t, h, d)` before a transpose, in backward) then views the local tensor and fails ("Cannot view a
    tensor with shape ... and strides ..."). Rebuilt contiguous, the DTensor and its local tensor agree."""
    if not isinstance(g, DTensor):
        return None
    local = g.to_local()
    if local.is_contiguous() and g.is_contiguous():
        return None
    return DTensor.from_local(local.contiguous(), g.device_mesh, g.placements, run_check=False, shape=g.shape,
                              stride=torch.empty(g.shape, device="meta").stride())


class _ReduceMasked(torch.autograd.Function):
    """Masked partial -> Replicate (all-reduce) whose backward hands the gradient on replicated (partial gradients
    summed first): DTensor's own redistribute would send a partial gradient back into the masked-partial type,
    which it cannot convert."""

    @staticmethod
    def forward(ctx, t):
        return t.redistribute(placements=[Replicate()])

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and grad.placements[0].is_partial():
            grad = grad.redistribute(placements=[Replicate()])
        return grad


_LAST: Any = None
"""The latest shared redistribution (input, key, result), kept for the readers that follow it
(`_shared_redistribute`)."""


def forget_recomputed() -> None:
    """End of a recomputation inside backward: drop the shared redistribution it made. Its result carries the
    recomputed graph, which holds what the recomputation saved; kept, that would stay alive through the next
    block's backward (one block's activations more at the peak)."""
    global _LAST
    if torch._C._current_graph_task_id() != -1:
        _LAST = None


def forget_gathered() -> None:
    """Start and end of a forward: drop the shared redistribution (`_shared_redistribute`), so a gathered tensor
    lives only as long as something holds it, and the gathers `keep_shards` may find."""
    global _LAST
    _LAST = None
    _SOURCES.clear()


class _Source:
    """A tensor gathered from a sequence shard: the shard (held once a saved tensor needs it), and the whole
    tensor while backward reads it."""

    __slots__ = ("ref", "shard", "full", "packs", "unpacks")

    def __init__(self, shard: DTensor):
        self.ref, self.shard, self.full, self.packs, self.unpacks = weakref.ref(shard), None, None, 0, 0


class _Regather:
    """A saved tensor that is (a view of) a gathered tensor, kept as its source's shard (see `keep_shards`)."""

    __slots__ = ("src", "size", "stride", "offset", "shape", "gstride")

    def __init__(self, src: _Source, local: torch.Tensor, t: DTensor | None):
        self.src, self.size, self.stride, self.offset = src, local.size(), local.stride(), local.storage_offset()
        self.shape, self.gstride = (t.shape, t.stride()) if t is not None else (None, None)


_SOURCES: dict[int, _Source] = {}
"""Storage address of each live tensor gathered from a sequence shard in the forward running now -> its source.
Filled outside backward only; an entry goes when its tensor does and at every forward's start and end
(`forget_gathered`), so an address is never stale."""


def _address(t: torch.Tensor) -> int | None:
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        return None  # no storage to compare (the dry run): saved whole
    return t.untyped_storage().data_ptr()


def _note_gather(shard: DTensor, out: DTensor) -> None:
    if not _KEEPING or torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
        return  # not under `keep_shards`, a recomputation inside backward, or nothing will be saved
    address = _address(out._local_tensor)
    if address is not None:
        _SOURCES[address] = _Source(shard)
        # the entry goes when the gathered tensor does (its storage can be reused after that, never before)
        weakref.finalize(out._local_tensor, _SOURCES.pop, address, None)


def _pack(t: Any) -> Any:
    if not _SOURCES or not isinstance(t, torch.Tensor):
        return t
    dt = isinstance(t, DTensor)
    if dt and not t.placements[0].is_replicate():
        return t
    local = t._local_tensor if dt else t  # a replicated subtree saves the gathered tensor's plain local view
    src = _SOURCES.get(_address(local))
    if src is None or (src.shard is None and src.ref() is None):
        return t
    src.shard = src.ref()
    src.packs += 1
    return _Regather(src, local, t if dt else None)


def _unpack(x: Any) -> Any:
    if not isinstance(x, _Regather):
        return x
    src = x.src
    if src.full is None:  # the first reader in backward gathers it again; the last lets it go
        with torch.no_grad():
            src.full = src.shard.redistribute(placements=[Replicate()])._local_tensor.contiguous()
    full = src.full
    src.unpacks += 1
    if src.unpacks >= src.packs:
        src.full = None
    local = full.as_strided(x.size, x.stride, full.storage_offset() + x.offset)
    if x.shape is None:
        return local
    return DTensor.from_local(local, src.shard.device_mesh, [Replicate()], run_check=False, shape=x.shape,
                              stride=x.gstride)


_KEEPING = False
"""Whether `keep_shards` is active (gathers are noted only then)."""


@contextlib.contextmanager
def keep_shards():
    """Megatron-LM's sequence-parallel memory: a tensor all-gathered from a sequence shard (a norm's output on its
    way into the column-parallel linears) is saved for backward as that shard and gathered again when backward
    reads it (once for the q, k and v that share it), instead of whole: tp times less memory for one more
    all-gather. Covers what autograd saves outside activation checkpointing (inside a checkpointed block,
    checkpointing's own hooks decide). Use as the context of forward and backward."""
    global _KEEPING
    was, _KEEPING = _KEEPING, True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _KEEPING = was


def autocast_dtype(t: Any, lower: bool) -> torch.dtype | None:
    """The dtype an input `t` of an op enters the op in under autocast when the op is on the lower-precision list
    (`lower`): the autocast dtype for an fp32 tensor, else None (no cast). The executor casts such an input before
    redistributing it, once for all the op's consecutive readers (q, k and v): the op would cast it anyway, and
    the collective then moves, and its gradient comes back in, half the bytes, as Megatron-LM's bf16 activations
    do."""
    if not lower or not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        return None
    device = t.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _shared_redistribute(t: Any, text: str, mesh: DeviceMesh, where: str, dtype: torch.dtype | None = None) -> Any:
    """`_redistribute`, shared by consecutive readers of one tensor in one placement: q, k and v read one norm
    output and gather it once, as Megatron's f does (their gradients then meet before one reduce-scatter). Only the
    latest result is kept, until another redistribution or the forward's end (`forget_gathered`): which
    collectives run never depends on object lifetimes (every rank must issue the same ones), and a tensor saved as
    its shard (`keep_shards`) is freed once its readers are done. A recomputation inside a backward keys its own
    entries, so it issues exactly the forward's collectives."""
    global _LAST
    if not isinstance(t, DTensor) and dtype is None:
        return _redistribute(t, text, mesh, where)
    key = (text, t._version, torch._C._current_graph_task_id(), dtype)
    if _LAST is not None and _LAST[0] is t and _LAST[1] == key:
        return _LAST[2]
    cast = t.to(dtype) if dtype is not None else t
    out = _redistribute(cast, text, mesh, where)
    if out is not t:
        # the cast is held with it: a gathered tensor is saved as that shard (`keep_shards`), found through a
        # weak reference while the readers run
        _LAST = (t, key, out, cast)
    return out


def _place_call(mod: nn.Module, path: str, placement: OpPlacement, mesh: DeviceMesh, op: str) -> None:
    """Hooks that give the module call the plan's input placements, assert that DTensor propagated the plan's
    output placement (`check_output`), and hand the output on as the plan says."""
    lower = module_kind(mod) in AUTOCAST_LOWER_KINDS
    unchecked = [True]

    def pre(module, args):
        if unchecked[0]:
            check_param_placements(list(module.parameters()), placement, op, path)
            unchecked[0] = False
        out, k = [], 0
        for a in args:
            if isinstance(a, torch.Tensor) and k < len(placement.inputs):
                a = _shared_redistribute(a, placement.inputs[k], mesh, f"{path} input {k}", autocast_dtype(a, lower))
                k += 1
            out.append(a)
        return tuple(out)

    def post(module, args, output):
        if isinstance(output, torch.Tensor):
            check_output(output, placement.output, op, path)
            return _redistribute(output, placement.output, mesh, f"{path} output")
        return output
    mod.register_forward_pre_hook(pre)
    mod.register_forward_hook(post)


def check_param_placements(params: list, placement: OpPlacement, op: str, path: str) -> None:
    """ExecutorError where a parameter an op reads (`params`, in `OpNode.params` order: the order the op reads
    them) lives elsewhere than the op's `params` say: parameters get the plan's `parameters` placements, which
    `plan` writes from the ops'; a hand-edited plan can contradict itself, and DTensor would then move the weight
    on every call, a cost the prediction does not have. Parameters of a 2-D (FSDP2) mesh are not compared."""
    from planner.dtensor_rules import placement_text
    if len(params) != len(placement.params):
        return
    for k, (p, planned) in enumerate(zip(params, placement.params)):
        if not isinstance(p, DTensor) or p.device_mesh.ndim != 1:
            continue
        have = p.placements[0]
        if have != parsed_placement(planned, p.dim()):
            raise ExecutorError(f"op {op} (module {path}): its parameter {k} is placed {placement_text(have) or have} "
                                f"(the plan's `parameters`), but the op's `params` say {planned}: the plan "
                                "contradicts itself; re-plan (plan writes both from one placement)")


def check_output(t: torch.Tensor, planned: str, op: str, path: str) -> None:
    """ExecutorError unless the placement DTensor propagated for a module call's output is the plan's `output`
    (a plain tensor counts as replicated; any partial sum matches `P`): the plan's candidates come from DTensor's
    own propagation (`planner.dtensor_rules`), so a mismatch means the plan does not describe what runs."""
    from planner.dtensor_rules import placement_text
    have = t.placements[0] if isinstance(t, DTensor) else Replicate()
    want = parsed_placement(planned, t.dim())
    if have == want or (isinstance(want, Partial) and have.is_partial()):
        return
    raise ExecutorError(f"op {op} (module {path}): DTensor propagated the output as "
                        f"{placement_text(have) or have}, the plan says {planned}; re-plan (plan writes the "
                        "placement DTensor propagates)")


_LOSS_INPUT = {  # loss op -> (argument index of the logits, their class dim: an int, or "nll" for nll_loss's)
    torch.ops.aten._log_softmax.default: (0, 1), torch.ops.aten._log_softmax_backward_data.default: (1, 2),
    torch.ops.aten.nll_loss_forward.default: (0, "nll"), torch.ops.aten.nll_loss2d_forward.default: (0, "nll"),
    torch.ops.aten.nll_loss_backward.default: (1, "nll"), torch.ops.aten.nll_loss2d_backward.default: (1, "nll")}


@functools.lru_cache(maxsize=None)
def _loss_handlers_where_sharded() -> dict:
    """DTensor custom-op handlers for the cross-entropy ops: torch's `loss_parallel` ones (vocabulary-parallel) on
    logits sharded on their class dim, DTensor's own propagation on any other."""
    from torch.distributed.tensor.parallel import loss as tp_loss
    handlers = DTensor._op_dispatcher._custom_op_handlers

    def where_sharded(op, vocab_parallel):
        arg, dim = _LOSS_INPUT[op]

        def handler(op_call, args, kwargs):
            x = args[arg]
            d = (0 if x.dim() == 1 else 1) if dim == "nll" else args[dim] % x.dim()
            if isinstance(x, DTensor) and any(p.is_shard(d) for p in x.placements):
                return vocab_parallel(op_call, args, kwargs)
            mine = handlers.pop(op_call)  # DTensor's own propagation for this call
            try:
                return op_call(*args, **kwargs)
            finally:
                handlers[op_call] = mine
        return handler
    return {op: where_sharded(op, h) for op, h in tp_loss.customized_loss_ops.items()}


@contextlib.contextmanager
def loss_parallel_where_sharded():
    """torch's `loss_parallel` (cross-entropy vocabulary-parallel, forward and backward) for logits sharded on their
    class dim, DTensor's own rules for any other: under `loss_parallel` itself a cross-entropy over replicated
    logits raises ("loss_parallel() requires exactly one mesh dim to shard tensor dimension 1"), so every tp plan of
    a model that computes its loss inside forward (nanoGPT's `forward(idx, targets)`) failed."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = _loss_handlers_where_sharded()
    before = {op: handlers.get(op) for op in mine}
    handlers.update(mine)
    try:
        yield
    finally:
        for op, h in before.items():
            if h is None:
                handlers.pop(op, None)
            else:
                handlers[op] = h


def to_plain(x: Any, keep_vocab_sharded: bool = False) -> Any:
    """Model outputs as plain tensors: DTensors gathered (`full_tensor`, differentiable). With
    `keep_vocab_sharded`, a tensor sharded on its last dim (vocabulary-parallel logits) stays a DTensor for
    `loss_parallel`."""
    def one(t):
        if not isinstance(t, DTensor):
            return t
        if keep_vocab_sharded and t.placements[0] == Shard(t.dim() - 1):
            return t
        return t.full_tensor()
    out = tree_map(one, x)
    if isinstance(getattr(out, "logits", None), DTensor):  # an output object pytree does not know
        out.logits = one(out.logits)
    return out


def stage_boundary_hooks(stage: nn.Module, mesh: DeviceMesh, last: bool, received: list[str] | None = None,
                         sent: list[str] | None = None) -> None:
    """A pipeline stage sends and receives plain tensors. `received` / `sent`: the placement (`S(d)`, or "R") each
    value crossing into / out of the stage has (`executor.pipeline.boundary_placements`; None: all "R"). A sharded
    value travels as each tp rank's local shard, between the same tp rank of the two stages: the sender unwraps its
    shard (redistributed to that placement first, should it hold another), the receiver wraps the shard back with
    it, and the gradients travel the same way. A value placed "R" travels whole: the sender gathers it to
    Replicate and unwraps it, the receiver reads it as Replicate (its gradient comes back a plain tensor). The last
    stage's outputs go to the loss as the model's outputs do."""
    def pre(module, args):
        return tuple(_received(a, mesh, received[i] if received and i < len(received) else "R")
                     for i, a in enumerate(args))

    def post(module, args, output):
        if isinstance(output, tuple):
            return tuple(_sent(o, mesh, sent[i] if sent and i < len(sent) else "R") for i, o in enumerate(output))
        return _sent(output, mesh, sent[0] if sent else "R")
    stage.register_forward_pre_hook(pre)
    if not last:
        stage.register_forward_hook(post)


def _received(t: Any, mesh: DeviceMesh, placement: str) -> Any:
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or not t.is_floating_point():
        return t
    return DTensor.from_local(t, mesh, [parsed_placement(placement, t.dim())], run_check=False)


def _sent(t: Any, mesh: DeviceMesh, placement: str) -> Any:
    if placement == "R" or not isinstance(t, torch.Tensor):
        return tree_map(_to_local, t)
    return _redistribute(t, placement, mesh, "a pipeline stage's output").to_local()


def reduce_partial_grads(params) -> None:
    """Sum partial gradients once before the optimizer: a replicated parameter read by sharded activations (a
    sequence-parallel norm's weight) gets a Partial gradient, which every optimizer op would otherwise all-reduce
    again (AdamW: three times); a plain parameter's DTensor gradient becomes the plain whole one."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements) \
                and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
        elif isinstance(g, DTensor) and not isinstance(p, DTensor):
            # a plain (replicated) parameter that DTensor code read as well, as a tied head written
            # F.linear(x, self.wte.weight) in the root's forward: its gradient arrives as a DTensor
            p.grad = g.full_tensor()
