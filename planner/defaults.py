"""Default plans: Megatron-LM's tensor-parallel layout, FLOP-balanced pipeline stages, and the simplest sensible
configuration for the `--force` keys the user left open.

The Megatron layout (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism) is only the layout of a
hand-written plan that gives a mesh and no placements (`default_plan`); the search never substitutes it for the
placement ILP's answer. It is derived from the graph's module structure, never from module names: in each block the
nn.Linear children of one module form a column/row pair (`megatron_pairs`), the ops in between work on head /
feature shards; the vocabulary embedding (`cost_model.ops.vocab_embedding`) is vocabulary-parallel and the LM head
(`cost_model.ops.lm_head`: the linear whose output the loss reads) is column-parallel over the vocabulary (a
cross-entropy reads its logits vocabulary-parallel). With sequence parallelism the [batch, seq, hidden] ops from the
first block on (norms, residual adds, dropout) are sharded on the sequence dim. The result passes
`planner.strategies.plan_tp_problems`.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from cost_model.ops import downstream, lm_head, vocab_embedding
from hardware_profiles.schema import Cluster
from planner.errors import PlanError
from planner.graph import OpGraph
from planner.layout import parameter_placements
from planner.plan import (Mesh, OpPlacement, Plan, StageSpec, cluster_record, model_fingerprint,
                          schedule_problem)
from planner.shard_flow import split_problems
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
    """Megatron-LM placements of every op over a tp axis of size `tp` (ops left out are replicated), the layout of a
    mesh-only plan (`default_plan`; it passes `planner.strategies.plan_tp_problems`):

    - in each module of a block whose nn.Linear children form a pair (`megatron_pairs`), the last is rowwise and
      the others colwise; the ops between them work on head / feature shards (`heads`, `shard`);
    - the vocabulary embedding is vocab-parallel and the LM head (the linear the loss reads) column-parallel over
      the vocabulary: a cross-entropy reads its sharded logits vocabulary-parallel (the executor's `loss_parallel`;
      the cost model prices that, cost_model.layers), other losses read them all-gathered;
    - with sequence parallelism, the ops from the first block on that work on [batch, seq, ...] activations
      (norms, residual adds, dropout) are `sequence`; ops before the blocks stay replicated, as the executor
      shards the stream on entering the first block.

    Raises PlanError when tp does not divide a size the layout shards (features, heads, vocabulary)."""
    if tp <= 1:
        return {}
    head, vocab = lm_head(graph), vocab_embedding(graph)
    after_head = downstream(graph, head) if head is not None else frozenset()
    pairs, between = megatron_pairs(graph, tp)
    first_block = next((i for i, op in enumerate(graph.ops) if op.block is not None), len(graph.ops))
    out: dict[str, OpPlacement] = {}
    for i, op in enumerate(graph.ops):
        name = op.name
        src = out[op.inputs[0]].output if op.inputs and op.inputs[0] in out else None
        if name in pairs or name == head:
            strategy = pairs.get(name, "colwise")
            p = _pick(op, tp, strategy)
            what = "output features" if strategy == "colwise" else "input features"
        elif name == vocab:
            p, what = _pick(op, tp, "vocab"), "vocabulary"
        elif name in between:
            if op.kind in ("attention", "matmul", "softmax"):
                p = _pick(op, tp, "heads")
            else:
                p = _pick(op, tp, None, first_input=src or "R")
                if p is not None and p.strategy == "sequence":
                    p = OpPlacement(strategy="shard", module=p.module, inputs=p.inputs, output=p.output,
                                    params=p.params)
                if p is None or (src and p.inputs[0] != src):
                    p = _follow_shard(op, src, out) or p
                if p is None:
                    continue  # no shard rule for this op (e.g. a multi-output chunk): priced replicated
            what = "heads / features"
        else:
            if sequence_parallel and i >= first_block and name not in after_head:
                p = _pick(op, tp, "sequence")
                if p is not None:
                    out[name] = p
            continue
        if p is None:
            raise PlanError(f"tp={tp} does not divide the {what} of {name} ({op.module_path}); choose a tp that "
                            "divides the model's hidden size, heads and vocabulary")
        out[name] = p
    return out


def _follow_shard(op, src: str | None, placed: Mapping[str, OpPlacement]) -> OpPlacement | None:
    """A `shard` placement keeping the input's shard S(d) for an op between a colwise and a rowwise linear that
    has no rule of its own (chunk, cat, getitem): valid when every output keeps dim d at the input's size."""
    if not src or not src.startswith("S(") or op.params or not op.output_meta or not op.input_meta:
        return None
    d = int(src[2:-1])
    size = op.input_meta[0].shape[d] if d < len(op.input_meta[0].shape) else None
    if size is None or any(d >= len(m.shape) or m.shape[d] != size for m in op.output_meta):
        return None
    inputs = tuple(placed[s].output if s in placed and placed[s].output == src else "R" for s in op.inputs)
    return OpPlacement(strategy="shard", module=op.module_path, inputs=inputs or (src,), output=src)


