"""Phi-3 style fused gate/up projection split with `chunk(2)`: tp must not shard it (issue: a colwise shard of
gate_up gives rank 0 only gate rows)."""
from swiglu_common import Model, loss_fn, sample_batch  # noqa: F401


def build_model():
    return Model(fused=True)
