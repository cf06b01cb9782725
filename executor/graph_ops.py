"""The plan's placements of every op, applied as written: the model runs as the graph `plan.json`'s op names
refer to, op by op.

`plan.model["graph"]` says which graph that is (`planner.trace`). By default torch.export's aten training IR
(non-strict): `exported` exports the model the planner's way with one micro-batch and unflattens it to its module
tree (same module paths and parameter names, so FSDP2, activation checkpointing and checkpoints keep their
modules); `place_exported_ops` runs every module's graph as generated code with the placements inline, ops matched
by node name. Where export failed the planner used torch.fx (built-in leaf modules whole): `place_ops` traces the
root and each repeated block on their own, blocks kept as leaves of the root's graph; their ops, blocks expanded in
place, are the whole-model trace's ops in the same order, which names them, and built-in module calls are placed
by `executor.tp`'s module hooks.

Either way, each op's inputs are made the placements the plan gives them (the redistribution the cost model priced
on that edge), the op runs on DTensors, and its output placement is asserted (ExecutorError naming the op and both
placements otherwise). An op that fails carries its module path and model-file line (`source_module`,
`source_stack`) for the dry run's message. An export that lacks an op the plan names is refused (`require_ops`).
Under pipelining the stages are cut from the same graph (`executor.pipeline.split_model`): its blocks run placed,
and each stage graph's own ops too (`place_stage_ops`: its nodes keep the names of the graph it was cut from).
"""
from __future__ import annotations

import inspect
import itertools
import linecache
import operator
import re
import types
import warnings
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from executor import tp
from executor.errors import ExecutorError
from planner.autocast import AUTOCAST_LOWER_KINDS
from planner.exporting import export_training
from planner.op_kinds import callee_name, function_kind
from planner.plan import Plan

_CALLS = ("call_function", "call_method", "call_module")
PIPELINED = ("pipeline stages run each block's ops as the plan places them; the ops between a stage's modules "
             "(outside the blocks: e.g. token plus position embeddings) follow DTensor's own propagation (the "
             "stages were cut from a trace that does not line up with the planner's)")
"""The note for a pipelined plan whose stages' own ops could not be matched to the plan (`place_stage_ops`)."""


NOT_TRACEABLE = ("ops outside module calls follow DTensor's propagation: the plan names torch.fx's ops, and fx "
                 "cannot trace the model here; re-plan (plan names torch.export's ops unless export fails)")
"""`place_ops`'s answer (and the note) for an fx-named plan whose model fx cannot trace."""


def _tracer(leaves: set[str]) -> torch.fx.Tracer:
    """The planner's tracer (built-in leaf modules whole), with the modules at `leaves` (paths from the traced
    root) kept whole too."""
    from planner.trace import _LeafTracer

    class _Tracer(_LeafTracer):
        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            return module_qualified_name in leaves or super().is_leaf_module(m, module_qualified_name)
    tracer = _Tracer()
    tracer.record_stack_traces = True  # each node keeps its model-file line, for error messages
    return tracer


def _key(node: torch.fx.Node, prefix: str) -> tuple:
    """What a call node calls, comparable across traces of a module and of its parent."""
    if node.op == "call_module":
        return node.op, prefix + str(node.target)
    return node.op, node.target


def _pieces(model: nn.Module, blocks: list[str], local: list[str]) -> dict[str, torch.fx.Graph] | None:
    """The root's graph under "" and each block's own graph, blocks and replicated subtrees (`local`) kept as
    leaves; None when fx cannot trace one."""
    named = dict(model.named_modules())
    out: dict[str, torch.fx.Graph] = {}
    try:
        out[""] = _tracer(set(blocks) | set(local)).trace(model)
        for path in blocks:
            inner = {p[len(path) + 1:] for p in local if p.startswith(path + ".")}
            out[path] = _tracer(inner).trace(named[path])
    except Exception:
        return None
    return out


