"""Per-layer costs the outer loop works with (`planner.search.outer`): what each layer of `OpGraph.layers()` takes
for one micro-batch, from the cost model's per-op figures, before any plan is predicted whole.

- `op_min_times`: every op at its fastest strategy, a compute lower bound (the search's group bounds);
- `placed`: the ops as one placement puts them, with the re-sharding into each op, parameter and activation bytes,
  and what full recomputation adds (the stage cut's and `placed_bound`'s inputs, `LayerArrays`).

Repeated blocks are priced once per block type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.graph import OpGraph
from planner.plan import OpPlacement
from planner.search.placement import PlacementResult
from planner.strategies import strategies_for


@dataclass
class LayerArrays:
    """Per-layer arrays for one (tp, mbs, sp) placement (one micro-batch)."""

    time: np.ndarray
    """Compute (`op_time`, forward + backward) plus re-sharding into each op (`reshard_time`), seconds."""
    param: np.ndarray
    """Parameter bytes (`op_memory`)."""
    act: np.ndarray
    """Saved activation bytes (`op_memory`)."""
    refwd: np.ndarray
    """What full recomputation adds to a block layer's backward: its forward up to the cost model's
    `recompute_stop` (torch checkpoint's early stop) run again, kernels and host set against the backward's as
    `predict` does; 0 elsewhere."""
    bound: np.ndarray
    """What `placed_bound` sums: like `time`, but a block's re-sharding into its first op is the smaller of its
    first and second copy's (the first copy's inputs come from the ops before the blocks, the others' from the
    previous copy; `time` prices every copy like the first)."""


class LayerCosts:
    """Per-layer arrays of one graph under one cost model and precision (`op_min_times` cached by tp and
    micro-batch size; the search keeps what `placed` returns with its placement)."""

    def __init__(self, graph: OpGraph, cost_model: Any, precision: str):
        self.graph, self.cm, self.precision = graph, cost_model, precision
        self.layers = graph.layers()
        self._op_min: dict[tuple, np.ndarray] = {}

    def op_min_times(self, tp: int, mbs: int) -> np.ndarray:
        """Per layer: sum over its ops of the fastest strategy's forward + backward time (a compute lower bound)."""
        key = (tp, mbs)
        if key not in self._op_min:
            by_type: dict[str, float] = {}
            out = []
            for layer in self.layers:
                if layer.block_type is not None and layer.block_type in by_type:
                    out.append(by_type[layer.block_type])
                    continue
                # each of kernels and host dispatch at its fastest strategy, combined per layer as `predict`
                # does (max on GPUs): a sum of per-op maxima would exceed the layer's max of sums
                parts = np.zeros(4)
                for op in self.graph.layer_ops(layer):
                    parts += np.min([self.cm.op_parts(op, None if p.strategy == "replicate" else p, tp, mbs,
                                                      self.precision) for p in strategies_for(op, tp)], axis=0)
                t = self.cm.compute.combine(parts[0], parts[2]) + self.cm.compute.combine(parts[1], parts[3])
                if layer.block_type is not None:
                    by_type[layer.block_type] = t
                out.append(t)
            self._op_min[key] = np.array(out)
        return self._op_min[key]

    def placed(self, tp: int, mbs: int, placement: PlacementResult) -> LayerArrays:
        """Per layer: compute + re-sharding time, parameter bytes, activation bytes (one micro-batch)."""
        args = (tp, mbs, self.precision)
        first: dict[str, tuple[float, ...]] = {}  # block type -> its first copy's row (`_layer_row`)
        second: dict[str, float] = {}  # block type -> its second copy's re-sharding
        rows = []
        for layer in self.layers:
            bt = layer.block_type
            if bt is None or bt not in first or bt not in second:
                row = self._layer_row(layer, placement, args)
                if bt is not None and bt in first:
                    second[bt] = row[4]
                elif bt is not None:
                    first[bt] = row
            rows.append(first[bt] if bt is not None else row)
        out = []
        for layer, (t, p, a, c, r, f) in zip(self.layers, rows):
            r = min(r, second.get(layer.block_type, r)) if layer.block_type is not None else r
            out.append((t, p, a, f if layer.block_type is not None else 0.0, c + r))
        return LayerArrays(*(np.array(col) for col in zip(*out)))

    def _layer_row(self, layer, placement: PlacementResult, args: tuple) -> tuple[float, ...]:
        """One layer's (compute + re-sharding, parameter bytes, activation bytes, compute, re-sharding, forward
        compute)."""
        p = a = r = 0.0
        parts = np.zeros(4)  # kernels and host dispatch, forward and backward, combined per layer as `predict` does
        rerun = np.zeros(4)  # the same for the ops a full-recompute re-run executes (up to the early stop)
        stop_of = getattr(self.cm, "recompute_stop", None)
        stop = stop_of(self.graph, layer) if stop_of is not None else len(layer.ops) - 1
        for pos, op in enumerate(self.graph.layer_ops(layer)):
            pl = placement.ops.get(op.name)
            op_parts = np.asarray(self.cm.op_parts(op, pl, *args))
            parts += op_parts
            if pos <= stop:
                rerun += op_parts
            pb, ab = self.cm.op_memory(op, pl, *args)
            p, a = p + pb, a + ab
            r += self._reshard_in(op, pl, placement, args)
        combine = self.cm.compute.combine
        f = combine(parts[0], parts[2])
        c = f + combine(parts[1], parts[3])
        # predict sets the re-run against the backward (cost_model's `ComputeModel.added`, written here with the
        # `combine` this search is passed); bound + re-run is then combine(backward + re-run), which only grows with
        # each part: a sound bound
        return c + r, p, a, c, r, combine(parts[1] + rerun[0], parts[3] + rerun[2]) - combine(parts[1], parts[3])

    def _reshard_in(self, op, pl: OpPlacement | None, placement: PlacementResult, args: tuple) -> float:
        total = 0.0
        for k, src in enumerate(op.inputs):
            if src not in self.graph.index:
                continue
            producer = self.graph.op(src)
            have = placement.ops[src].output if src in placement.ops else "R"
            want = pl.inputs[k] if pl is not None and k < len(pl.inputs) else "R"
            if have != want and producer.output_meta:
                total += sum(self.cm.reshard_time(producer.output_meta[0], have, want, *args))
        return total
