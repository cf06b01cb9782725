"""Partial full recomputation in the search (`Plan.recompute_blocks`), with the real cost model on a traced GPT:
on a device where the plan without recomputation does not fit and full recomputation does, the search re-runs
only the blocks each pipeline rank's memory needs."""
import dataclasses
import os
import textwrap

import pytest

from cost_model.model import CostModel
from planner.search.outer import OuterSearch
from test_memory_activations import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORCED = {"dp": 1, "tp": 1, "pp": 2, "zero": 0, "mbs": 8, "schedule": "1f1b", "sp": 0}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    model = tmp_path_factory.mktemp("partial") / "gpt8.py"
    model.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
        from gpt import GPT, GPTConfig
        CFG = GPTConfig(n_layer=8, n_embd=64, n_head=4, vocab_size=128, block_size=256)
        def build_model():
            return GPT(CFG)
        def sample_batch(b):
            import torch
            t = torch.randint(0, 128, (b, 257))
            return t[:, :-1], t[:, 1:]
    """))
    return trace_model(load_model_file(str(model)), batch_size=1, progress=False)


def _search(graph, memory, **forced):
    cl = cluster(per_node=2)
    cl = dataclasses.replace(cl, device=dataclasses.replace(cl.device, memory_bytes=memory,
                                                            usable_memory_fraction=1.0))
    return OuterSearch(graph, cl, CostModel(cl), batch_size=32, forced={**FORCED, **forced}, top_k=20).run()


def test_search_recomputes_only_the_blocks_memory_needs(graph):
    big = 2 ** 40
    none = _search(graph, big, recompute="none").ranked[0]
    full = _search(graph, big, recompute="full").ranked[0]
    lo, hi = full.prediction.peak_memory_bytes, none.prediction.peak_memory_bytes
    assert lo < hi
    res = _search(graph, (lo + hi) // 2)
    best = res.ranked[0]
    assert best.plan.recompute == "full" and best.prediction.fits
    counts = best.plan.recompute_blocks
    assert len(counts) == 2 and 0 < sum(counts) < 8
    assert counts[0] >= counts[1]  # the first 1F1B stage holds more micro-batches
    assert none.prediction.step_time_s < best.prediction.step_time_s < full.prediction.step_time_s
    # the partial plan is the fastest that fits: every classic full-recompute candidate is slower, none fits
    # without recomputation
    assert all(s.prediction.step_time_s > best.prediction.step_time_s for s in res.ranked
               if s.plan.recompute == "full" and not s.plan.recompute_blocks)
    assert not any(s.plan.recompute == "none" for s in res.ranked)
    # a forced recompute level is kept as given: full means every block
    forced = _search(graph, (lo + hi) // 2, recompute="full").ranked
    assert all(not s.plan.recompute_blocks for s in forced)