def _expanded(pieces: dict[str, torch.fx.Graph]) -> list[tuple[str, torch.fx.Node, tuple]]:
    """(piece, node, key) for every call node of the root graph with each block's call replaced by its own
    graph's call nodes: the whole model's op order (a replicated subtree's call standing for all of its ops)."""
    out = []
    for node in pieces[""].nodes:
        if node.op not in _CALLS:
            continue
        if node.op == "call_module" and str(node.target) in pieces:
            path = str(node.target)
            out += [(path, n, _key(n, path + ".")) for n in pieces[path].nodes if n.op in _CALLS]
        else:
            out.append(("", node, _key(node, "")))
    return out


def _inside(node: torch.fx.Node, path: str) -> bool:
    """Whether a whole-trace node runs inside the module at `path`."""
    if node.op == "call_module" and (node.target == path or str(node.target).startswith(path + ".")):
        return True
    return path in (node.meta.get("nn_module_stack") or {})


def _align(order: list, calls: list[torch.fx.Node], local: set[str]) -> list[tuple] | None:
    """[(piece, piece node, key, whole node)] pairing the expanded pieces with the whole trace's call nodes; a
    replicated subtree's call pairs with the first of its ops and skips the rest. None where they differ."""
    out, i = [], 0
    for piece, node, key in order:
        if i >= len(calls):
            return None
        w = calls[i]
        if node.op == "call_module" and key[1] in local:
            if not _inside(w, key[1]):
                return None
            out.append((piece, node, key, w))
            while i < len(calls) and _inside(calls[i], key[1]):
                i += 1
            continue
        if key != _key(w, "") or len(w.all_input_nodes) != len(node.all_input_nodes):
            return None
        out.append((piece, node, key, w))
        i += 1
    return out if i == len(calls) else None


_NOT_TENSOR_METHODS = frozenset({"size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size",
                                  "tolist", "item", "type", "get_device", "__len__", "is_floating_point"})
"""Methods that read a tensor's metadata or values into Python: not ops of the plan, their inputs stay as they are."""


def _is_metadata(node: torch.fx.Node) -> bool:
    import builtins
    if node.op == "call_method":
        return node.target in _NOT_TENSOR_METHODS
    return node.op == "call_function" and node.target in (builtins.getattr, builtins.len, builtins.isinstance)


def _annotate(e: Exception, node: torch.fx.Node, whole: torch.fx.Node | None, prefix: str) -> None:
    """Mark `e` with where in the model the op `node` (of a module's graph at `prefix`) runs: the innermost failing
    op names it (`source_module`, `source_stack`: the dry run's message)."""
    if hasattr(e, "source_module"):
        return
    path = _path(whole) if whole is not None else str(node.target) if node.op == "call_module" else ""
    if node.op == "call_module" and path:
        path = ".".join(p for p in (prefix, str(node.target)) if p)
    e.source_module, e.source_stack = path or prefix, node.stack_trace or ""  # type: ignore[attr-defined]


