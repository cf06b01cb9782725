"""From rank 0's raw measurements (`hardware_profiles.probe.run_rank`) to a profile: the `Cluster` they describe
(`build_cluster`: rates over the best measured ones, fitted ring links, bf16 rates on CPU ranks) and the comment
lines written above its YAML (`header`: where, when and how it was measured)."""
from __future__ import annotations

import datetime as _dt
import re
import socket
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from hardware_profiles.schema import (Cluster, CollectiveCurve, DeviceSpec, LinkSpec, MatmulModel, OpOverhead,
                                      PrecisionRates, ProfileError)


def _efficiency(rates: Sequence[tuple[float, float]], peak: float) -> tuple[tuple[float, float], ...]:
    """[(size, rate / peak)]: fractions of the best measured rate, which is 1.0 at its size."""
    return tuple((float(s), min(1.0, r / peak)) for s, r in rates)


GEMM_TILES = ((256, 128), (128, 128))
"""Output tiles a probed GPU profile's GEMM-by-shape model picks among: the two largest of NVIDIA's "Matrix
Multiplication Background User's Guide" (Sec. 2.3, the most efficient in cuBLAS), as the presets list them."""


def gemm_depth_model(m: int, n: int, points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(deep-K FLOP/s, k_overhead) of the GEMM depth sweep: its M x N GEMMs fill whole waves, so their seconds are a
    line in K, t = a K + c (least squares of the relative misses, as timing noise is a share of each time, over
    `points` [(K, seconds)]): 2MN / a is the rate of the K loop alone and c / a the elements of K each output tile
    spends beyond it (pipeline fill, epilogue; `MatmulModel.k_overhead`, at least 0). None with fewer than two
    depths or a slope that is not positive."""
    if len({k for k, _ in points}) < 2 or any(t <= 0 for _, t in points):
        return None
    w = [1.0 / (t * t) for _, t in points]  # minimise sum ((a K + c - t) / t)^2
    sw = sum(w)
    mk = sum(wi * k for wi, (k, _) in zip(w, points)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, points)) / sw
    a = sum(wi * (k - mk) * (t - mt) for wi, (k, t) in zip(w, points)) / \
        sum(wi * (k - mk) ** 2 for wi, (k, _) in zip(w, points))
    if a <= 0:
        return None
    return 2.0 * m * n / a, max(0.0, (mt - a * mk) / a)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "profiled"


def _inter_kind() -> str:
    ib = Path("/sys/class/infiniband")
    return "infiniband" if ib.is_dir() and any(ib.iterdir()) else "ethernet"


def _op_overhead(measured: dict[str, float]) -> OpOverhead:
    """The OpOverhead fields of rank 0's overhead figures (the raw DDP step / all-reduce times stay in raw)."""
    names = {f.name for f in fields(OpOverhead)}
    return OpOverhead(**{k: float(v) for k, v in measured.items() if k in names})


def build_cluster(raw: dict[str, Any], name: str | None = None, links_from: Cluster | None = None) -> Cluster:
    """The Cluster that `raw` (rank 0's measurements) describes; with one rank (no curves measured) its links and
    collective curves are `links_from`'s."""
    from hardware_profiles.measure_collectives import fit_ring_allreduce
    world, local_world, dev = raw["world"], raw["local_world"], raw["device"]
    cuda = raw["backend"] == "nccl"
    main_dtype = "bf16" if cuda else "fp32"  # the dtype training runs in on this hardware
    peaks = {dt: max(r for _, r in rates) for dt, rates in raw["matmul"].items()}
    low = raw.get("bf16")
    if low and low["linear"]:  # a bf16 linear forward (AMX) may beat the small square matmuls timed at bf16; not
        # its backward, a difference of two noisy times (under load it once came out at 3e16 FLOP/s)
        peaks["bf16"] = max(peaks["bf16"], *(f for _, f, _ in low["linear"]))
    depth = raw.get("gemm_depths")
    fitted = gemm_depth_model(depth["m"], depth["n"], depth["seconds"]) if depth else None
    if fitted:  # a deep K loop may outrun every square matmul: the peak is the best rate measured either way
        peaks["bf16"] = max(peaks["bf16"], fitted[0])
    bw_peak = max(r for _, r in raw["copy"])
    device = DeviceSpec(name=dev["name"], memory_bytes=int(dev["memory_bytes"]),
                        usable_memory_fraction=round(min(1.0, dev["usable_fraction"]), 4),
                        peak_flops=peaks, memory_bandwidth=bw_peak,
                        matmul_efficiency=_efficiency(raw["matmul"][main_dtype], peaks[main_dtype]),
                        memory_efficiency=_efficiency(raw["copy"], bw_peak),
                        op_overhead=_op_overhead(raw.get("overhead", {})),
                        kernel_costs={k: (float(f), float(b)) for k, (f, b) in raw.get("kernels", {}).items()},
                        linear_efficiency=_efficiency([(f, r) for f, r, _ in raw.get("linear", [])],
                                                      peaks[main_dtype]),
                        linear_backward_efficiency=_efficiency([(f, r) for f, _, r in raw.get("linear", [])],
                                                               peaks[main_dtype]),
                        sms=int(dev.get("sms", 0)), async_host=cuda, kernel_floor=float(raw.get("kernel_floor", 0.0)),
                        matmul=MatmulModel(tiles=GEMM_TILES, best_efficiency=fitted[0] / peaks["bf16"],
                                           k_overhead=fitted[1]) if fitted else None,
                        # gloo's collectives run on host threads beside the rank's compute thread(s), on its cores
                        threads=int(dev.get("threads", 0)), comm_shares_compute=not cuda,
                        sync_wait=tuple((float(x), float(y)) for x, y in raw.get("sync_wait", ())),
                        matmul_shapes=tuple(tuple(r) for r in raw.get("matmul_shapes", ())),
                        attention_shapes=tuple(tuple(r) for r in raw.get("attention_shapes", ())),
                        norm_shapes=tuple(tuple(r) for r in raw.get("norm_shapes", ())),
                        reduce_shapes=tuple(tuple(r) for r in raw.get("reduce_shapes", ())),
                        by_precision=_by_precision(raw, peaks))
    links, curves = {}, []
    for level, by_name in raw["curves"].items():
        n = local_world if level == "intra_node" else world // local_world
        bw, lat = fit_ring_allreduce(by_name["all_reduce"], n)
        kind = dev["link_kind"] if level == "intra_node" else _inter_kind()
        links[level] = LinkSpec(kind=kind, bandwidth=bw, latency=lat)
        for coll, points in by_name.items():
            curves.append(CollectiveCurve(collective=coll, level=level, group_size=2 if coll == "send_recv" else n,
                                          points=tuple((int(s), float(t)) for s, t in points)))
    if not links:
        if links_from is None:
            raise ProfileError("one rank measures no links: add --links-from PRESET (the profile whose links to keep)")
        links = {"intra_node": links_from.intra_node, "inter_node": links_from.inter_node}
        curves = list(links_from.collectives)
    if "inter_node" not in links:  # one host: no second node to measure; inter-node = the same loopback
        i = links["intra_node"]
        links["inter_node"] = LinkSpec(kind="loopback", bandwidth=i.bandwidth, latency=i.latency)
    return Cluster(name=name or ("cpu-local" if not cuda else _slug(dev["name"])), nodes=world // local_world,
                   devices_per_node=local_world, device=device, intra_node=links["intra_node"],
                   inter_node=links["inter_node"], collectives=tuple(curves))


def _by_precision(raw: dict[str, Any], peaks: dict[str, float]) -> dict[str, PrecisionRates]:
    """CPU ranks' bf16 measurements as `DeviceSpec.by_precision` (fractions of the bf16 peak); {} without them."""
    low = raw.get("bf16")
    if not low:
        return {}
    pk = peaks["bf16"]
    return {"bf16": PrecisionRates(matmul_efficiency=_efficiency(raw["matmul"]["bf16"], pk),
                                   linear_efficiency=_efficiency([(f, r) for f, r, _ in low["linear"]], pk),
                                   linear_backward_efficiency=_efficiency([(f, r) for f, _, r in low["linear"]], pk),
                                   attention_efficiency=_by_head_dim(low.get("attention", []), 2, pk),
                                   attention_backward_efficiency=_by_head_dim(low.get("attention", []), 3, pk),
                                   kernel_costs={k: (float(f), float(b)) for k, (f, b) in low["kernels"].items()})}


def _by_head_dim(rows: Sequence[tuple], col: int, peak: float) -> dict[int, tuple[tuple[float, float], ...]]:
    """{head dim: [(FLOPs, rate / peak)]} of `attention_rates` rows (rate in column `col`)."""
    dims = sorted({int(r[0]) for r in rows})
    return {d: _efficiency([(r[1], r[col]) for r in rows if r[0] == d], peak) for d in dims}


def header(raw: dict[str, Any], elapsed: float, links_from: Cluster | None = None) -> str:
    import torch
    nodes = raw["world"] // raw["local_world"]
    lines = [f"Measured by `plan profile` on {socket.gethostname()}, {_dt.date.today().isoformat()}: "
             f"{raw['world']} ranks ({raw['backend']}, {nodes} node(s) x {raw['local_world']}), torch "
             f"{torch.__version__}, {elapsed:.1f} s.",
             "peak_flops and memory_bandwidth are the best rates measured here (expected time over repeats, median over "
             "ranks; on GPUs device time of calls queued back to back, the host ahead, as a step runs them), not "
             "datasheet peaks;",
             "matmul_efficiency / memory_efficiency are the measured rates by size divided by them (square "
             "matmuls; tensor copies, bytes read + written).",
             "op_overhead: seconds per op of a chain of 64 one-element adds (forward; backward per autograd node), "
             "per parameter tensor of a default AdamW step,",
             "matmul_*: a chain of tiny 2-D matmuls y @ w; dtensor_*: the same on replicated DTensors over a "
             "1-D mesh of all ranks (the elementwise chain multiplies, so each backward node dispatches one op). "
             "kernel_costs: [forward, backward] seconds per element "
             "of fp32 kernels on a 256 x 512 tensor (GPUs: adamw, the executor's default AdamW on a "
             "2^26-element parameter, and widen, a bf16 -> fp32 conversion of as many elements; other elementwise "
             "kernels are priced by their bytes). fsdp_*: FSDP2's seconds per "
             "fully_shard'ed module and per parameter tensor (forward + backward of a stack of tiny modules, minus the same unsharded).",
             "ddp_*: DDP's own seconds per synchronised step, parameter tensor and gradient byte (nn.Linear stacks "
             "under DDP minus unwrapped, minus their buckets' all-reduces alone); dtensor_redistribute: seconds per "
             "DTensor all-gather of an activation between matmuls (ranks lined up by a barrier) beyond the all-gather "
             "alone; dtensor_local_call_*: "
             "seconds per call of a tiny module run on local tensors through hooks that unwrap its DTensor input "
             "and wrap its output (a chain of them, minus the same chain plain). checkpoint_* / sac_*: "
             "seconds per op (elementwise; *_linear_*: F.linear) of a fully / selectively checkpointed chain of "
             "16 tiny ops beyond the same chain plain (backward: beyond one plain re-run too); function_mode_op / "
             "checkpoint_call_*: per call of a tiny GPT block's forward under recompute=attention's function mode, "
             "and its SDPA call's re-run in backward (beyond the block under the mode alone); mesh_slice: one "
             "mesh['dp'].get_local_rank() on a (pp, dp, tp) DeviceMesh (host time: CPU time on CPU ranks, wall "
             "time on GPUs, where the autograd engine's own thread runs the backward). linear_* / "
             "dtensor_linear_*: a chain of tiny F.linear calls on a 2-D input, *_nd_* on a (1, 2, 2) one (a "
             "model's (batch, sequence, features): F.linear flattens and restores the leading dims).",
             "linear_efficiency / linear_backward_efficiency: nn.Linear(n, n) on n tokens, forward and backward "
             "rates (per-op overheads taken out) over peak_flops, by forward FLOPs, timed with the weights out of "
             "cache and the input in, as a step finds them. by_precision.bf16 (CPU ranks): the same linears with bf16 "
             "weights and input, and the square bf16 matmuls, over the bf16 peak (the best of their forward rates); "
             "attention_efficiency / attention_backward_efficiency: by head dim d, causal SDPA on (1, 8, s, d) bf16 "
             "q, k, v, by dense forward FLOPs 4 b s^2 d, rates over those FLOPs (backward: 2.5x them); "
             "kernel_costs of add, gelu, tanh on a bf16 tensor (autocast runs norms, softmax and losses in fp32) and "
             "widen, a bf16 -> fp32 conversion per element.",
             "matmul_shapes / attention_shapes (--model): the model's own GEMMs [batch, M, N, K, precision, s, layout] "
             "(layout: nn, nt = second operand read transposed as F.linear reads its weight, tn = first) and "
             "SDPA calls [b*h, s_q, s_k, d, causal, precision, fwd s, bwd s]; norm_shapes: its layer/RMS norms "
             "[rows, width, parameters, function, fp32 (autocast runs norms in fp32), fwd s, bwd s]; reduce_shapes: "
             "its linears' bias gradients [rows, width, precision, s] (sum over the rows); expected "
             "device time (CUDA events around calls queued back to back on GPUs; wall clock minus op_overhead on "
             "CPUs). kernel_floor (GPUs): device seconds per kernel of 64 one-element adds replayed as a CUDA graph. "
             "matmul (GPUs): GEMMs priced by shape (tile and wave quantization over `sms`); best_efficiency and "
             "k_overhead from bf16 GEMMs of 1024 x (256 x sms) outputs (whole waves) at K = 512 .. 16384, whose times "
             "are a line in K: the K loop's rate over the bf16 peak (which is that rate where it beats every square "
             "matmul), and the intercept over the slope (the K each output tile spends beyond its loop).",
             "usable_memory_fraction: free / total memory when measured (GPUs: at most 0.9, the presets' reserve for "
             "NCCL buffers and allocator fragmentation, which an idle device does not show). links: bandwidth and "
             "latency fitted to "
             "the measured all-reduce",
             "with the ring model t = 2(n-1)/n * S/B + 2(n-1)*alpha (Thakur et al. 2005). Collective points are "
             "[bytes, seconds] expected times (mean of the repeats without the slowest 5 %; on CPU ranks each of one call issued alone after a barrier, as training "
             "issues them between ops; on GPUs of back-to-back loops for small messages, as nccl-tests)."]
    if raw["backend"] == "gloo":
        lines.append("CPU ranks: `threads` compute threads each; gloo talks TCP over the loopback interface (kind "
                     "loopback) from threads on the same cores (comm_shares_compute: no overlap with compute). "
                     "sync_wait: [seconds of 128 x 128 matmuls on every rank, seconds the barrier after them takes "
                     "beyond one issued right after another] (mean over ranks): how far apart the ranks reach a "
                     "collective after that much compute.")
    if links_from is not None and raw["world"] == 1:
        lines.append(f"One rank: no link measured; links and collective curves are those of {links_from.name} "
                     "(--links-from), not of this machine.")
    elif nodes == 1:
        lines.append("One node: inter_node is a copy of intra_node with kind loopback (no second node measured).")
    return "\n".join(lines)
