"""Discrete-event simulation of the pipeline part of one training step.

One representative device per pipeline rank (the devices of one rank are symmetric over dp and tp). Each rank runs
its schedule's sequence of forward (F) and backward (B) passes of (chunk, micro-batch) on its compute stream; an F
waits for the previous stage's F of the same micro-batch plus the point-to-point transfer, a B for the next stage's
B. Schedules (Narayanan et al. SC21 Sec 2.2):

- gpipe: all forwards, then all backwards (in reverse micro-batch order);
- 1f1b (PipeDream-Flush): rank r runs min(p-1-r, m) warm-up forwards, then alternates one F and one B;
- interleaved: v chunks per rank, Megatron-LM's order (forward k runs chunk (k // p) % v of micro-batch
  (k // (p v)) p + k % p; warm-up (p-1-r)*2 + (v-1)*p forwards); needs m to be a multiple of p.

`hold[r, c]` (optional): seconds rank r's compute stream waits after chunk c's last backward before its next pass
(torch's multi-stage schedules run each stage's gradient reduction there, `REDUCE_GRAD`, and FSDP2 makes the stream
wait for it); the pass's own end, which the next stage's backward waits for, is unchanged. `ready[r, c]` (optional):
the earliest start of any forward of chunk c on rank r (its parameters' all-gather, prefetched from the step's
start, has to be done).

`simulate` is exact for any schedule (an event loop over ranks, each advancing while its next pass's dependency is
done). `_simulate_waves` computes the same times for gpipe and for 1f1b with m >= p-1 in O(m + p) numpy wave
steps (max-plus scans), which is what makes a 3072-GPU, 512-micro-batch configuration take milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import PlanError


@dataclass(frozen=True)
class PipelineTimes:
    """Start and end of every pass, indexed [rank, chunk, micro-batch] (seconds from the step's start)."""

    f_start: np.ndarray
    """Forward start times, shape (p, v, m)."""
    f_end: np.ndarray
    """Forward end times."""
    b_start: np.ndarray
    """Backward start times."""
    b_end: np.ndarray
    """Backward end times."""
    stream_end: np.ndarray | None = None
    """When each rank's compute stream is free after its last pass and any `hold` after it, shape (p,); None
    without holds."""

    def rank_end(self) -> np.ndarray:
        """When each rank's compute stream finishes its last pass."""
        return np.maximum(self.f_end.max(axis=(1, 2)), self.b_end.max(axis=(1, 2)))


def schedule_sequence(schedule: str, p: int, v: int, m: int, rank: int) -> list[tuple[int, int, int]]:
    """The ordered passes of one rank as (is_backward, chunk, micro-batch)."""
    if schedule == "gpipe":
        return [(0, 0, i) for i in range(m)] + [(1, 0, i) for i in reversed(range(m))]
    if schedule == "1f1b":
        w = min(p - 1 - rank, m)
        seq = [(0, 0, i) for i in range(w)]
        for j in range(m - w):
            seq += [(0, 0, w + j), (1, 0, j)]
        return seq + [(1, 0, j) for j in range(m - w, m)]
    if schedule == "interleaved":
        if m % p:
            raise PlanError(f"interleaved schedule needs the micro-batch count ({m}) to be a multiple of pp ({p}); "
                            "change the batch size or mbs, or use schedule=1f1b")
        total = m * v
        w = min((p - 1 - rank) * 2 + (v - 1) * p, total)

        def fwd(k: int) -> tuple[int, int, int]:
            return (0, (k // p) % v, (k // (p * v)) * p + k % p)

        def bwd(k: int) -> tuple[int, int, int]:
            return (1, v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)
        seq = [fwd(k) for k in range(w)]
        for i in range(total - w):
            seq += [fwd(w + i), bwd(i)]
        return seq + [bwd(k) for k in range(total - w, total)]
    raise PlanError(f"unknown schedule {schedule!r}; use gpipe, 1f1b or interleaved")


def simulate(schedule: str, fwd: np.ndarray, bwd: np.ndarray, m: int, p2p_s: float,
             hold: np.ndarray | None = None, ready: np.ndarray | None = None) -> PipelineTimes:
    """Simulate the passes of one step. `fwd[r, c]`, `bwd[r, c]` are one micro-batch's pass times of chunk c on
    rank r; `p2p_s` is the transfer time of one activation (or its gradient) between neighbouring stages; `hold`
    and `ready` as in the module docstring."""
    p, v = fwd.shape
    if hold is None and ready is None and (schedule == "gpipe" and v == 1
                                           or (schedule == "1f1b" and v == 1 and m >= p - 1)):
        return _simulate_waves(schedule, fwd[:, 0], bwd[:, 0], m, p2p_s)
    return _simulate_events(schedule, fwd, bwd, m, p2p_s, hold, ready)


def _simulate_events(schedule: str, fwd: np.ndarray, bwd: np.ndarray, m: int, p2p_s: float,
                     hold: np.ndarray | None = None, ready: np.ndarray | None = None) -> PipelineTimes:
    p, v = fwd.shape
    held = hold.tolist() if hold is not None else None
    first = ready.tolist() if ready is not None else [[0.0] * v for _ in range(p)]
    backwards = [[0] * v for _ in range(p)]  # backward passes run so far, by rank and chunk
    seqs = [schedule_sequence(schedule, p, v, m, r) for r in range(p)]
    nan = float("nan")
    starts = [[[nan] * (v * m) for _ in range(p)] for _ in range(2)]
    ends = [[[nan] * (v * m) for _ in range(p)] for _ in range(2)]
    f_list, b_list = fwd.tolist(), bwd.tolist()
    ptr, free = [0] * p, [0.0] * p
    remaining = sum(len(s) for s in seqs)
    ascending = True
    while remaining:
        progressed = False
        for r in (range(p) if ascending else range(p - 1, -1, -1)):
            seq, e_f, e_b = seqs[r], ends[0], ends[1]
            while ptr[r] < len(seq):
                is_b, c, mb = seq[ptr[r]]
                if not is_b:
                    if r > 0:
                        dep = e_f[r - 1][c * m + mb] + p2p_s
                    elif c > 0:
                        dep = e_f[p - 1][(c - 1) * m + mb] + p2p_s
                    else:
                        dep = 0.0
                    if dep < first[r][c]:  # False for NaN (dependency not run yet): kept NaN
                        dep = first[r][c]
                    dur = f_list[r][c]
                else:
                    if r < p - 1:
                        dep = e_b[r + 1][c * m + mb] + p2p_s
                    elif c < v - 1:
                        dep = e_b[0][(c + 1) * m + mb] + p2p_s
                    else:
                        dep = e_f[r][c * m + mb]
                    dur = b_list[r][c]
                if dep != dep:  # NaN: the dependency has not run yet
                    break
                s = free[r] if free[r] > dep else dep
                free[r] = s + dur
                if is_b and held is not None:
                    backwards[r][c] += 1
                    if backwards[r][c] == m:
                        free[r] += held[r][c]
                starts[is_b][r][c * m + mb] = s
                ends[is_b][r][c * m + mb] = s + dur
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, v={v}, m={m})")
        ascending = not ascending

    def arr(x: list) -> np.ndarray:
        return np.asarray(x, dtype=float).reshape(p, v, m)
    return PipelineTimes(arr(starts[0]), arr(ends[0]), arr(starts[1]), arr(ends[1]),
                         np.asarray(free, dtype=float) if held is not None else None)


def _scan(a: np.ndarray, d: np.ndarray, c: float) -> np.ndarray:
    """End times of a chain x_i = max(a_i, x_{i-1} + c) + d_i (x_{-1} = -inf), by a max-plus prefix scan."""
    prefix = np.cumsum(d + c) - c
    return np.maximum.accumulate(a + d - prefix) + prefix


def _simulate_waves(schedule: str, f: np.ndarray, b: np.ndarray, m: int, c: float) -> PipelineTimes:
    p = f.shape[0]
    # rows are waves, columns ranks; converted to [rank, micro-batch] at the end
    fs_w, bs_w = np.zeros((m + p - 1, p)), np.zeros((m, p))
    free = np.zeros(p)
    if schedule == "gpipe":
        fs_w = np.zeros((m, p))
        for mb in range(m):
            free = _scan(free, f, c)
            fs_w[mb] = free - f
        rb, rfree = b[::-1], None
        for mb in reversed(range(m)):
            rfree = _scan(free[::-1], rb, c)
            free = rfree[::-1]
            bs_w[mb] = free - b
        fs, bs = fs_w.T.copy(), bs_w.T.copy()
    else:
        # F of micro-batch u - r on rank r forms wave u (ranks lo..hi-1); it needs wave u-1 (previous rank) and
        # B wave u-p (same rank, through `free`); B wave j runs ranks p-1 .. 0 as one chain and needs F wave
        # j + p - 1.
        prev = np.zeros(p)  # end of the previous F wave, by rank

        def f_wave(u: int) -> None:
            lo, hi = max(0, u - m + 1), min(p, u + 1)
            start = free[lo:hi].copy()
            a = max(lo, 1)
            np.maximum(start[a - lo:], prev[a - 1:hi - 1] + c, out=start[a - lo:])
            fs_w[u, lo:hi] = start
            end = start + f[lo:hi]
            free[lo:hi] = end
            prev[lo:hi] = end

        rb = b[::-1]
        for u in range(min(p, m + p - 1)):
            f_wave(u)
        for j in range(m):
            e = _scan(free[::-1], rb, c)[::-1]
            bs_w[j] = e - b
            free[:] = e
            if j + p < m + p - 1:
                f_wave(j + p)
        ranks = np.arange(p)[:, None]
        fs = fs_w[np.arange(m)[None, :] + ranks, ranks]
        bs = bs_w.T.copy()
    fe, be = fs + f[:, None], bs + b[:, None]
    shape = (p, 1, m)
    return PipelineTimes(fs.reshape(shape), fe.reshape(shape), bs.reshape(shape), be.reshape(shape))
