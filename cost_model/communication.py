"""Collective communication time: alpha-beta ring formulas per link level, one ring across nodes, measured
curves first.

Formulas (shared/reference/formulas.csv):
- all-reduce (allreduce_time_bandwidth_term, alpha_beta_ring_allreduce): 2(n-1)/n * S/B + 2(n-1) alpha
- all-gather / reduce-scatter (reducescatter_allgather_time): (n-1)/n * S/B + (n-1) alpha
- all-to-all (alltoall_and_in_network_factors): (n-1)/n * S/B + (n-1) alpha
- broadcast (broadcast_reduce_time): S/B + (n-1) alpha (pipelined ring)
- send/recv: S/B + alpha
S is the whole array (nccl-tests convention), B the per-device unidirectional link bandwidth.

A group spanning k nodes with g members per node runs NCCL's ring over all n members (nccl_internal_cost_model:
algBw = busBw * n / nsteps, n the ranks, not the nodes): each member moves the ring's 2(n-1)/n*S over NVLink, and
the g members of a node share the network through their g NICs, so the bandwidth term is 2(n-1)/n*S over
min(B_intra, g * B_inter). Measured: 4 DGX A100 (32 GPUs, 8x 200 Gb per node) reach 192 GB/s all-reduce busbw =
8 x 24 GB/s, and 4 DGX H100 370 GB/s = min(370, 8 x 48) (nccl_measured_bandwidth.csv NVIDIA_GTC25_reference,
32-GPU rows); a two-level count, 2(k-1)/k*S/g on the network (hierarchical_allreduce_traffic), would give 247
and 406 GB/s. Latency follows NCCL's ring model: base + (steps - inter_steps) * intra_latency + inter_steps *
inter_latency.

A measured curve in the profile for (collective, level, group size) replaces the formula; other group sizes fall
back to the formula.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from hardware_profiles.schema import Cluster, CollectiveCurve

NCCL_RING_BASE_LATENCY_S = 8.4e-6
"""NCCL ring base latency, Simple protocol: baseLat Ring Simple = 8.4 us (nccl_tuning_latency_constants.csv, NVIDIA
nccl src/graph/tuning.cc @ b6475625). Applied to NCCL link kinds only (not shm/loopback, i.e. gloo on one host)."""
NCCL_LINK_KINDS = frozenset({"nvlink", "nvswitch", "pcie", "infiniband", "roce", "ethernet"})
"""Link kinds on which collectives run through NCCL."""
NCCL_LL_US = {"base_ring": 6.6, "base_tree": 6.8, "ring": {"nvlink": 0.6, "pci": 1.0, "net": 2.7},
              "tree": {"nvlink": 0.6, "pci": 1.0, "net": 5.0}, "net_overhead": 1.0}
"""NCCL's latencies (us) for its LL protocol, which it picks for a message of a few bytes: baseLat Ring/Tree LL,
hwLat by link (NVLink, PCI, NET) for Ring and Tree LL, and the per-step host overhead that bounds the intra-node
latency when the group spans nodes (netOverhead, Intel CPUs) (nccl_tuning_latency_constants.csv, NVIDIA nccl
src/graph/tuning.cc @ b6475625)."""
NCCL_OVERLAP_COMPUTE_SLOWDOWN = 0.189
"""Fraction by which compute kernels slow down while an NCCL collective runs concurrently on the same GPU: NCCL
runs each channel as a CTA on an SM (and streams through HBM), so an overlapped collective takes SMs and memory
bandwidth from the compute it hides behind. Measured average over GPT and LLaMA training kernels on A100, H100,
MI250 and MI210: 18.9 % (max 40 %) (Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed
Deep Learning, arXiv 2507.03114, abstract). First-principles check: an nsys trace of an H100 (132 SMs) shows an
ncclAllGather of 24 CTAs beside a GEMM, 24/132 = 18 % of the SMs (NVIDIA developer forum thread "Compute-
Communication Overlap Causes Severe GEMM Performance Degradation because of Tail Effect")."""


@dataclass(frozen=True)
class Group:
    """A communication group: its size and how it lies over the nodes."""

    size: int
    """Ranks in the group (n)."""
    nodes: int
    """Nodes the group spans (k)."""

    @property
    def per_node(self) -> int:
        """Members per node (g = n / k)."""
        return max(1, self.size // self.nodes)


def mesh_groups(dp: int, tp: int, pp: int, devices_per_node: int) -> dict[str, Group]:
    """The tp, dp and pp groups of a mesh laid out tp innermost (contiguous ranks), then dp, then pp outermost.

    tp spans ceil(tp / devices_per_node) nodes; dp members sit tp ranks apart, pp members tp*dp apart."""
    def span(size: int, stride: int) -> Group:
        if size <= 1:
            return Group(1, 1)
        if stride >= devices_per_node:
            return Group(size, size)
        per_node = max(1, devices_per_node // stride)
        return Group(size, max(1, -(-size // per_node)))
    return {"tp": span(tp, 1), "dp": span(dp, tp), "pp": span(pp, tp * dp)}


def _curve_time(curve: CollectiveCurve, nbytes: float) -> float:
    """Time from a measured curve: linear between points; below the first point its time (the latency floor);
    above the last, the last segment's bandwidth."""
    pts = curve.points
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if len(pts) == 1:
        return pts[0][1] * nbytes / pts[0][0]
    if nbytes >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        i = bisect.bisect_right([p[0] for p in pts], nbytes)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    slope = (y1 - y0) / (x1 - x0)
    return y0 + slope * (nbytes - x0)


class CommModel:
    """Prices collectives on one cluster."""

    def __init__(self, cluster: Cluster):
        """Keep the cluster's link levels and measured curves."""
        self.cluster = cluster

    def overlap_slowdown(self, group: Group) -> float:
        """Fraction by which compute slows while a collective over `group` overlaps it
        (`NCCL_OVERLAP_COMPUTE_SLOWDOWN` when the group's links run NCCL; 0 for gloo on CPU ranks, not measured)."""
        if group.size <= 1:
            return 0.0
        link = self.cluster.inter_node if group.nodes > 1 else self.cluster.intra_node
        return NCCL_OVERLAP_COMPUTE_SLOWDOWN if link.kind in NCCL_LINK_KINDS else 0.0

    def shares_compute(self, group: Group) -> bool:
        """Whether collectives over `group` run on the cores the rank computes on (the profile's
        `comm_shares_compute`: gloo on CPU ranks), so that they serialise with compute instead of overlapping it."""
        return group.size > 1 and self.cluster.device.comm_shares_compute

    def sync_wait(self, group: Group, compute_s: float) -> float:
        """Seconds a blocking collective over `group` waits for its ranks to arrive after `compute_s` of compute
        since they last met, beyond its own time: the profile's `sync_wait` (ranks sharing a host's cores arrive
        apart), linear between its points from (0, 0) and the last point's beyond them; 0 where not measured
        (GPUs)."""
        pts = self.cluster.device.sync_wait
        if group.size <= 1 or not pts or compute_s <= 0:
            return 0.0
        xs, ys = [0.0] + [x for x, _ in pts], [0.0] + [y for _, y in pts]
        if compute_s >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, compute_s)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (compute_s - xs[i - 1]) / (xs[i] - xs[i - 1])

    def _alpha_terms(self, steps: int, inter_steps: int) -> float:
        intra, inter = self.cluster.intra_node, self.cluster.inter_node
        nccl = intra.kind in NCCL_LINK_KINDS or (inter_steps > 0 and inter.kind in NCCL_LINK_KINDS)
        base = NCCL_RING_BASE_LATENCY_S if nccl else 0.0
        return base + (steps - inter_steps) * intra.latency + inter_steps * inter.latency

    def scalar_all_reduce(self, group: Group) -> float:
        """Seconds for an all-reduce of one fp32 scalar over `group` (a loss, a gradient norm): a measured curve's
        first point; on NCCL links NCCL's own choice for a message of a few bytes, the LL protocol over a ring or,
        across nodes, a tree, whichever its model prices lower (ring: base + (steps - inter_steps) intra +
        inter_steps inter; tree: base + 2 ((g - 1) intra + log2(k) inter); nccl_tuning_latency_constants.csv); else
        the ring formula (`time`)."""
        n, k, g = group.size, group.nodes, group.per_node
        if n <= 1:
            return 0.0
        level = "intra_node" if k == 1 else "inter_node"
        intra, inter = self.cluster.intra_node.kind, self.cluster.inter_node.kind
        nccl = intra in NCCL_LINK_KINDS and (k == 1 or inter in NCCL_LINK_KINDS)
        if self.cluster.curve("all_reduce", level, n) is not None or not nccl:
            return self.time("all_reduce", 4.0, group)
        hw = lambda kind: "pci" if kind == "pcie" else "nvlink" if kind in ("nvlink", "nvswitch") else "net"
        c = NCCL_LL_US
        steps, inter_steps = 2 * (n - 1), (2 * k if k > 1 else 0)
        intra_ring = max(c["ring"][hw(intra)], c["net_overhead"]) if k > 1 else c["ring"][hw(intra)]
        ring = c["base_ring"] + (steps - inter_steps) * intra_ring + inter_steps * c["ring"]["net"]
        if k > 1:
            intra_tree = max(c["tree"][hw(intra)], c["net_overhead"])
            tree = c["base_tree"] + 2 * ((g - 1) * intra_tree + math.log2(k) * c["tree"]["net"])
            ring = min(ring, tree)
        return ring * 1e-6

    def time(self, collective: str, nbytes: float, group: Group) -> float:
        """Seconds for one collective of `nbytes` (whole array) over `group`; 0 for a group of one."""
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        level = "intra_node" if group.nodes == 1 else "inter_node"
        curve = self.cluster.curve(collective, level, n)
        if curve is not None:
            return _curve_time(curve, nbytes)
        k, g = group.nodes, group.per_node
        b_intra, b_inter = self.cluster.intra_node.bandwidth, self.cluster.inter_node.bandwidth
        if collective == "all_reduce":
            factor, steps, inter_steps = 2.0, 2 * (n - 1), (2 * k if k > 1 else 0)
        elif collective in ("all_gather", "reduce_scatter", "all_to_all"):
            factor, steps, inter_steps = 1.0, n - 1, k - 1
        elif collective == "broadcast":
            factor, steps, inter_steps = 0.0, n - 1, k - 1
            return nbytes / (b_inter if k > 1 else b_intra) + self._alpha_terms(steps, inter_steps)
        elif collective == "send_recv":
            return nbytes / (b_inter if k > 1 else b_intra) + self._alpha_terms(1, 1 if k > 1 else 0)
        else:
            raise ValueError(f"unknown collective {collective!r}")
        ring = factor * (n - 1) / n * nbytes  # bytes each member sends around the ring
        if k == 1:
            bw_term = ring / b_intra
        else:  # the node's g members share the network through their g NICs
            bw_term = max(ring / b_intra if g > 1 else 0.0, ring / (g * b_inter))
        return bw_term + self._alpha_terms(steps, inter_steps)