def megatron_pairs(graph: OpGraph, tp: int = 2) -> tuple[dict[str, str], set[str]]:
    """Megatron's column/row pairs read off the module structure (for `megatron_placements`), and the ops between
    them.

    In a block, the linear ops (one 2-D weight) whose modules share a parent module (q/k/v/out-projection of an
    attention module; up/gate/down of an MLP) form a pair when the last of them in execution order is reached from
    every other one through non-linear, non-norm ops of the block: it is rowwise, the others colwise. The ops on
    those paths are returned as `between` (they run on head / feature shards). A pair whose colwise outputs an op
    would misread on local shards (`planner.shard_flow`: a `chunk` of a fused gate/up, a `split` of a fused qkv)
    is left out: its Linears stay replicated (`refused_pairs` says why)."""
    pairs, between = _structural_pairs(graph)
    refused = refused_pairs(graph, tp, pairs)
    if refused:
        drop = {n for n in pairs if graph.op(n).module_path.rpartition(".")[0] in refused}
        pairs = {n: s for n, s in pairs.items() if n not in drop}
        between = {n for n in between if graph.op(n).module_path not in refused}
    return pairs, between


def refused_pairs(graph: OpGraph, tp: int, pairs: Mapping[str, str] | None = None) -> dict[str, str]:
    """Parent module of a Megatron pair -> why tp cannot shard it (`planner.shard_flow.split_problems`)."""
    pairs = _structural_pairs(graph)[0] if pairs is None else pairs
    colwise = {graph.op(n).module_path for n, s in pairs.items() if s == "colwise"}
    out: dict[str, str] = {}
    for module, problem in split_problems(graph, colwise, tp):
        out.setdefault(module.rpartition(".")[0], problem)
    return out


def refused_note(graph: OpGraph, tp: int) -> str | None:
    """One line for the report naming the modules tp leaves replicated and the first reason, or None."""
    if tp <= 1:
        return None
    refused = refused_pairs(graph, tp)
    if not refused:
        return None
    first = next(iter(refused))
    return (f"tp={tp}: {len(refused)} module(s) kept replicated, e.g. {first}: {refused[first]} "
            "(see README, Running a plan)")


def _structural_pairs(graph: OpGraph) -> tuple[dict[str, str], set[str]]:
    """`megatron_pairs` before the shard-flow check."""
    users: dict[str, list[str]] = {}
    for op in graph.ops:
        for s in op.inputs:
            users.setdefault(s, []).append(op.name)
    by_parent: dict[tuple[str, str], list] = {}
    for op in graph.ops:
        if op.block is not None and op.kind == "linear" and sum(len(p.shape) == 2 for p in op.params) == 1:
            by_parent.setdefault((op.block, op.module_path.rpartition(".")[0]), []).append(op)
    pairs: dict[str, str] = {}
    between: set[str] = set()
    for (block, _), lins in by_parent.items():
        if len(lins) < 2:
            continue
        last = lins[-1].name
        region: set[str] = set()
        reached_from_all = True
        for col in lins[:-1]:
            seen, stack, hit = set(), list(users.get(col.name, ())), False
            while stack:
                n = stack.pop()
                op = graph.op(n)
                hit |= n == last
                if n in seen or op.block != block or op.kind in ("linear", "norm"):
                    continue
                seen.add(n)
                stack.extend(users.get(n, ()))
            reached_from_all &= hit
            region |= seen
        if reached_from_all:
            pairs.update({op.name: "colwise" for op in lins[:-1]})
            pairs[last] = "rowwise"
            between |= region
    return pairs, between


def even_stages(graph: OpGraph, pp: int, virtual_stages: int = 1) -> tuple[StageSpec, ...]:
    """pp * virtual_stages contiguous stages of `graph.layers()` balanced by layer FLOPs (minimising the largest
    stage), cut only where `graph.cut_points` allows; stage i runs on pipeline rank i % pp."""
    layers = graph.layers()
    n = pp * virtual_stages
    starts = [j for j in range(1, len(layers)) if graph.cut_points[j]]
    if n > len(starts) + 1:
        why = "" if len(starts) + 1 == len(layers) else \
            f" (of its {len(layers)}, a module called in several places stays in one stage)"
        raise PlanError(f"pp x vp = {n} stages but the model has only {len(starts) + 1} layers to split{why}; use a "
                        "smaller pp or vp")
    w = [float(sum(op.flops for op in graph.layer_ops(l))) or 1.0 for l in layers]
    lo, hi = max(w), sum(w)
    for _ in range(60):
        mid = (lo + hi) / 2
        if _cut(w, n, mid, graph.cut_points) is None:
            lo = mid
        else:
            hi = mid
    bounds = _cut(w, n, hi, graph.cut_points)
    assert bounds is not None
    stages = []
    for i, (a, b) in enumerate(bounds):
        mods = tuple(dict.fromkeys(m for l in layers[a:b] for m in graph.layer_modules(l)))
        stages.append(StageSpec(start_layer=a, end_layer=b, modules=mods, rank=i % pp))
    return tuple(stages)