def _input_placer(node: torch.fx.Node, whole: torch.fx.Node, placement: Any, mesh: DeviceMesh,
                  prefix: str) -> Callable[..., tuple]:
    """The function the generated code calls with the op `node`'s input values (`node.all_input_nodes` order) to
    get them as the plan places them: each input the whole trace's op reads from another op moves to the plan's
    placement for it (replicated ops, `placement` None: only sharded or partial inputs move, to replicated)."""
    lower = node.op in ("call_function", "call_method") and \
        function_kind(callee_name(node.op, node.target), False) in AUTOCAST_LOWER_KINDS
    moves, seen = [], set()  # (position among the op's inputs, whether the whole trace's input is an op's output)
    for j, w_in in enumerate(whole.all_input_nodes[:len(node.all_input_nodes)]):
        if w_in.name not in seen:
            seen.add(w_in.name)
            moves.append((j, w_in.op in _CALLS))
    first = node.all_input_nodes.index(node.args[0]) \
        if _is_reshape(node) and node.args and isinstance(node.args[0], torch.fx.Node) else None
    unchecked = [placement is not None and bool(placement.params)]
    reads_params = any(not from_op for _, from_op in moves)  # parameters (get_attr), not other ops' outputs

    def place(*values):
        try:
            if unchecked[0]:
                unchecked[0] = False
                tp.check_param_placements([values[j] for j, from_op in moves if not from_op
                                           and isinstance(values[j], nn.Parameter)], placement, whole.name,
                                          placement.module)
            out = list(values)
            k = 0
            on_dtensors = reads_params and any(isinstance(v, DTensor) for v in values)
            for j, from_op in moves:
                value = values[j]
                if not from_op and on_dtensors and _plain_parameter(value):
                    # a plain parameter (of a replicated module) read by DTensor code, as a tied head written
                    # F.linear(x, self.wte.weight) in the root's forward: entered as Replicate, so that its
                    # gradient comes back plain and whole (implicit replication would hand it a DTensor
                    # gradient, which FSDP2's reduce-scatter during backward cannot take)
                    out[j] = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
                if not from_op or not isinstance(value, torch.Tensor):
                    continue
                if placement is None:
                    if isinstance(value, DTensor) and not value.placements[0].is_replicate():
                        out[j] = tp._shared_redistribute(value, "R", mesh, f"op {whole.name} input {k}")
                elif k < len(placement.inputs):
                    text, dtype = placement.inputs[k], tp.autocast_dtype(value, lower)
                    # already where the plan wants it (most inputs): nothing to move, nothing to look up
                    if dtype is not None or not isinstance(value, DTensor) \
                            or value.placements[0] != tp.parsed_placement(text, value.dim()):
                        out[j] = tp._shared_redistribute(value, text, mesh, f"op {whole.name} input {k}", dtype)
                k += 1
            if first is not None and isinstance(out[first], DTensor) and not out[first].to_local().is_contiguous():
                # reshape copies what it cannot view; on a DTensor it views the local tensor (a gathered
                # transpose: "Cannot view a tensor with shape [8, 64, 4, 32] and strides ..."), so copy first
                out[first] = out[first].clone(memory_format=torch.contiguous_format)
            return tuple(out)
        except Exception as e:
            _annotate(e, node, whole, prefix)
            raise
    place.__name__ = f"place_{node.name}"
    return place


def _plain_parameter(value: Any) -> bool:
    """Whether `value` is a parameter left a plain tensor (not a DTensor) that needs a gradient."""
    return isinstance(value, nn.Parameter) and not isinstance(value, DTensor) and value.requires_grad


def _output_checker(node: torch.fx.Node, whole: torch.fx.Node, placement: Any, mesh: DeviceMesh,
                    prefix: str) -> Callable[[Any], Any]:
    """The function the generated code passes the op's output through: ExecutorError unless DTensor propagated the
    plan's placement; a vocabulary-parallel embedding's masked partial sum is reduced where the op ends (tp's
    module hook does the same for a module call)."""
    want = placement.output if placement is not None else "R"
    where = placement.module if placement is not None else _path(whole)

    def check(out):
        if not isinstance(out, torch.Tensor):
            return out
        try:
            tp.check_output(out, want, whole.name, where)
            if want == "P" and placement is not None:
                return tp._redistribute(out, "P", mesh, f"op {whole.name} output")
            return out
        except Exception as e:
            _annotate(e, node, whole, prefix)
            raise
    check.__name__ = f"check_{node.name}"
    return check


_CODE_IDS = itertools.count(1)
"""Numbers the placed code's pseudo-files (`<shardwise placed PATH #N>`), so that tracebacks show its lines."""


