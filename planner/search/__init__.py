"""The plan search: `search(...)` returns the best plan it finds with its prediction and the runners-up.

Three levels, each in its own module (the cost model is passed in and is the only source of costs):

- `planner.strategies`: candidate placements per op kind (the SOAP space over the tp axis);
- `planner.search.ilp` / `placement`: one integer program per repeated block type (and one for the ops between
  blocks) choosing a strategy per op to minimise compute plus re-sharding under a memory budget, cached;
- `planner.search.stages`: the dynamic program cutting the layer sequence into pipeline stages;
- `planner.search.space` / `outer`: mesh shapes, micro-batching, sequence parallelism, schedules, ZeRO and
  recompute, visited best-first by a compute lower bound, each survivor scored by `cost_model.predict`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from hardware_profiles.schema import Cluster
from planner.graph import OpGraph
from planner.plan import Plan


@dataclass
class SearchResult:
    """What a search returns."""

    best: Plan
    """The chosen plan, with `predicted` filled."""
    best_prediction: Any
    """Its `cost_model.Prediction` (with the timeline when asked)."""
    candidates: list = field(default_factory=list)
    """(Plan, Prediction) pairs, best first (the best included)."""
    notes: list = field(default_factory=list)
    """Warnings and remarks for the user (e.g. tp spanning nodes)."""
    stats: dict = field(default_factory=dict)
    """Search counters: groups, groups_evaluated, groups_bounded, predictions, ilp_solves, seconds."""
    evaluated: list = field(default_factory=list)
    """Every candidate predicted (`outer.Evaluated`: step time, peak memory, fits, label), fitting or not."""
    fallbacks: list = field(default_factory=list)
    """(Plan, Prediction) pairs beyond the candidates: the fastest fitting one of each `configuration` (tp, pp,
    sequence parallelism, ZeRO, recompute) the candidates do not have, fastest first. What `plan`'s dry run tries
    when every candidate fails it: a failure is usually one configuration's (tp on an op the model reshapes, a
    pipeline cut the model's forward cannot take), which its mbs and schedule variants share."""


def search(graph: OpGraph, cluster: Cluster, cost_model: Any, *, batch_size: int, precision: str = "bf16",
           forced: Mapping[str, Any] | None = None, top_k: int = 5, time_budget_s: float = 60.0,
           progress: bool = False, model_path: str = "", ignore_memory: bool = False,
           max_grad_norm: float = 0.0) -> SearchResult:
    """Plan `graph` on `cluster` for a global batch of `batch_size` with the `forced` keys pinned.

    Returns the fastest fitting plan and up to `top_k` candidates; stops after `time_budget_s` with the best so
    far. `progress`: show a progress bar on stderr once the search has run ~2 s (`planner.progress`). Raises
    PlanError when the forced keys contradict the cluster or nothing fits (saying what would help).
    `ignore_memory`: rank candidates as if every one fitted, for a what-if prediction (e.g. of a published run whose
    runtime keeps fewer activations than this executor); predictions still say whether they fit.
    `max_grad_norm`: the gradient clipping every candidate plan does (0: none)."""
    from planner.progress import SearchProgress
    from planner.search.outer import OuterSearch, with_prediction

    with SearchProgress(show=progress) as bar:
        result = OuterSearch(graph, cluster, cost_model, batch_size=batch_size, precision=precision, forced=forced,
                             time_budget_s=time_budget_s, model_path=model_path,
                             on_progress=bar if progress else None, top_k=top_k, ignore_memory=ignore_memory,
                             max_grad_norm=max_grad_norm).run()
    top = result.ranked[:max(1, top_k)]
    candidates = [(with_prediction(s.plan, s.prediction), s.prediction) for s in top]
    seen = {configuration(s.plan) for s in top}
    fallbacks = []
    for s in result.ranked[len(top):]:
        if len(fallbacks) == MAX_FALLBACKS:
            break
        if configuration(s.plan) not in seen:
            seen.add(configuration(s.plan))
            fallbacks.append((with_prediction(s.plan, s.prediction), s.prediction))
    best, best_prediction = candidates[0]
    return SearchResult(best=best, best_prediction=best_prediction, candidates=candidates, notes=result.notes,
                        stats=result.stats, evaluated=result.evaluated, fallbacks=fallbacks)


MAX_FALLBACKS = 5
"""Fallbacks kept: a dry run takes seconds (minutes for a deep pipeline of a large model), so a few."""


def configuration(plan: Plan) -> tuple:
    """What a dry-run failure usually hangs on: tp, pp and the stages per rank, sequence parallelism, ZeRO stage and
    recompute policy (not dp or the micro-batch size, which change no code path the model's forward takes)."""
    return (plan.mesh.tp, plan.mesh.pp, plan.virtual_stages, plan.sequence_parallel, plan.zero_stage,
            plan.recompute)


__all__ = ["SearchResult", "configuration", "search", "replace"]
