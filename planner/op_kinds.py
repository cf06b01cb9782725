"""Coarse op kinds for traced nodes: what the strategy registry and the cost model key on.

A node is classified from what it calls: a leaf `nn.Module` class (fx `call_module`), a function or aten op
(`call_function`, fx or torch.export) or a tensor method (`call_method`). Names are normalised (leading `_` and a
trailing in-place `_` dropped), so `aten._softmax.default`, `F.softmax` and `x.softmax` are all `softmax`.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn as nn

KINDS = ("linear", "matmul", "embedding", "norm", "softmax", "attention", "conv", "pool", "elementwise", "loss",
         "reshape", "other")
"""Every kind an `OpNode.kind` may take."""

_MATMULS = {"mm", "matmul", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "mv", "addmv", "dot", "tensordot"}
"""Matrix products: `linear` when one operand is a parameter (HF GPT-2's Conv1D is an addmm), else `matmul`."""

SDPA_CALLS = frozenset({"scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                        "scaled_dot_product_efficient_attention", "scaled_dot_product_cudnn_attention",
                        "scaled_dot_product_flash_attention_for_cpu"})
"""Normalised names of `F.scaled_dot_product_attention` and the aten kernels it dispatches to: the calls
`recompute: attention` re-runs one by one in backward (the cost model prices it, executor.parallel applies it)."""

_BY_NAME: dict[str, str] = {}
for _kind, _names in {
    "linear": "linear bilinear",
    "embedding": "embedding embedding_bag",
    "norm": "layer_norm native_layer_norm rms_norm fused_rms_norm batch_norm native_batch_norm "
            "native_batch_norm_legit native_batch_norm_legit_functional native_batch_norm_legit_no_training "
            "group_norm native_group_norm instance_norm local_response_norm normalize",
    "softmax": "softmax log_softmax safe_softmax softmin",
    "attention": " ".join(sorted(SDPA_CALLS)) + " multi_head_attention_forward fused_sdpa",
    "conv": "conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d conv_transpose3d",
    "pool": "max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d "
            "adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d "
            "max_pool2d_with_indices max_pool3d_with_indices lp_pool1d lp_pool2d",
    "loss": "cross_entropy cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss "
            "huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div",
    "reshape": "view reshape unsafe_view transpose permute t expand expand_as flatten unflatten squeeze unsqueeze "
               "contiguous cat concat concatenate stack split split_with_sizes chunk unbind getitem slice select "
               "narrow alias clone view_as repeat repeat_interleave tile movedim swapaxes swapdims detach "
               "as_strided hstack vstack",
    "elementwise": "add sub rsub mul div truediv floordiv neg pow rsqrt sqrt exp log log1p sin cos tanh sigmoid "
                   "relu relu6 gelu silu leaky_relu elu selu hardtanh hardswish hardsigmoid mish softplus "
                   "dropout native_dropout feature_dropout where masked_fill clamp clamp_min clamp_max clip abs "
                   "reciprocal to float half bfloat16 double type type_as to_copy erf triu tril iadd isub imul "
                   "itruediv square fill zero copy lerp addcmul addcdiv sign maximum minimum logical_not eq ne "
                   "lt le gt ge bitwise_and bitwise_or and or xor invert",
}.items():
    for _n in _names.split():
        _BY_NAME[_n] = _kind

_MODULE_KINDS: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"), (nn.Bilinear, "linear"),
    (nn.Embedding, "embedding"), (nn.EmbeddingBag, "embedding"),
    (nn.modules.batchnorm._NormBase, "norm"), (nn.LayerNorm, "norm"), (nn.GroupNorm, "norm"),
    (nn.LocalResponseNorm, "norm"),
    (nn.Softmax, "softmax"), (nn.LogSoftmax, "softmax"), (nn.Softmin, "softmax"),
    (nn.MultiheadAttention, "attention"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.modules.loss._Loss, "loss"),
    (nn.Flatten, "reshape"), (nn.Unflatten, "reshape"), (nn.Identity, "reshape"),
    (nn.modules.dropout._DropoutNd, "elementwise"),
)
if hasattr(nn, "RMSNorm"):
    _MODULE_KINDS += ((nn.RMSNorm, "norm"),)


def normalise(name: str) -> str:
    """Drop leading/trailing underscores: `_softmax` -> `softmax`, `add_` -> `add`, `__and__` -> `and`."""
    return name.strip("_")


def callee_name(op: str, target: Any) -> str:
    """The bare name of what a node calls (`linear`, `add`, `view`, ...) for call_function/call_method nodes."""
    if op == "call_method":
        return normalise(str(target))
    if isinstance(target, torch._ops.OpOverload):
        return normalise(target._schema.name.split("::")[-1])
    if isinstance(target, torch._ops.OpOverloadPacket):
        return normalise(target._qualified_op_name.split("::")[-1])
    return normalise(getattr(target, "__name__", str(target)))


def module_kind(module: nn.Module) -> str:
    """Kind of a leaf module call."""
    for cls, kind in _MODULE_KINDS:
        if isinstance(module, cls):
            return kind
    cls_name = type(module).__name__
    if "Pool" in cls_name:
        return "pool"
    if type(module).__module__ == "torch.nn.modules.activation":
        return "elementwise"
    if "Norm" in cls_name:
        return "norm"
    return "other"


def function_kind(name: str, reads_parameter: bool) -> str:
    """Kind of a function/method call from its normalised name (`callee_name`)."""
    if name in _MATMULS:
        return "linear" if reads_parameter else "matmul"
    return _BY_NAME.get(name, "other")


def target_label(op: str, target: Any, module: nn.Module | None = None) -> str:
    """A readable `OpNode.target`: `torch.nn.Linear`, `aten.linear.default`, `F.gelu`, `operator.add`, `.view`."""
    if module is not None:
        cls = type(module)
        prefix = "torch.nn" if cls.__module__.startswith("torch.nn") else cls.__module__
        return f"{prefix}.{cls.__qualname__}"
    if op == "call_method":
        return f"Tensor.{target}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    fn: Callable[..., Any] = target
    name = getattr(fn, "__name__", str(fn))
    if getattr(operator, name, None) is fn:
        return f"operator.{name}"
    if getattr(torch.nn.functional, name, None) is fn:
        return f"F.{name}"
    if getattr(torch, name, None) is fn:
        return f"torch.{name}"
    mod = getattr(fn, "__module__", None) or ""
    return f"{mod}.{getattr(fn, '__qualname__', name)}" if mod else name
