r"""Inter-stage cutting: split L layers into S contiguous pipeline stages (Alpa / Piper style dynamic program).

Pure functions over numpy arrays. With t[l] the time of layer l for one micro-batch (forward + backward),
p[l] its resident bytes (parameters, gradients, optimizer state as priced by the caller) and a[l] its activation
bytes per micro-batch, stage k holding layers [i, j) costs T(i, j) = sum t[i:j] and needs

    mem_k(i, j) = sum p[i:j] + n_k * sum a[i:j]           (n_k micro-batches in flight on stage k)

The program minimises the pipeline bottleneck max_k T(stage k) subject to mem_k <= M for every stage:

    F[0][0] = 0;   F[k][j] = min_{i < j, mem_k(i, j) <= M} max(F[k-1][i], T(i, j));   answer F[S][L]

In steady state a synchronous pipeline runs one micro-batch per bottleneck time, so this is the term that grows
with the micro-batch count; the sum of stage times (the fill/drain part, Alpa's sum term) does not depend on where
contiguous cuts fall when layer costs do not, so it is not part of the objective. Ties are broken towards the cut
whose stages are most even (smallest sum of squared stage times), then the earliest.

The layers are `OpGraph.layers()`: the model's blocks by `planner.blocks.layer_blocks` (its repeated blocks, or its
top-level units when it has none) and the ops between them, the units the executor's pipeline split cuts at too.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageCut:
    """A cut of the layer sequence into contiguous stages."""

    bounds: tuple[tuple[int, int], ...]
    """(start, end) layer index per stage, end exclusive, covering 0..L in order."""
    bottleneck: float
    """Largest stage time."""
    stage_times: tuple[float, ...]
    """Time per stage."""
    stage_memory: tuple[float, ...]
    """Bytes per stage."""


def stage_memory(param: np.ndarray, act: np.ndarray, inflight: np.ndarray, bounds) -> list[float]:
    """Bytes each stage needs under `bounds`."""
    return [float(param[i:j].sum() + inflight[k] * act[i:j].sum()) for k, (i, j) in enumerate(bounds)]


def cut_stages(time: np.ndarray, param: np.ndarray, act: np.ndarray, num_stages: int, mem_limit: float = np.inf,
               inflight: np.ndarray | None = None, cuttable=None) -> StageCut | None:
    """The cut minimising the bottleneck stage time under the memory limit, every stage holding parameters when
    the layers have any (a stage of parameter-free layers, say a lone ReLU, has nothing for its optimizer, which
    torch refuses); None when no cut fits.

    `inflight[k]` is the micro-batches whose activations stage k holds (1F1B: S - k; GPipe: all); default 1.
    `cuttable[j]` (j = 0..L): whether a stage may start at layer j (`OpGraph.cut_points`); default everywhere."""
    time, param, act = (np.asarray(x, dtype=float) for x in (time, param, act))
    n = len(time)
    if num_stages < 1 or num_stages > n:
        return None
    infl = np.ones(num_stages) if inflight is None else np.asarray(inflight, dtype=float)
    ct, cp, ca, c2 = (np.concatenate([[0.0], np.cumsum(x)]) for x in (time, param, act, time))
    best = np.full((num_stages + 1, n + 1), np.inf)
    even = np.full((num_stages + 1, n + 1), np.inf)  # tie-break: sum of squared stage times
    arg = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0, 0], even[0, 0] = 0.0, 0.0
    # T[i, j] = time of a stage holding layers [i, j); only i < j is a stage
    span = ct[None, :] - ct[:, None]
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    if cuttable is not None:
        at = np.asarray(cuttable, dtype=bool)
        valid &= at[:, None] & at[None, :]
    for k in range(1, num_stages + 1):
        mem = (cp[None, :] - cp[:, None]) + infl[k - 1] * (ca[None, :] - ca[:, None])
        ok = valid & (mem <= mem_limit) & ((cp[None, :] - cp[:, None] > 0) | (cp[-1] <= 0))
        val = np.where(ok, np.maximum(best[k - 1][:, None], span), np.inf)  # [i, j]
        lo = val.min(axis=0)
        sq = np.where(val <= lo[None, :] * (1 + 1e-12), even[k - 1][:, None] + span * span, np.inf)
        pick = np.argmin(sq, axis=0)
        cols = np.arange(n + 1)
        best[k] = lo
        even[k] = np.where(np.isfinite(lo), sq[pick, cols], np.inf)
        arg[k] = pick
    if not np.isfinite(best[num_stages, n]):
        return None
    bounds = []
    j = n
    for k in range(num_stages, 0, -1):
        i = int(arg[k, j])
        bounds.append((i, j))
        j = i
    bounds.reverse()
    times = tuple(float(time[i:j].sum()) for i, j in bounds)
    return StageCut(tuple(bounds), max(times), times, tuple(stage_memory(param, act, infl, bounds)))


def cut_stages_reference(time, param, act, num_stages: int, mem_limit: float = np.inf,
                         inflight=None) -> StageCut | None:
    """Slow reference: try every placement of the S-1 cut points (tests compare `cut_stages` with it)."""
    time, param, act = (np.asarray(x, dtype=float) for x in (time, param, act))
    n = len(time)
    if num_stages < 1 or num_stages > n:
        return None
    infl = np.ones(num_stages) if inflight is None else np.asarray(inflight, dtype=float)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0,) + cuts + (n,)
        bounds = tuple(zip(edges[:-1], edges[1:]))
        mem = stage_memory(param, act, infl, bounds)
        if max(mem) > mem_limit or (param.sum() > 0 and any(not param[i:j].sum() > 0 for i, j in bounds)):
            continue
        times = tuple(float(time[i:j].sum()) for i, j in bounds)
        if best is None or max(times) < best.bottleneck:
            best = StageCut(bounds, max(times), times, tuple(mem))
    return best


def inflight_microbatches(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> np.ndarray:
    """Micro-batches whose activations each (virtual) stage holds at its peak, per stage in model order.

    GPipe runs every forward before any backward, so each stage holds all m; 1F1B holds pp - rank on rank `rank`
    (Narayanan et al. 2021, sec. 2.2); interleaved 1F1B is treated like 1F1B per rank, its chunks sharing it."""
    stages = pp * virtual_stages
    ranks = np.arange(stages) % pp
    if schedule == "gpipe":
        return np.full(stages, float(num_microbatches))
    return np.minimum(pp - ranks, num_microbatches).astype(float)


def pipeline_bound(stage_times, pp: int, num_microbatches: int) -> float:
    """A lower bound on a synchronous pipeline's step from per-stage times (forward + backward of one
    micro-batch, stages in model order, stage k on rank k % pp; pp = 1 is no pipeline):

        max_r  m * W_r + sum_{k < r} T_k        W_r = sum of the times of rank r's stages

    Rank r runs all m micro-batches of its stages one pass at a time; its first pass (micro-batch 0's forward of
    its first stage, stage r) waits for that micro-batch's forwards on stages 0..r-1, and its last pass (a
    backward of stage r, in GPipe, 1F1B and interleaved 1F1B alike) is followed by the backwards on stages
    r-1..0."""
    t = np.asarray(stage_times, dtype=float)
    m = num_microbatches
    if pp <= 1:
        return float(t.sum()) * m
    per_rank = np.bincount(np.arange(len(t)) % pp, weights=t, minlength=pp)
    before = np.concatenate([[0.0], np.cumsum(t[:pp - 1])])
    return float((m * per_rank + before).max())


def min_pipeline_bound(time, pp: int, num_microbatches: int) -> float:
    """The smallest `pipeline_bound` over every cut of the layers (per-layer times `time`) into pp contiguous
    stages, one per rank: a step-time lower bound for a GPipe or 1F1B pipeline whatever its cut. With prefix
    sums c, a stage [i, j) on rank r contributes c_i + m (c_j - c_i), and the program minimises the largest:

        G[0][0] = 0;   G[k][j] = min_{i < j} max(G[k-1][i], c_i + m (c_j - c_i));   answer G[pp][L]"""
    t = np.asarray(time, dtype=float)
    n, m = len(t), num_microbatches
    if pp < 1 or pp > n:
        return np.inf
    c = np.concatenate([[0.0], np.cumsum(t)])
    cost = np.where(np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1),
                    c[:, None] + m * (c[None, :] - c[:, None]), np.inf)  # [i, j]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for _ in range(pp):
        best = np.maximum(best[:, None], cost).min(axis=0)
    return float(best[n])
