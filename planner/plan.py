"""The plan: how to parallelize one model on one cluster, as pure data that round-trips through JSON.

The same `Plan` comes from the search, from `--force`, or from a hand-written file, and the executor applies it
the same way whoever wrote it. Vocabulary (torchtitan's): an *axis* is a mesh axis (dp, tp, pp); a *dim* is a tensor
dimension. Per-op placements use DTensor's shorthand over the tp axis: `R` replicate, `S(d)` shard tensor dim d,
`P` partial sums awaiting a reduction. The dp axis always shards the batch (dim 0) of activations.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from hardware_profiles.files import atomic_output, unwritable_output
from planner.errors import PlanError

RECOMPUTE = ("none", "attention", "selective", "full")
"""Activation recomputation, least recomputed first (the search tries them in this order): keep everything;
re-run only the attention core (Megatron-LM's selective, Korthikanti et al.); torchtitan's op-level selective
policy; keep only each block's input."""
SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules."""
STRATEGIES = {
    "replicate": "weights and activations replicated over tp; every tp rank computes the whole op",
    "colwise": "Linear weight sharded on its output features (S(0)); input R, output S(-1) (Megatron column)",
    "rowwise": "Linear weight sharded on its input features (S(1)); input S(-1), output P -> all-reduce "
               "(or reduce-scatter to S(1) with sequence parallelism) (Megatron row)",
    "vocab": "Embedding weight sharded on the vocabulary (S(0)); input R, output P (vocab-parallel embedding)",
    "sequence": "norm/dropout/elementwise op on activations sharded on the sequence dim S(1) (sequence parallel)",
    "heads": "attention on q/k/v sharded on the head dim; no communication",
    "shard": "elementwise op applied to whatever shard its input has; no communication",
    "partial": "elementwise/view op linear in its partial-sum inputs (P + P, a view of P): output P; no "
               "communication, every tp rank computes the whole tensor",
}
"""Strategy names an `OpPlacement` may carry, and what each means; the executor maps module strategies
(colwise, rowwise, vocab, sequence) to DTensor parallel styles."""
PRECISIONS = ("bf16", "fp16", "fp32")
"""Training precisions: bf16/fp16 compute with fp32 master weights and Adam state, or plain fp32."""
PLACEMENT = {"$ref": "#/$defs/Placement"}
"""Schema of one placement string (R, P or S(dim)); `planner.plan_schema` defines it."""


def _meta(required: bool = False, **schema: Any) -> dict[str, Any]:
    """Field metadata for plan.json's JSON Schema (`planner.plan_schema`): whether a hand-written plan must give
    the key, and JSON Schema keywords that narrow the type its annotation gives (minimum, enum, items, ...)."""
    return {"required": required, "schema": schema}


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The device mesh: data-parallel x tensor-parallel x pipeline-parallel."""

    dp: int = field(default=1, metadata=_meta(True, minimum=1))
    """Data-parallel degree (replicas, or ZeRO shards)."""
    tp: int = field(default=1, metadata=_meta(True, minimum=1))
    """Tensor-parallel degree (within an op)."""
    pp: int = field(default=1, metadata=_meta(True, minimum=1))
    """Pipeline-parallel degree (physical stages)."""

    @property
    def world_size(self) -> int:
        """Devices the mesh spans."""
        return self.dp * self.tp * self.pp


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One pipeline (virtual) stage: a contiguous range of `OpGraph.layers()`."""

    start_layer: int = field(metadata=_meta(True, minimum=0))
    """First layer index (inclusive)."""
    end_layer: int = field(metadata=_meta(True, minimum=1))
    """Last layer index (exclusive)."""
    modules: tuple[str, ...] = ()
    """Top-level module paths the stage holds (e.g. `transformer.h.4`), for the executor's model split."""
    rank: int = field(default=0, metadata=_meta(minimum=0))
    """Pipeline rank that runs it: stage i runs on rank i % pp (a plan file may leave it out)."""


@dataclass(frozen=True, kw_only=True)
class OpPlacement:
    """How one op is split over the tp axis (FlexFlow's SOAP, in DTensor placements)."""

    strategy: str = field(metadata=_meta(True, enum=list(STRATEGIES)))
    """Readable strategy name: replicate, colwise, rowwise, vocab, sequence, ..."""
    module: str = ""
    """Module path the op belongs to (what the executor parallelizes)."""
    inputs: tuple[str, ...] = field(default=("R",), metadata=_meta(items=PLACEMENT))
    """Placement of each activation input."""
    output: str = field(default="R", metadata=_meta(**PLACEMENT))
    """Placement of the output."""
    params: tuple[str, ...] = field(default=(), metadata=_meta(items=PLACEMENT))
    """Placement of each parameter the op reads, in `OpNode.params` order."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete parallelization plan for one model on one cluster."""

    mesh: Mesh = field(metadata=_meta(True))
    """dp x tp x pp."""
    zero_stage: int = field(default=0, metadata=_meta(enum=[0, 1, 2, 3]))
    """0 = plain DP; 1 shards optimizer state; 2 also gradients; 3 also parameters (FSDP)."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence dim over the tp axis (Korthikanti et al.)."""
    recompute: str = field(default="none", metadata=_meta(enum=list(RECOMPUTE)))
    """Activation recomputation: none; attention (only the attention core, each SDPA call, re-runs in backward:
    Megatron-LM's `--recompute-granularity selective`); selective (torchtitan's op-level policy); or full (each
    block's forward re-runs)."""
    recompute_blocks: tuple[int, ...] = field(default=(), metadata=_meta(items={"type": "integer", "minimum": 0}))
    """How many blocks of each pipeline stage, its first ones, run full recomputation (one count per stage in model
    order; one count without pipelining). With recompute `full` the others keep their activations (Megatron-LM's
    `--recompute-method block --recompute-num-layers`, per stage; empty: every block); with `selective` the
    others run selective recomputation (empty: none runs full)."""
    schedule: str = field(default="1f1b", metadata=_meta(enum=list(SCHEDULES)))
    """Pipeline schedule: gpipe, 1f1b or interleaved."""
    virtual_stages: int = field(default=1, metadata=_meta(minimum=1))
    """Model chunks per pipeline rank (v); > 1 only with the interleaved schedule."""
    global_batch_size: int = field(default=1, metadata=_meta(True, minimum=1))
    """Samples per optimizer step, over all replicas."""
    microbatch_size: int = field(default=1, metadata=_meta(True, minimum=1))
    """Samples per micro-batch on one replica."""
    num_microbatches: int = field(default=1, metadata=_meta(True, minimum=1))
    """Micro-batches per step per replica: global_batch_size / (dp * microbatch_size)."""
    precision: str = field(default="bf16", metadata=_meta(enum=list(PRECISIONS)))
    """bf16, fp16 or fp32."""
    max_grad_norm: float = field(default=0.0, metadata=_meta(minimum=0))
    """Clip the gradients to this global norm before each optimizer step (torch.nn.utils.clip_grad_norm_ over the
    whole model; Megatron-LM's `--clip-grad`); 0: no clipping."""
    stages: tuple[StageSpec, ...] = ()
    """Pipeline stages, pp * virtual_stages of them, in model order."""
    ops: Mapping[str, OpPlacement] = field(default_factory=dict)
    """Op name to its placement over the tp axis; ops not listed are replicated."""
    parameters: Mapping[str, str] = field(default_factory=dict, metadata=_meta(additionalProperties=PLACEMENT))
    """Parameter name (the first name of a tied weight in `named_parameters()`) to its placement over the tp axis
    (`S(dim)`); parameters not listed are replicated. The executor distributes parameters exactly so."""
    cluster: Mapping[str, Any] = field(default_factory=dict, metadata=_meta(properties={
        "name": {"type": "string"}, "nodes": {"type": "integer", "minimum": 1},
        "devices_per_node": {"type": "integer", "minimum": 1}, "device": {"type": "string"},
        "link": {"type": "string"}}))
    """`name`, `nodes`, `devices_per_node` of the cluster the plan was made for, its `device` name and `link`, the
    kind of its links inside a node (`loopback` for CPU ranks; `cluster_record`). Plans written before the last
    two lack them."""
    model: Mapping[str, Any] = field(default_factory=dict, metadata=_meta(properties={
        "path": {"type": "string"}, "parameters": {"type": "integer", "minimum": 0},
        "fingerprint": {"type": "string"}, "graph": {"enum": ["export", "fx"]}}))
    """`path`, `parameters` (count) and `fingerprint` (`model_fingerprint`) of the model the plan was made for, and
    `graph`: which trace `ops` names, `export` (torch.export's aten training IR, the default) or `fx` (torch.fx,
    for a model export cannot trace). A plan without it names export's."""
    predicted: Mapping[str, Any] = field(default_factory=dict)
    """The cost model's prediction for this plan (step_time_s, breakdown, memory, ...), if any."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check internal consistency; raises PlanError naming the field and the fix."""
        m = self.mesh
        for axis in ("dp", "tp", "pp"):
            if getattr(m, axis) < 1:
                raise PlanError(f"plan: mesh.{axis} must be >= 1, got {getattr(m, axis)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"plan: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"plan: recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"plan: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"plan: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and self.schedule != "interleaved"):
            raise PlanError(f"plan: virtual_stages={self.virtual_stages} needs schedule 'interleaved' (or use 1)")
        if not (isinstance(self.max_grad_norm, (int, float)) and 0 <= self.max_grad_norm < float("inf")):
            raise PlanError(f"plan: max_grad_norm must be a finite number >= 0 (0: no clipping), got "
                            f"{self.max_grad_norm!r}")
        if self.microbatch_size < 1 or self.num_microbatches < 1:
            raise PlanError("plan: microbatch_size and num_microbatches must be >= 1")
        expected = m.dp * self.microbatch_size * self.num_microbatches
        if expected != self.global_batch_size:
            raise PlanError(
                f"plan: global_batch_size {self.global_batch_size} != dp {m.dp} x microbatch_size "
                f"{self.microbatch_size} x num_microbatches {self.num_microbatches} (= {expected})")
        if self.recompute_blocks:
            want = m.pp * self.virtual_stages
            if self.recompute not in ("full", "selective"):
                raise PlanError(f"plan: recompute_blocks needs recompute 'full' or 'selective', got "
                                f"{self.recompute!r} (or drop it)")
            if len(self.recompute_blocks) != want:
                raise PlanError(f"plan: recompute_blocks gives {len(self.recompute_blocks)} counts, one per pipeline "
                                f"stage needs {want}")
            if min(self.recompute_blocks) < 0:
                raise PlanError(f"plan: recompute_blocks must be >= 0, got {list(self.recompute_blocks)}")
        if self.stages and len(self.stages) != m.pp * self.virtual_stages:
            raise PlanError(f"plan: {len(self.stages)} stages given, mesh.pp x virtual_stages needs "
                            f"{m.pp * self.virtual_stages}")
        end = 0  # the stages cut the layers in order: each starts where the one before ends, from layer 0
        for i, st in enumerate(self.stages):
            if st.start_layer != end or st.end_layer <= st.start_layer:
                raise PlanError(f"plan: stages[{i}] covers layers [{st.start_layer}, {st.end_layer}), but the stages "
                                f"must cut the layers in order from 0 without gaps or overlaps (it should start at "
                                f"{end} and end after it); plan again or correct the stage")
            end = st.end_layer

    @property
    def world_size(self) -> int:
        """Devices the plan needs."""
        return self.mesh.world_size

    @property
    def fsdp_mixed_precision(self) -> bool:
        """Whether the executor computes with 16-bit copies of fp32 parameters through FSDP2's
        `MixedPrecisionPolicy(param_dtype=...)` (executor.parallel): `fully_shard` under ZeRO >= 1 with dp > 1,
        `replicate` with tp or pp (at dp = 1 over a one-rank mesh, where FSDP2 copies instead of communicating, as
        Megatron-LM keeps 16-bit weights beside fp32 main ones). False at fp32, for DDP (dp alone) and on one device,
        which train under autocast over fp32 parameters (an fp32 residual stream). The cost model and the executor
        both ask this."""
        m = self.mesh
        return fsdp_mixed_precision(self.precision, m.dp, m.tp, m.pp, self.zero_stage)

    def recomputed_blocks(self, stage_blocks: Sequence[Sequence[str]]) -> set[str]:
        """The blocks full recomputation re-runs, given each stage's blocks in model order (one list without
        pipelining): the first `recompute_blocks[k]` of stage k; without counts, all of them under `full` and none
        under `selective`. The cost model and the executor both ask this, so they recompute the same blocks."""
        if self.recompute != "full" and not self.recompute_blocks:  # counts go only with full or selective
            return set()
        counts = self.recompute_blocks or tuple(len(b) for b in stage_blocks)
        return {b for blocks, n in zip(stage_blocks, counts) for b in list(blocks)[:n]}

    def placement(self, op_name: str) -> OpPlacement | None:
        """The op's placement, or None when it is replicated over tp."""
        return self.ops.get(op_name)

    # ---- JSON -----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (the plan.json schema)."""
        d = asdict(self)
        d["stages"] = [asdict(s) for s in self.stages]
        d["ops"] = {k: asdict(v) for k, v in self.ops.items()}
        d["parameters"] = dict(self.parameters)
        d["cluster"] = dict(self.cluster)
        d["model"] = dict(self.model)
        d["predicted"] = _jsonable(self.predicted)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "plan") -> "Plan":
        """Build from plan.json's content. It is first validated against plan.json's JSON Schema
        (`planner.plan_schema`: unknown or missing keys, types, ranges, placement strings), then for consistency
        (`validate`, then `_check_file_plan`); either raises PlanError `where: field.path: problem` naming the first
        problem."""
        from planner.plan_schema import check_plan_dict
        if _too_deep(d, MAX_DEPTH):  # the schema validator and to_dict recurse
            raise PlanError(f"{where}: not a plan: nested too deeply (over {MAX_DEPTH} levels); pass the file "
                            "`plan ... -o` wrote")
        check_plan_dict(d, where)
        d = dict(d)
        try:
            mesh = Mesh(**{k: int(v) for k, v in d.pop("mesh").items()})
            stages = tuple(StageSpec(**{**s, "modules": tuple(s.get("modules", ())), "rank": i % mesh.pp,
                                        **{k: int(s[k]) for k in ("start_layer", "end_layer", "rank") if k in s}})
                           for i, s in enumerate(d.pop("stages", ())))  # a stage without a rank runs on i % pp
            ops = {name: OpPlacement(**{k: tuple(v) if isinstance(v, list) else v for k, v in o.items()})
                   for name, o in d.pop("ops", {}).items()}
            for k in ("zero_stage", "virtual_stages", "global_batch_size", "microbatch_size", "num_microbatches"):
                if k in d:
                    d[k] = int(d[k])  # the schema accepts 2.0 as an integer, as JSON Schema does
            if "max_grad_norm" in d:
                d["max_grad_norm"] = float(d["max_grad_norm"])
            if "recompute_blocks" in d:
                d["recompute_blocks"] = tuple(int(n) for n in d["recompute_blocks"])
            plan = cls(mesh=mesh, stages=stages, ops=ops, **d)
        except PlanError as e:  # validate()'s consistency checks, said of this file
            msg = str(e)
            raise PlanError(f"{where}: {msg[len('plan: '):] if msg.startswith('plan: ') else msg}") from None
        _check_file_plan(plan, where)
        return plan

    def to_json(self) -> str:
        """JSON text of `to_dict()`."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        """Parse plan.json text."""
        try:
            d = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise PlanError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}); regenerate it with `plan ... -o`")
        except RecursionError:
            raise PlanError(f"{where}: not a plan: nested too deeply (over {MAX_DEPTH} levels); pass the file "
                            "`plan ... -o` wrote") from None
        except _DuplicateKey as e:
            raise PlanError(f"{where}: key {json.dumps(e.key)} appears twice in one object (JSON readers keep the "
                            "last silently); keep one") from None
        except ValueError as e:  # a number of more digits than int() converts (4300)
            raise PlanError(f"{where}: not a plan: {str(e).split(';')[0]}; regenerate it with `plan ... -o`") \
                from None
        return cls.from_dict(d, where)

    def save(self, path: str | os.PathLike) -> None:
        """Write plan.json atomically (temp file + rename)."""
        write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read plan.json; a missing file or bad content raises PlanError."""
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM some editors write is no error
                text = f.read()
        except OSError as e:
            raise PlanError(f"{path}: cannot read plan ({e.strerror}); pass the file `plan ... -o` wrote")
        except UnicodeDecodeError as e:
            raise PlanError(f"{path}: not a UTF-8 text file (byte {e.object[e.start]:#04x} at offset {e.start}); "
                            "pass the plan.json `plan ... -o` wrote") from None
        return cls.from_json(text, where=str(path))


MAX_DEPTH = 32
"""Nesting a plan file may have (its own is 4 deep); deeper is not a plan, and would overflow the recursion."""
PREDICTED_NUMBERS = ("step_time_s", "peak_memory_bytes", "tflops_per_device", "mfu")
"""Keys of `Plan.predicted` that `plan measure` compares with what it measures (and the throughput `plan` reports
with them): finite and >= 0 when given."""
PREDICTED_TABLES = ("breakdown", "memory_breakdown")
"""Keys of `Plan.predicted` holding an object of numbers (step time and memory by part), which `plan measure`
compares after its run: each value a finite number."""


class _DuplicateKey(Exception):
    """A key given twice in one JSON object of a plan file."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object, or _DuplicateKey (json.loads keeps the last of two silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _too_deep(data: Any, limit: int) -> bool:
    """Whether lists/objects in `data` nest more than `limit` levels (iteratively: no recursion to overflow)."""
    todo = [(data, 0)]
    while todo:
        x, depth = todo.pop()
        if isinstance(x, (Mapping, list, tuple)):
            if depth >= limit:
                return True
            todo += [(v, depth + 1) for v in (x.values() if isinstance(x, Mapping) else x)]
    return False


def _bad_real(x: Any) -> bool:
    """Not a finite number (a bool, a string, NaN, Infinity)."""
    return isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)


def _bad_number(x: Any) -> bool:
    return _bad_real(x) or x < 0


def _check_file_plan(plan: Plan, where: str) -> None:
    """Checks of a plan read from a file, beyond `validate`: PlanError `where: field: problem; fix`. Not in
    `validate`, because plans built in code may leave out stages (the executor derives them) or the cluster."""
    from planner.plan_schema import _show
    m, n = plan.mesh, plan.mesh.pp * plan.virtual_stages
    if n > 1 and not plan.stages:
        raise PlanError(f"{where}: stages: pp={m.pp} x virtual_stages={plan.virtual_stages} needs {n} stages, the "
                        "plan has 0; list them (start_layer, end_layer, modules, rank) or re-plan with `plan ... -o`")
    listed = [k for k, s in enumerate(plan.stages) if s.modules]
    if listed and len(listed) < len(plan.stages):  # the executor would ignore every stage's modules
        k = next(k for k, s in enumerate(plan.stages) if not s.modules)
        raise PlanError(f"{where}: stages[{k}].modules: stage {k} lists no modules but stage {listed[0]} does; list "
                        "the modules it holds (or none in any stage, to cut the model by layer ranges)")
    # a container of listed modules (`transformer` above `transformer.h.0`) may recur: its own ops run in each
    # stage; any other module in two stages would run in one of them only, silently
    listed_mods = {mod for s in plan.stages for mod in s.modules}
    containers = {mod.rsplit(".", i)[0] for mod in listed_mods for i in range(1, mod.count(".") + 1)}
    owner: dict[str, int] = {}
    for k, s in enumerate(plan.stages):
        for mod in s.modules:
            if owner.get(mod, k) != k and mod not in containers:
                raise PlanError(f"{where}: stages[{k}].modules: module {mod!r} is listed in stage {owner[mod]} and "
                                f"stage {k}; list each module in one stage only")
            owner.setdefault(mod, k)
    nodes, per_node = plan.cluster.get("nodes"), plan.cluster.get("devices_per_node")
    if isinstance(nodes, (int, float)) and isinstance(per_node, (int, float)) and \
            m.world_size != int(nodes) * int(per_node):
        devices = int(nodes) * int(per_node)
        raise PlanError(f"{where}: mesh: dp x tp x pp = {m.dp} x {m.tp} x {m.pp} = {m.world_size} but the plan's "
                        f"cluster has {devices} devices ({int(nodes)} node{'s' if int(nodes) != 1 else ''} x "
                        f"{int(per_node)}); make the product {devices} or re-plan for the cluster with `plan ... -o`")
    problem = schedule_problem(plan.schedule, m.pp, plan.num_microbatches)
    if problem:  # the executor would stop at launch; the planner writes no such plan
        raise PlanError(f"{where}: num_microbatches: {problem}; raise global_batch_size or lower microbatch_size, "
                        "use schedule gpipe, or re-plan with `plan ... -o`")
    moved = next((k for k, s in enumerate(plan.stages) if s.rank != k % m.pp), None)
    if moved is not None:  # the executor runs stage k on rank k % pp whatever the file says, and export refuses it
        raise PlanError(f"{where}: stages[{moved}].rank: {plan.stages[moved].rank}, but stage k runs on pipeline rank "
                        f"k % pp = {moved % m.pp}; drop rank or set it to {moved % m.pp}")
    if m.tp == 1:
        sharded = next((name for name, p in plan.parameters.items() if p != "R"), None)
        if sharded is not None:
            raise PlanError(f"{where}: parameters[{json.dumps(sharded)}]: placed {plan.parameters[sharded]} but "
                            "mesh.tp is 1 (nothing to shard over); drop `parameters` or raise tp")
    pred = plan.predicted
    for key in PREDICTED_NUMBERS:
        if key in pred and _bad_number(pred[key]):
            raise PlanError(f"{where}: predicted.{key}: expected a finite number >= 0, got {_show(pred[key])}; drop "
                            "`predicted` or re-plan with `plan ... -o`")
    for key in PREDICTED_TABLES:
        table = pred.get(key)
        if table is not None and not isinstance(table, Mapping):
            raise PlanError(f"{where}: predicted.{key}: expected an object of numbers, got {_show(table)}; drop "
                            "`predicted` or re-plan with `plan ... -o`")
        bad = next((k for k, v in (table or {}).items() if _bad_real(v)), None)
        if bad is not None:
            raise PlanError(f"{where}: predicted.{key}.{bad}: expected a finite number, got {_show(table[bad])}; drop "
                            "`predicted` or re-plan with `plan ... -o`")
    per_device = pred.get("memory_per_device_bytes", [])
    if not isinstance(per_device, (list, tuple)) or any(_bad_number(x) for x in per_device):
        raise PlanError(f"{where}: predicted.memory_per_device_bytes: expected a list of finite numbers >= 0, got "
                        f"{_show(per_device)}; drop `predicted` or re-plan with `plan ... -o`")


def schedule_problem(schedule: str, pp: int, microbatches: int) -> str | None:
    """Why the executor cannot run `schedule` over pp pipeline ranks with this many micro-batches per step, or None
    when it can: 1F1B needs at least pp of them (torch.distributed.pipelining's Schedule1F1B raises otherwise), the
    interleaved schedule a multiple of pp (Megatron-LM's rule, which the cost model's schedule follows). The search,
    `--force` and the executor all ask this."""
    if pp <= 1 or schedule == "gpipe":
        return None
    if schedule == "1f1b" and microbatches < pp:
        return f"schedule 1f1b needs at least pp={pp} micro-batches per step, got {microbatches}"
    if schedule == "interleaved" and microbatches % pp:
        return f"schedule interleaved needs a micro-batch count that is a multiple of pp={pp}, got {microbatches}"
    return None


def fsdp_mixed_precision(precision: str, dp: int, tp: int, pp: int, zero_stage: int) -> bool:
    """`Plan.fsdp_mixed_precision` for a plan with this precision, mesh and ZeRO stage (also for a cost asked
    without a whole plan: any 16-bit plan with tp > 1 computes with 16-bit weights)."""
    return precision != "fp32" and ((dp > 1 and zero_stage >= 1) or tp > 1 or pp > 1)


def cluster_record(cluster) -> dict[str, Any]:
    """`Plan.cluster` for a `hardware_profiles.schema.Cluster`: what `plan measure` checks the machine against."""
    return {"name": cluster.name, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
            "device": cluster.device.name, "link": cluster.intra_node.kind}


def block_counts(plan: Plan) -> str:
    """`Plan.recompute_blocks` in a few characters, `3/2/1/0` (the middle elided past 8 stages), or "" when there
    are no counts."""
    n = [str(c) for c in plan.recompute_blocks]
    return "/".join(n if len(n) <= 8 else n[:3] + ["..."] + n[-2:])


def recompute_counts(plan: Plan) -> str:
    """`block_counts` as a label's suffix: `[3/2/1/0]`, under selective `+full[3/2/1/0]` (the blocks that run full
    recomputation), or ""."""
    n = block_counts(plan)
    return f"{'+full' if plan.recompute == 'selective' else ''}[{n}]" if n else ""


def model_fingerprint(named_shapes: "Iterable[tuple[str, Sequence[int]]]") -> str:
    """A short digest of a model's parameter names and shapes (`Plan.model["fingerprint"]`), so a plan made for
    one model is refused for another. Tied parameters count once, in `named_parameters()` order."""
    h = hashlib.sha1()
    for name, shape in named_shapes:
        h.update(f"{name}:{tuple(int(s) for s in shape)};".encode())
    return h.hexdigest()[:16]


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def check_output(path: str | os.PathLike, flag: str, inputs: Sequence[str | os.PathLike | None] = ()) -> None:
    """Before any work: PlanError (one line) when `path`, given with `flag`, cannot be written (empty, or
    `unwritable_output`: a folder's name among others) or is one of the command's `inputs` (writing it would
    destroy them)."""
    path = os.fspath(path)
    if not path:
        raise PlanError(f"{flag} is empty; give a file path")
    for given in inputs:
        if given and os.path.exists(given) and os.path.exists(path) and os.path.samefile(given, path):
            raise PlanError(f"{flag} {path} is also this command's input {os.fspath(given)}; writing it would "
                            "destroy it: pick another file")
    why = unwritable_output(path)
    if why:
        raise PlanError(f"{flag} {path}: {why}; give a file path in a folder you can write to")


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path via `atomic_output`, so a crash never leaves half a file. A path that cannot be written
    (`unwritable_output`, or an error making the folder, the temp file or the rename) is a PlanError, one line."""
    path = os.fspath(path)
    target = os.path.realpath(path)
    why = unwritable_output(path)
    if why is None:
        try:
            with atomic_output(target) as tmp, open(tmp, "w") as f:
                f.write(text)
            return
        except OSError as e:
            why = e.strerror or str(e)
    raise PlanError(f"cannot write {path}: {why}; give a file path in a folder you can write to")
