"""Tracing a model file into an `OpGraph` without touching real memory.

    model file -> build_model() on the meta device -> graph (torch.export's training IR; torch.fx when export fails)
               -> run every node on meta tensors (shapes, dtypes, views) -> per-op FLOPs and saved activations
               (planner.op_analysis, cached so repeated blocks are measured once) -> OpGraph

torch.export (non-strict, training IR) yields aten ops (`linear`, `view_3`) whose module path comes from
`nn_module_stack`: the graph the executor runs under tp (`executor.graph_ops`). fx, the fallback, keeps built-in
leaf modules (Linear, Embedding, LayerNorm, Conv, ...) as single ops named by their module path
(`h_0_attn_q_proj`). The loss (`loss_fn(outputs, targets)`) is appended as one op of kind `loss`. Saved
activations are counted once per storage over the whole graph: a LayerNorm output saved by the q, k and v
projections is listed at the first of them.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from planner import op_kinds
from planner.blocks import block_of, layer_blocks
from planner.errors import ModelError
from planner.exporting import export_training
from planner.graph import OpGraph, OpNode, ParamInfo, TensorMeta
from planner.model_file import (ModelFile, batch, build, built_on_cpu_note, default_loss, frame_in_file,
                                prepare_for_training, widen_floats)
from planner.model_file import first_line as _first_line
from planner.op_analysis import SDPA_TARGETS, OpAnalyser, fused_sdpa, storage_key, storage_meta


class _LeafTracer(torch.fx.Tracer):
    """fx tracer that keeps built-in modules without children (and MultiheadAttention) as single ops."""

    proxy_buffer_attributes = True  # buffers become graph values, so `self.rope_cos[:s]` traces

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, nn.MultiheadAttention):
            return True
        builtin = m.__module__.startswith(("torch.nn", "torch.ao.nn"))
        return builtin and next(m.children(), None) is None


def _meta(x: Any) -> Any:
    """Every tensor in a (nested) batch moved to the meta device, dtypes kept."""
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, x)


def _call_args(inputs: Any) -> tuple[tuple, dict]:
    """How the model is called with `inputs`: a tensor -> model(x), tuple -> model(*xs), dict -> model(**xs)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _meta_str(x: Any) -> str:
    """Shapes of the tensors in a nested value, for messages."""
    shapes = [tuple(t.shape) for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]
    return ", ".join(str(s) for s in shapes) or "no tensors"


def _plain(x: Any) -> Any:
    """A hashable, printable stand-in for one call argument: numbers, strings and None as they are, tensors as
    `T`, sequences as tuples, slices as `("slice", start, stop, step)`, anything else by its type name."""
    if isinstance(x, torch.Tensor):
        return "T"
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(x)
    if isinstance(x, slice):
        return ("slice", _plain(x.start), _plain(x.stop), _plain(x.step))
    if x is Ellipsis:
        return "..."
    if isinstance(x, (tuple, list, torch.Size)):
        return tuple(_plain(v) for v in x)
    return type(x).__name__


def plain_args(call_args: tuple[tuple, dict]) -> tuple:
    """`OpNode.args` of a call: positional arguments, then keyword arguments as (name, value) pairs in call order,
    the order of the tensors in `OpNode.input_meta` and `OpNode.inputs` (`planner.dtensor_rules` refills the
    `T`s from them in this order)."""
    args, kwargs = call_args
    if not isinstance(kwargs, dict):  # the loss op: (outputs, targets)
        return tuple(_plain(a) for a in call_args)
    return tuple(_plain(a) for a in args) + tuple((k, _plain(v)) for k, v in kwargs.items())


def _tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."))


