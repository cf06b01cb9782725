"""Which ops torch.autocast runs in its lower precision and which in fp32 (torch.amp docs, "Autocast Op Reference",
CUDA op lists), by the graph's op kinds: the one list the cost model (cost_model.dtypes) and the executor
(executor.tp, which casts a linear's fp32 input before moving it) both read. Imports nothing heavy."""

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
