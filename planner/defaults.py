"""Default plans: Megatron-LM's tensor-parallel layout, FLOP-balanced pipeline stages, and the simplest sensible
configuration for the `--force` keys the user left open.

The Megatron layout (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism) is derived from the
graph's structure (`cost_model.ops.roles`), never from module names: in each block the linears reading a norm's
output are column-parallel, the linear closing the region after attention / the activation is row-parallel, the
ops in between work on head / feature shards; the largest embedding is vocabulary-parallel and the LM head is
column-parallel over the vocabulary with a vocabulary-parallel loss. With sequence parallelism the remaining
[batch, seq, hidden] ops (norms, residual adds, dropout) are sharded on the sequence dim.
"""
from __future__ import annotations

from typing import Any, Mapping

from cost_model.ops import roles
from hardware_profiles.schema import Cluster
from planner.errors import PlanError
from planner.graph import OpGraph
from planner.plan import Mesh, OpPlacement, Plan, StageSpec, model_fingerprint
from planner.strategies import strategies_for


def _pick(op, tp: int, strategy: str | None, first_input: str | None = None) -> OpPlacement | None:
    """The candidate placement of `op` with this strategy name (any non-replicate one when None) whose first
    input placement is `first_input` when given."""
    cands = [p for p in strategies_for(op, tp) if p.strategy != "replicate"]
    if strategy is not None:
        cands = [p for p in cands if p.strategy == strategy]
    if first_input is not None:
        matching = [p for p in cands if p.inputs and p.inputs[0] == first_input]
        cands = matching or cands
    return cands[0] if cands else None


def megatron_placements(graph: OpGraph, tp: int, sequence_parallel: bool) -> dict[str, OpPlacement]:
    """Megatron-LM placements of every op over a tp axis of size `tp` (ops left out are replicated).

    Raises PlanError when tp does not divide a size the layout shards (features, heads, vocabulary)."""
    if tp <= 1:
        return {}
    r = roles(graph)
    out: dict[str, OpPlacement] = {}
    for op in graph.ops:
        name = op.name
        src = None
        if op.inputs and op.inputs[0] in out:
            src = out[op.inputs[0]].output
        if name in r.colwise or name == r.lm_head:
            p = _pick(op, tp, "colwise")
            what = "output features"
        elif name in r.rowwise:
            p = _pick(op, tp, "rowwise")
            what = "input features"
        elif name == r.vocab:
            p = _pick(op, tp, "vocab")
            what = "vocabulary"
        elif name in r.between:
            if op.kind in ("attention", "matmul", "softmax"):
                p = _pick(op, tp, "heads")
            else:
                p = _pick(op, tp, None, first_input=src or "R")
                if p is not None and p.strategy == "sequence":
                    p = OpPlacement(strategy="shard", module=p.module, inputs=p.inputs, output=p.output,
                                    params=p.params)
            what = "heads / features"
        elif name in r.after_head:
            # vocabulary-parallel loss: each rank works on its vocabulary shard of the logits
            n = max(1, len(op.inputs))
            p = OpPlacement(strategy="shard", module=op.module_path,
                            inputs=((src or "R"),) + ("R",) * (n - 1), output="R")
            what = ""
        else:
            if sequence_parallel:
                p = _pick(op, tp, "sequence")
                if p is not None:
                    out[name] = p
            continue
        if p is None:
            raise PlanError(f"tp={tp} does not divide the {what} of {name} ({op.module_path}); choose a tp that "
                            "divides the model's hidden size, heads and vocabulary")
        out[name] = p
    return out


def _layer_modules(graph: OpGraph, layer) -> list[str]:
    if layer.block_type is not None:
        return [layer.name]
    mods = []
    for op in graph.layer_ops(layer):
        if op.module_path and op.module_path not in mods:
            mods.append(op.module_path)
    return mods


def even_stages(graph: OpGraph, pp: int, virtual_stages: int = 1) -> tuple[StageSpec, ...]:
    """pp * virtual_stages contiguous stages of `graph.layers()` balanced by layer FLOPs (minimising the largest
    stage); stage i runs on pipeline rank i % pp."""
    layers = graph.layers()
    n = pp * virtual_stages
    if n > len(layers):
        raise PlanError(f"pp x vp = {n} stages but the model has only {len(layers)} layers to split; use a smaller "
                        "pp or vp")
    w = [float(sum(op.flops for op in graph.layer_ops(l))) or 1.0 for l in layers]
    lo, hi = max(w), sum(w)
    for _ in range(60):
        mid = (lo + hi) / 2
        if _cut(w, n, mid) is None:
            lo = mid
        else:
            hi = mid
    bounds = _cut(w, n, hi)
    assert bounds is not None
    stages = []
    for i, (a, b) in enumerate(bounds):
        mods = tuple(m for l in layers[a:b] for m in _layer_modules(graph, l))
        stages.append(StageSpec(start_layer=a, end_layer=b, modules=mods, rank=i % pp))
    return tuple(stages)