def _placed_code(graph: torch.fx.Graph, specs: dict[torch.fx.Node, tuple], mesh: DeviceMesh,
                 prefix: str) -> Callable[..., Any]:
    """forward(module, *inputs): `graph` as generated Python code with each placed op's inputs passed through its
    `_input_placer` and its output through its `_output_checker` (a copy of the graph: the module keeps its own).
    Generated code, not torch.fx.Interpreter: the interpreter's Python walk over the nodes (per call a new
    Interpreter and its progress bar, per node context managers and argument maps) cost a placed nn.Linear's call
    about 0.3 ms on a CPU rank, which no cost term prices. An exception from an op carries the op's module path
    (`_annotate`), found from the generated code's failing line."""
    copy = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    copy.output(copy.graph_copy(graph, env))
    for old, (whole, placement) in specs.items():
        n = env[old]
        inputs = list(n.all_input_nodes)
        if inputs:
            with copy.inserting_before(n):
                placed = copy.call_function(_input_placer(old, whole, placement, mesh, prefix), tuple(inputs))
                got = {x: copy.call_function(operator.getitem, (placed, j)) for j, x in enumerate(inputs)}
            n.args = torch.fx.node.map_arg(n.args, lambda x: got.get(x, x))
            n.kwargs = torch.fx.node.map_arg(n.kwargs, lambda x: got.get(x, x))
        with copy.inserting_after(n):
            checked = copy.call_function(_output_checker(old, whole, placement, mesh, prefix), (n,))
        n.replace_all_uses_with(checked, delete_user_cb=lambda user: user is not checked)
    code = copy.python_code(root_module="self")
    key = f"<shardwise placed {prefix or 'root'} #{next(_CODE_IDS)}>"
    linecache.cache[key] = (len(code.src), None, code.src.splitlines(True), key)  # readable tracebacks
    scope = dict(code.globals)
    exec(compile(code.src, key, "exec"), scope)
    fn = scope["forward"]
    by_copy = {new: old for old, new in env.items()}
    nodes = list(copy.nodes)

    def forward(module: nn.Module, *inputs: Any) -> Any:
        try:
            return fn(module, *inputs)
        except Exception as e:
            if not hasattr(e, "source_module"):
                node = _failing_node(e, key, code, nodes)
                old = by_copy.get(node) if node is not None else None
                if old is not None:
                    _annotate(e, old, specs[old][0] if old in specs else None, prefix)
            raise
    return forward