@dataclass
class _Traced:
    """An fx graph ready to interpret: where get_attr nodes resolve and how placeholders get values."""

    graph: torch.fx.Graph
    root: nn.Module
    placeholders: dict[str, Any]
    tracer: str
    unflatten_output: Callable[[Any], Any] = lambda out: out


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict) -> _Traced:
    graph = _LeafTracer().trace(model)
    import inspect
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise ModelError(f"the inputs from sample_batch() do not fit {type(model).__name__}.forward(): {e}") \
            from None
    values: dict[str, Any] = {}
    positional = list(args)
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if node.target in bound.arguments:
            values[node.name] = bound.arguments[node.target]
        elif node.args:
            values[node.name] = node.args[0]
        elif positional:
            values[node.name] = positional.pop(0)
        else:
            raise ModelError(f"forward() argument {node.target!r} has no value in sample_batch()'s inputs")
    return _Traced(graph, model, values, "fx")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence stdout/stderr at the file-descriptor level (torch.export logs graphs and warnings there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _trace_export(model: nn.Module, args: tuple, kwargs: dict) -> _Traced:
    from torch.export.graph_signature import InputKind, OutputKind
    with _quiet():
        ep = export_training(model, args, kwargs)
    sig = ep.graph_signature
    user = iter(tree_flatten((args, kwargs))[0])
    values: dict[str, Any] = {}
    for spec in sig.input_specs:
        name = getattr(spec.arg, "name", None)
        if spec.kind == InputKind.USER_INPUT:
            values[name] = next(user)
        elif spec.kind == InputKind.PARAMETER:
            values[name] = model.get_parameter(spec.target)
        elif spec.kind == InputKind.BUFFER:
            try:
                values[name] = model.get_buffer(spec.target)
            except AttributeError:
                values[name] = _meta(ep.constants[spec.target])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            values[name] = _meta(ep.constants[spec.target])
        else:
            values[name] = ep.constants.get(spec.target) if spec.target else None
    user_out = [i for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    out_spec = ep.call_spec.out_spec

    def unflatten(flat: Any) -> Any:
        picked = [flat[i] for i in user_out]
        return tree_unflatten(picked, out_spec) if out_spec is not None else picked

    return _Traced(ep.graph, ep.graph_module, values, "export", unflatten)


def _fetch_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_MATMULS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "conv1d", "conv2d", "conv3d",
                      "convolution", "_convolution"})
"""Ops whose tensor operands must all be floating point (meta tensors do not check it; the real kernels do)."""


def _integer_operand(fn: Any, module: nn.Module | None, args: tuple, kwargs: dict) -> str | None:
    """The dtype of an integer or bool operand of a matmul or convolution (`_MATMULS`, or an nn.Linear /
    convolution module's input), which its kernel refuses ("mat1 and mat2 must have the same dtype"); else None."""
    if module is not None:
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            return None
    elif str(getattr(fn, "__name__", "")).split(".")[0] not in _MATMULS:
        return None
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            return str(t.dtype).removeprefix("torch.")
    floats = {t.dtype for t in [*tensors, *(module.parameters() if module is not None else ())]
              if t.is_floating_point()}
    if torch.float64 in floats and len(floats) > 1:  # meta kernels let it through; autocast never casts float64
        return "float64"
    return None


class _IntegerOperand(Exception):
    """A matmul or convolution got an integer operand (`_integer_operand`)."""


class _NodeFailed(Exception):
    """Running one node on meta tensors raised."""

    def __init__(self, node: torch.fx.Node, label: str, exc: BaseException):
        super().__init__(f"op {node.name} ({label}) raised {_first_line(exc)}")
        self.node, self.label, self.exc = node, label, exc