def _cut(w: list[float], n: int, cap: float) -> list[tuple[int, int]] | None:
    """Greedy split of w into exactly n non-empty contiguous groups of sum <= cap, or None."""
    out, start, acc = [], 0, 0.0
    for i, x in enumerate(w):
        left_layers, left_groups = len(w) - i, n - len(out)
        if i > start and (acc + x > cap or left_layers < left_groups):
            out.append((start, i))
            start, acc = i, 0.0
        if x > cap:
            return None
        acc += x
    out.append((start, len(w)))
    return out if len(out) == n else None


def _mesh(cluster: Cluster, forced: Mapping[str, Any]) -> Mesh:
    n = cluster.world_size
    given = {k: int(forced[k]) for k in ("dp", "tp", "pp") if k in forced}
    prod = 1
    for v in given.values():
        prod *= v
    if n % prod:
        raise PlanError(f"--force {','.join(f'{k}={v}' for k, v in given.items())} needs a multiple of {prod} "
                        f"devices but cluster {cluster.name} has {n} ({cluster.nodes} node(s) x "
                        f"{cluster.devices_per_node}); change the degrees or --nodes")
    rest = n // prod
    for axis in ("dp", "tp", "pp"):  # the simplest sensible default: the rest goes to data parallelism
        if axis not in given:
            given[axis] = rest
            rest = 1
    mesh = Mesh(dp=given["dp"], tp=given["tp"], pp=given["pp"])
    if mesh.world_size != n:
        raise PlanError(f"dp x tp x pp = {mesh.dp} x {mesh.tp} x {mesh.pp} = {mesh.world_size} but cluster "
                        f"{cluster.name} has {n} devices; make the product equal {n}")
    return mesh


def default_plan(graph: OpGraph, cluster: Cluster, batch_size: int, precision: str, forced: Mapping[str, Any],
                 model_path: str, notes: list[str] | None = None) -> Plan:
    """The plan `--force` pins, with simple defaults for the rest (all devices to dp, ZeRO-0, mbs 1, no
    recompute, 1F1B, no sequence parallelism). Bad combinations raise PlanError naming the fix; warnings go to
    `notes`."""
    notes = notes if notes is not None else []
    mesh = _mesh(cluster, forced)
    if mesh.tp > cluster.devices_per_node:
        notes.append(f"tp={mesh.tp} spans {-(-mesh.tp // cluster.devices_per_node)} nodes: its collectives run over "
                     "the inter-node network, which is usually much slower")
    mbs = int(forced.get("mbs", 1))
    if batch_size % (mesh.dp * mbs):
        raise PlanError(f"--batch-size {batch_size} is not divisible by dp x mbs = {mesh.dp} x {mbs}; use a batch "
                        f"size that is a multiple of {mesh.dp * mbs} or change dp/mbs")
    m = batch_size // (mesh.dp * mbs)
    vp = int(forced.get("vp", 1))
    schedule = forced.get("schedule", "interleaved" if vp > 1 else "1f1b")
    if vp > 1 and schedule != "interleaved":
        raise PlanError(f"vp={vp} needs schedule=interleaved (or use vp=1)")
    if schedule == "interleaved":
        if mesh.pp == 1:
            raise PlanError("schedule=interleaved needs pp > 1")
        if "vp" not in forced:
            vp = 2
        if m % mesh.pp:
            raise PlanError(f"schedule=interleaved needs the micro-batch count ({m} = batch {batch_size} / "
                            f"(dp {mesh.dp} x mbs {mbs})) to be a multiple of pp={mesh.pp}; change the batch size "
                            "or mbs, or use schedule=1f1b")
    sp = bool(forced.get("sp", 0))
    if sp and mesh.tp == 1:
        raise PlanError("sp=1 (sequence parallelism) needs tp > 1")
    zero = int(forced.get("zero", 0))
    if zero and mesh.dp == 1:
        notes.append(f"zero={zero} with dp=1 shards nothing")
    return Plan(
        mesh=mesh, zero_stage=zero, sequence_parallel=sp, recompute=forced.get("recompute", "none"),
        schedule=schedule, virtual_stages=vp, global_batch_size=batch_size, microbatch_size=mbs,
        num_microbatches=m, precision=precision, stages=even_stages(graph, mesh.pp, vp),
        ops=megatron_placements(graph, mesh.tp, sp),
        cluster={"name": cluster.name, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node},
        model={"path": model_path, "parameters": graph.num_parameters,
               "fingerprint": model_fingerprint((p.name, p.shape) for p in graph.parameters)})
