"""The control for swiglu_fused.py: the same model with separate gate and up Linears, which tp shards."""
from swiglu_common import Model, loss_fn, sample_batch  # noqa: F401


def build_model():
    return Model(fused=False)
