"""The outer loop: mesh x micro-batching x sequence parallelism x schedule groups, best-first by a lower bound,
ZeRO stage and recompute inside each group, every surviving candidate scored by the cost model's `predict`.

Order of work (cheap to expensive):

1. Enumerate groups (`planner.search.space`): a group fixes dp, tp, pp, micro-batch size, sp, schedule and v.
2. Lower-bound each group's step time from per-op compute alone: every op at its fastest strategy
   (`op_parts`; kernels and host dispatch summed apart and combined per layer, as `predict` does); a GPipe or
   1F1B pipeline needs at least min over stage cuts of max_r (m T_r + sum_{k<r} T_k)
   (rank r runs all m micro-batches of its stage after the first one's forward crossed the stages before it,
   and the last one's backward crosses them again: `stages.min_pipeline_bound`), and an interleaved one at
   least m * sum_k T_k / pp. Communication, bubbles and recompute only add to this.
3. Visit groups in increasing bound; stop when the bound reaches the best predicted step found (nothing left can
   win) or the time budget runs out.
4. In a group: placements from the ILP (cached), stages from the DP on the placed layer times, then ZeRO stages
   leanest first (3, 2, 1, 0) for each recompute level (none, attention where SDPA is priced unfused, selective,
   full): once a ZeRO stage does not fit, the less sharded ones cannot either; a ZeRO stage that fits is not retried
   with more recompute, which can only be slower. A ZeRO stage that fits with full recompute but not without gets
   partial full recompute too (`_partial`: each pipeline rank re-runs only the blocks its memory needs). A group
   whose leanest candidate does not fit is retried once with memory-aware stage cuts and a memory-budgeted ILP.
5. Before a group's sweep, a second, tighter bound from its actual placements and stage cuts (`placed_bound`):
   per layer the compute plus re-sharding time the ILP priced (`op_time` + `reshard_time` of the chosen
   placements, which `predict` charges at least: it adds partial-gradient reductions, recompute, ZeRO and
   data-parallel traffic, the optimizer and waits), and per pipeline rank r, m times its stages' time plus the
   time of the first micro-batch's forward and backward on the stages before it (`stages.pipeline_bound`); full
   recompute adds the blocks' forward compute, which it runs again. When the bound of a recompute level exceeds
   the `top_k`-th best step found so far, none of its candidates can enter the top `top_k`: the level is swept
   only to its first fitting candidate (which decides, exactly as the full sweep would, whether the
   memory-aware retry runs), or skipped when an earlier level already fitted. The `top_k` candidates returned
   are the same as with the full sweep.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from cost_model.ops import attention_recompute_problem
from hardware_profiles.schema import UNFUSED_ATTENTION, Cluster
from planner.defaults import check_forced_recompute_blocks, forced_recompute_blocks, stage_block_counts
from planner.errors import PlanError
from planner.graph import NO_REPEATED_BLOCKS, OpGraph
from planner.layout import parameter_placements
from planner.plan import (RECOMPUTE, Mesh, OpPlacement, Plan, StageSpec, cluster_record, model_fingerprint,
                          recompute_counts)
from planner.search.ilp import ILPError
from planner.search.layer_costs import LayerArrays, LayerCosts
from planner.search.placement import PlacementResult, PlacementSolver
from planner.search.space import (MAX_MICROBATCHES, Group, check_batch_size, check_forced, check_forced_stages,
                                   divisors, forced_schedule_problem, groups, meshes, recomputes,
                                   zero_stages)
from planner.search.stages import cut_stages, inflight_microbatches, min_pipeline_bound, pipeline_bound
from planner.strategies import plan_tp_problems



@dataclass(frozen=True)
class Scored:
    """One evaluated candidate."""

    plan: Plan
    """The candidate plan."""
    prediction: Any
    """The cost model's Prediction for it."""
    lower_bound_s: float
    """The group's step-time lower bound (for checking the bound against predict)."""


@dataclass(frozen=True)
class Evaluated:
    """One candidate the search predicted, fitting or not: what `plan --plot` draws."""

    step_time_s: float
    """Predicted step time."""
    peak_memory_bytes: int
    """Predicted peak memory on the most loaded device."""
    fits: bool
    """Whether it fits the device's usable memory."""
    label: str
    """Its configuration in a few characters (`candidate_label`)."""


@dataclass
class OuterResult:
    """What the outer loop found."""

    ranked: list[Scored]
    """Fitting candidates, fastest first."""
    notes: list[str]
    """What the search did and skipped, for the user."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Counts: groups, groups_evaluated, groups_bounded (swept only to their first fitting candidate),
    predictions, ilp_solves, bound_violations, seconds."""
    evaluated: list[Evaluated] = field(default_factory=list)
    """Every candidate predicted, in search order."""