def _cut(w: list[float], n: int, cap: float, cuttable: tuple[bool, ...]) -> list[tuple[int, int]] | None:
    """Greedy split of w into exactly n non-empty contiguous groups of sum <= cap, each starting where `cuttable`
    allows, or None."""
    out, start, acc = [], 0, 0.0
    later = [0] * (len(w) + 1)  # later[i]: the cut positions after i
    for i in range(len(w) - 1, 0, -1):
        later[i - 1] = later[i] + cuttable[i]
    for i, x in enumerate(w):
        if i > start and cuttable[i] and (acc + x > cap or later[i] < n - len(out) - 1):
            out.append((start, i))
            start, acc = i, 0.0
        acc += x
        if acc > cap:
            return None
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


def stage_block_counts(layers: Sequence[Any], stages: Sequence[StageSpec]) -> list[int]:
    """How many blocks (of `graph.layers()`, those with a block type) each stage holds."""
    return [sum(1 for l in layers[s.start_layer:s.end_layer] if l.block_type) for s in stages]


def check_forced_recompute_blocks(forced: Mapping[str, Any], num_blocks: int) -> None:
    """PlanError (one line) for `--force recompute_blocks=N` above the model's block count: no stage can have
    that many, whatever the pipeline."""
    n = forced.get("recompute_blocks")
    if n is None or forced.get("recompute", "full") not in ("full", "selective") or n <= num_blocks:
        return
    if num_blocks == 0:
        raise PlanError(f"--force recompute_blocks={n}: the model has no repeated blocks to count; drop "
                        "recompute_blocks (recompute=full re-runs the whole model)")
    raise PlanError(f"--force recompute_blocks={n}: the model has {num_blocks} blocks in all, so no pipeline stage "
                    f"has more than {num_blocks}; use recompute_blocks={num_blocks} or fewer (or recompute=full alone "
                    "to re-run every block)")


def forced_recompute_blocks(forced: Mapping[str, Any], blocks: Sequence[int]) -> tuple[int, ...]:
    """`--force recompute_blocks=N`: N blocks of each of the plan's stages (Megatron-LM's `--recompute-method
    block --recompute-num-layers N`; with recompute=selective, the blocks of each stage that run full
    recomputation, the others selective), capped at each stage's block count (`blocks`) so the plan says what
    runs; () when not forced."""
    if "recompute_blocks" not in forced or forced.get("recompute", "full") not in ("full", "selective"):
        return ()
    n = int(forced["recompute_blocks"])
    return tuple(min(n, have) for have in blocks)


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
    problem = schedule_problem(schedule, mesh.pp, m)
    if problem:
        raise PlanError(f"{problem} (batch {batch_size} / (dp {mesh.dp} x mbs {mbs})); change the batch size or mbs, "
                        "or use schedule=gpipe")
    sp = bool(forced.get("sp", 0))
    if sp and mesh.tp == 1:
        raise PlanError("sp=1 (sequence parallelism) needs tp > 1")
    refused = refused_note(graph, mesh.tp)
    if refused:
        notes.append(refused)
    zero = int(forced.get("zero", 0))
    if zero and mesh.dp == 1:
        notes.append(f"zero={zero} with dp=1 shards nothing")
    ops = megatron_placements(graph, mesh.tp, sp)
    stages, layers = even_stages(graph, mesh.pp, vp), graph.layers()
    check_forced_recompute_blocks(forced, sum(1 for l in layers if l.block_type))
    return Plan(
        mesh=mesh, zero_stage=zero, sequence_parallel=sp, recompute=forced.get("recompute", "none"),
        recompute_blocks=forced_recompute_blocks(forced, stage_block_counts(layers, stages)),
        schedule=schedule, virtual_stages=vp, global_batch_size=batch_size, microbatch_size=mbs,
        num_microbatches=m, precision=precision, stages=stages,
        ops=ops, parameters=parameter_placements(graph, ops),
        cluster=cluster_record(cluster),
        model={"path": model_path, "parameters": graph.num_parameters,
               "fingerprint": model_fingerprint((p.name, p.shape) for p in graph.parameters), "graph": graph.tracer})
