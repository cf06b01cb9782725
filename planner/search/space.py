"""The outer search space: mesh shapes, ZeRO stages, micro-batch sizes, recompute, schedules, sequence parallelism.

Topology first (Megatron-LM's rule, Narayanan et al. 2021 sec. 3): tensor parallelism needs the fastest links, so
tp ranges over the powers of two that divide the devices of one node; a tp beyond a node is considered only when
`--force tp=...` asks for it (and is then warned about). Pipeline depth pp divides the devices left and is at most
the number of layers; dp is what remains and must divide the global batch.

`forced` pins any subset of the keys dp, tp, pp, zero, mbs, recompute, schedule, vp, sp; a forced combination the
cluster or the batch cannot satisfy raises a one-line PlanError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hardware_profiles.schema import Cluster
from planner.errors import PlanError
from planner.plan import RECOMPUTE, schedule_problem

MAX_MICROBATCHES = 8192
"""Micro-batches per step a candidate may have: the pipeline simulation and the dp timing are linear in them, so a
batch of 10^11 samples in micro-batches of 1 would take hours to predict. Real runs use far fewer (GPT-3 1T on
3072 GPUs, Narayanan et al. SC21 Table 1: 512 per pipeline)."""
INTERLEAVE_DEPTHS = (2, 4)
"""Virtual stages per pipeline rank tried for the interleaved schedule (Megatron-LM's experiments use 2-4 chunks
per rank; Narayanan et al. 2021, fig. 12); any other v can be forced with `--force vp=V`."""


@dataclass(frozen=True)
class Group:
    """Candidates sharing mesh, micro-batch size, sequence parallelism and schedule (they share placements and
    stage cuts; ZeRO stage and recompute vary inside a group)."""

    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline-parallel degree."""
    mbs: int
    """Micro-batch size."""
    num_microbatches: int
    """Micro-batches per step per replica."""
    sp: bool
    """Sequence parallelism on."""
    schedule: str
    """gpipe, 1f1b or interleaved."""
    vp: int
    """Virtual stages per pipeline rank."""

    def label(self) -> str:
        """Short form for notes and progress, e.g. `dp4 tp2 pp1 mbs2 sp`."""
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f"(v{self.vp})" if self.vp > 1 else "")
        return f"dp{self.dp} tp{self.tp} pp{self.pp} mbs{self.mbs}{' sp' if self.sp else ''}{sched}"


MAX_BATCH = 10 ** 12
"""Largest global batch (samples per step) the search takes: far above any training run, and small enough for its
divisor loops (the square root of 10^20 took minutes)."""


def check_batch_size(batch_size: int) -> None:
    """One-line PlanError for a global batch below 1 or above MAX_BATCH."""
    if batch_size < 1:
        raise PlanError(f"--batch-size must be >= 1, got {batch_size}")
    if batch_size > MAX_BATCH:
        raise PlanError(f"--batch-size {batch_size} is above {MAX_BATCH:,} samples per optimizer step, more than any "
                        "training run takes; give the global batch in samples (sequences)")


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_forced(forced: Mapping[str, Any], cluster: Cluster, batch_size: int) -> list[str]:
    """Reject forced choices that contradict the cluster or each other (one-line PlanError); return warnings."""
    world, dpn = cluster.world_size, cluster.devices_per_node
    notes = []
    axes = {k: forced[k] for k in ("dp", "tp", "pp") if k in forced}
    prod = 1
    for v in axes.values():
        prod *= v
    where = f"{world} devices ({cluster.nodes} node{'s' if cluster.nodes > 1 else ''} x {dpn})"
    if len(axes) == 3 and prod != world:
        raise PlanError(f"--force dp={axes['dp']},tp={axes['tp']},pp={axes['pp']}: dp x tp x pp = {prod} but the "
                        f"cluster has {where}; make the product {world} or change --nodes")
    if world % prod:
        shown = ",".join(f"{k}={v}" for k, v in axes.items())
        what = f"their product {prod} does not" if len(axes) > 1 else "it does not"
        raise PlanError(f"--force {shown}: {what} divide the cluster's {where}; pick a divisor of {world} or "
                        "change --nodes")
    if "tp" in forced and forced["tp"] > dpn:
        notes.append(f"tp={forced['tp']} spans nodes ({dpn} devices per node): its collectives cross the "
                     "inter-node link on every layer")
    if "dp" in forced and batch_size % forced["dp"]:
        raise PlanError(f"--force dp={forced['dp']} does not divide --batch-size {batch_size}")
    if forced.get("vp", 1) > 1 and forced.get("schedule", "interleaved") != "interleaved":
        raise PlanError(f"--force vp={forced['vp']} needs schedule=interleaved, not {forced['schedule']}")
    if forced.get("sp") and forced.get("tp") == 1:
        raise PlanError("--force sp=1 needs tp > 1 (sequence parallelism shards over the tensor-parallel axis)")
    if forced.get("pp") == 1 and (forced.get("vp", 1) > 1 or forced.get("schedule", "1f1b") != "1f1b"):
        given = ",".join(f"{k}={forced[k]}" for k in ("schedule", "vp") if k in forced)
        raise PlanError(f"--force {given} needs a pipeline, and pp=1 is forced too: drop {given} or force pp > 1")
    return notes