class OuterSearch:
    """One search: graph, cluster, cost model, batch and forced keys; `run()` returns an OuterResult.
    `on_progress(groups done, groups in all, best step so far or inf)` is called as groups are visited."""

    def __init__(self, graph: OpGraph, cluster: Cluster, cost_model: Any, *, batch_size: int, precision: str = "bf16",
                 forced: Mapping[str, Any] | None = None, time_budget_s: float = 60.0, model_path: str = "",
                 on_progress: Callable[[int, int, float], None] | None = None, top_k: int = 5,
                 ignore_memory: bool = False, max_grad_norm: float = 0.0):
        self.graph, self.cluster, self.cm = graph, cluster, cost_model
        self.max_grad_norm = max_grad_norm  # every candidate clips its gradients so (priced by the cost model)
        self.ignore_memory = ignore_memory  # rank every candidate as if it fitted (a what-if; nothing is written)
        self.top_k = max(1, top_k)
        self._top: list[float] = []  # the top_k fastest fitting step times found so far, ascending
        self.batch, self.precision = batch_size, precision
        self.forced = dict(forced or {})
        self.budget_s, self.model_path, self.on_progress = time_budget_s, model_path, on_progress
        self.layers = graph.layers()
        self.placer = PlacementSolver(graph, cost_model)
        self.layer_costs = LayerCosts(graph, cost_model, precision)
        self.notes: list[str] = []
        self.stats = {"groups": 0, "groups_evaluated": 0, "groups_bounded": 0, "predictions": 0,
                      "bound_violations": 0}
        self._bottleneck: dict[tuple, float] = {}
        self._cuts: dict[tuple, tuple[StageSpec, ...] | None] = {}
        self._tight: dict[tuple, tuple[PlacementResult, LayerArrays] | None] = {}
        self._placed: dict[tuple, tuple[PlacementResult, LayerArrays] | None] = {}
        self._leanest: tuple[float, Plan] | None = None
        self.evaluated: list[Evaluated] = []
        self._modules = [graph.layer_modules(layer) for layer in self.layers]
        self._fingerprint = model_fingerprint((p.name, p.shape) for p in graph.parameters)
        self._num_params = graph.num_parameters  # a sum over every parameter: once, not per candidate
        self._problems: dict[tuple, list[str]] = {}
        self._noted: set[tuple] = set()
        self._skipped: list[str] = []  # notes saying a tp was skipped, for infeasible_message
        # set when no candidate was built because every tp the meshes need sharded no weight: those tp are then
        # solved as a forced tp is (a plan the cluster can run beats none)
        self._shard_idle = False
        # recompute=attention re-runs the blocks' SDPA calls: possible only where every block makes them, and tried
        # unforced only where SDPA is priced unfused, whose s x s scores it frees (Korthikanti et al.); a fused
        # kernel's call frees only its log-sum-exp, a re-run for almost nothing
        self._attention_problem = attention_recompute_problem(graph)
        att = cluster.device.attention
        self._try_attention = att is not None and att.kernel == UNFUSED_ATTENTION

    # ---- driver ---------------------------------------------------------------------------------------------------
    def run(self) -> OuterResult:
        """Search and rank; raises PlanError when nothing fits (or nothing was found in the time budget)."""
        start = time.monotonic()
        check_batch_size(self.batch)
        self.notes += check_forced(self.forced, self.cluster, self.batch)
        if self.graph.checkpoint_calls:
            self.notes.append(user_checkpoint_note(self.graph.checkpoint_calls))
        self.notes += self.graph.build_notes
        check_forced_stages(self.forced, len(self.layers), self.graph.cut_points, self.graph.split_modules)
        check_forced_recompute_blocks(self.forced, sum(1 for l in self.layers if l.block_type))
        if "recompute_blocks" in self.forced and not self.graph.repeats_blocks:
            units = [l.name for l in self.layers if l.block_type]
            self.notes.append(f"{NO_REPEATED_BLOCKS}: recompute_blocks counts {', '.join(units[:6])}"
                              f"{', ...' if len(units) > 6 else ''}")
        if self.forced.get("recompute") == "attention" and self._attention_problem:
            raise PlanError(self._attention_problem)
        todo = []
        mesh_list = meshes(self.cluster, len(self.layers), self.batch, self.forced)
        for mesh in mesh_list:
            todo += groups(mesh, self.batch, len(self.layers), self.forced)
        if not todo:
            problem = forced_schedule_problem(mesh_list, self.batch, self.forced)
            if problem:
                raise PlanError(problem)
            raise PlanError(f"no micro-batch size / schedule fits --batch-size {self.batch} with the forced keys "
                            f"{self.forced} and at most {MAX_MICROBATCHES} micro-batches per step; relax --force or "
                            "lower --batch-size")
        bounds = sorted(((self.lower_bound(g), i, g) for i, g in enumerate(todo)), key=lambda t: t[:2])
        self.stats["groups"] = len(bounds)
        if self.on_progress:
            self.on_progress(0, len(bounds), math.inf)
        ranked = self._visit(bounds, start)
        idle = sorted({k[1] for k in self._noted if k[0] == "idle"})
        if not ranked and idle:
            # every mesh of the cluster whose dp divides the batch needs tp > 1 (or a pipeline deeper than the
            # layers), and at those tp the ILP shards nothing: solve them as a forced tp, once
            self._shard_idle = True
            self.stats["groups_evaluated"] = 0
            if hint := self._batch_hint():
                self.notes.append(hint)
            gone = {t for t in self._skipped if "no weight worth sharding" in t}
            self._skipped = [t for t in self._skipped if t not in gone]
            self.notes = [n for n in self.notes if n not in gone]
            for cache in (self._placed, self._tight):
                for key in [k for k, v in cache.items() if v is None and k[0] in idle]:
                    del cache[key]
            ranked = self._visit(bounds, start)
        self.stats["ilp_solves"] = self.placer.solves
        self.stats["seconds"] = time.monotonic() - start
        if not ranked:
            raise PlanError(self.infeasible_message())
        ranked.sort(key=_rank_key)
        return OuterResult(ranked=ranked, notes=self.notes, stats=self.stats, evaluated=self.evaluated)

    def _visit(self, bounds: list[tuple[float, int, Group]], start: float) -> list[Scored]:
        """Evaluate the groups best bound first until the bound passes the best step found or the budget ends;
        the fitting candidates."""
        ranked: list[Scored] = []
        best = math.inf
        for k, (lb, _, g) in enumerate(bounds):
            if lb > best * (1 + 1e-6):  # equal bounds are still visited: a tie may be a simpler plan
                self.notes.append(f"{len(bounds) - k} of {len(bounds)} candidate groups skipped: their compute "
                                  f"lower bound is already slower than the best plan ({best:.4g} s)")
                break
            if time.monotonic() - start > self.budget_s and ranked:
                self.notes.append(f"time budget {self.budget_s:g} s reached after {k} of {len(bounds)} candidate "
                                  "groups; returning the best plan found so far")
                break
            for s in self.evaluate(g, lb):
                ranked.append(s)
                best = min(best, s.prediction.step_time_s)
                bisect.insort(self._top, s.prediction.step_time_s)
                del self._top[self.top_k:]
            if self.on_progress:
                self.on_progress(k + 1, len(bounds), best)
        if self.on_progress:
            self.on_progress(len(bounds), len(bounds), best)
        return ranked

    # ---- bounds ---------------------------------------------------------------------------------------------------
    def lower_bound(self, g: Group) -> float:
        """A step time no plan of the group can beat (see the module docstring)."""
        t = self.layer_costs.op_min_times(g.tp, g.mbs)
        if g.pp == 1:
            return float(t.sum()) * g.num_microbatches
        if g.schedule == "interleaved":
            return float(t.sum()) * g.num_microbatches / g.pp
        key = (g.tp, g.mbs, g.pp, g.num_microbatches)
        if key not in self._bottleneck:
            self._bottleneck[key] = min_pipeline_bound(t, g.pp, g.num_microbatches)
        return self._bottleneck[key]

    # ---- one group ------------------------------------------------------------------------------------------------
    def evaluate(self, g: Group, lb: float) -> list[Scored]:
        """Predict the group's ZeRO x recompute candidates (with the pruning rules above); the fitting ones."""
        self.stats["groups_evaluated"] += 1
        placed = self.placed(g.tp, g.mbs, g.sp)
        if placed is None:
            return []
        placement, arrays = placed
        stages = self.stages(g, arrays, math.inf)
        if stages is None:
            return []
        found, leanest = self._sweep(g, lb, placement, arrays, stages)
        if found or leanest is None:
            return found
        return self._retry_leaner(g, lb, placement, arrays, leanest)

    def placed_bound(self, g: Group, arrays: LayerArrays, stages: tuple[StageSpec, ...], recompute: str = "none"
                     ) -> float:
        """A step time no candidate with these placements (per-layer `arrays`), stage cuts and recompute level can
        beat (step 5 of the module docstring)."""
        per_layer = arrays.bound + arrays.refwd if recompute == "full" else arrays.bound
        times = [float(per_layer[s.start_layer:s.end_layer].sum()) for s in stages]
        return pipeline_bound(times, g.pp, g.num_microbatches)

    def _sweep(self, g: Group, lb: float, placement: PlacementResult, arrays: LayerArrays,
               stages: tuple[StageSpec, ...]) -> tuple[list[Scored], Any]:
        """Predict ZeRO x recompute leanest first (module docstring, step 4). A recompute level whose
        `placed_bound` shows that none of its candidates can enter the top `top_k` (step 5) is swept only up to
        its first fitting candidate, and not at all once another level has fitted. The fitting ones and the
        leanest."""
        found: list[Scored] = []
        leanest = None
        preds: dict[tuple[int, str], Any] = {}  # (ZeRO stage, recompute) -> prediction, for `_partial`
        kth = self._top[-1] * (1 + 1e-6) if len(self._top) >= self.top_k else math.inf
        self.stats["groups_bounded"] += max(lb, self.placed_bound(g, arrays, stages)) > kth
        todo = zero_stages(g.dp, self.forced)  # leanest first
        for recompute in recomputes(self.forced):
            if recompute == "attention" and (self._attention_problem or not (self._try_attention
                                                                             or "recompute" in self.forced)):
                continue
            level_lb = max(lb, self.placed_bound(g, arrays, stages, recompute))
            out_of_top = level_lb > kth
            if out_of_top and found:
                continue  # nothing here can enter the top k, and something fitted already: no retry depends on it
            # a ZeRO stage that fitted with less recompute is at least as fast there: only retry the others
            failed = []
            for k, zero in enumerate(todo):
                plan = self.build(g, placement, stages, zero, recompute)
                pred = self.predict(plan, level_lb)
                preds[(zero, recompute)] = pred
                if leanest is None or pred.peak_memory_bytes < leanest[0].peak_memory_bytes:
                    leanest = (pred, plan)
                if not self.fits(pred):
                    failed = todo[k:]  # less sharding needs more memory: these cannot fit either
                    break
                found.append(Scored(plan, pred, level_lb))
                if out_of_top:
                    return found, leanest
            if not failed:
                break
            todo = failed
        found += self._partial(g, lb, placement, arrays, stages, preds, kth)
        return found, leanest

    def _partial(self, g: Group, lb: float, placement: PlacementResult, arrays: LayerArrays,
                 stages: tuple[StageSpec, ...], preds: dict[tuple[int, str], Any], kth: float) -> list[Scored]:
        """Partial full recomputation (`Plan.recompute_blocks`) for the ZeRO stages that fit with full recomputation
        but not without: each pipeline rank re-runs the share of its stages' blocks its memory needs,
        (peak without - usable) / (peak without - peak with full recomputation), rounded up; a rank still over
        re-estimates its share from where it stands (at least one more block a stage) until the plan fits. Early
        1F1B ranks hold more micro-batches, so they recompute more than late ones. The other blocks keep their
        activations (`recompute=full` with counts) or, where selective recomputation was predicted and did not fit
        either, run selective (`recompute=selective` with counts), which needs fewer blocks under full.

        A rank's peak without recomputation, where the sweep did not predict it, is its peak with full recomputation
        plus what recomputation saved it at the leanest ZeRO stage that did not fit (the activations, which ZeRO
        does not shard). Skipped when the recompute level is forced, and for a ZeRO stage that cannot enter the top
        `top_k`: its step is at least the bound without recomputation and at least its full-recompute step less the
        recompute seconds (with a pipeline's fill and drain), or its step under selective recomputation."""
        if "recompute" in self.forced:
            return []
        nblocks = [sum(1 for l in self.layers[s.start_layer:s.end_layer] if l.block_type) for s in stages]
        bound = max(lb, self.placed_bound(g, arrays, stages, "none"))
        if max(nblocks) < 2 or bound > kth:
            return []
        return (self._partial_over("none", g, bound, placement, stages, preds, kth, nblocks)
                + self._partial_over("selective", g, bound, placement, stages, preds, kth, nblocks))

    def _partial_over(self, rest: str, g: Group, bound: float, placement: PlacementResult,
                      stages: tuple[StageSpec, ...], preds: dict[tuple[int, str], Any], kth: float,
                      nblocks: list[int]) -> list[Scored]:
        """`_partial` with the blocks beyond the counts under `rest` (none or selective)."""
        usable = self.cluster.device.usable_memory_bytes
        out: list[Scored] = []
        saved = None  # per rank: peak under `rest` - peak with full, at the last ZeRO stage predicted so
        for zero in zero_stages(g.dp, self.forced):  # leanest first
            without = preds.get((zero, rest))
            if without is not None and self.fits(without):
                continue
            if without is None and (saved is None or rest != "none"):
                break  # nothing to estimate from (selective's saving depends on the model's ops, not only ZeRO)
            if (zero, "full") not in preds:
                preds[(zero, "full")] = self.predict(self.build(g, placement, stages, zero, "full"), bound)
            full = preds[(zero, "full")]
            if not self.fits(full):
                break  # less sharding needs more memory
            lo = full.memory_per_device_bytes
            if without is not None:
                saved = [hi - b for hi, b in zip(without.memory_per_device_bytes, lo)]
            hi = [b + d for b, d in zip(lo, saved)]  # each rank's peak under `rest`
            # recompute seconds are m passes of one rank's; a pipeline's fill and drain repeat them pp - 1 times
            dropped = full.breakdown.get("recompute_s", 0.0) * (g.num_microbatches + g.pp - 1) / g.num_microbatches
            floor = without.step_time_s if rest == "selective" else full.step_time_s - dropped
            if max(bound, floor) > kth:
                continue
            share = [min(1.0, max(0.0, (h - usable) / (h - b))) if h > b else 1.0 for h, b in zip(hi, lo)]
            held = [sum(n for s, n in zip(stages, nblocks) if s.rank == r) for r in range(g.pp)]
            need = [math.ceil(x * h - 1e-9) for x, h in zip(share, held)]
            base = self.build(g, placement, stages, zero, "full" if rest == "none" else rest)
            counts = spread_blocks(need, stages, nblocks)
            while counts != nblocks:
                plan = replace(base, recompute_blocks=tuple(counts))
                pred = self.predict(plan, bound)
                if self.fits(pred):
                    out.append(Scored(plan, pred, bound))
                    break
                # a rank still over: the same estimate from where it now stands, at least one more of its blocks
                now = pred.memory_per_device_bytes
                share = [x + (1 - x) * (b - usable) / (b - f) if b > usable and b > f else (1.0 if b > usable else x)
                         for x, b, f in zip(share, now, lo)]
                need = [min(h, max(k + (b > usable), math.ceil(x * h - 1e-9)))
                        for k, b, x, h in zip(need, now, share, held)]
                if (counts := spread_blocks(need, stages, nblocks)) == list(plan.recompute_blocks):
                    break  # no rank over that has a block left to re-run
        return out

    def _retry_leaner(self, g: Group, lb: float, placement: PlacementResult, arrays: LayerArrays,
                      leanest: tuple[Any, Plan]) -> list[Scored]:
        """Nothing fitted: cut stages and place ops under a memory limit scaled by usable / predicted peak."""
        pred, plan = leanest
        scale = self.cluster.device.usable_memory_bytes / max(1, pred.peak_memory_bytes)
        level = math.floor(scale * 8) / 8  # a few budget levels, so the ILP cache is reused
        if level <= 0 or level >= 1:
            return []
        key = (g.tp, g.mbs, g.sp, level)
        if key not in self._tight:
            tight = self.solve_placement(g.tp, g.mbs, g.sp, budget_scale=level) if g.tp > 1 else None
            self._tight[key] = None if tight is None else (tight, self.layer_costs.placed(g.tp, g.mbs, tight))
        if self._tight[key] is not None:
            placement, arrays = self._tight[key]
        infl = inflight_microbatches(g.schedule, g.pp, g.num_microbatches, g.vp)
        if g.pp > 1:
            current = self.stages(g, arrays, math.inf)
            mem = [arrays.param[s.start_layer:s.end_layer].sum() + infl[k] * arrays.act[s.start_layer:s.end_layer]
                   .sum() for k, s in enumerate(current)]
            stages = self.stages(g, arrays, max(mem) * level)
        else:
            stages = self.stages(g, arrays, math.inf)
        if stages is None:
            return []
        found, _ = self._sweep(g, lb, placement, arrays, stages)
        return found

    # ---- pieces ---------------------------------------------------------------------------------------------------
    def placed(self, tp: int, mbs: int, sp: bool) -> tuple[PlacementResult, LayerArrays] | None:
        """Placements (ILP) and the per-layer arrays they give, cached per (tp, mbs, sp); None: not a candidate."""
        key = (tp, mbs, sp)
        if key not in self._placed:
            placement = self.solve_placement(tp, mbs, sp)
            self._placed[key] = None if placement is None else (placement, self.layer_costs.placed(tp, mbs, placement))
        return self._placed[key]

    def solve_placement(self, tp: int, mbs: int, sp: bool, budget_scale: float | None = None
                        ) -> PlacementResult | None:
        """The placement ILP's answer for (tp, mbs, sp), which the plan carries as it is, or None when this tp is
        skipped here (one note per tp and reason says why, naming the first group it happened in):

        - the ILP fails, or its layout breaks a rule of `planner.strategies.plan_tp_problems`;
        - at tp > 1 it shards no weight (tp ranks would duplicate the linears' work, and the executor refuses a tp
          plan that places no parameter over tp): skipped unless the user forced tp (or sp=1, which needs tp > 1),
          in which case it is solved again with at least one Linear of every block sharded
          (`PlacementSolver.solve`'s `shard_a_linear`: the cheapest layout in which the tp ranks split some work;
          the ILP picks which Linears, how, and everything between)."""
        if tp <= 1:
            return self.placer.solve(tp, mbs, self.precision, sp, budget_scale=budget_scale)
        self._refused_note(tp)
        at = f"micro-batch size {mbs}{', sequence parallel' if sp else ''}"
        try:
            res = self.placer.solve(tp, mbs, self.precision, sp, budget_scale=budget_scale)
            if res is not None and _shards_nothing(res):
                reason = f"tp={tp} is forced" if "tp" in self.forced else "sp=1 is forced" if self.forced.get("sp") \
                    else "no plan without it was found" if self._shard_idle else ""
                if not reason:
                    self._note(("idle", tp), f"tp={tp}: the placement ILP found no weight worth sharding at tp={tp} on "
                                             f"this cluster (first seen at {at}); skipped")
                    return None
                self._note(("forced", tp), f"tp={tp}: the placement ILP found no weight worth sharding (first seen at "
                                           f"{at}), but {reason}: solved again with at least one Linear "
                                           "of every block sharded (the cheapest such layout: the ILP picks which "
                                           "Linears, colwise or rowwise, and the layout between)")
                res = self.placer.solve(tp, mbs, self.precision, sp, budget_scale=budget_scale, shard_a_linear=True)
                if res is not None and _shards_nothing(res):
                    linears = [op for op in self.graph.ops if op.kind == "linear"]
                    computed = [op for op in linears if not any(len(p.shape) == 2 for p in op.params)]
                    why = (f" (the weights of {len(computed)} of its {len(linears)} Linears are computed in forward, "
                           "as torch.nn.utils.parametrize and weight_norm do, and tp shards parameters only)"
                           if computed else "")
                    self._note(("none", tp), f"tp={tp}: no Linear of this model can be sharded over tp={tp}{why}; "
                                             "skipped")
                    return None
        except ILPError as e:
            self._note(("failed", tp), f"tp={tp}: the placement ILP failed ({e}; {at}); skipped")
            return None
        if res is None:
            return None
        problems = self.tp_problems(res.ops, tp)
        if problems:
            self._note(("problem", tp), f"tp={tp}: the placement ILP's layout cannot be a plan ({problems[0]}; "
                                        f"{at}); skipped")
            return None
        if sp and self.forced.get("sp") and not res.sequence_parallel:  # a forced key is never dropped
            lengths = sorted({op.output_meta[0].shape[1] for op in self.graph.ops if op.kind == "norm"
                              and op.output_meta and len(op.output_meta[0].shape) >= 3
                              and op.output_meta[0].shape[1] % tp})
            why = (f"; its norms' sequence length {', '.join(map(str, lengths))} is not a multiple of tp={tp}: pad "
                   f"the sequence to one" if lengths else "")
            self._note(("no-sequence", tp), f"tp={tp}: sp=1 is forced, but no op of this model can run on sequence "
                                            "shards (sequence parallelism splits the norms, dropouts and residual "
                                            "adds between tp regions on dim 1, the sequence of a (batch, sequence, "
                                            f"features) activation{why}; or drop sp=1; "
                                            f"{at}); skipped")
            return None
        return res

    def _note(self, key: tuple, text: str) -> None:
        """Add `text` to the notes unless a note with this key was added already (one note per tp and reason);
        notes saying a tp was skipped are also kept for `infeasible_message`."""
        if key in self._noted:
            return
        self._noted.add(key)
        self.notes.append(text)
        if text.endswith("skipped"):
            self._skipped.append(text)

    def _refused_note(self, tp: int) -> None:
        """Once per tp: the Linears kept off colwise because their own module would misread the shards (a
        `chunk` of a fused gate/up, a `split` of a fused qkv, a head view tp does not divide). The rowwise filter
        (`partial_refusals`: q/k/v projections feeding attention) is not noted: no layout wants those rowwise."""
        own = {m: problem for m, (problem, where) in self.placer.refused_colwise(tp).items()
               if where == m.rpartition(".")[0]}
        if own:
            first = next(iter(own))
            self._note(("refused", tp), f"tp={tp}: {len(own)} Linear(s) kept from column-parallel (colwise), e.g. "
                                        f"{first}: {own[first]}")

    def tp_problems(self, ops: Mapping[str, OpPlacement], tp: int) -> list[str]:
        """`planner.strategies.plan_tp_problems` with the graph's modules computed once per search and the answer
        cached per distinct placement (the same layout comes back for many micro-batch sizes)."""
        key = (frozenset(ops.items()), tp)
        if key not in self._problems:
            self._problems[key] = plan_tp_problems(self.graph, ops, tp, self.placer.tp_modules)
        return self._problems[key]

    def stages(self, g: Group, arrays: LayerArrays, mem_limit: float) -> tuple[StageSpec, ...] | None:
        """Stage specs from the DP cut of the placed layer times (one stage when pp = 1)."""
        n_stages = g.pp * g.vp
        if n_stages == 1:
            return (StageSpec(start_layer=0, end_layer=len(self.layers), modules=self._stage_modules(0, len(
                self.layers)), rank=0),)
        infl = inflight_microbatches(g.schedule, g.pp, g.num_microbatches, g.vp)
        # arrays live as long as the search (held in _placed / _tight), so their id is a stable key
        key = (id(arrays), n_stages, g.pp, tuple(infl) if mem_limit != math.inf else None, mem_limit)
        if key not in self._cuts:
            cut = cut_stages(arrays.time, arrays.param, arrays.act, n_stages, mem_limit, infl,
                             cuttable=self.graph.cut_points)
            self._cuts[key] = None if cut is None else tuple(
                StageSpec(start_layer=a, end_layer=b, modules=self._stage_modules(a, b), rank=k % g.pp)
                for k, (a, b) in enumerate(cut.bounds))
        return self._cuts[key]

    def _stage_modules(self, a: int, b: int) -> tuple[str, ...]:
        out: list[str] = []
        for mods in self._modules[a:b]:
            out += [m for m in mods if m not in out]
        return tuple(out)

    def build(self, g: Group, placement: PlacementResult, stages: tuple[StageSpec, ...], zero: int,
              recompute: str, batch: int | None = None) -> Plan:
        """The Plan for one candidate (`batch` overrides the global batch, for one-replica probes)."""
        c = self.cluster
        blocks = forced_recompute_blocks(self.forced, stage_block_counts(self.layers, stages)) \
            if recompute in ("full", "selective") else ()
        return Plan(mesh=Mesh(dp=g.dp, tp=g.tp, pp=g.pp), zero_stage=zero,
                    sequence_parallel=g.sp and placement.sequence_parallel, recompute=recompute,
                    recompute_blocks=blocks,
                    schedule=g.schedule, virtual_stages=g.vp, global_batch_size=batch or self.batch,
                    microbatch_size=g.mbs,
                    num_microbatches=g.num_microbatches, precision=self.precision,
                    max_grad_norm=self.max_grad_norm, stages=stages, ops=dict(placement.ops),
                    parameters=self._parameters(placement),
                    cluster=cluster_record(c),
                    model={"path": self.model_path, "parameters": self._num_params,
                           "fingerprint": self._fingerprint, "graph": self.graph.tracer})

    def _parameters(self, placement: PlacementResult) -> dict[str, str]:
        """`Plan.parameters` of a placement (`planner.layout`), computed once per placement result."""
        cache = self.__dict__.setdefault("_param_cache", {})
        key = id(placement.ops)
        if key not in cache:
            cache[key] = (placement.ops, parameter_placements(self.graph, placement.ops))
        return dict(cache[key][1])

    def fits(self, pred: Any) -> bool:
        """Whether the search may rank `pred`: it fits the device's usable memory, or memory is ignored."""
        return pred.fits or self.ignore_memory

    def predict(self, plan: Plan, lb: float) -> Any:
        """Score with the cost model; keep the leanest prediction for the infeasible message."""
        pred = self.cm.predict(self.graph, plan)
        self.stats["predictions"] += 1
        if pred.step_time_s < lb * (1 - 1e-9):
            self.stats["bound_violations"] += 1
        if self._leanest is None or pred.peak_memory_bytes < self._leanest[0]:
            self._leanest = (pred.peak_memory_bytes, plan)
        self.evaluated.append(Evaluated(pred.step_time_s, pred.peak_memory_bytes, pred.fits, candidate_label(plan)))
        return pred

    def _batch_hint(self) -> str:
        """What the batch rules out when no dp > 1 divides it (empty otherwise, or when dp is forced)."""
        world = self.cluster.world_size
        dps = divisors(world)[1:]
        if "dp" in self.forced or any(self.batch % d == 0 for d in dps):
            return ""
        return (f"--batch-size {self.batch} divides over no dp > 1 of the {world} devices, so only dp=1 meshes were "
                f"tried: a batch divisible by {' or '.join(map(str, dps[:3]))} allows data parallelism")

    def infeasible_message(self) -> str:
        """Why nothing fits: the leanest candidate's memory per device against the device, and what would help."""
        usable = self.cluster.device.usable_memory_bytes
        if self._leanest is None:
            why = self._skipped[0] if self._skipped else ""
            batch = self._batch_hint()
            forced = f" with the forced keys {', '.join(f'{k}={v}' for k, v in self.forced.items())}" \
                if self.forced else ""
            fixes = "; ".join(filter(None, [batch, "relax --force" if self.forced else ""]))
            return f"no candidate plan could be built for this model and cluster{forced}" \
                   f"{' (' + why + ')' if why else ''}{'; ' + fixes if fixes else ''}"
        need, plan = self._leanest
        what = (f"dp={plan.mesh.dp} tp={plan.mesh.tp} pp={plan.mesh.pp} ZeRO-{plan.zero_stage} "
                f"recompute={plan.recompute} mbs={plan.microbatch_size}")
        return (f"the model fits nowhere: the leanest plan found ({what}) needs {format_bytes(need)} per device, "
                f"one {self.cluster.device.name} has {format_bytes(usable)} usable; "
                f"try {', '.join(self._memory_levers(plan, need / usable))}; or predict it anyway with "
                "--ignore-memory (no plan is written)")

    def _memory_levers(self, plan: Plan, over: float) -> list[str]:
        """What could make the leanest plan fit: the forced keys that hold memory up (by name, with the value
        forced), the levers the search did not pull, and more nodes where the forced mesh leaves room for them."""
        f, out = self.forced, []
        if plan.zero_stage < 3 and plan.mesh.dp > 1:
            out.append(f"zero=3 instead of the forced zero={f['zero']}" if "zero" in f else "ZeRO-3")
        if plan.recompute != "full":
            out.append(f"recompute=full instead of the forced recompute={f['recompute']}"
                       if "recompute" in f else "full recompute")
        elif "recompute_blocks" in f:
            out.append(f"more blocks than the forced recompute_blocks={f['recompute_blocks']}")
        if f.get("mbs", 1) > 1:
            out.append(f"mbs=1 instead of the forced mbs={f['mbs']}")
        if f.get("sp") == 0 and plan.mesh.tp > 1:
            out.append("sp=1 instead of the forced sp=0")
        axes = [k for k in ("dp", "tp", "pp") if k in f]
        if len(axes) == 3:  # the mesh is the device count: more nodes cannot be given to it
            out.append(f"a larger tp or pp than the forced tp={f['tp']}, pp={f['pp']}")
            return out
        step = math.prod(f[k] for k in axes)  # the forced axes' product must keep dividing the device count
        nodes = max(self.cluster.nodes + 1, math.ceil(self.cluster.nodes * over))
        while nodes * self.cluster.devices_per_node % step:
            nodes += 1
        out.append(f"more nodes (try --nodes {nodes})")
        return out


