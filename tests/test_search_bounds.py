"""The search's lower bounds never exceed what the real cost model predicts (on GPUs, where a layer costs the max
of its kernels and its host dispatch, not a sum of per-op maxima)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from cost_model.model import CostModel
from hardware_profiles.load import load_cluster
from planner.model_file import ModelFile, default_loss
from planner.search import search
from planner.search.outer import OuterSearch
from planner.trace import trace_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpt():
    """A 2-layer GPT (examples/gpt.py) where some ops are host-bound on an H100 and the GEMMs are kernel-bound."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_embd=1024, n_head=16, vocab_size=8192, block_size=512)

    def sample(b: int):
        tokens = torch.zeros(b, 513, dtype=torch.long)
        return tokens[:, :-1], tokens[:, 1:]
    return trace_model(ModelFile(path="gpt-2x1024", build_model=lambda: GPT(cfg), sample_batch=sample,
                                 loss_fn=default_loss), progress=False)


@pytest.mark.parametrize("mbs", [1, 2])
def test_compute_bounds_at_most_the_predicted_compute_on_an_async_host_gpu(gpt, mbs):
    cluster = load_cluster("dgx-h100")
    assert cluster.device.async_host
    cm = CostModel(cluster)
    forced = {"dp": 8, "tp": 1, "pp": 1, "zero": 0, "mbs": mbs, "recompute": "none", "sp": 0}
    compute = search(gpt, cluster, cm, batch_size=8 * mbs, forced=forced).best_prediction.breakdown["compute_s"]
    outer = OuterSearch(gpt, cluster, cm, batch_size=8 * mbs)
    assert outer.op_min_times(1, mbs).sum() <= compute * (1 + 1e-9)
    _, arrays = outer.placed(1, mbs, False)
    assert arrays.bound.sum() <= compute * (1 + 1e-9)


def test_full_recompute_bound_stops_where_the_re_run_stops():
    """Full recomputation's re-run stops after the last op whose output backward saved (torch checkpoint's early
    stop, `CostModel.recompute_stop`); a bound that charged the whole forward again exceeded the prediction
    (7 times in this search before it stopped there)."""
    from gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_embd=2304, n_head=24, vocab_size=8192, block_size=2048)

    def sample(b: int):
        tokens = torch.zeros(b, 2049, dtype=torch.long)
        return tokens[:, :-1], tokens[:, 1:]
    graph = trace_model(ModelFile(path="gpt-2x2304", build_model=lambda: GPT(cfg), sample_batch=sample,
                                  loss_fn=default_loss), progress=False)
    cluster = load_cluster("dgx-a100-80gb")
    res = search(graph, cluster, CostModel(cluster), batch_size=64, forced={"recompute": "full"})
    assert res.stats["predictions"] > 0 and res.stats["bound_violations"] == 0
