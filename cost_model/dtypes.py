"""The dtype of every tensor an op reads and writes under the executor's autocast, and the casts autocast adds.

At bf16/fp16 the executor trains under `torch.autocast` (executor.runner), whose rules (torch.amp docs, "Autocast
Op Reference", CUDA op lists) decide each op's dtype:

- lower-precision ops (linear, matmul/bmm/baddbmm/addmm, conv, scaled_dot_product_attention) cast every floating
  input to the autocast dtype and write it: an fp32 activation costs a cast kernel (read 4 bytes, write 2) per op
  and per micro-batch, in backward too (the cast's gradient is cast back); autocast caches only the casts of
  parameters (priced per linear in cost_model.layers);
- fp32 ops (norms, softmax, losses, and `pow`, `rsqrt`, `exp`, `log`, `sum`, `cumsum`, `reciprocal`, ...) cast a
  lower-precision input up to fp32 and write fp32;
- everything else (elementwise ops, views, `mean`, dropout) runs in the widest floating dtype of its inputs: an
  fp32 tensor meeting a bf16 one gives fp32.

Tensors from outside the graph (buffers such as RoPE tables) are fp32; parameters are fp32 (autocast keeps them)
except under FSDP2, whose `MixedPrecisionPolicy(param_dtype)` gathers them in the autocast dtype. So a model whose
embedding table is fp32 carries an fp32 residual stream, a LayerNorm's output is fp32, and a hand-written RMSNorm
runs in fp32: each reads and writes twice the bytes of a bf16 tensor, and each linear after it casts its input.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_model.work import floating, split_inputs
from planner.autocast import AUTOCAST_LOWER_KINDS, fp32_lists
from planner.graph import OpGraph, OpNode
from planner.shard_flow import callee


@dataclass(frozen=True)
class OpDtypes:
    """The precision ("fp32" or the autocast one) of each of an op's `input_meta` tensors as its kernel reads them
    (after autocast's casts; non-floating tensors keep their own size whatever is written here), of its output,
    and which `input_meta` indices autocast casts first."""

    inputs: tuple[str, ...]
    output: str
    casts: tuple[int, ...] = ()


def runs_in_fp32(op: OpNode, cpu: bool = False) -> bool:
    """Whether autocast runs `op` in fp32 whatever its inputs (`cpu`: CPU autocast's list, on CPU ranks)."""
    kinds, callees = fp32_lists(cpu)
    return op.kind in kinds or callee(op.target) in callees


def autocast_dtypes(graph: OpGraph, precision: str, param_precision: str, cpu: bool = False) -> dict[str, OpDtypes]:
    """Per op name, its tensors' precisions under autocast at `precision` with parameters held at
    `param_precision` (see the module docstring; `cpu`: under CPU autocast, whose fp32 list holds only the losses
    and `prod`); empty at fp32, where every tensor is fp32. Kept on the graph like its cached properties: the
    search prices many plans of one graph."""
    if precision not in ("bf16", "fp16"):
        return {}
    key = f"_shardwise_autocast_{precision}_{param_precision}{'_cpu' if cpu else ''}"
    out = graph.__dict__.get(key)
    if out is None:
        out = graph.__dict__[key] = _autocast_dtypes(graph, precision, param_precision, cpu)
    return out


def _autocast_dtypes(graph: OpGraph, precision: str, param_precision: str, cpu: bool) -> dict[str, OpDtypes]:
    out: dict[str, OpDtypes] = {}
    produced: dict[str, str] = {}
    for op in graph.ops:
        acts, par = split_inputs(op)
        have = ["fp32"] * len(op.input_meta)
        for j, i in enumerate(acts):
            src = op.inputs[j] if j < len(op.inputs) else None
            have[i] = produced.get(src, "fp32")
        for i in par:
            have[i] = param_precision
        floats = {i for i, m in enumerate(op.input_meta) if floating(m)}
        if op.kind in AUTOCAST_LOWER_KINDS:
            reads = tuple(precision if i in floats else have[i] for i in range(len(have)))
            casts = tuple(i for i in acts if i in floats and have[i] != precision)
            d = OpDtypes(reads, precision, casts)
        elif runs_in_fp32(op, cpu):
            reads = tuple("fp32" if i in floats else have[i] for i in range(len(have)))
            casts = tuple(i for i in acts if i in floats and have[i] != "fp32")
            d = OpDtypes(reads, "fp32", casts)
        elif op.kind == "embedding":
            d = OpDtypes(tuple(have), param_precision)
        else:
            wide = any(have[i] == "fp32" for i in floats)
            d = OpDtypes(tuple(have), "fp32" if wide or not floats else precision)
        out[op.name] = d
        produced[op.name] = d.output
    return out