def spread_blocks(need: Sequence[int], stages: Sequence[StageSpec], nblocks: Sequence[int]) -> list[int]:
    """Per stage, how many of its first blocks run full recomputation so that pipeline rank r recomputes `need[r]`
    of its blocks: one more block a stage in turn over the rank's stages (in model order), each up to its own
    count, so an interleaved rank's chunks share the re-run evenly rather than each rounding up on its own."""
    counts = [0] * len(stages)
    for r, want in enumerate(need):
        mine = [k for k, s in enumerate(stages) if s.rank == r]
        while want > 0 and any(counts[k] < nblocks[k] for k in mine):
            for k in mine:
                if want > 0 and counts[k] < nblocks[k]:
                    counts[k] += 1
                    want -= 1
    return counts


def _rank_key(s: Scored) -> tuple:
    """Fastest first; predictions equal to 6 significant digits go to the simpler plan (less ZeRO, less
    recompute, fewer pipeline and tensor splits), which is what a user would pick by hand."""
    p = s.plan
    return (float(f"{s.prediction.step_time_s:.6g}"), p.zero_stage, RECOMPUTE.index(p.recompute), p.mesh.pp,
            p.mesh.tp, p.virtual_stages, p.sequence_parallel, s.prediction.peak_memory_bytes)