@dataclass
class _Builder:
    """Interprets a traced graph on meta tensors and collects OpNodes."""

    model: nn.Module
    traced: _Traced
    loss_fn: Callable[[Any, Any], torch.Tensor]
    analyser: OpAnalyser = field(default_factory=OpAnalyser)
    ops: list[OpNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.param_names: dict[int, str] = {}
        self.params: list[ParamInfo] = []
        for name, p in self.model.named_parameters():
            self.param_names[storage_key(p)] = name
            self.params.append(ParamInfo(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")))
        self.param_info = {p.name: p for p in self.params}
        self.state_storages = set(self.param_names) | {storage_key(b) for b in self.model.buffers()}
        self.blocks = layer_blocks(self.model)
        self.env: dict[str, Any] = {}
        self.op_names: set[str] = set()
        self.saved_seen: set[int] = set()
        self.owner: dict[int, TensorMeta] = {}
        self.from_batch: set[str] = set()  # nodes whose value depends on the model's inputs
        self.batch_storages: set[int] = set()  # the storages of those values

    def _callee(self, node: torch.fx.Node) -> tuple[Callable[..., Any], Hashable, nn.Module | None, str]:
        """What a node calls: (callable, cache identity, module for call_module, readable target)."""
        if node.op == "call_module":
            mod = self.traced.root.get_submodule(node.target)
            state = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                          for n, t in [*mod.named_parameters(), *mod.named_buffers()])
            return mod, ("module", type(mod), mod.training, mod.extra_repr(), state), mod, \
                op_kinds.target_label(node.op, None, mod)
        if node.op == "call_method":
            name = node.target
            return (lambda self, *a, **k: getattr(self, name)(*a, **k)), ("method", name), None, \
                op_kinds.target_label(node.op, name)
        fn = fused_sdpa if node.target in SDPA_TARGETS else node.target
        try:
            ident: Hashable = ("fn", fn)
            hash(ident)
        except TypeError:
            ident = ("fn-id", id(fn))
        return fn, ident, None, op_kinds.target_label(node.op, node.target)

    def _module_path(self, node: torch.fx.Node) -> str:
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        return path if isinstance(path, str) else ""

    def _note_outputs(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.owner.setdefault(storage_key(t), storage_meta(t))

    def run(self, progress: Callable[[], None] | None = None) -> Any:
        """Interpret every node; returns the model output (structured)."""
        for node in self.traced.graph.nodes:
            if node.op == "placeholder":
                self.env[node.name] = self.traced.placeholders.get(node.name)
                self._note_outputs(self.env[node.name])
                inputs = [storage_key(t) for t in tree_flatten(self.env[node.name])[0]
                          if isinstance(t, torch.Tensor) and t.layout == torch.strided]
                if any(k not in self.state_storages for k in inputs):  # a model input, not a lifted parameter
                    self.from_batch.add(node.name)
                    self.batch_storages.update(inputs)
            elif node.op == "get_attr":
                self.env[node.name] = _fetch_attr(self.traced.root, node.target)
            elif node.op == "output":
                out = torch.fx.node.map_arg(node.args[0], lambda n: self.env[n.name])
                return node, self.traced.unflatten_output(out)
            else:
                self._run_node(node)
            if progress is not None:
                progress()
        raise ModelError("the traced graph has no output")

    def _run_node(self, node: torch.fx.Node) -> None:
        fn, ident, module, label = self._callee(node)
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n.name])
        wrong = _integer_operand(fn, module, args, kwargs)
        if wrong is not None:
            raise _NodeFailed(node, label, _IntegerOperand(
                f"{label} got an operand of dtype {wrong}, which it cannot multiply"
                + (" with the float32 weights" if wrong == "float64" else "")))
        try:
            with torch.enable_grad():
                value = fn(*args, **kwargs)
        except Exception as e:
            raise _NodeFailed(node, label, e) from e
        self.env[node.name] = value
        outs = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        if any(n.name in self.from_batch for n in node.all_input_nodes):
            self.from_batch.add(node.name)
            self.batch_storages.update(storage_key(t) for t in outs if t.layout == torch.strided)
        if not outs:
            return  # sizes, shapes and other plain values: not an op
        self._note_outputs(value)
        key = OpAnalyser.key(ident, (args, kwargs), self.state_storages)
        try:
            cost = self.analyser.analyse(key, fn, args, kwargs, self.state_storages, module)
        except Exception as e:
            raise _NodeFailed(node, label, e) from e
        producers = tuple(dict.fromkeys(n.name for n in node.all_input_nodes if n.name in self.op_names))
        name = op_kinds.callee_name(node.op, node.target) if module is None else ""
        self._add_op(node.name, label, self._module_path(node), producers, (args, kwargs), outs, cost, module,
                     lambda reads_param: op_kinds.module_kind(module) if module is not None
                     else op_kinds.function_kind(name, reads_param), causal=_is_causal(fn, args, kwargs),
                     sources=self._tensor_sources(node, producers))

    def _tensor_sources(self, node: torch.fx.Node, producers: tuple[str, ...]) -> list[int]:
        """Per tensor of the call (in `tree_flatten` order of its arguments), the position in `producers` of the
        node it comes from, or -1 (a placeholder, a `get_attr`, a constant)."""
        out: list[int] = []
        for leaf in tree_flatten((node.args, node.kwargs))[0]:
            value = self.env[leaf.name] if isinstance(leaf, torch.fx.Node) else leaf
            k = producers.index(leaf.name) if isinstance(leaf, torch.fx.Node) and leaf.name in producers else -1
            out += [k] * sum(isinstance(t, torch.Tensor) for t in tree_flatten(value)[0])
        return out

    def _add_op(self, name: str, label: str, path: str, producers: tuple[str, ...], call_args: Any,
                outs: list[torch.Tensor], cost: Any, module: nn.Module | None,
                kind_of: Callable[[bool], str], causal: bool = False, sources: list[int] | None = None) -> None:
        ins = [t for t in tree_flatten(call_args)[0] if isinstance(t, torch.Tensor)]
        in_storages = {storage_key(t) for t in ins if t.layout == torch.strided}
        copies = any(t.layout == torch.strided and storage_key(t) not in in_storages for t in outs)
        read = ins + (list(module.parameters()) if module is not None else [])
        params: dict[str, ParamInfo] = {}
        for t in read:
            pname = self.param_names.get(storage_key(t))
            if pname is not None:
                params.setdefault(pname, self.param_info[pname])
        saved: list[TensorMeta] = []
        elsewhere: list[int] = []
        fixed: list[int] = []  # saved tensors that do not depend on the batch
        batch_free = name not in self.from_batch
        for where, what in cost.saved:
            if where == "internal":
                fixed += [len(saved)] if batch_free else []
                saved.append(what)
                continue
            t = (ins if where == "input" else outs)[what]
            k = storage_key(t)
            if k in self.state_storages or k in self.saved_seen:
                if where == "input" and k not in self.state_storages:
                    elsewhere.append(what)
                continue
            self.saved_seen.add(k)
            fixed += [len(saved)] if batch_free or k not in self.batch_storages else []
            saved.append(self.owner.get(k) or storage_meta(t))
        block, block_type = block_of(path, self.blocks)
        in_meta = tuple(_tensor_meta(t) for t in read)
        out_meta = tuple(_tensor_meta(t) for t in outs)
        self.ops.append(OpNode(
            name=name, kind=kind_of(bool(params)), target=label, module_path=path, inputs=producers,
            input_meta=in_meta, output_meta=out_meta, fwd_flops=cost.fwd_flops, bwd_flops=cost.bwd_flops,
            bytes_read=sum(m.bytes for m in in_meta), bytes_written=sum(m.bytes for m in out_meta),
            params=tuple(params.values()), saved=tuple(saved), saved_elsewhere=tuple(elsewhere), block=block,
            block_type=block_type,
            args=plain_args(call_args), causal=causal, copies=copies, batch_free=batch_free,
            fixed_saved=tuple(fixed),
            input_sources=tuple(sources) + (-1,) * (len(read) - len(ins)) if sources is not None
            and len(sources) == len(ins) else ()))
        self.op_names.add(name)

    def add_loss(self, output_node: torch.fx.Node, outputs: Any, targets: Any, path: str) -> None:
        """Append `loss_fn(outputs, targets)` as one op of kind `loss`."""
        loss_fn = self.loss_fn

        def fn(out: Any, tgt: Any) -> torch.Tensor:
            return loss_fn(out, tgt)

        try:
            with torch.enable_grad():
                value = fn(outputs, targets)
            if not isinstance(value, torch.Tensor) or value.dim() != 0:  # not numel: at the traced batch of 1 a
                # per-sample loss (reduction="none") has one element, and fails backward at any other batch size
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ModelError(f"{path}: loss_fn(outputs, targets) must return a 0-dim (scalar) tensor, got {got}; "
                                 "reduce the loss in loss_fn (e.g. with .mean())")
            cost = self.analyser.analyse(("loss", id(fn)), fn, (outputs, targets), {}, self.state_storages)
        except ModelError:
            raise
        except Exception as e:
            where = frame_in_file(e, path)
            at = f":{where[0]}" if where else ""
            raise ModelError(f"{path}{at}: loss_fn(outputs, targets) raised {_first_line(e)} with outputs "
                             f"[{_meta_str(outputs)}] and targets [{_meta_str(targets)}]; "
                             f"{_loss_fix(e, outputs, targets, loss_fn is default_loss)}") from None
        name = "loss" if "loss" not in self.op_names else "loss_fn"
        producers = tuple(dict.fromkeys(n.name for n in output_node.all_input_nodes if n.name in self.op_names))
        label = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        self.from_batch.add(name)  # the loss reads the targets
        self.batch_storages.update(storage_key(t) for t in tree_flatten(targets)[0]
                                   if isinstance(t, torch.Tensor) and t.layout == torch.strided)
        self._add_op(name, label, "", producers, (outputs, targets), [value], cost, None, lambda _: "loss")


_SHAPE_WORDS = ("shape", "size", "dim", "dtype", "scalar type", "out of bounds", "broadcast", "match",
                "Tensor, not")
"""Fragments of a loss's exception message that mean outputs and targets did not fit each other."""


def _loss_fix(exc: BaseException, outputs: Any, targets: Any, default: bool) -> str:
    """The fix for `loss_fn` raising: the batch's targets only when it looks like a shape or dtype mismatch."""
    if _meta_str(outputs) == "no tensors":
        return "make forward() return the output tensors the loss takes"
    if _meta_str(targets) == "no tensors" or any(w in str(exc) for w in _SHAPE_WORDS):
        return ("make sample_batch's targets match the model output (or define loss_fn in the model file)" if default
                else "make sample_batch's targets match the model output (or loss_fn take them as they are)")
    return ("define loss_fn(outputs, targets) in the model file (the default is cross-entropy for class ids, else "
            "MSE)" if default else "fix loss_fn (the error is its own, not the batch's)")


def _is_causal(fn: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an attention call (SDPA, or MultiheadAttention's forward) was made with `is_causal=True`."""
    if fn is fused_sdpa:
        import inspect
        try:
            return bool(inspect.signature(fused_sdpa).bind(*args, **kwargs).arguments.get("is_causal", False))
        except TypeError:
            return False
    return isinstance(fn, nn.MultiheadAttention) and bool(kwargs.get("is_causal", False))


def _eager_failure(model: nn.Module, args: tuple, kwargs: dict) -> BaseException | None:
    """Run forward eagerly on the meta inputs; the exception it raises, if any."""
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        return e
    return None


_DATA_DEPENDENT = ("meta tensor", "data-dependent", "_local_scalar_dense", "item()", "cannot be called on meta")
"""Message fragments that mean forward needed tensor values, which tracing on the meta device cannot give."""


def _batch_error(path: str, eager: BaseException, inputs: Any, op: str = "") -> ModelError:
    """The one-line error for forward() failing on the sample batch (wrong shapes or dtypes)."""
    where = frame_in_file(eager, path)
    at = f":{where[0]}: at `{where[1]}`" if where else ""
    return ModelError(f"{path}{at}: forward() failed on the inputs from sample_batch() [{_meta_str(inputs)}]{op}: "
                      f"{_first_line(eager)}; make sample_batch return inputs of the shapes and dtypes forward() "
                      "expects")


def _untraceable(path: str, errors: list[tuple[str, BaseException]], eager: BaseException | None,
                 inputs: Any) -> ModelError:
    """The one-line error for a model neither fx nor export could trace (or that fails on the batch)."""
    if eager is not None and not any(s in str(eager) for s in _DATA_DEPENDENT):
        return _batch_error(path, eager, inputs)
    where = None
    for _, e in reversed(errors):
        where = where or frame_in_file(e, path)
    if eager is not None:
        where = frame_in_file(eager, path) or where
    at = f":{where[0]}: at `{where[1]}`" if where else ""
    reasons = "; ".join(f"{name}: {_first_line(e, 120)}" for name, e in errors)
    return ModelError(f"{path}{at}: cannot trace the model ({reasons}); the planner traces without data, so "
                      "make control flow depend on shapes, not tensor values (torch.where / torch.cond)")


TRACERS = ("export", "fx")
"""The tracers `trace_model` tries, in order: torch.export's aten training IR (the graph the executor runs), then
torch.fx where export fails."""


def trace_model(model_file: ModelFile, batch_size: int = 1, progress: bool | None = None,
                tracers: tuple[str, ...] = TRACERS) -> OpGraph:
    """Trace a model file into an OpGraph on the meta device (no weights allocated), with the first of `tracers`
    that succeeds; raises ModelError."""
    model = build(model_file, "meta")
    prepared = prepare_for_training(model)  # as the executor does
    model.train()
    inputs, targets = batch(model_file, batch_size)
    if prepared.widened:
        inputs, targets = widen_floats((inputs, targets))
    inputs, targets = _meta(inputs), _meta(targets)
    args, kwargs = _call_args(inputs)
    errors: list[tuple[str, BaseException]] = []
    traced = None
    by_name = {"export": ("torch.export", _trace_export), "fx": ("torch.fx", _trace_fx)}
    checkpoints = [0]
    for name, tracer in (by_name[t] for t in tracers):
        try:
            checkpoints[0] = 0
            with _counting_checkpoints(checkpoints):
                traced = tracer(model, args, kwargs)
            break
        except ModelError:
            raise
        except Exception as e:
            errors.append((name, e))
    if traced is None:
        raise _untraceable(model_file.path, errors, _eager_failure(model, args, kwargs), inputs)
    builder = _Builder(model, traced, model_file.loss_fn)
    show = sys.stderr.isatty() if progress is None else progress
    try:
        output_node, outputs = _run_with_progress(builder, show)
    except _NodeFailed as failed:
        module = builder._module_path(failed.node) or "<root>"
        if isinstance(failed.exc, _IntegerOperand):  # meta tensors would run it; the real kernel refuses
            wide = "float64" in str(failed.exc)
            raise ModelError(f"{model_file.path}: forward() failed on the inputs from sample_batch() "
                             f"[{_meta_str(inputs)}] at op {failed.node.name} (module {module}): {failed.exc}; make "
                             "sample_batch return float32 inputs where they reach a matmul (e.g. .float())"
                             + ("" if wide else ", or give token ids to an embedding")) from None
        eager = _eager_failure(model, args, kwargs)
        if eager is not None:
            raise _batch_error(model_file.path, eager, inputs,
                               f" at op {failed.node.name} ({failed.label}, module {module})") from None
        raise ModelError(f"{model_file.path}: cannot run {failed} on meta tensors (module {module}); rerun with "
                         "--debug and report it") from failed.exc
    builder.add_loss(output_node, outputs, targets, model_file.path)
    flat_inputs = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    return OpGraph(model_name=model_file.path, ops=tuple(builder.ops), parameters=tuple(builder.params),
                   batch_size=batch_size, tracer=traced.tracer, inputs=tuple(_tensor_meta(t) for t in flat_inputs),
                   checkpoint_calls=checkpoints[0],
                   build_notes=tuple(n for n in (built_on_cpu_note(model_file.path), *prepared.notes) if n))


@contextlib.contextmanager
def _counting_checkpoints(count: list[int]) -> Iterator[None]:
    """Count the model's own torch.utils.checkpoint calls while it is traced, at the two functions checkpoint()
    looks up when called (non-reentrant and reentrant), whatever name the model imported it under. torch.export
    inlines the checkpointed ops without a trace of the call; without these functions nothing is counted."""
    import torch.utils.checkpoint as cp
    gen, function = getattr(cp, "_checkpoint_without_reentrant_generator", None), getattr(cp, "CheckpointFunction", None)
    if gen is None or function is None:
        yield
        return

    def counted_gen(*args, **kwargs):
        count[0] += 1
        return gen(*args, **kwargs)

    class Counted(function):
        @classmethod
        def apply(cls, *args, **kwargs):
            count[0] += 1
            return function.apply(*args, **kwargs)
    cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = counted_gen, Counted
    try:
        yield
    finally:
        cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = gen, function


def _run_with_progress(builder: _Builder, show: bool) -> Any:
    """builder.run(), with a rich progress bar on stderr when `show`."""
    if not show:
        return builder.run()
    from rich.console import Console
    from rich.progress import Progress
    total = len(builder.traced.graph.nodes)
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"tracing ({builder.traced.tracer})", total=total)
        return builder.run(lambda: bar.advance(task))