def meshes(cluster: Cluster, num_layers: int, batch_size: int, forced: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """(dp, tp, pp) shapes to search, topology-respecting, honouring forced axes."""
    world, dpn = cluster.world_size, cluster.devices_per_node
    if "tp" in forced:
        tps = [forced["tp"]]
    else:
        tps = [t for t in (2 ** k for k in range(0, 11)) if t <= dpn and dpn % t == 0 and world % t == 0]
        if forced.get("sp"):
            tps = [t for t in tps if t > 1]
    out = []
    for tp in tps:
        if world % tp:
            continue
        pps = [forced["pp"]] if "pp" in forced else [p for p in divisors(world // tp) if p <= num_layers
                                                         and (p > 1 or not _pipelined(forced))]
        for pp in pps:
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if ("dp" in forced and forced["dp"] != dp) or batch_size % dp:
                continue
            out.append((dp, tp, pp))
    if not out:
        pinned = ", ".join(f"{k}={forced[k]}" for k in ("dp", "tp", "pp") if k in forced) or "none"
        raise PlanError(f"no mesh dp x tp x pp = {world} with dp dividing --batch-size {batch_size} and pp <= "
                        f"{num_layers} layers (forced: {pinned}); change --batch-size, --nodes or --force")
    return out


def check_forced_stages(forced: Mapping[str, Any], num_layers: int, cuttable: Sequence[bool] | None = None,
                        split: Mapping[str, tuple[int, int]] | None = None) -> None:
    """A forced pp (times vp) needs at least one of the model's layers per (virtual) stage, and a stage may start
    only where `cuttable` (`OpGraph.cut_points`, positions 0..L) allows, `split` (`OpGraph.split_modules`) naming
    why: one-line PlanError."""
    pp, vp = forced.get("pp"), forced.get("vp", 1)
    starts = 1 + sum(1 for j in range(1, num_layers) if cuttable is None or cuttable[j])
    named = "; ".join(f"{m} is called in layers {a} and {b}" for m, (a, b) in list((split or {}).items())[:3])
    why = (f"the model has {num_layers} layers (the units a pipeline stage holds)" if starts == num_layers else
           f"of the model's {num_layers} layers (the units a pipeline stage holds) only {starts} can start a stage, "
           "since a module called in two places stays in one stage with every layer between" +
           (f" ({named})" if named else ""))
    fix = "" if starts == num_layers else " (or give each place a module of its own, two nn.Dropout, to cut there)"
    if pp is not None and pp > starts:
        raise PlanError(f"--force pp={pp}: {why}, so at most pp={starts}{fix}")
    if vp > 1 and (pp or 2) * vp > starts:
        stages = f"{pp * vp} virtual stages" if pp else f"pp >= 2, so at least {2 * vp} virtual stages"
        raise PlanError(f"--force {f'pp={pp},' if pp else ''}vp={vp} needs {stages}, but {why}; force pp x vp "
                        f"<= {starts}{fix}")


def _pipelined(forced: Mapping[str, Any]) -> bool:
    """Whether the forced keys ask for a pipeline (a schedule or virtual stages) without pinning pp."""
    return "schedule" in forced or forced.get("vp", 1) > 1


def groups(mesh: tuple[int, int, int], batch_size: int, num_layers: int, forced: Mapping[str, Any]) -> list[Group]:
    """Every (micro-batch size, sp, schedule, v) combination for one mesh."""
    dp, tp, pp = mesh
    per_replica = batch_size // dp
    mbss = [forced["mbs"]] if "mbs" in forced else divisors(per_replica)
    if "mbs" in forced and per_replica // forced["mbs"] > MAX_MICROBATCHES:
        raise PlanError(f"--force mbs={forced['mbs']} makes {per_replica // forced['mbs']} micro-batches per step, "
                        f"more than the {MAX_MICROBATCHES} a plan may have; raise mbs or lower --batch-size")
    mbss = [mbs for mbs in mbss if per_replica // mbs <= MAX_MICROBATCHES]
    sps = [bool(forced["sp"])] if "sp" in forced else ([False, True] if tp > 1 else [False])
    out = []
    for mbs in mbss:
        if per_replica % mbs:
            continue
        m = per_replica // mbs
        for sp in sps:
            if sp and tp == 1:
                continue
            for schedule, vp in _schedules(pp, m, num_layers, forced):
                out.append(Group(dp, tp, pp, mbs, m, sp, schedule, vp))
    return out


def _schedules(pp: int, m: int, num_layers: int, forced: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs to try at pp ranks and m micro-batches: those the executor runs
    (`schedule_problem`), and interleaved only at depths that leave each chunk a layer."""
    if pp == 1:
        return [("1f1b", 1)]
    names = [forced["schedule"]] if "schedule" in forced else (
        ["interleaved"] if forced.get("vp", 1) > 1 else ["gpipe", "1f1b", "interleaved"])
    out = []
    for name in names:
        if schedule_problem(name, pp, m):
            continue
        if name != "interleaved":
            out.append((name, 1))
            continue
        vps = [forced["vp"]] if "vp" in forced else list(INTERLEAVE_DEPTHS)
        out += [("interleaved", v) for v in vps if v > 1 and pp * v <= num_layers]
    return out


def forced_schedule_problem(mesh_list: list[tuple[int, ...]], batch_size: int,
                            forced: Mapping[str, Any]) -> str | None:
    """Why a forced schedule and micro-batch size run on none of the meshes (`schedule_problem` for the first, with
    the micro-batch count spelled out), or None: the reason `groups` found nothing to try."""
    if "schedule" not in forced or "mbs" not in forced:
        return None
    for dp, _, pp in mesh_list:
        if batch_size % (dp * forced["mbs"]):
            continue  # this mesh is out for the micro-batch size, not the schedule
        m = batch_size // (dp * forced["mbs"])
        problem = schedule_problem(forced["schedule"], pp, m)
        if problem:
            return (f"{problem} (--batch-size {batch_size} / (dp {dp} x mbs {forced['mbs']})); raise --batch-size, "
                    f"lower mbs or use schedule=gpipe")
    return None


def zero_stages(dp: int, forced: Mapping[str, Any]) -> list[int]:
    """ZeRO stages to try, leanest first (3, 2, 1, 0); with dp = 1 there is nothing to shard."""
    if "zero" in forced:
        return [forced["zero"]]
    return [0] if dp == 1 else [3, 2, 1, 0]


def recomputes(forced: Mapping[str, Any]) -> list[str]:
    """Recompute choices, cheapest first."""
    return [forced["recompute"]] if "recompute" in forced else list(RECOMPUTE)