def candidate_label(plan: Plan) -> str:
    """A candidate in a few characters: dp x tp x pp, ZeRO stage, micro-batch size x count, recompute (when on),
    pipeline schedule (when pp > 1) and sequence parallelism (when on), e.g. `64x4x4 Z1 1x24 int4 sp`."""
    m = plan.mesh
    parts = [f"{m.dp}x{m.tp}x{m.pp}", f"Z{plan.zero_stage}", f"{plan.microbatch_size}x{plan.num_microbatches}"]
    if plan.recompute != "none":
        short = {"attention": "attn", "selective": f"sel{recompute_counts(plan)}"}
        parts.append(short.get(plan.recompute, f"full{recompute_counts(plan)}"))
    if m.pp > 1:
        parts.append(f"int{plan.virtual_stages}" if plan.schedule == "interleaved" else plan.schedule)
    if plan.sequence_parallel:
        parts.append("sp")
    return " ".join(parts)


def format_bytes(n: float) -> str:
    """Bytes in GiB, MiB or KiB, e.g. `79.3 GiB`."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def user_checkpoint_note(calls: int) -> str:
    """What a plan of a model that calls torch.utils.checkpoint itself means for its memory."""
    return (f"the model calls torch.utils.checkpoint itself ({calls} call(s) per forward): predictions keep those "
            "activations (the checkpointed blocks' memory is over-predicted), and under tp or pp the executor runs "
            "the model's torch.export graph, without the recomputation; take the calls out and let the plan "
            "recompute (the search tries it; --force recompute=full)")


def with_prediction(plan: Plan, prediction: Any) -> Plan:
    """The plan with its prediction recorded (plan.json's `predicted`)."""
    return replace(plan, predicted=prediction.to_dict())


def _shards_nothing(placement: PlacementResult) -> bool:
    """Whether the placements shard no parameter: every Linear replicated, so tp ranks would duplicate its work,
    whatever activations (sequence-parallel norms, a root-level elementwise op) they split; executor.runner refuses
    such a plan ("places no parameter over it")."""
    return not any(s.startswith("S") for p in placement.ops.values() for s in p.params)
