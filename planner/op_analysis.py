"""Per-op FLOPs and saved activations, measured by running one op on meta tensors forward and backward.

Each op is re-run in isolation on fresh meta tensors under `torch.utils.flop_counter.FlopCounterMode` (forward and
backward counted separately) and `torch.autograd.graph.saved_tensors_hooks` (to see what autograd keeps for the
backward). A saved tensor is described relative to the op — its `k`-th tensor input, its `k`-th tensor output, or an
internal tensor (a LayerNorm's mean, a softmax output inside a fused kernel) — so the result depends only on the op
and its input shapes and can be cached: the 96 layers of GPT-3 are analysed once. The tracer maps `input`/`output`
descriptors back to graph values (by storage), which is how a tensor saved by several ops is counted once.

Attention: `scaled_dot_product_attention` is analysed as the fused flash kernel (efficient-attention when a mask is
given), as it runs on GPUs: FLOPs from FlopCounterMode's formulas for those kernels (backward recomputes the scores:
2.5x forward), and saved activations q, k, v, output and log-sum-exp rather than the s x s score matrix the
math fallback would keep. Grouped-query k/v (`enable_gqa=True`) stay unexpanded without a mask: torch's flash kernel
reads the shared heads in place (`backend_supports_grouped_query_attention` in ATen's sdp_utils.cpp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from planner.graph import TensorMeta

aten = torch.ops.aten


def fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` as the fused GPU kernel would run it (flash, or efficient with a mask)."""
    if query.dim() != 4 or query.device.type != "meta":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is None:  # flash reads grouped k/v heads as they are (enable_gqa): k and v are saved unexpanded
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if key.shape[1] != query.shape[1]:  # GQA with a mask: k/v heads expanded, as in SDPA's documented reference
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    bias = attn_mask.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                                        scale=scale)[0]


SDPA_TARGETS = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default,
                aten.scaled_dot_product_attention}
"""Callables replaced by `fused_sdpa` when tracing."""


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind `t` (views share it); valid while the tensor is alive."""
    return t.untyped_storage()._cdata


def storage_meta(t: torch.Tensor) -> TensorMeta:
    """TensorMeta covering the whole storage behind `t` (its own shape when it spans all of it)."""
    dtype = str(t.dtype).removeprefix("torch.")
    nbytes = t.untyped_storage().nbytes()
    if t.numel() * t.element_size() == nbytes:
        return TensorMeta(tuple(t.shape), dtype)
    return TensorMeta((nbytes // t.element_size(),), dtype)


@dataclass(frozen=True)
class OpCost:
    """What one run of an op on meta tensors measured."""

    fwd_flops: int
    """Forward FLOPs (FlopCounterMode)."""
    bwd_flops: int
    """Backward FLOPs (FlopCounterMode)."""
    saved: tuple[tuple[str, Any], ...]
    """Saved-for-backward tensors: ("input", k), ("output", k) (k-th tensor leaf) or ("internal", TensorMeta)."""


def _fresh(v: torch.Tensor, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A meta tensor like `v` (same shape, strides, dtype) and the autograd leaf behind it, if any.

    Activations that need grad are a clone of a leaf, so that in-place ops on them are legal, as in the model."""
    if not requires_grad:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta"), None
    extent = 1 + sum((s - 1) * st for s, st in zip(v.shape, v.stride())) if v.numel() else 0
    leaf = torch.empty(extent, dtype=v.dtype, device="meta", requires_grad=True)
    return leaf.clone().as_strided(v.shape, v.stride()), leaf


class OpAnalyser:
    """Runs ops on fresh meta tensors and caches the result per (callee, input shapes/dtypes, other arguments)."""

    def __init__(self) -> None:
        self.cache: dict[Hashable, OpCost] = {}
        """Results by `key`."""
        self.runs = 0
        """Ops actually run (cache misses)."""

    @staticmethod
    def key(callee: Hashable, args: Any, param_storages: set[int]) -> Hashable:
        """Cache key: the callee plus every argument, tensors by shape/stride/dtype/grad/parameter-ness."""
        flat, spec = tree_flatten(args)
        sig = []
        for v in flat:
            if isinstance(v, torch.Tensor):
                sig.append(("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad,
                            storage_key(v) in param_storages))
            elif v is None or isinstance(v, (int, float, bool, str, torch.dtype, torch.device, torch.layout,
                                             torch.memory_format, slice, type(Ellipsis))):
                sig.append((type(v), repr(v)))
            else:
                sig.append(("id", id(v)))
        return (callee, spec, tuple(sig))

    def analyse(self, key: Hashable, fn: Callable[..., Any], args: tuple, kwargs: dict,
                param_storages: set[int], module: torch.nn.Module | None = None) -> OpCost:
        """FLOPs and saved tensors of `fn(*args, **kwargs)` (cached by `key`); `module` owns extra parameters."""
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._run(fn, args, kwargs, param_storages, module)
            self.runs += 1
        return hit

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, param_storages: set[int],
             module: torch.nn.Module | None) -> OpCost:
        flat, spec = tree_flatten((args, kwargs))
        new_flat: list[Any] = []
        leaves: list[torch.Tensor] = []
        exclude: set[int] = set()
        input_keys: list[int] = []
        for v in flat:
            if not isinstance(v, torch.Tensor):
                new_flat.append(v)
                continue
            is_param = storage_key(v) in param_storages
            t, leaf = _fresh(v, v.requires_grad and not is_param)
            if is_param:
                t.requires_grad_(v.requires_grad)
                exclude.add(storage_key(t))
                leaf = t if v.requires_grad else None
            if leaf is not None:
                leaves.append(leaf)
            input_keys.append(storage_key(t))
            new_flat.append(t)
        if module is not None:
            for p in module.parameters():
                exclude.add(storage_key(p))
                if p.requires_grad:
                    leaves.append(p)
            exclude.update(storage_key(b) for b in module.buffers())
        a, k = tree_unflatten(new_flat, spec)
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with FlopCounterMode(display=False) as counter:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(*a, **k)
            fwd = counter.get_total_flops()
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            need = [o for o in outs if o.requires_grad and o.grad_fn is not None]
            if need and leaves:
                torch.autograd.grad(need, leaves, [torch.empty_like(o) for o in need], allow_unused=True)
            bwd = counter.get_total_flops() - fwd
        return OpCost(fwd, bwd, _describe_saved(saved, exclude, input_keys, [storage_key(o) for o in outs]))


def _describe_saved(saved: list[torch.Tensor], exclude: set[int], input_keys: list[int],
                    output_keys: list[int]) -> tuple[tuple[str, Any], ...]:
    """Saved tensors relative to the op: which input or output they are (by storage), or internal, once each."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for t in saved:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue
        k = storage_key(t)
        if k in exclude or k in seen:
            continue
        seen.add(k)
        if k in input_keys:
            out.append(("input", input_keys.index(k)))
        elif k in output_keys:
            out.append(("output", output_keys.index(k)))
        else:
            out.append(("internal", storage_meta(t)))
    return tuple(out)
