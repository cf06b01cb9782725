"""The pipeline-stage DP against a slow reference on random arrays, and hand-computable cuts."""
import numpy as np
import pytest

from planner.search.stages import cut_stages, cut_stages_reference, inflight_microbatches


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    s = int(rng.integers(1, n + 1))
    t, p, a = rng.uniform(0.1, 3, n), rng.uniform(0, 5, n), rng.uniform(0, 2, n)
    inflight = rng.integers(1, 4, size=s)
    limit = [np.inf, rng.uniform(3, 15)][seed % 2]
    got = cut_stages(t, p, a, s, limit, inflight)
    ref = cut_stages_reference(t, p, a, s, limit, inflight)
    assert (got is None) == (ref is None)
    if got is not None:
        assert got.bottleneck == pytest.approx(ref.bottleneck)
        assert max(got.stage_memory) <= limit
        assert got.bounds[0][0] == 0 and got.bounds[-1][1] == n
        assert all(b[0] == c[1] and b[1] > b[0] for b, c in zip(got.bounds[1:], got.bounds))


def test_hand_cut():
    # times 1,1,1,1,4 in two stages: [1,1,1,1] | [4] -> bottleneck 4
    cut = cut_stages([1, 1, 1, 1, 4], [0] * 5, [0] * 5, 2)
    assert cut.bounds == ((0, 4), (4, 5)) and cut.bottleneck == 4
    # memory: each layer 10 bytes, limit 25 -> at most 2 layers a stage; 5 layers cannot go in 2 stages
    assert cut_stages([1] * 5, [10] * 5, [0] * 5, 2, mem_limit=25) is None
    cut = cut_stages([1] * 5, [10] * 5, [0] * 5, 3, mem_limit=25)
    assert cut.bottleneck == 2 and max(cut.stage_memory) <= 25
    # in-flight activations weigh on early stages: first stage holds 3 micro-batches of 5-byte activations
    cut = cut_stages([1] * 4, [0] * 4, [5] * 4, 2, mem_limit=16, inflight=[3, 1])
    assert cut.bounds == ((0, 1), (1, 4))
    assert cut_stages([1], [0], [0], 2) is None


def test_even_tie_break():
    cut = cut_stages([1, 1, 1, 1], [0] * 4, [0] * 4, 2)
    assert cut.bounds == ((0, 2), (2, 4))


def test_inflight():
    assert list(inflight_microbatches("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert list(inflight_microbatches("1f1b", 4, 2)) == [2, 2, 2, 1]
    assert list(inflight_microbatches("gpipe", 2, 8)) == [8, 8]
    assert list(inflight_microbatches("interleaved", 2, 8, 2)) == [2, 1, 2, 1]
