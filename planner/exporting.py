"""The model's torch.export: one function, so the graph the planner traces is the graph the executor runs.

`export_training` is `torch.export.export(..., strict=False)` (the training IR), then one rewrite: an SDPA call whose
mask is a plain causal mask computed from constants alone becomes `is_causal=True` without the mask. transformers
builds such a mask under torch.export (its `masking_utils` skips it in eager, where unpacked, unpadded sequences
give SDPA `is_causal=True`, but not while exporting, since an exported program may run at another query length:
pytorch/pytorch issue 108108). Left in, a tp or pp plan, which runs the exported graph, would run the masked SDPA
(on GPUs the memory-efficient kernel instead of flash, over the dense s x s, plus the mask's construction) where
eager and a dp plan run causal flash attention. A mask that reads a model input (padding), a parameter or a buffer,
or that is not exactly causal (a sliding window), is left as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_OPTIONS = (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False))
"""SDPA's arguments after query, key and value that may be given by position, with their defaults."""
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
_MAX_MASK_ELEMENTS = 1 << 30
"""Masks larger than this (a micro-batch of 16 at 8k tokens) are not evaluated to be checked, and stay."""


def export_training(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """`torch.export.export(model, args, kwargs, strict=False)`, with every constant causal SDPA mask replaced by
    `is_causal=True` (see the module's docstring)."""
    ep = torch.export.export(model, args, kwargs, strict=False)
    if causal_masks_to_flags(ep.graph):
        ep.graph_module.recompile()
    return ep


def causal_masks_to_flags(graph: fx.Graph) -> int:
    """Rewrite, in place, each SDPA node whose `attn_mask` is computed from constants only and equals the causal
    mask into `is_causal=True` with no mask, and erase the nodes that computed only masks. How many were rewritten."""
    causal: dict[fx.Node, bool] = {}  # per mask node: the layers of a model share one, evaluated once
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask, dropout_p, is_causal = (node.args[3 + i] if len(node.args) > 3 + i else node.kwargs.get(name, default)
                                      for i, (name, default) in enumerate(_SDPA_OPTIONS))
        if not isinstance(mask, fx.Node) or is_causal or not _fits(mask, node):
            continue
        if mask not in causal:
            with unset_fake_temporarily():  # real values, also inside a dry run's fake tensor mode
                try:
                    value = _constant_value(mask)
                    causal[mask] = value is not None and _is_causal_mask(value)
                except Exception:  # noqa: BLE001 — a mask that cannot be evaluated here stays a mask
                    causal[mask] = False
        if not causal[mask]:
            continue
        node.args = (*node.args[:3], None, dropout_p, True)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in dict(_SDPA_OPTIONS)}
        _erase_unused(mask)
        rewritten += 1
    return rewritten


def _fits(mask: fx.Node, sdpa: fx.Node) -> bool:
    """Whether the mask's last two dims are this call's (query length, key length), over more than one query (where
    `is_causal` means what a lower-triangular mask does)."""
    m, q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (mask, *sdpa.args[:2]))
    if not all(isinstance(t, torch.Tensor) for t in (m, q, k)) or m.dim() < 2:
        return False
    return tuple(m.shape[-2:]) == (q.shape[-2], k.shape[-2]) and q.shape[-2] > 1


def _constant_value(mask: fx.Node) -> torch.Tensor | None:
    """The mask's value on the CPU where every node it depends on is a pure function call on constants (no graph
    input, parameter or buffer); else None."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        if n.op != "call_function" or n.is_impure():
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        seen.add(n)
        order.append(n)
        return True

    if not visit(mask):
        return None
    meta = mask.meta.get("val")
    if isinstance(meta, torch.Tensor) and meta.numel() > _MAX_MASK_ELEMENTS:
        return None
    env: dict[fx.Node, object] = {}

    def on_cpu(a: object) -> object:
        if isinstance(a, fx.Node):
            return env[a]
        return torch.device("cpu") if isinstance(a, torch.device) else a

    for n in order:
        env[n] = n.target(*fx.node.map_aggregate(n.args, on_cpu), **fx.node.map_aggregate(n.kwargs, on_cpu))
    value = env[mask]
    return value if isinstance(value, torch.Tensor) else None


def _is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether `mask`, as SDPA reads it (bool: True attends; float: added to the scores), is SDPA's `is_causal`
    mask, the lower triangle of its last two dims (query, key), in every batch and head it broadcasts over."""
    tril = torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        lowest = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask == float("-inf")) | (mask == lowest)).all()):
            return False
        allowed = mask == 0
    else:
        return False
    return bool((allowed == tril).all())


def _erase_unused(node: fx.Node) -> None:
    """Erase `node` and, in turn, the inputs it leaves without users (export's metadata assertions on them too)."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.op != "call_function" or not all(_is_assertion(u) for u in n.users):
            continue
        erased.add(n)
        for u in list(n.users):
            n.graph.erase_node(u)
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def _is_assertion(node: fx.Node) -> bool:
    """An export check of one value's metadata (`aten._assert_tensor_metadata`), which nothing reads."""
    return not node.users and node.op == "call_function" and node.target is _ASSERT_METADATA \
        and len(node.all_input_nodes) == 1
