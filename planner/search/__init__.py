"""The plan search: `search(...)` returns the best plan it finds with its prediction and the runners-up.

This initial version builds the default plan for the `--force` keys (`planner.defaults.default_plan`) and asks the
cost model for its prediction; the full search (placement ILP, stage DP, outer loop) replaces the internals and
keeps this interface.
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


def search(graph: OpGraph, cluster: Cluster, cost_model: Any, *, batch_size: int, precision: str = "bf16",
           forced: Mapping[str, Any] | None = None, top_k: int = 5, time_budget_s: float = 60.0,
           progress: bool = False, model_path: str = "") -> SearchResult:
    """Plan `graph` on `cluster` for a global batch of `batch_size` with the `forced` keys pinned."""
    from planner.defaults import default_plan
    notes: list[str] = []
    plan = default_plan(graph, cluster, batch_size, precision, dict(forced or {}), model_path, notes=notes)
    prediction = cost_model.predict(graph, plan)
    best = replace(plan, predicted=prediction.to_dict())
    return SearchResult(best=best, best_prediction=prediction, candidates=[(best, prediction)], notes=notes)
