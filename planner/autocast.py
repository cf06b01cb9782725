"""Which ops torch.autocast runs in its lower precision and which in fp32 (torch.amp docs, "Autocast Op Reference",
CUDA op lists; CPU autocast's shorter fp32 list on CPU ranks), by the graph's op kinds: the one list the cost model
(cost_model.dtypes) and the executor (executor.tp, which casts a linear's fp32 input before moving it) both read.
Imports nothing heavy."""

AUTOCAST_LOWER_KINDS = frozenset({"linear", "matmul", "conv", "attention"})
"""Kinds on the lower-precision list (linear, matmul, mm, bmm, baddbmm, addmm, conv*, scaled_dot_product_attention):
every floating input is cast to the autocast dtype."""
AUTOCAST_FP32_KINDS = frozenset({"norm", "softmax", "loss"})
"""Kinds on the fp32 list (layer_norm, group_norm, norm, softmax, log_softmax, cross_entropy, nll_loss, mse_loss and
the other losses): they read and write fp32 whatever their inputs."""
AUTOCAST_FP32_CALLEES = frozenset({"pow", "rsqrt", "exp", "expm1", "log", "log1p", "log2", "log10", "reciprocal",
                                   "softplus", "sum", "prod", "cumsum", "cumprod", "logsumexp", "norm", "normalize",
                                   "acos", "asin", "cosh", "sinh", "tan", "erfinv", "dist", "cdist", "pdist",
                                   "renorm"})
"""Functions on the fp32 list that the graph classes under other kinds (elementwise, other)."""
AUTOCAST_FP32_KINDS_CPU = frozenset({"loss"})
"""CPU autocast's fp32 list among those kinds: the losses only. Its lists (torch.amp docs, "CPU Ops that can autocast
to float32") have no norm or softmax: under torch.autocast("cpu") layer_norm, group_norm, rms_norm, softmax and
log_softmax run in their input's dtype, while cross_entropy, nll_loss and mse_loss run in fp32 (checked on torch
2.13's CPU build)."""
AUTOCAST_FP32_CALLEES_CPU = frozenset({"prod"})
"""The functions of AUTOCAST_FP32_CALLEES that CPU autocast also runs in fp32 (pow, rsqrt, exp, log, sum, cumsum,
norm, logsumexp, softplus and reciprocal keep their input's dtype there; same check)."""


def fp32_lists(cpu: bool) -> tuple[frozenset, frozenset]:
    """(kinds, functions) autocast runs in fp32: CUDA's lists, or CPU autocast's on CPU ranks."""
    return (AUTOCAST_FP32_KINDS_CPU, AUTOCAST_FP32_CALLEES_CPU) if cpu else (AUTOCAST_FP32_KINDS, AUTOCAST_FP32_CALLEES)
