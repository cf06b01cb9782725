"""Benchmark `plan profile` at its CPU default (2 gloo ranks): wall time (target: under 60 s) and what it measured.

    python3 benchmarks/profile_cpu.py [--nproc N] [-o cluster.yaml]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from hardware_profiles import load_cluster, save_cluster
from hardware_profiles.probe import profile_local


def main() -> int:
    """Run the default CPU profile once and print elapsed time, fitted link, matmul and copy rates."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("-o", "--output", default=None, help="also keep the YAML here")
    args = p.parse_args()
    start = time.perf_counter()
    result = profile_local(nproc=args.nproc, backend="gloo", quick=False, progress=sys.stderr.isatty())
    out = Path(args.output) if args.output else Path(tempfile.mkdtemp()) / "cluster.yaml"
    save_cluster(result.cluster, out, header=result.header)
    elapsed = time.perf_counter() - start
    c = load_cluster(str(out))
    assert c == result.cluster, "the written YAML does not load back to the measured cluster"
    link = c.intra_node
    print(f"plan profile (CPU default, {args.nproc} gloo ranks): {elapsed:.1f} s wall (target < 60 s)")
    print(f"  fitted ring all-reduce link: {link.bandwidth / 1e9:.3f} GB/s per rank, "
          f"{link.latency * 1e6:.1f} us per step")
    mm = ", ".join(f"{flops / 1e6:.3g} MFLOP {eff * c.device.peak_flops['fp32'] / 1e9:.1f}"
                   for flops, eff in c.device.matmul_efficiency)
    print(f"  fp32 matmul GFLOP/s per rank by size: {mm}")
    print("  best matmul GFLOP/s per rank: " + ", ".join(f"{k} {v / 1e9:.2f}"
                                                          for k, v in c.device.peak_flops.items()))
    print(f"  best memory copy: {c.device.memory_bandwidth / 1e9:.1f} GB/s (read + write) per rank")
    ar = c.curve("all_reduce", "intra_node", args.nproc)
    print("  all_reduce: " + ", ".join(f"{s // 1024} KiB {t * 1e6:.0f} us" for s, t in ar.points))
    print(f"  written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
