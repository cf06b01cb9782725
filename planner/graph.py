"""The operator graph: what the planner knows about a model, built once by tracing, never holding real weights.

An `OpGraph` is a topologically ordered tuple of `OpNode`s plus the model's unique parameters. Every per-op figure
(FLOPs, bytes, saved activations) is for the batch the model was traced with (`OpGraph.batch_size` samples); the
cost model scales them linearly to a micro-batch. Element counts are kept next to bytes so that the cost model can
re-price a graph traced in fp32 at bf16/fp16 without tracing again.

Vocabulary: an *op* is one node of the traced graph; a *block* is one instance of a repeated sub-module (a
transformer layer) and its *block type* is shared by all instances that are structurally identical; a *layer* is an
entry of `OpGraph.layers()`, the sequence the pipeline-stage DP cuts (pre-block ops, each block, post-block ops).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Mapping

import networkx as nx

DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "complex64": 8, "complex128": 16, "complex32": 4,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
"""Bytes per element for the dtypes a traced graph may carry (torch dtype names without the `torch.` prefix)."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named like `float32` or `torch.float32`."""
    return DTYPE_BYTES[dtype.removeprefix("torch.")]


class _Sized:
    """numel and bytes from `shape` and `dtype` (shared by TensorMeta and ParamInfo)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bytes(self) -> int:
        """Size in bytes at this dtype."""
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class TensorMeta(_Sized):
    """Shape and dtype of one tensor flowing along a graph edge."""

    shape: tuple[int, ...]
    """Sizes per dim; dim 0 is the batch dim for activations."""
    dtype: str
    """torch dtype name, e.g. `float32`."""


@dataclass(frozen=True)
class ParamInfo(_Sized):
    """One parameter of the model, by its fully qualified name (as in `model.named_parameters()`)."""

    name: str
    """Fully qualified name, e.g. `transformer.h.0.attn.c_attn.weight`."""
    shape: tuple[int, ...]
    """Parameter shape."""
    dtype: str
    """Dtype the model was built with (bytes are at this dtype)."""


@dataclass(frozen=True)
class OpNode:
    """One operator of the traced model with everything the cost model needs to price it."""

    name: str
    """Unique node name (the fx node name)."""
    kind: str
    """Coarse op kind used by the strategy registry: linear, matmul, embedding, norm, softmax, attention, conv,
    pool, elementwise, loss, reshape, other."""
    target: str
    """What was called, e.g. `aten.mm.default`, `torch.nn.Linear`, `F.scaled_dot_product_attention`."""
    module_path: str
    """Dotted path of the innermost module the op came from (`""` for the root)."""
    inputs: tuple[str, ...]
    """Names of the producer ops of this op's tensor inputs (the graph edges)."""
    input_meta: tuple[TensorMeta, ...]
    """Tensor inputs, in call order (activations and parameters)."""
    output_meta: tuple[TensorMeta, ...]
    """Tensor outputs."""
    fwd_flops: int
    """Forward FLOPs for the traced batch (FlopCounterMode's count; 0 for ops it does not count)."""
    bwd_flops: int
    """Backward FLOPs for the traced batch."""
    bytes_read: int
    """Bytes of all tensor inputs (activations and parameters) read in forward."""
    bytes_written: int
    """Bytes of all tensor outputs written in forward."""
    params: tuple[ParamInfo, ...] = ()
    """Parameters this op reads (a tied parameter appears at every op that reads it)."""
    saved: tuple[TensorMeta, ...] = ()
    """Activations autograd keeps for this op's backward (parameters excluded). A tensor saved by several ops (a
    LayerNorm output read by the q, k and v projections) is listed at its first saving op only, so that summing
    over ops counts it once."""
    saved_elsewhere: tuple[int, ...] = ()
    """Indices into `input_meta` of tensor inputs this op saves for backward that an earlier op (or an earlier input
    of this op) already saved, so that `saved` leaves them out. Under autocast an op that casts such an input saves
    its own cast copy (autocast caches casts of parameters only), which the cost model adds."""
    block: str | None = None
    """Repeated-block instance this op belongs to, e.g. `transformer.h.3`; None outside any block."""
    block_type: str | None = None
    """Label shared by structurally identical blocks, e.g. `transformer.h.*`."""
    args: tuple = ()
    """The call's arguments other than tensors, in call order (`T` where a tensor was passed; keyword arguments
    last, as `(name, value)` pairs): the dims of a split, transpose or softmax, which shapes alone cannot tell."""
    causal: bool = False
    """Attention called with `is_causal=True`: the kernel skips the score blocks above the diagonal, so it does
    about half the dense work that `fwd_flops` / `bwd_flops` (FlopCounterMode's dense count) give."""
    input_sources: tuple[int, ...] = ()
    """Per `input_meta` entry, the position in `inputs` of the producer whose output it is, or -1 (a parameter,
    buffer, model input or constant); empty where the tracer did not record it (then the k-th activation tensor is
    taken to be producer k's)."""
    copies: bool = False
    """The op's output does not alias any input's storage: for a `reshape`-kind op (cat, stack, repeat,
    repeat_interleave, contiguous or reshape of a non-contiguous tensor) a memory-bound copy, not a free view."""
    batch_free: bool = False
    """Computed from parameters, buffers and constants only, never from the batch (a weight-norm weight, RoPE
    tables made in forward): its work is the same at any micro-batch size."""
    fixed_saved: tuple[int, ...] = ()
    """Indices into `saved` of tensors that do not depend on the batch (the weight-norm weight a convolution saves):
    each forward keeps one, whatever the micro-batch size."""

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs for the traced batch."""
        return self.fwd_flops + self.bwd_flops

    @property
    def saved_bytes(self) -> int:
        """Bytes of `saved` at the traced dtypes."""
        return sum(t.bytes for t in self.saved)


@dataclass(frozen=True)
class Layer:
    """A contiguous run of ops the pipeline cutter treats as indivisible: one block, or the ops between blocks."""

    index: int
    """Position in `OpGraph.layers()`."""
    name: str
    """Block instance name (e.g. `transformer.h.3`) or `pre`/`post`/`between.K` for non-block ops."""
    block_type: str | None
    """Block type for blocks, None otherwise."""
    ops: tuple[int, ...]
    """Indices into `OpGraph.ops`."""


NO_REPEATED_BLOCKS = ("no block repeats (a block is one of two or more identical layers in an nn.ModuleList, "
                      "nn.Sequential or nn.ModuleDict), so each top-level module is a block")
"""Said where a choice counts blocks of a model without repeated ones (`OpGraph.repeats_blocks` False)."""


@dataclass(frozen=True)
class OpGraph:
    """The traced model: ops in topological order, its unique parameters, and the batch it was traced with."""

    model_name: str
    """Where the model came from (file path or class name)."""
    ops: tuple[OpNode, ...]
    """Operators in topological (execution) order."""
    parameters: tuple[ParamInfo, ...]
    """Unique parameters of the model (tied weights once), in `named_parameters()` order."""
    batch_size: int
    """Samples in the batch the model was traced with; per-op figures are for this many samples."""
    tracer: str = "export"
    """Which tracer produced the graph: `export` (torch.export's aten training IR) or `fx` (where export fails)."""
    inputs: tuple[TensorMeta, ...] = field(default=())
    """Model inputs as traced."""
    checkpoint_calls: int = 0
    """Calls the model's own forward makes to torch.utils.checkpoint (its graph holds their ops once, as saved)."""
    build_notes: tuple[str, ...] = ()
    """What building the model for the trace did that the user should know (`planner.model_file.build` building
    it on the CPU, `prepare_for_training`'s changes), as notes."""

    @cached_property
    def index(self) -> Mapping[str, int]:
        """Op name to position in `ops`."""
        return {op.name: i for i, op in enumerate(self.ops)}

    def op(self, name: str) -> OpNode:
        """The op with this name."""
        return self.ops[self.index[name]]

    def module_op(self, path: str) -> OpNode:
        """The first op that runs in the module at `path` (a built-in module such as `h.0.mlp.c_fc` is one op in
        either trace, while op names differ: fx's `h_0_mlp_c_fc`, export's `linear_4`); KeyError if none does."""
        for op in self.ops:
            if op.module_path == path:
                return op
        raise KeyError(path)

    @cached_property
    def nx_graph(self) -> nx.DiGraph:
        """The ops as a networkx DiGraph (nodes are op names, edges producer -> consumer)."""
        g = nx.DiGraph()
        for op in self.ops:
            g.add_node(op.name)
            for src in op.inputs:
                g.add_edge(src, op.name)
        return g

    @property
    def num_parameters(self) -> int:
        """Total unique parameter elements."""
        return sum(p.numel for p in self.parameters)

    @property
    def parameter_bytes(self) -> int:
        """Total unique parameter bytes at the traced dtype."""
        return sum(p.bytes for p in self.parameters)

    def flops_per_sample(self) -> float:
        """Forward plus backward FLOPs per sample (ops that do not read the batch left out)."""
        return sum(op.flops for op in self.ops if not op.batch_free) / self.batch_size

    def saved_bytes_per_sample(self) -> float:
        """Activation bytes saved for backward per sample (no recomputation; tensors that do not depend on the batch
        left out)."""
        return sum(t.bytes for op in self.ops for i, t in enumerate(op.saved) if i not in op.fixed_saved) \
            / self.batch_size

    @property
    def repeats_blocks(self) -> bool:
        """Whether some block type has two or more instances (else each top-level module is a block of its own:
        planner.blocks' fallback, NO_REPEATED_BLOCKS)."""
        return any(len(v) > 1 for v in self.block_types.values())

    @cached_property
    def block_types(self) -> Mapping[str, tuple[str, ...]]:
        """Block type to the ordered names of its instances."""
        out: dict[str, list[str]] = {}
        for op in self.ops:
            if op.block is not None and op.block_type is not None:
                names = out.setdefault(op.block_type, [])
                if not names or names[-1] != op.block:
                    if op.block not in names:
                        names.append(op.block)
        return {k: tuple(v) for k, v in out.items()}

    def layers(self) -> tuple[Layer, ...]:
        """The layer sequence the pipeline cutter works on (cached on first use)."""
        return self._layers

    @cached_property
    def blocks_sharing_parameters(self) -> frozenset[int]:
        """Indices in `layers()` of the blocks holding a parameter another layer holds too (a module reused by two
        blocks); empty for most models (a tied embedding and LM head are not blocks)."""
        names = [{p.name for i in layer.ops for p in self.ops[i].params} for layer in self.layers()]
        holders: dict[str, int] = {}
        for own in names:
            for n in own:
                holders[n] = holders.get(n, 0) + 1
        return frozenset(k for k, (layer, own) in enumerate(zip(self.layers(), names))
                         if layer.block_type is not None and any(holders[n] > 1 for n in own))

    @cached_property
    def _layers(self) -> tuple[Layer, ...]:
        layers: list[Layer] = []
        cur_key: tuple[str | None, str | None] | None = None
        cur_ops: list[int] = []
        seen_block = False
        between = 0

        def flush() -> None:
            nonlocal between
            if not cur_ops:
                return
            block, block_type = cur_key  # type: ignore[misc]
            if block is None:
                name = "pre" if not seen_block else f"between.{between}"
                between += 1 if seen_block else 0
            else:
                name = block
            layers.append(Layer(len(layers), name, block_type, tuple(cur_ops)))

        for i, op in enumerate(self.ops):
            key = (op.block, op.block_type)
            if key != cur_key:
                flush()
                if cur_key is not None and cur_key[0] is not None:
                    seen_block = True
                cur_key, cur_ops = key, []
            cur_ops.append(i)
        flush()
        # the trailing non-block run is "post"
        if layers and layers[-1].block_type is None and seen_block:
            last = layers[-1]
            layers[-1] = Layer(last.index, "post", None, last.ops)
        return tuple(layers)

    def layer_ops(self, layer: Layer) -> Iterator[OpNode]:
        """The ops of one layer."""
        for i in layer.ops:
            yield self.ops[i]

    def layer_modules(self, layer: Layer) -> list[str]:
        """The module paths a layer's ops come from (the block instance itself for blocks): what a pipeline stage
        holding the layer lists."""
        if layer.block_type is not None:
            return [layer.name]
        out: list[str] = []
        for op in self.layer_ops(layer):
            if op.module_path and op.module_path not in out:
                out.append(op.module_path)
        return out

    @cached_property
    def split_modules(self) -> Mapping[str, tuple[int, int]]:
        """Modules called in layers apart (a dropout applied after the embedding and again before the head), each
        with the first and last layer calling it: a pipeline stage may not start between them, since it would list
        the module in two stages, and the executor's stages hold modules. A module whose own ops surround its
        children's (HF's GPT2Model around its blocks) is not called twice: the executor cuts its forward between
        stages."""
        mods = [self.layer_modules(layer) for layer in self.layers()]
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for k, names in enumerate(mods):
            for m in names:
                first.setdefault(m, k)
                last[m] = k
        return {m: (a, last[m]) for m, a in first.items() if last[m] > a
                and not any(n.startswith(m + ".") for names in mods[a + 1:last[m]] for n in names)}

    @cached_property
    def cut_points(self) -> tuple[bool, ...]:
        """Per layer position 0..L, whether a pipeline stage may start there: not inside a `split_modules` span."""
        ok = [True] * (len(self.layers()) + 1)
        for a, b in self.split_modules.values():
            for j in range(a + 1, b + 1):
                ok[j] = False
        return tuple(ok)
