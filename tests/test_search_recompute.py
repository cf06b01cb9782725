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


def _halfway(graph, level):
    """The best plans at `level` and at full recomputation with memory unlimited, and the unforced search on a
    device whose memory lies halfway between their peaks."""
    big = 2 ** 40
    at = _search(graph, big, recompute=level).ranked[0]
    full = _search(graph, big, recompute="full").ranked[0]
    lo, hi = full.prediction.peak_memory_bytes, at.prediction.peak_memory_bytes
    assert lo < hi
    return at, full, _search(graph, (lo + hi) // 2)


def test_search_recomputes_only_the_blocks_memory_needs(graph):
    none, full, res = _halfway(graph, "none")
    lo, hi = full.prediction.peak_memory_bytes, none.prediction.peak_memory_bytes
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


FLAT = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.qkv, self.o = nn.LayerNorm(32), nn.Linear(32, 96), nn.Linear(32, 32)
    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
class Flat(nn.Module):  # blocks as plain attributes: no container to find them in
    def __init__(self):
        super().__init__()
        self.emb, self.block0, self.block1, self.head = nn.Embedding(64, 32), Block(), Block(), nn.Linear(32, 64)
    def forward(self, idx):
        return self.head(self.block1(self.block0(self.emb(idx))))
def build_model():
    return Flat()
def sample_batch(b):
    ids = torch.randint(0, 64, (b, 17))
    return ids[:, :-1], ids[:, 1:]
'''


def test_a_model_without_repeated_blocks_says_what_its_blocks_are(tmp_path, capsys):
    # its top-level modules are the blocks: recompute_blocks=1 re-ran the embedding without a word, and
    # recompute=attention failed in the dry run blaming nn.MultiheadAttention
    from planner.cli import main
    model = tmp_path / "flat.py"
    model.write_text(FLAT)
    base = [str(model), "--cluster", "cpu-local", "--batch-size", "4", "--no-check"]
    assert main(base + ["--force", "dp=2,recompute=full,recompute_blocks=1"]) == 0
    assert "so each top-level module is a block: recompute_blocks counts emb, block0, block1, head" in capsys.readouterr().out
    assert main(base + ["--force", "dp=2,recompute=attention"]) == 2
    err = capsys.readouterr().err
    assert "block emb makes none (no block repeats" in err and err.count("\n") == 1


def test_search_runs_selective_on_the_blocks_full_recomputation_leaves(graph):
    # where selective recomputation does not fit either, full recomputation of some blocks and selective on the
    # others (recompute=selective with counts) fits between the two, faster than full recomputation everywhere
    sel, full, res = _halfway(graph, "selective")
    hybrid = [s for s in res.ranked if s.plan.recompute == "selective" and s.plan.recompute_blocks]
    assert hybrid and all(s.prediction.fits for s in hybrid)
    assert 0 < sum(hybrid[0].plan.recompute_blocks) < 8
    assert sel.prediction.step_time_s < hybrid[0].prediction.step_time_s < full.prediction.step_time_s
    assert not any(s.plan.recompute == "selective" and not s.plan.recompute_blocks for s in res.ranked)


def test_spread_blocks_shares_a_ranks_recomputed_blocks_over_its_stages():
    # an interleaved rank's chunks take one more block each in turn (up to what each holds): rank 0 needs 3 of its
    # 1 + 2 blocks, rank 1 one of its 2 + 2
    from planner.plan import StageSpec
    from planner.search.outer import spread_blocks
    stages = [StageSpec(start_layer=k, end_layer=k + 1, rank=k % 2) for k in range(4)]
    assert spread_blocks([3, 1], stages, [1, 2, 2, 2]) == [1, 1, 2, 0]
    assert spread_blocks([2, 0], stages, [1, 2, 2, 2]) == [1, 0, 1, 0]
    assert spread_blocks([9, 9], stages, [1, 2, 2, 2]) == [1, 2, 2, 2]  # no more than the stages hold