def _failing_node(e: Exception, key: str, code: Any, nodes: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The node of the generated code `key` whose line raised `e` (None when the traceback does not say)."""
    lineno_map, start = getattr(code, "_lineno_map", None), getattr(code, "_prologue_start", 0)
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == key:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None or not lineno_map:
        return None
    index = lineno_map.get(line - start)
    return nodes[index] if index is not None and index < len(nodes) else None


def _is_reshape(node: torch.fx.Node) -> bool:
    """`reshape` in either graph: export's `aten.reshape.default`, fx's `x.reshape(...)` / `torch.reshape`."""
    if node.op == "call_method":
        return node.target == "reshape"
    return node.op == "call_function" and node.target in (torch.ops.aten.reshape.default, torch.reshape)


def _path(node: torch.fx.Node) -> str:
    """The module a whole-trace node runs in (for messages)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    last = list(stack.values())[-1] if stack else None
    return str(last[0]) if last and isinstance(last[0], str) else ""


def _install(module: nn.Module, path: str, graph: torch.fx.Graph, specs: dict, mesh: DeviceMesh) -> None:
    """`module.forward` becomes `graph`'s placed code, called with the original forward's arguments."""
    sig = inspect.signature(module.forward)
    names = [str(n.target).lstrip("*") for n in graph.nodes if n.op == "placeholder"]
    run = _placed_code(graph, specs, mesh, path)

    def forward(self, *args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        out = run(self, *graph.process_inputs(*[bound.arguments[k] for k in names]))
        return graph.process_outputs(out)
    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def place_ops(model: nn.Module, plan: Plan, mesh: DeviceMesh, blocks: list[str], local: list[str],
              hooked: set[str], root: bool = True, root_specs: dict | None = None) -> str | None:
    """Run `model` as its traced graph with the plan's placement on every op that is not a module call `executor.tp`
    hooks (`hooked`: their paths); see the module docstring. `blocks`: the repeated blocks' paths; `local`: the
    subtrees that run on plain tensors. `root=False` leaves the root's own forward as it is and places the blocks'
    ops only (pipelining: call it on the whole model before the stages are cut, which keep the blocks' modules),
    and fills `root_specs` with the root's own ops by node name, for `place_stage_ops`.
    Returns None when done, else why nothing was replaced (for the notes)."""
    from planner.trace import _LeafTracer
    named = dict(model.named_modules())
    try:
        whole = _LeafTracer().trace(model)  # the planner's trace: its node names are the plan's op names
    except Exception:
        return NOT_TRACEABLE
    blocks = [b for b in blocks if b and b not in local]
    pieces = _pieces(model, blocks, local)
    pairs = _align(_expanded(pieces), [n for n in whole.nodes if n.op in _CALLS], set(local)) \
        if pieces is not None else None
    if pairs is None:
        return ("ops outside module calls follow DTensor's propagation: the model's blocks, traced alone, do not "
                "line up with the whole model's trace")
    specs: dict[str, dict[torch.fx.Node, tuple]] = {p: {} for p in pieces}
    for piece, node, key, w in pairs:
        if _is_metadata(node):
            continue
        if node.op == "call_module" and (key[1] in hooked or key[1] in pieces or key[1] in local):
            continue  # tp's hooks place it; a block runs its own placed code; a replicated subtree runs plainly
        specs[piece][node] = (w, plan.ops.get(w.name))
    for piece, spec in specs.items():
        if spec and (piece or root):
            _install(named[piece] if piece else model, piece, pieces[piece], spec, mesh)
    if root_specs is not None:
        root_specs.update({n.name: (_key(n, ""), w, pl) for n, (w, pl) in specs[""].items()})
    return None


def exported_specs(flat: torch.fx.Graph, plan: Plan) -> dict:
    """`place_stage_ops`'s table for stages cut from a torch.export graph: every op of the flat graph by name."""
    return {n.name: (_key(n, ""), n, plan.ops.get(n.name)) for n in flat.nodes
            if n.op in _CALLS and _makes_tensors(n)}


def _unpacks_module_call(n: torch.fx.Node) -> bool:
    """`getitem` of a module call's outputs (unflattening adds these where a module returns several values)."""
    return n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "call_module"


def place_stage_ops(stage: torch.fx.GraphModule, by_name: dict, mesh: DeviceMesh) -> bool:
    """Run a pipeline stage's own ops (those between its modules: `wte(idx) + wpe(pos)`) as the plan places them:
    its graph's nodes keep the names of the trace it was cut from, which `by_name` maps to (call key, whole-trace
    node, placement) (`place_ops(..., root_specs=)`, `exported_specs`). Returns False, changing nothing, when a
    node of the stage is not in that table as the same call (the cut came from another trace)."""
    specs = {}
    for n in stage.graph.nodes:
        if n.op not in ("call_function", "call_method") or _is_metadata(n) \
                or str(n.target).startswith("aten._assert"):
            continue
        entry = by_name.get(n.name)
        if entry is None and "val" in n.meta and (not _makes_tensors(n) or _unpacks_module_call(n)):
            continue  # an export node that makes no tensor (sizes), or picks a module's output: no op of the plan
        if entry is None or entry[0] != _key(n, ""):
            return False
        specs[n] = entry[1:]
    if specs:
        _install(stage, "", stage.graph, specs, mesh)
    return True


_PASS_THROUGH = frozenset({"contiguous", "clone", "alias", "detach"})
"""Ops that hand their input on unchanged (same shape and placement): an export on real tensors can lack one the
planner's export on meta tensors had (`contiguous()` of a tensor whose strides the real kernel already made
contiguous); its consumer then reads the same placement from the producer."""


def _absent(plan: Plan, names: set[str]) -> list[str]:
    """The plan's ops not among `names`, pass-through ops (`_PASS_THROUGH`) that keep their placement excepted."""
    return [name for name, p in plan.ops.items() if name not in names
            and not (re.sub(r"_\d+$", "", name) in _PASS_THROUGH and set(p.inputs) == {p.output})]


def exported(model: nn.Module, example: Any, plan: Plan) -> tuple[nn.Module, torch.fx.Graph]:
    """The model exported the planner's way (non-strict training IR) with `example` (one micro-batch, as the model
    is called) and unflattened to its module tree (same module paths and parameter names), and the flat exported
    graph whose node names the plan's ops use. ExecutorError when the export lacks an op the plan names (a plan
    made for another model, torch or transformers version)."""
    from executor.pipeline import export_call
    ep = export_training(model, *export_call(example))
    require_ops(plan, ep.graph)
    return unflatten(ep), ep.graph


def unflatten(ep: torch.export.ExportedProgram) -> nn.Module:
    """`torch.export.unflatten(ep)`, without the FutureWarning torch 2.13's unflatten raises on every rank by
    deep-copying its own call signatures' tree specs (`isinstance(treespec, LeafSpec)` is deprecated): torch's code,
    nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        return torch.export.unflatten(ep)


def require_ops(plan: Plan, flat: torch.fx.Graph) -> None:
    """ExecutorError when the model's export graph `flat` lacks an op the plan places (a plan made for another
    model, torch or transformers version): that op could not run as written."""
    missing = _absent(plan, {n.name for n in flat.nodes if n.op in _CALLS})
    if missing:
        raise ExecutorError(f"plan op {missing[0]!r} is not in this model's torch.export graph (the plan was made "
                            "for another model, or with another torch or transformers version); re-plan for it")


def run_generated(root: nn.Module, where: Callable[[str], bool] = lambda path: True) -> None:
    """The unflattened modules of `root` at paths `where` accepts run their graph's generated code, not
    torch.fx.Interpreter, which unflattened modules use by default (InterpreterModule: it walks the module tree
    and the graph on every call, ~0.15 ms a module call on a CPU rank): what needs no placement (a plain-tensor
    subtree, a pipeline stage without tp) runs as eager code does. Generated again from the graph as it is now:
    unflatten renames a submodule called twice (ResNet's `relu@1` -> `relu`) after generating it."""
    for path, m in root.named_modules():
        if where(path) and isinstance(getattr(m, "graph_module", None), torch.fx.GraphModule) \
                and m.graph_module.graph is m.graph:
            _drop_assertions(m.graph)
            _rename_self(m.graph)
            m.graph_module.recompile()
            m._run_with_interpreter = False


def _rename_self(graph: torch.fx.Graph) -> None:
    """Rename a node called `self`: the call of a submodule named so (Hugging Face's BertAttention.self), whose
    result the generated code assigns to `self` and so loses the module whose submodules it calls next ("'Tensor'
    object has no attribute 'output'"). Such a node is a module call, not an op a plan names."""
    for n in graph.nodes:
        if n.name == "self":
            n._rename("self_module")


def _drop_assertions(graph: torch.fx.Graph) -> None:
    """Erase export's own metadata assertions (`aten._assert_tensor_metadata` and the like, no users): they pin
    the dtypes the trace saw, where a `.to(dtype)` was a no-op (transformers' RMSNorm upcasting an input that was
    already fp32), and fail on the bf16 activations of FSDP2's bf16 parameters; no op of the plan, no DTensor
    rule."""
    for n in list(graph.nodes):
        if n.op == "call_function" and not n.users and str(n.target).startswith("aten._assert"):
            graph.erase_node(n)


def place_exported_ops(root: nn.Module, flat: torch.fx.Graph, plan: Plan, mesh: DeviceMesh,
                       local: list[str], within: list[str] | None = None) -> None:
    """Run the unflattened export `root` with the plan's placement on every op (see `exported`): each module's
    graph runs as generated code placing its ops (`_placed_code`), matched to the flat graph's nodes by name
    (unflattening keeps them). Subtrees in `local` run on plain tensors (`executor.tp`) and are left as they are.
    `within`: only the subtrees at these paths (pipelining: the blocks, which the stages hold whole)."""
    def under(path: str, tops) -> bool:
        return any(path == p or path.startswith(p + ".") for p in tops)
    whole = {n.name: n for n in flat.nodes if n.op in _CALLS}
    modules = [(path, m) for path, m in root.named_modules()
               if isinstance(getattr(m, "graph", None), torch.fx.Graph) and not under(path, local)
               and (within is None or under(path, within))]
    seen = {n.name for _, m in modules for n in m.graph.nodes if n.op in _CALLS}
    missing = [name for name in _absent(plan, seen) if not under(plan.ops[name].module, local)
               and (within is None or under(plan.ops[name].module, within))]
    # a module called twice (ResNet's shared ReLU) keeps one graph, its first call's: a later call's op runs as
    # its first call's op does, which must then be an op of that module with the same target, placed alike
    for name in missing:
        op = plan.ops[name]
        twins = [s for s in seen if s in plan.ops and plan.ops[s].module == op.module and s in whole
                 and name in whole and whole[s].target == whole[name].target]
        if any(plan.ops[s] == op for s in twins):
            continue
        if twins:
            raise ExecutorError(
                f"op {name} is a later call of module {op.module}, which torch.export.unflatten keeps as its first "
                f"call's graph, where op {twins[0]} runs; the plan places the two differently ({op.strategy} and "
                f"{plan.ops[twins[0]].strategy}): place them alike in the plan's ops, or replan")
        # unflattening dropped or renamed it: nothing would place that op
        raise ExecutorError(f"op {name} of the plan is in the model's torch.export graph but not in its "
                            "unflattened modules (torch.export.unflatten), so it cannot run as placed; report it")
    # a plain-tensor subtree, and (pipelining) a module outside the blocks, which follows DTensor's propagation
    run_generated(root, lambda path: under(path, local) or (within is not None and not under(path, within)))
    for path, m in modules:
        _drop_assertions(m.graph)
        specs = {n: (whole[n.name], plan.ops.get(n.name)) for n in m.graph.nodes
                 if n.op == "call_function" and n.name in whole and _makes_tensors(whole[n.name])}
        if specs:
            _install_exported(m, path, specs, mesh)


def _makes_tensors(node: torch.fx.Node) -> bool:
    """Whether an exported node's value (export's `meta["val"]`) holds a tensor: the planner's ops are exactly
    these (sizes, assertions and other plain values are not ops)."""
    from torch.utils._pytree import tree_flatten
    return any(isinstance(v, torch.Tensor) for v in tree_flatten(node.meta.get("val"))[0])


def _install_exported(module: nn.Module, path: str, specs: dict, mesh: DeviceMesh) -> None:
    """An unflattened module's forward runs its graph's placed code (its own forward's argument
    handling: kwargs bound to the placeholders by name; the root flattens inputs and rebuilds outputs)."""
    from torch.utils._pytree import tree_unflatten
    is_root = hasattr(module, "process_forward_inputs")
    run = _placed_code(module.graph, specs, mesh, path)

    def forward(self, *args, **kwargs):
        if is_root:
            flat = self.process_forward_inputs(*args, **kwargs)
            return tree_unflatten(run(self, *flat), self.module_call_graph[0].signature.out_spec)
        if kwargs:
            args = tuple(args) + tuple(kwargs[k] for k in self.arg_names[len(args):] if k in kwargs)
        return run(self, *args)
    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
