"""The pipeline simulator against closed forms (Narayanan et al. SC21 Sec 2.2): bubble (p-1)/m for GPipe and
1F1B, (p-1)/(v m) interleaved, with equal stage times and no communication; the fast wave path equals the event
loop; and a whole-step prediction adds up."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cost_model.simulator import _simulate_events, _simulate_waves, schedule_sequence, simulate
from planner.errors import PlanError


def bubble_fraction(schedule: str, p: int, v: int, m: int, tf: float = 1.0, tb: float = 2.0) -> float:
    f = np.full((p, v), tf / v)
    b = np.full((p, v), tb / v)
    times = simulate(schedule, f, b, m, 0.0)
    step = times.rank_end().max()
    ideal = m * (tf + tb)
    return (step - ideal) / ideal


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (4, 8), (8, 32), (4, 3)])
def test_bubble_gpipe_1f1b(schedule, p, m):
    assert bubble_fraction(schedule, p, 1, m) == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (8, 4, 16)])
def test_bubble_interleaved(p, v, m):
    assert bubble_fraction("interleaved", p, v, m) == pytest.approx((p - 1) / (v * m))


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(PlanError, match="multiple of pp"):
        schedule_sequence("interleaved", 4, 2, 6, 0)


def test_every_pass_runs_once_in_order():
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for r in range(4):
            seq = schedule_sequence(sched, 4, v, 8, r)
            assert sorted(seq) == sorted({(b, c, mb) for b in (0, 1) for c in range(v) for mb in range(8)})
            first_b = {(c, mb): i for i, (b, c, mb) in enumerate(seq) if b}
            assert all(i < first_b[(c, mb)] for i, (b, c, mb) in enumerate(seq) if not b)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), extra=st.integers(0, 10), schedule=st.sampled_from(["gpipe", "1f1b"]),
       seed=st.integers(0, 1000), c=st.floats(0, 0.5))
def test_waves_equal_event_loop(p, extra, schedule, seed, c):
    m = max(1, p - 1) + extra
    rng = np.random.default_rng(seed)
    f, b = rng.random((p, 1)) + 0.1, rng.random((p, 1)) * 2 + 0.1
    slow, fast = _simulate_events(schedule, f, b, m, c), _simulate_waves(schedule, f[:, 0], b[:, 0], m, c)
    for a, z in zip((slow.f_start, slow.f_end, slow.b_start, slow.b_end),
                    (fast.f_start, fast.f_end, fast.b_start, fast.b_end)):
        np.testing.assert_allclose(a, z, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 8), m=st.integers(1, 40))
def test_more_microbatches_never_increase_1f1b_bubble(p, m):
    assert bubble_fraction("1f1b", p, 1, m + 1) <= bubble_fraction("1f1b", p, 1, m) + 1e-12


def test_dependencies_respected_with_transfer_time():
    p, m, c = 4, 6, 0.25
    f, b = np.ones((p, 1)), 2 * np.ones((p, 1))
    t = simulate("1f1b", f, b, m, c)
    for r in range(1, p):
        assert np.all(t.f_start[r, 0] >= t.f_end[r - 1, 0] + c - 1e-12)
        assert np.all(t.b_start[r - 1, 0] >= t.b_end[r, 0] + c - 1e-12)
    # GPipe with equal stages and transfers: (m + p - 1)(tf + tb) + 2 (p-1) c
    g = simulate("gpipe", f, b, m, c)
    assert g.rank_end().max() == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * c)
    assert t.rank_end().max() >= (m + p - 1) * 3 + 2 * (p - 1) * c - 1e-12


def test_a_hold_after_a_chunks_last_backward_delays_the_ranks_next_passes_only():
    # torch's interleaved schedule reduces a chunk's gradients right after its last backward (REDUCE_GRAD) and the
    # compute stream waits: the rank's later passes start after the hold, the earlier ones and that backward's own
    # end (which the previous stage's backward waits for) do not move
    p, v, m = 2, 2, 4
    f, b = np.ones((p, v)), 2 * np.ones((p, v))
    base = simulate("interleaved", f, b, m, 0.0)
    assert base.stream_end is None
    none = simulate("interleaved", f, b, m, 0.0, np.zeros((p, v)))
    assert np.allclose(none.b_end, base.b_end) and np.allclose(none.stream_end, base.rank_end())
    hold = np.zeros((p, v))
    hold[1, 1] = 5.0
    t = simulate("interleaved", f, b, m, 0.0, hold)
    seq = schedule_sequence("interleaved", p, v, m, 1)
    k = seq.index((1, 1, m - 1))  # rank 1's last backward of chunk 1
    start = lambda times, x: (times.b_start if x[0] else times.f_start)[1, x[1], x[2]]  # noqa: E731
    end = lambda times, x: (times.b_end if x[0] else times.f_end)[1, x[1], x[2]]  # noqa: E731
    for x in seq[:k + 1]:
        assert start(t, x) == pytest.approx(start(base, x)) and end(t, x) == pytest.approx(end(base, x))
    assert start(t, seq[k + 1]) >= end(t, seq[k]) + 5.0 - 1e-12
    assert t.stream_end[1] >= t.rank_end()[1] and t.rank_end().max() > base.rank_end().max()
