"""The cluster profile's types: frozen dataclasses a `Cluster` is made of, and `ProfileError`.

Units are SI everywhere: bytes, seconds, bytes/s, FLOP/s. Bandwidths are per device and per direction
(unidirectional), the figure nccl-tests' busbw converges to. The YAML form and its strict loading are in
`hardware_profiles.profile_dict`.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
"""Collectives a profile may carry measured curves for."""
LEVELS = ("intra_node", "inter_node")
"""Link levels: inside a node (NVLink/NVSwitch, PCIe, shared memory) and between nodes (InfiniBand, RoCE, Ethernet)."""
LINK_KINDS = ("nvlink", "nvswitch", "pcie", "shm", "infiniband", "roce", "ethernet", "loopback")
"""Kinds of link a level may be."""
FLOP_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
"""Dtypes a device may list a peak for."""


KERNELS = ("add", "gelu", "tanh", "softmax", "layer_norm", "adamw", "widen")
"""Elementwise kernel families a profile may carry measured per-element costs for (see `DeviceSpec.kernel_costs`);
`widen` is a 16-bit to fp32 conversion (autocast's casts up, and the gradients of its casts down)."""

NORM_FUNCTIONS = ("layer_norm", "rms_norm")
"""Normalizations `plan profile --model` times at the model's shapes (`DeviceSpec.norm_shapes`)."""
GEMM_LAYOUTS = ("nn", "nt", "tn")
"""How a GEMM C[M, N] = A[M, K] B[K, N] reads its operands: "nn" both stored as written, "nt" B stored [N, K] and
read transposed (F.linear's forward: x W^T), "tn" A stored [K, M] and read transposed (a linear's weight gradient,
dY^T x). At an unaligned dimension the layouts run different kernels (GPT-2's 50257-wide head on an H100,
2026-11-26: 13.25 ms in F.linear against 9.83 ms timed contiguous)."""


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
    linear_nd_forward: float = 0.0
    """As `linear_forward` with a (1, 2, 2) input: a model's (batch, sequence, features) activations, whose leading
    dims F.linear flattens and restores (0 when not measured: such a linear pays `linear_forward`)."""
    linear_nd_backward: float = 0.0
    """As `linear_backward` with that input."""
    dtensor_linear_nd_forward: float = 0.0
    """As `dtensor_linear_forward` with that input (on DTensors each view dispatches through DTensor too)."""
    dtensor_linear_nd_backward: float = 0.0
    """As `dtensor_linear_backward` with that input."""
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
    timed alone after a barrier: issuing and waiting for the functional collective and DTensor's copies (measured
    on a chain of matmuls and activation all-gathers; profiles measured before 2026-11-26 also include the ranks'
    skew after the chain's matmul, which `DeviceSpec.sync_wait` now prices)."""
    dtensor_local_call_forward: float = 0.0
    """Seconds per call of a module tensor parallelism leaves replicated (it runs on plain tensors): unwrapping its
    DTensor inputs and wrapping its outputs (forward hooks, `to_local` / `DTensor.from_local`), beyond the module
    itself; 0 when not measured."""
    dtensor_local_call_backward: float = 0.0
    """The backward of that unwrapping and wrapping (their autograd nodes), per call."""
    ddp_call: float = 0.0
    """DDP's own seconds per synchronised forward + backward, beyond the same module unwrapped and its buckets'
    all-reduces timed on their own: its Python forward, the reducer's preparation and finalisation (waiting for
    the all-reduce work, on gloo handed between threads)."""
    ddp_tensor: float = 0.0
    """Additional DDP seconds per parameter tensor of such a step (its reducer's autograd hook, bucket
    bookkeeping)."""
    ddp_byte: float = 0.0
    """DDP's own seconds per fp32 gradient byte of such a step (copying gradients into the buckets and back)."""
    checkpoint_forward: float = 0.0
    """Seconds per op inside a fully checkpointed block (non-reentrant torch.utils.checkpoint) beyond its plain
    forward: saved-tensor packing (chains of tiny ops, `hardware_profiles.measure_recompute`); 0 when unknown."""
    checkpoint_backward: float = 0.0
    """Seconds per such op in backward beyond its plain backward and one plain re-run of its forward (unpacking,
    the re-run's frame)."""
    checkpoint_linear_forward: float = 0.0
    """As `checkpoint_forward` for an F.linear call on a 3-D activation."""
    checkpoint_linear_backward: float = 0.0
    """As `checkpoint_backward` for an F.linear call."""
    sac_forward: float = 0.0
    """As `checkpoint_forward` under selective checkpointing (every aten op through the SAC TorchDispatchMode)."""
    sac_backward: float = 0.0
    """As `checkpoint_backward` under selective checkpointing."""
    sac_linear_forward: float = 0.0
    """As `sac_forward` for an F.linear call (its four aten ops through the mode)."""
    sac_linear_backward: float = 0.0
    """As `sac_backward` for an F.linear call."""
    checkpoint_call_forward: float = 0.0
    """Seconds that recompute `attention`'s re-run-in-backward call (executor.parallel's autograd Function around
    each SDPA call) adds to the call's plain forward; 0 when unknown."""
    checkpoint_call_backward: float = 0.0
    """As `checkpoint_call_forward` in backward, beyond the call's plain backward and one plain re-run of it."""
    function_mode_op: float = 0.0
    """Seconds per op of a block's forward under `recompute: attention`, whose Python TorchFunctionMode sees every
    torch call to find the SDPA ones (executor.parallel.checkpoint_attention); 0 when unknown."""
    mesh_slice: float = 0.0
    """Seconds of one data-parallel sub-mesh lookup and local rank (`mesh["dp"].get_local_rank()` on a (pp, dp, tp)
    DeviceMesh, which rebuilds the sub-mesh's layout in Python each time): the executor's runner makes one per step
    to take a dp replica's share of the global batch."""


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
    k_overhead: float = 0.0
    """Elements of K each output tile's pipeline fill and epilogue cost on top of its K loop: a GEMM runs at
    K / (K + k_overhead) of the efficiency of a very deep one (measured; 0: none)."""
    unaligned_efficiency: float | None = None
    """Achieved fraction of peak of a GEMM with a dimension that is not a multiple of 16 bytes (GPT-2's vocabulary
    of 50257): cuBLAS then cannot use its aligned Tensor Core kernels (NVIDIA, "Matrix Multiplication Background
    User's Guide", Tensor Core requirements); measured, else None (no penalty)."""


UNFUSED_ATTENTION = "unfused"
"""Attention kernel name meaning no fused kernel: SDPA runs as separate kernels (batched GEMMs over the dense
scores, softmax, dropout), as Megatron-LM did before FlashAttention and PyTorch's math backend does; priced from
the GEMM model and the memory bandwidth (`ComputeModel.unfused_attention_time`), so it takes no efficiencies."""


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
    """Name of the kernel these efficiencies describe (e.g. `flash2`, `cudnn`, `flash3`); "" when unnamed;
    `UNFUSED_ATTENTION` for no fused kernel (the efficiencies are then unused)."""
    kernels: tuple[tuple[str, float, float], ...] = ()
    """All kernels the profile lists, as (name, forward_efficiency, backward_efficiency); `kernel` is one of them.
    Empty when the profile gives one kernel's figures only."""
    head_dim: int = 128
    """Head dimension the efficiencies above were published at."""
    head_dims: tuple[tuple[str, int, float, float], ...] = ()
    """Efficiencies at other head dimensions (at `seq_len`), as (kernel name, head dim, forward, backward); a
    call's head dim interpolates between them and `head_dim`'s in log2 (held flat beyond the listed ones). Smaller
    heads do less work per byte and per softmax element: FlashAttention-3's H100 figures at head dim 64 are
    0.7-0.9x those at 128."""
    seq_len: int = 2048
    """Sequence length the efficiencies above (`forward_efficiency`, `backward_efficiency`, `head_dims`) were
    published at."""
    seq_lens: tuple[tuple[str, int, int, float, float], ...] = ()
    """Efficiencies at other sequence lengths, as (kernel name, head dim, sequence length, forward, backward); a
    call's length interpolates in log2 along its head dim's figures (held flat beyond them), then across head dims
    as above. Each query block of a fused kernel pays a fixed cost (loading it, the softmax's last rescale, writing
    the output) that its loop over the key blocks amortises: the TFLOP/s FlashAttention-3's paper publishes for H100
    at 512 tokens are 0.53-0.75x those at 2k, at 8k 1.09-1.24x (all three kernels, head dims 64 and 128)."""

    def efficiency(self, head_dim: int, backward: bool, seq_len: int | None = None) -> float:
        """The running kernel's efficiency at `head_dim` and `seq_len` (None: `self.seq_len`), forward or
        backward."""
        ref = self.seq_len
        s = ref if seq_len is None else seq_len
        cols: dict[int, dict[int, float]] = {self.head_dim: {ref: self.backward_efficiency if backward
                                                              else self.forward_efficiency}}
        for k, d, f, b in self.head_dims:
            if k == self.kernel and d != self.head_dim:
                cols.setdefault(d, {})[ref] = b if backward else f
        for k, d, n, f, b in self.seq_lens:
            if k == self.kernel:
                cols.setdefault(d, {}).setdefault(n, b if backward else f)
        return interp_log(sorted((d, interp_log(sorted(c.items()), s)) for d, c in cols.items()), head_dim)


def interp_log(curve: Sequence[tuple[float, float]], x: float) -> float:
    """Value of a [size, value] curve (sorted by size) at size x, linear in log(size), clamped to the end values."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    i = bisect.bisect_right([p[0] for p in curve], x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


@dataclass(frozen=True, kw_only=True)
class PrecisionRates:
    """A CPU rank's rates measured at a 16-bit precision (`plan profile` on CPU ranks: bf16), which the fp32 ones
    do not predict: without AMX or AVX512-BF16, oneDNN emulates bf16 matmuls far below the fp32 rate, and
    elementwise kernels convert each element. Curves are fractions of `peak_flops` at that precision."""

    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    """[FLOPs of one square matmul, fraction of the precision's peak], as `DeviceSpec.matmul_efficiency`."""
    linear_efficiency: tuple[tuple[float, float], ...] = ()
    """[forward FLOPs of one nn.Linear call with 16-bit weights and input, fraction of the precision's peak in its
    forward], as `DeviceSpec.linear_efficiency`."""
    linear_backward_efficiency: tuple[tuple[float, float], ...] = ()
    """The same linear's backward, as `DeviceSpec.linear_backward_efficiency`."""
    attention_efficiency: Mapping[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Head dim -> [dense forward FLOPs 4 b s^2 d of one causal scaled_dot_product_attention call, those FLOPs over
    its forward seconds as a fraction of the precision's peak] (on CPUs the bf16 kernel runs far below fp32's, the
    more so at small head dims: measured 2026-11-27, s = 64, backward 3.8 GFLOP/s at d = 32, 6.6 at d = 64)."""
    attention_backward_efficiency: Mapping[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """The same calls' backward (2.5x the dense forward FLOPs), as `attention_efficiency`."""
    kernel_costs: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Kernel family -> (forward, backward) seconds per element on a tensor of this precision (`widen`: a
    conversion of it to fp32), as `DeviceSpec.kernel_costs`."""

    def attention_fraction(self, head_dim: int, flops: float, backward: bool) -> float:
        """Fraction of peak of a causal SDPA call of `flops` dense forward FLOPs: each measured head dim's curve at
        `flops`, interpolated between the two nearest head dims in log2 (held flat beyond them)."""
        table = self.attention_backward_efficiency if backward else self.attention_efficiency
        dims = sorted(table)
        lo = max([d for d in dims if d <= head_dim], default=dims[0])
        hi = min([d for d in dims if d >= head_dim], default=dims[-1])
        e_lo, e_hi = interp_log(table[lo], flops), interp_log(table[hi], flops)
        if hi == lo:
            return e_lo
        w = (math.log2(head_dim) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return e_lo + w * (e_hi - e_lo)


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
    matmul_shapes: tuple[tuple, ...] = ()
    """Measured GEMMs [batch, M, N, K, precision, seconds] or [..., seconds, layout] (`plan profile --model`;
    layout one of GEMM_LAYOUTS, absent in older profiles); they take precedence over the shape model: a GEMM at a
    listed shape, or differing from one in a single dimension, is priced as that measurement times the shape
    model's ratio between the two shapes, from a row of its own layout where there is one."""
    attention_shapes: tuple[tuple[int, int, int, int, bool, str, float, float], ...] = ()
    """Measured fused attention [batch x heads, query length, key length, head dim, causal, precision, forward s,
    backward s], used as `matmul_shapes` (a different batch x heads scales by the shape model)."""
    norm_shapes: tuple[tuple[int, int, int, str, str, float, float], ...] = ()
    """Measured normalizations [rows, width, parameters (weight, bias: 0-2), function (NORM_FUNCTIONS), precision,
    forward s, backward s] (`plan profile --model`); a norm of the same width, parameters and function is priced as
    the measurement scaled by the bytes model between the two row counts. The backward includes the weight and bias
    gradients' column reduction, which at narrow widths runs far below the copy rate (GPT-2's width 768 on an H100,
    2026-11-26: 0.4 of it)."""
    reduce_shapes: tuple[tuple[int, int, str, float], ...] = ()
    """Measured bias gradients [rows, width, precision, seconds]: `grad.sum(0)` over a linear's [rows, width] output
    gradient, as addmm's backward runs it (`plan profile --model`); a bias of the same width and precision is priced
    as the measurement scaled by the bytes model between the two row counts. A column reduction runs far below the
    copy rate at narrow widths (GPT-2 124M's biases on an H200, 2026-11-27, 16384 rows: 30 us at width 768 for
    25 MB read, 46 us at 3072 for 101 MB), so the bytes model alone under-prices it."""
    threads: int = 0
    """CPU threads (cores) each rank computes with (`plan profile` on CPU ranks: 1, torch.set_num_threads); 0 where
    it does not apply or is unknown (GPUs)."""
    comm_shares_compute: bool = False
    """Whether a rank's collectives run on the same cores as its compute: gloo on CPU ranks does its copies,
    reductions and send/receive loop on host threads that compete with the rank's compute thread(s) for its cores,
    so a collective cannot hide behind compute (the cost model serialises the two). False on GPUs, where NCCL runs
    on its own SMs and copy engines beside the compute kernels."""
    sync_wait: tuple[tuple[float, float], ...] = ()
    """[seconds of compute since the ranks last met in a collective, seconds the next blocking collective waits
    beyond its measured curve], increasing in compute: ranks that share a host's cores arrive apart after the same
    work (`hardware_profiles.measure_collectives.sync_wait_points`). Measured on CPU ranks; empty elsewhere (no
    wait priced)."""

    by_precision: Mapping[str, PrecisionRates] = field(default_factory=dict)
    """Precision ("bf16", "fp16") -> rates measured at it on CPU ranks (`PrecisionRates`); empty in profiles measured
    before `plan profile` took them, and on GPUs (where `matmul_efficiency` is measured at bf16 already)."""

    def rates(self, precision: str) -> PrecisionRates | None:
        """The rates measured at a 16-bit `precision`, or None where the profile has none."""
        return self.by_precision.get(precision)

    def matmul_curve(self, precision: str) -> tuple[tuple[float, float], ...]:
        """The matmul efficiency curve at `precision`: its own where measured (`by_precision`), else
        `matmul_efficiency`."""
        r = self.by_precision.get(precision)
        return r.matmul_efficiency if r is not None and r.matmul_efficiency else self.matmul_efficiency

    def kernel_cost(self, family: str, precision: str = "fp32") -> tuple[float, float] | None:
        """(forward, backward) seconds per element of a kernel family on a tensor of `precision`: measured at it
        (`by_precision`) where the profile has that, else `kernel_costs`; None where neither lists the family."""
        r = self.by_precision.get(precision)
        if r is not None and family in r.kernel_costs:
            return r.kernel_costs[family]
        return self.kernel_costs.get(family)

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

    @property
    def cpu_ranks(self) -> bool:
        """Whether the ranks are CPU processes: gloo over loopback, the link kind `plan profile` writes for CPU
        ranks (torch.autocast("cpu") follows other op lists than CUDA's)."""
        return self.intra_node.kind == "loopback"

    def with_nodes(self, nodes: int) -> "Cluster":
        """The same cluster with a different node count."""
        if nodes < 1:
            raise ProfileError(f"--nodes must be >= 1, got {nodes}")
        return Cluster(name=self.name, nodes=nodes, devices_per_node=self.devices_per_node, device=self.device,
                       intra_node=self.intra_node, inter_node=self.inter_node, collectives=self.collectives)

    def with_attention_kernel(self, kernel: str) -> "Cluster":
        """The same cluster pricing SDPA with `kernel`: one the profile's attention block lists (e.g. flash2, cudnn,
        flash3 on the H100 preset) or `UNFUSED_ATTENTION` (separate kernels: a run without FlashAttention)."""
        att = self.device.attention
        table = att.kernels if att is not None else ()
        listed = [k for k, _, _ in table] or ([att.kernel] if att is not None and att.kernel else [])
        if kernel == UNFUSED_ATTENTION:
            new = replace(att, forward_efficiency=0.0, backward_efficiency=0.0, kernel=kernel) if att is not None \
                else AttentionModel(forward_efficiency=0.0, backward_efficiency=0.0, kernel=kernel)
        elif any(k == kernel for k, _, _ in table):
            f, b = next((f, b) for k, f, b in table if k == kernel)
            new = replace(att, forward_efficiency=f, backward_efficiency=b, kernel=kernel)
        elif att is not None and att.kernel == kernel:
            return self
        else:
            names = ", ".join([*listed, UNFUSED_ATTENTION])
            raise ProfileError(f"--attention {kernel}: the profile {self.name} prices the attention kernels {names}; "
                               "pick one of them (or add the kernel's efficiencies to the profile's attention block)")
        return replace(self, device=replace(self.device, attention=new))

    def curve(self, collective: str, level: str, group_size: int) -> CollectiveCurve | None:
        """The measured curve for this collective, level and group size, if the profile has one."""
        for c in self.collectives:
            if c.collective == collective and c.level == level and c.group_size == group_size:
                return c
        return None
