"""The cluster profile schema: frozen dataclasses, strict loading from plain dicts (parsed YAML).

Units are SI everywhere: bytes, seconds, bytes/s, FLOP/s. Bandwidths are per device and per direction
(unidirectional), the figure nccl-tests' busbw converges to. Unknown or missing keys, wrong types and non-positive
sizes raise `ProfileError` naming the field path.

YAML layout::

    cluster: {name: dgx-a100-80gb, nodes: 1, devices_per_node: 8}
    device:
      name: A100-SXM4-80GB
      memory_bytes: 85899345920
      usable_memory_fraction: 0.9
      peak_flops: {fp32: 19.5e12, tf32: 156e12, bf16: 312e12, fp16: 312e12}
      memory_bandwidth: 2.039e12
      matmul_efficiency: [[1.0e9, 0.2], [1.0e12, 0.8]]   # [FLOPs of one matmul, achieved fraction of peak]
      memory_efficiency: [[1.0e6, 0.3], [1.0e9, 0.9]]    # [bytes moved by one op, achieved fraction of peak]
      op_overhead: {forward: 4.0e-6, backward: 8.0e-6, optimizer: 6.0e-5}   # optional, measured; default 0
      kernel_costs: {gelu: [3.6e-9, 4.0e-9]}              # optional, measured: [forward, backward] s per element
      sms: 108                                            # optional: GEMM tiles / attention blocks run in waves
      matmul: {tiles: [[256, 128], [128, 128]], best_efficiency: 0.869}   # optional: GEMM efficiency by shape
      attention: {forward_efficiency: 0.73, backward_efficiency: 0.63, block: 128}   # optional: fused SDPA; or
                                                          # {kernel: K, kernels: {K: {...}, ...}}: K runs
      kernel_floor: 3.8e-6                                # optional: minimum seconds per kernel
      async_host: true                                    # optional: host dispatch overlaps kernels (GPUs)
      threads: 1                                          # optional: CPU threads per rank (0: unknown / a GPU)
      comm_shares_compute: true                           # optional: collectives run on the compute threads
      matmul_shapes: [[1, 2048, 4096, 4096, bf16, 1.2e-4]]  # optional, measured: [batch, M, N, K, precision, s]
      attention_shapes: [[32, 2048, 2048, 128, true, bf16, 3.0e-4, 8.0e-4]]   # optional, measured
    links:
      intra_node: {kind: nvswitch, bandwidth: 300e9, latency: 3.4e-6}
      inter_node: {kind: infiniband, bandwidth: 25e9, latency: 5.0e-6}
    collectives:                                          # optional, measured; they take precedence
      - {collective: all_reduce, level: intra_node, group_size: 8, points: [[1048576, 1.0e-4], ...]}
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
"""Collectives a profile may carry measured curves for."""
LEVELS = ("intra_node", "inter_node")
"""Link levels: inside a node (NVLink/NVSwitch, PCIe, shared memory) and between nodes (InfiniBand, RoCE, Ethernet)."""
LINK_KINDS = ("nvlink", "nvswitch", "pcie", "shm", "infiniband", "roce", "ethernet", "loopback")
"""Kinds of link a level may be."""
FLOP_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
"""Dtypes a device may list a peak for."""


KERNELS = ("add", "gelu", "tanh", "softmax", "layer_norm", "adamw")
"""Elementwise kernel families a profile may carry measured per-element costs for (see `DeviceSpec.kernel_costs`)."""


class ProfileError(ValueError):
    """A cluster profile is malformed; the message names the field path and the fix."""


@dataclass(frozen=True, kw_only=True)
class OpOverhead:
    """Fixed host-side seconds per operator, on top of its kernel time: eager PyTorch's Python call, dispatcher and
    autograd bookkeeping (on GPU, the kernel-launch floor). Measured by `plan profile` on CPU; 0 when unknown."""

    forward: float = 0.0
    """Seconds per op in forward (a chain of tiny ops, timed, divided by its length)."""
    backward: float = 0.0
    """Seconds per autograd node in backward (the same chain's backward)."""
    optimizer: float = 0.0
    """Seconds per parameter tensor of one torch.optim.AdamW step with default settings, beyond its bytes."""
    matmul_forward: float = 0.0
    """Seconds of one tiny 2-D matmul (`y @ w`, a chain of them) beyond its kernel; 0 when not measured (a matmul
    then pays `forward`)."""
    matmul_backward: float = 0.0
    """Seconds of that matmul's backward node (two matmuls and their transposes) and the weight's gradient
    accumulation; 0 when not measured."""
    dtensor_forward: float = 0.0
    """Seconds per op in forward when the operands are DTensors (tensor parallelism), no communication: a chain of
    one-element multiplications on replicated DTensors (CPU profiles measured before it: additions)."""
    dtensor_backward: float = 0.0
    """Seconds per autograd node in backward on DTensors (the chain's nodes, each one DTensor multiplication)."""
    dtensor_matmul_forward: float = 0.0
    """As `matmul_forward` on replicated DTensors (0: a DTensor matmul pays `dtensor_forward`)."""
    dtensor_matmul_backward: float = 0.0
    """As `matmul_backward` on replicated DTensors."""
    dtensor_optimizer: float = 0.0
    """Seconds per DTensor parameter (FSDP2 / tensor-parallel shards) of one AdamW step."""
    dtensor_partial_optimizer: float = 0.0
    """Seconds per replicated DTensor parameter with a Partial gradient (sequence-parallel norms) of one AdamW
    step: each optimizer op reading the gradient all-reduces it."""
    linear_forward: float = 0.0
    """Seconds of one nn.Linear forward beyond its matmul: all its dispatches (a tiny F.linear timed); 0 when not
    measured (the linear then pays `forward`)."""
    linear_backward: float = 0.0
    """Seconds of one nn.Linear backward beyond its matmuls: its autograd nodes and its parameters' gradient
    accumulations (0: one node and one per parameter at `backward`)."""
    dtensor_linear_forward: float = 0.0
    """As `linear_forward` for a column-parallel linear on DTensors (sharded weight, replicated input)."""
    dtensor_linear_backward: float = 0.0
    """As `linear_backward` on DTensors."""
    fsdp_module: float = 0.0
    """FSDP2's seconds per forward + backward of one `fully_shard`ed module without resharding (ZeRO-1/2): hooks,
    all-gather copy-in/out and gradient reduce-scatter copies, without the collectives themselves (profiles
    measured before 2026-11-23 include its tiny collectives' latency)."""
    fsdp_tensor: float = 0.0
    """Additional FSDP2 seconds per parameter tensor of such a module (ZeRO-1/2)."""
    fsdp_module_reshard: float = 0.0
    """As `fsdp_module`, resharding after forward (ZeRO-3: a second all-gather before backward)."""
    fsdp_tensor_reshard: float = 0.0
    """As `fsdp_tensor`, resharding after forward (ZeRO-3)."""
    dtensor_redistribute: float = 0.0
    """Seconds per tensor-parallel collective (a DTensor redistribution, forward or backward) beyond the collective
    timed alone after a barrier: issuing and waiting for the functional collective, DTensor's copies and the
    ranks' skew after compute (measured on a chain of matmuls and activation all-gathers)."""
    ddp_call: float = 0.0
    """DDP's own seconds per synchronised forward + backward, beyond the same module unwrapped and its buckets'
    all-reduces timed on their own: its Python forward, the reducer's preparation and finalisation (waiting for
    the all-reduce work, on gloo handed between threads)."""
    ddp_tensor: float = 0.0
    """Additional DDP seconds per parameter tensor of such a step (its reducer's autograd hook, bucket
    bookkeeping)."""
    ddp_byte: float = 0.0
    """DDP's own seconds per fp32 gradient byte of such a step (copying gradients into the buckets and back)."""


@dataclass(frozen=True, kw_only=True)
class MatmulModel:
    """First-principles GEMM efficiency by shape (NVIDIA, "Matrix Multiplication Background User's Guide": tile and
    wave quantization): a GEMM of M x N outputs runs as ceil(M/tm) x ceil(N/tn) output tiles, one thread block
    each, in waves of `DeviceSpec.sms` blocks; its efficiency is `best_efficiency` times the useful fraction of
    the tiles x waves it occupies (the best tile listed wins, as cuBLAS's heuristics pick one per shape)."""

    tiles: tuple[tuple[int, int], ...]
    """Output tile sizes [rows, columns] the GEMM library chooses among, e.g. [[256, 128], [128, 128]]."""
    best_efficiency: float
    """Achieved fraction of peak at large, tile-aligned shapes (a measured maximum achievable matmul)."""


@dataclass(frozen=True, kw_only=True)
class AttentionModel:
    """Fused attention (FlashAttention-style SDPA) efficiency: its own forward and backward fractions of peak, for
    the FLOPs the kernel really does (causal attention skips the blocks above the diagonal), with wave
    quantization over batch x heads x query blocks.

    A profile may list several kernels (`kernels`, e.g. FlashAttention-2, cuDNN, FlashAttention-3: which one SDPA
    or the trainer runs depends on the software stack) and name the one that runs (`kernel`); the efficiencies
    here are that kernel's."""

    forward_efficiency: float
    """Fraction of peak the forward kernel achieves on the FLOPs it does (causal: the blocks it computes, see
    `cost_model.kernels`); a published causal throughput, which counts half the dense FLOPs, converts through it."""
    backward_efficiency: float
    """As `forward_efficiency`, for the backward kernels (2.5x the forward's FLOPs)."""
    block: int = 128
    """Query / key block size of the kernel (rows per thread block; the causal diagonal's granularity)."""
    kernel: str = ""
    """Name of the kernel these efficiencies describe (e.g. `flash2`, `cudnn`, `flash3`); "" when unnamed."""
    kernels: tuple[tuple[str, float, float], ...] = ()
    """All kernels the profile lists, as (name, forward_efficiency, backward_efficiency); `kernel` is one of them.
    Empty when the profile gives one kernel's figures only."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU rank)."""

    name: str
    """Marketing or driver name, e.g. `NVIDIA A100-SXM4-80GB`."""
    memory_bytes: int
    """Device memory in bytes."""
    usable_memory_fraction: float
    """Fraction of memory_bytes the training process can use (CUDA context, allocator fragmentation)."""
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per dtype (fp32, tf32, bf16, fp16, fp8)."""
    memory_bandwidth: float
    """Peak memory bandwidth, bytes/s."""
    matmul_efficiency: tuple[tuple[float, float], ...]
    """[FLOPs of one matmul call, achieved fraction of peak], increasing in size; interpolated in log(FLOPs)."""
    memory_efficiency: tuple[tuple[float, float], ...]
    """[bytes moved by one memory-bound op, achieved fraction of memory_bandwidth], increasing in size."""
    op_overhead: OpOverhead = OpOverhead()
    """Fixed seconds per op, per backward node and per optimizer tensor (all 0 when the profile has none)."""
    kernel_costs: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Kernel family (one of KERNELS) -> measured (forward, backward) seconds per element at activation sizes, for
    elementwise kernels that are compute-bound where the bytes roofline would under-price them (transcendentals
    on CPU). Families not listed are priced by the bytes roofline."""

    linear_efficiency: tuple[tuple[float, float], ...] = ()
    """[forward FLOPs of one nn.Linear call, achieved fraction of peak_flops' main dtype in its forward], measured on
    the module itself (n tokens x n features -> n, a 3-D input as transformers pass) with the per-op overhead taken
    out; empty when not measured (matmul_efficiency prices linears)."""
    linear_backward_efficiency: tuple[tuple[float, float], ...] = ()
    """[forward FLOPs of the nn.Linear, achieved fraction of peak in its backward (2x the forward FLOPs: input and
    weight gradients, with the bias gradient and the transposes it takes)], as `linear_efficiency`."""
    sms: int = 0
    """Streaming multiprocessors (thread blocks run in waves of this many); 0 for CPUs (no wave quantization)."""
    matmul: MatmulModel | None = None
    """GEMM efficiency by shape; None: `matmul_efficiency` by FLOPs prices every GEMM."""
    attention: AttentionModel | None = None
    """Fused-attention efficiency; None: attention is priced as GEMMs."""
    kernel_floor: float = 0.0
    """Minimum seconds of any kernel launched on the device (back-to-back launch rate in one stream); 0: none."""
    async_host: bool = False
    """Whether the host's per-op dispatch overlaps kernel execution (CUDA streams are asynchronous): a layer costs
    max(sum of kernels, sum of host dispatches) instead of their sum (CPU ranks run ops synchronously)."""
    matmul_shapes: tuple[tuple[int, int, int, int, str, float], ...] = ()
    """Measured GEMMs [batch, M, N, K, precision, seconds] (`plan profile --model`); they take precedence over the
    shape model: a GEMM at a listed shape, or differing from one in a single dimension, is priced as that
    measurement times the shape model's ratio between the two shapes."""
    attention_shapes: tuple[tuple[int, int, int, int, bool, str, float, float], ...] = ()
    """Measured fused attention [batch x heads, query length, key length, head dim, causal, precision, forward s,
    backward s], used as `matmul_shapes` (a different batch x heads scales by the shape model)."""
    threads: int = 0
    """CPU threads (cores) each rank computes with (`plan profile` on CPU ranks: 1, torch.set_num_threads); 0 where
    it does not apply or is unknown (GPUs)."""
    comm_shares_compute: bool = False
    """Whether a rank's collectives run on the same cores as its compute: gloo on CPU ranks does its copies,
    reductions and send/receive loop on host threads that compete with the rank's compute thread(s) for its cores,
    so a collective cannot hide behind compute (the cost model serialises the two). False on GPUs, where NCCL runs
    on its own SMs and copy engines beside the compute kernels."""

    @property
    def usable_memory_bytes(self) -> int:
        """Bytes a plan may use per device."""
        return int(self.memory_bytes * self.usable_memory_fraction)


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One link level as seen by one device."""

    kind: str
    """nvlink, nvswitch, pcie, shm, infiniband, roce, ethernet or loopback."""
    bandwidth: float
    """Per-device unidirectional bandwidth in bytes/s (what a ring collective's busbw approaches)."""
    latency: float
    """Per-message (per ring step) latency in seconds."""


@dataclass(frozen=True, kw_only=True)
class CollectiveCurve:
    """A measured collective: time by message size, for one group size on one link level."""

    collective: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast or send_recv."""
    level: str
    """intra_node or inter_node."""
    group_size: int
    """Ranks in the measured group."""
    points: tuple[tuple[int, float], ...]
    """[message bytes (whole array, nccl-tests convention), seconds], increasing in bytes."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A cluster: identical nodes of identical devices joined by two link levels."""

    name: str
    """Profile name."""
    nodes: int
    """Number of nodes (`--nodes` overrides)."""
    devices_per_node: int
    """Devices (GPUs or CPU ranks) per node."""
    device: DeviceSpec
    """The device every rank has."""
    intra_node: LinkSpec
    """Links between devices of one node."""
    inter_node: LinkSpec
    """Links between nodes (per device: a node's NIC bandwidth divided by its devices)."""
    collectives: tuple[CollectiveCurve, ...] = ()
    """Measured collective curves; they take precedence over the link formulas."""

    @property
    def world_size(self) -> int:
        """Total devices."""
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> "Cluster":
        """The same cluster with a different node count."""
        if nodes < 1:
            raise ProfileError(f"--nodes must be >= 1, got {nodes}")
        return Cluster(name=self.name, nodes=nodes, devices_per_node=self.devices_per_node, device=self.device,
                       intra_node=self.intra_node, inter_node=self.inter_node, collectives=self.collectives)

    def curve(self, collective: str, level: str, group_size: int) -> CollectiveCurve | None:
        """The measured curve for this collective, level and group size, if the profile has one."""
        for c in self.collectives:
            if c.collective == collective and c.level == level and c.group_size == group_size:
                return c
        return None


# ---- strict loading ---------------------------------------------------------------------------------------------

def _keys(d: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = [k for k in d if k not in required and k not in optional]
    if unknown:
        raise ProfileError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(required + optional)})")
    missing = [k for k in required if k not in d]
    if missing:
        raise ProfileError(f"{where}.{missing[0]}: missing key")
    return d


def _pos(x: Any, where: str, integer: bool = False, unit: str = "") -> Any:
    if integer and isinstance(x, float) and x.is_integer():
        x = int(x)  # 80e9 bytes is a whole number written in float notation; accept it
    ok_types = (int,) if integer else (int, float)
    if isinstance(x, bool) or not isinstance(x, ok_types):
        if isinstance(x, str):
            raise ProfileError(f"{where}: got the string {x!r}; give a plain number{' in ' + unit if unit else ''}"
                               " (e.g. 80e9, not '80GB')")
        kind = "an integer" if integer else "a number"
        raise ProfileError(f"{where}: expected {kind}{' in ' + unit if unit else ''}, got {type(x).__name__}")
    if not math.isfinite(x) or x <= 0:
        raise ProfileError(f"{where}: must be > 0{' ' + unit if unit else ''}, got {x}")
    return x


def _fraction(x: Any, where: str) -> float:
    _pos(x, where)
    if x > 1:
        raise ProfileError(f"{where}: is a fraction and must be in (0, 1], got {x}")
    return float(x)


def _curve(pts: Any, where: str, y_fraction: bool) -> tuple[tuple[float, float], ...]:
    if not isinstance(pts, (list, tuple)) or not pts:
        raise ProfileError(f"{where}: expected a non-empty list of [size, value] pairs")
    out = []
    for i, p in enumerate(pts):
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ProfileError(f"{where}[{i}]: expected a [size, value] pair")
        x = _pos(p[0], f"{where}[{i}][0]")
        y = _fraction(p[1], f"{where}[{i}][1]") if y_fraction else float(_pos(p[1], f"{where}[{i}][1]"))
        out.append((x, y))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        raise ProfileError(f"{where}: sizes must be strictly increasing")
    return tuple(out)


def _link(d: Any, where: str) -> LinkSpec:
    d = _keys(d, where, ("kind", "bandwidth", "latency"))
    if d["kind"] not in LINK_KINDS:
        raise ProfileError(f"{where}.kind: {d['kind']!r} is not one of {', '.join(LINK_KINDS)}")
    bw = _pos(d["bandwidth"], f"{where}.bandwidth", unit="bytes/s")
    if bw < 1e6:
        raise ProfileError(f"{where}.bandwidth: {bw} bytes/s is implausibly small; the unit is bytes/s "
                           "(e.g. 25e9 for 200 Gb/s InfiniBand)")
    lat = _pos(d["latency"], f"{where}.latency", unit="seconds")
    if lat > 1.0:
        raise ProfileError(f"{where}.latency: {lat} s is implausibly large; the unit is seconds (e.g. 5e-6)")
    return LinkSpec(kind=d["kind"], bandwidth=float(bw), latency=float(lat))


def _device(d: Any, where: str) -> DeviceSpec:
    d = _keys(d, where, ("name", "memory_bytes", "usable_memory_fraction", "peak_flops", "memory_bandwidth",
                         "matmul_efficiency", "memory_efficiency"),
              ("op_overhead", "kernel_costs", "linear_efficiency", "linear_backward_efficiency") + _GPU_KEYS)
    mem = _pos(d["memory_bytes"], f"{where}.memory_bytes", integer=True, unit="bytes")
    if mem < 2**26:
        raise ProfileError(f"{where}.memory_bytes: {mem} is under 64 MiB; the unit is bytes (80 GB = 80e9 "
                           "written as an integer, e.g. 85899345920)")
    peaks = d["peak_flops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise ProfileError(f"{where}.peak_flops: expected a mapping of dtype to FLOP/s")
    for k, v in peaks.items():
        if k not in FLOP_DTYPES:
            raise ProfileError(f"{where}.peak_flops.{k}: unknown dtype (allowed: {', '.join(FLOP_DTYPES)})")
        _pos(v, f"{where}.peak_flops.{k}", unit="FLOP/s")
    return DeviceSpec(
        name=str(d["name"]), memory_bytes=int(mem),
        usable_memory_fraction=_fraction(d["usable_memory_fraction"], f"{where}.usable_memory_fraction"),
        peak_flops={k: float(v) for k, v in peaks.items()},
        memory_bandwidth=float(_pos(d["memory_bandwidth"], f"{where}.memory_bandwidth", unit="bytes/s")),
        matmul_efficiency=_curve(d["matmul_efficiency"], f"{where}.matmul_efficiency", y_fraction=True),
        memory_efficiency=_curve(d["memory_efficiency"], f"{where}.memory_efficiency", y_fraction=True),
        op_overhead=_overhead(d.get("op_overhead"), f"{where}.op_overhead"),
        kernel_costs=_kernels(d.get("kernel_costs"), f"{where}.kernel_costs"),
        **{k: _curve(d[k], f"{where}.{k}", y_fraction=True) for k in ("linear_efficiency",
                                                                     "linear_backward_efficiency") if k in d},
        **_gpu_fields(d, where))


_GPU_KEYS = ("sms", "matmul", "attention", "kernel_floor", "async_host", "matmul_shapes", "attention_shapes",
             "threads", "comm_shares_compute")
"""Optional device keys of the shape-aware compute model and of how a rank's cores are used (profiles without them
load as before)."""
_PRECISIONS = ("fp32", "bf16", "fp16")
"""Precisions a measured shape row may name."""
_ATTN_EFFS = ("forward_efficiency", "backward_efficiency")
"""The keys of one attention kernel's figures."""


def _matmul(d: Any, where: str) -> MatmulModel:
    d = _keys(d, where, ("tiles", "best_efficiency"))
    tiles = d["tiles"]
    if not isinstance(tiles, list) or not tiles or any(not isinstance(t, list) or len(t) != 2 for t in tiles):
        raise ProfileError(f"{where}.tiles: expected a list of [rows, columns] pairs, e.g. [[256, 128]]")
    return MatmulModel(tiles=tuple((int(_pos(a, f"{where}.tiles", integer=True)),
                                    int(_pos(b, f"{where}.tiles", integer=True))) for a, b in tiles),
                       best_efficiency=_fraction(d["best_efficiency"], f"{where}.best_efficiency"))


def _attention_effs(d: Mapping[str, Any], where: str) -> tuple[float, float]:
    return (_fraction(d["forward_efficiency"], f"{where}.forward_efficiency"),
            _fraction(d["backward_efficiency"], f"{where}.backward_efficiency"))


def _attention(d: Any, where: str) -> AttentionModel:
    """`{forward_efficiency, backward_efficiency[, block, kernel]}` (one kernel), or `{kernel, kernels: {name:
    {forward_efficiency, backward_efficiency}, ...}[, block]}` (several; `kernel` names the one that runs)."""
    if isinstance(d, Mapping) and "kernels" in d:
        d = _keys(d, where, ("kernel", "kernels"), ("block",))
        ks = d["kernels"]
        if not isinstance(ks, Mapping) or not ks:
            raise ProfileError(f"{where}.kernels: expected a mapping of kernel name to "
                               "{forward_efficiency, backward_efficiency}")
        table = tuple((str(k), *_attention_effs(_keys(v, f"{where}.kernels.{k}", _ATTN_EFFS),
                                                f"{where}.kernels.{k}")) for k, v in ks.items())
        chosen = [t for t in table if t[0] == str(d["kernel"])]
        if not chosen:
            raise ProfileError(f"{where}.kernel: {d['kernel']!r} is not one of the listed kernels "
                               f"({', '.join(t[0] for t in table)})")
        name, f, b = chosen[0]
    else:
        d = _keys(d, where, _ATTN_EFFS, ("block", "kernel"))
        (f, b), name, table = _attention_effs(d, where), str(d.get("kernel", "")), ()
    return AttentionModel(forward_efficiency=f, backward_efficiency=b, kernel=name, kernels=table,
                          block=int(_pos(d.get("block", 128), f"{where}.block", integer=True)))


def _attention_dict(a: AttentionModel) -> dict[str, Any]:
    """Plain-data form of an AttentionModel that `_attention` reads back to an equal one."""
    if a.kernels:
        return {"kernel": a.kernel, "block": a.block,
                "kernels": {k: {"forward_efficiency": f, "backward_efficiency": b} for k, f, b in a.kernels}}
    out: dict[str, Any] = {"forward_efficiency": a.forward_efficiency, "backward_efficiency": a.backward_efficiency,
                           "block": a.block}
    if a.kernel:
        out["kernel"] = a.kernel
    return out


def _rows(rows: Any, where: str, ints: int, flags: int, secs: int, example: str) -> tuple:
    """A measured shape table: each row `ints` positive integers, `flags` booleans, a precision, `secs` seconds."""
    if not isinstance(rows, list):
        raise ProfileError(f"{where}: expected a list of rows like {example}")
    out = []
    for i, r in enumerate(rows):
        w = f"{where}[{i}]"
        if not isinstance(r, list) or len(r) != ints + flags + 1 + secs:
            raise ProfileError(f"{w}: expected a row like {example}")
        row: list[Any] = [int(_pos(x, w, integer=True)) for x in r[:ints]]
        for x in r[ints:ints + flags]:
            if not isinstance(x, bool):
                raise ProfileError(f"{w}: expected true/false for causal, got {x!r}")
            row.append(x)
        if r[ints + flags] not in _PRECISIONS:
            raise ProfileError(f"{w}: precision {r[ints + flags]!r} is not one of {', '.join(_PRECISIONS)}")
        row.append(r[ints + flags])
        row.extend(_seconds(x, w) for x in r[ints + flags + 1:])
        out.append(tuple(row))
    return tuple(out)


def _gpu_fields(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The optional shape-aware compute fields present in a device mapping, validated."""
    out: dict[str, Any] = {}
    if "sms" in d:
        out["sms"] = int(_pos(d["sms"], f"{where}.sms", integer=True))
    if "matmul" in d:
        out["matmul"] = _matmul(d["matmul"], f"{where}.matmul")
    if "attention" in d:
        out["attention"] = _attention(d["attention"], f"{where}.attention")
    if "kernel_floor" in d:
        out["kernel_floor"] = _seconds(d["kernel_floor"], f"{where}.kernel_floor")
    for k in ("async_host", "comm_shares_compute"):
        if k in d:
            if not isinstance(d[k], bool):
                raise ProfileError(f"{where}.{k}: expected true or false")
            out[k] = d[k]
    if "threads" in d:
        out["threads"] = int(_pos(d["threads"], f"{where}.threads", integer=True))
    if "matmul_shapes" in d:
        out["matmul_shapes"] = _rows(d["matmul_shapes"], f"{where}.matmul_shapes", 4, 0, 1,
                                     "[batch, M, N, K, bf16, seconds]")
    if "attention_shapes" in d:
        out["attention_shapes"] = _rows(d["attention_shapes"], f"{where}.attention_shapes", 4, 1, 2,
                                        "[batch*heads, s_q, s_k, head_dim, causal, bf16, fwd_s, bwd_s]")
    return out


def _gpu_dict(dev: DeviceSpec) -> dict[str, Any]:
    """The shape-aware compute fields of a device that differ from their defaults, as plain data."""
    out: dict[str, Any] = {}
    if dev.sms:
        out["sms"] = dev.sms
    if dev.matmul is not None:
        out["matmul"] = {"tiles": [list(t) for t in dev.matmul.tiles], "best_efficiency": dev.matmul.best_efficiency}
    if dev.attention is not None:
        out["attention"] = _attention_dict(dev.attention)
    if dev.kernel_floor:
        out["kernel_floor"] = dev.kernel_floor
    if dev.async_host:
        out["async_host"] = True
    if dev.threads:
        out["threads"] = dev.threads
    if dev.comm_shares_compute:
        out["comm_shares_compute"] = True
    if dev.matmul_shapes:
        out["matmul_shapes"] = [list(r) for r in dev.matmul_shapes]
    if dev.attention_shapes:
        out["attention_shapes"] = [list(r) for r in dev.attention_shapes]
    return out


def _seconds(x: Any, where: str) -> float:
    """A non-negative number of seconds under one second (0 is allowed: no overhead)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0:
        return 0.0
    s = float(_pos(x, where, unit="seconds"))
    if s >= 1.0:
        raise ProfileError(f"{where}: {s} s is implausibly large; the unit is seconds (e.g. 5e-6)")
    return s


def _overhead(d: Any, where: str) -> OpOverhead:
    if d is None:
        return OpOverhead()
    names = tuple(f.name for f in fields(OpOverhead))
    d = _keys(d, where, (), names)
    return OpOverhead(**{k: _seconds(v, f"{where}.{k}") for k, v in d.items()})


def _kernels(d: Any, where: str) -> dict[str, tuple[float, float]]:
    if d is None:
        return {}
    d = _keys(d, where, (), KERNELS)
    out = {}
    for k, v in d.items():
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise ProfileError(f"{where}.{k}: expected [forward, backward] seconds per element")
        out[k] = (_seconds(v[0], f"{where}.{k}[0]"), _seconds(v[1], f"{where}.{k}[1]"))
    return out


def _collective(d: Any, where: str) -> CollectiveCurve:
    d = _keys(d, where, ("collective", "level", "group_size", "points"))
    if d["collective"] not in COLLECTIVES:
        raise ProfileError(f"{where}.collective: {d['collective']!r} is not one of {', '.join(COLLECTIVES)}")
    if d["level"] not in LEVELS:
        raise ProfileError(f"{where}.level: {d['level']!r} is not one of {', '.join(LEVELS)}")
    pts = _curve(d["points"], f"{where}.points", y_fraction=False)
    return CollectiveCurve(collective=d["collective"], level=d["level"],
                           group_size=int(_pos(d["group_size"], f"{where}.group_size", integer=True)),
                           points=tuple((int(x), float(y)) for x, y in pts))


def cluster_from_dict(d: Any, where: str = "profile") -> Cluster:
    """Build a Cluster from parsed YAML; raises ProfileError naming the field path on any problem."""
    d = _keys(d, where, ("cluster", "device", "links"), ("collectives",))
    c = _keys(d["cluster"], f"{where}.cluster", ("name", "nodes", "devices_per_node"))
    links = _keys(d["links"], f"{where}.links", LEVELS)
    curves = d.get("collectives") or []
    if not isinstance(curves, list):
        raise ProfileError(f"{where}.collectives: expected a list")
    return Cluster(
        name=str(c["name"]),
        nodes=int(_pos(c["nodes"], f"{where}.cluster.nodes", integer=True)),
        devices_per_node=int(_pos(c["devices_per_node"], f"{where}.cluster.devices_per_node", integer=True)),
        device=_device(d["device"], f"{where}.device"),
        intra_node=_link(links["intra_node"], f"{where}.links.intra_node"),
        inter_node=_link(links["inter_node"], f"{where}.links.inter_node"),
        collectives=tuple(_collective(x, f"{where}.collectives[{i}]") for i, x in enumerate(curves)))


def cluster_to_dict(c: Cluster) -> dict[str, Any]:
    """Plain-data form that `cluster_from_dict` reads back to an equal Cluster."""
    def link(l: LinkSpec) -> dict[str, Any]:
        return {f.name: getattr(l, f.name) for f in fields(l)}
    dev = c.device
    return {
        "cluster": {"name": c.name, "nodes": c.nodes, "devices_per_node": c.devices_per_node},
        "device": {"name": dev.name, "memory_bytes": dev.memory_bytes,
                   "usable_memory_fraction": dev.usable_memory_fraction, "peak_flops": dict(dev.peak_flops),
                   "memory_bandwidth": dev.memory_bandwidth,
                   "matmul_efficiency": [list(p) for p in dev.matmul_efficiency],
                   "memory_efficiency": [list(p) for p in dev.memory_efficiency],
                   **({"op_overhead": {f.name: getattr(dev.op_overhead, f.name) for f in fields(OpOverhead)}}
                      if dev.op_overhead != OpOverhead() else {}),
                   **({"kernel_costs": {k: list(v) for k, v in dev.kernel_costs.items()}}
                      if dev.kernel_costs else {}),
                   **{k: [list(p) for p in getattr(dev, k)] for k in ("linear_efficiency",
                                                                     "linear_backward_efficiency") if getattr(dev, k)},
                   **_gpu_dict(dev)},
        "links": {"intra_node": link(c.intra_node), "inter_node": link(c.inter_node)},
        "collectives": [{"collective": k.collective, "level": k.level, "group_size": k.group_size,
                         "points": [list(p) for p in k.points]} for k in c.collectives],
    }
