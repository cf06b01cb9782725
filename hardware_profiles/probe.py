"""`plan profile`: measure the cluster this runs on and write it as a profile YAML.

    plan profile [--nproc N] [--backend nccl|gloo] [-o cluster.yaml] [--quick] [--model MODEL.py ...]

Without CUDA it starts N local CPU ranks (gloo, one thread each); with CUDA one rank per GPU (NCCL). Under
torchrun across nodes (LOCAL_WORLD_SIZE < WORLD_SIZE) it also measures the inter-node level. Each rank measures
matmul throughput by size, memory-copy bandwidth and collective time by message size; rank 0 turns the
measurements into a profile (`hardware_profiles.fit`: rates, the ring all-reduce's bandwidth and latency) and
writes the YAML atomically. With `--model`, each rank also times that
model's own GEMM, attention and norm shapes (`hardware_profiles.shapes`), which the cost model prefers to its
first-principles shape model.
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from hardware_profiles import host
from hardware_profiles.files import unwritable_output
from hardware_profiles.fit import build_cluster, header
from hardware_profiles.schema import Cluster, ProfileError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> _Parser:
    p = _Parser(prog="plan profile", description=(
        "Measure this machine (or, under torchrun, these machines) and write a cluster profile YAML for "
        "`plan --cluster`: matmul throughput by size and dtype, memory bandwidth, and collective time by message "
        "size, with the link bandwidth and latency fitted to the measured all-reduce. Without CUDA it measures N "
        "local CPU ranks over gloo.\n\nOn GPU nodes: torchrun --nnodes=K --nproc-per-node=G -m planner.cli "
        "profile --backend nccl -o cluster.yaml"), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="local ranks to start (default: the GPU count with CUDA, else 2); ignored under torchrun")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    p.add_argument("-o", "--output", default="cluster.yaml", metavar="PATH",
                   help="where to write the profile (default: cluster.yaml)")
    p.add_argument("--name", default=None, help="profile name written into the YAML (default: from the device)")
    p.add_argument("--quick", action="store_true", help="few sizes and repeats (seconds; for tests)")
    p.add_argument("--model", action="append", default=None, metavar="MODEL.py",
                   help="also time this model's own GEMMs (in the operand layouts the step runs), attention "
                        "calls, layer / RMS norms and bias gradients (traced at batch 1, unsharded; the cost model "
                        "scales them to other micro-batches and tp splits) and write them as matmul_shapes / "
                        "attention_shapes / norm_shapes / reduce_shapes; repeat it for several models (one "
                        "profile for all)")
    p.add_argument("--links-from", default=None, metavar="PRESET|YAML",
                   help="with one rank (a machine with one GPU) there is no link to measure: keep the links and "
                        "collective curves of this profile (e.g. dgx-h100) and say so in the header")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What one profiling run produced."""

    cluster: Cluster
    """The measured cluster."""
    header: str
    """Comment lines written above the YAML: where, when and how it was measured."""
    elapsed_s: float
    """Wall time of the run, process start-up included."""
    raw: dict[str, Any] = field(default_factory=dict)
    """Rank 0's raw measurements (per-repeat samples where kept), for tests and benchmarks."""


# ---- the work of one rank ----------------------------------------------------------------------------------------

def _gather_median(local: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Median rate across ranks at each size (all ranks measure at once, as they would train)."""
    import torch.distributed as dist
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return [(size, statistics.median(r[i][1] for r in everyone)) for i, (size, _) in enumerate(local)]


def _node_groups(world: int, local_world: int) -> tuple[Any, Any]:
    """(this rank's intra-node group, its inter-node group): None/None on one node (the default group)."""
    import torch.distributed as dist
    if local_world == world:
        return None, None
    rank = dist.get_rank()
    intra = inter = None
    for node in range(world // local_world):  # every rank must create every group, in the same order
        g = dist.new_group(list(range(node * local_world, (node + 1) * local_world)))
        if rank // local_world == node:
            intra = g
    for local in range(local_world):
        g = dist.new_group(list(range(local, world, local_world)))
        if rank % local_world == local:
            inter = g
    return intra, inter


GPU_USABLE_CAP = 0.9
"""Most of a GPU's memory a measured profile lets a plan use: the presets' reserve for cuBLAS workspaces, NCCL
buffers and caching-allocator fragmentation (a judgment, see the presets), which an idle device's free memory does
not show (one H200 read 0.996 free after the CUDA context). Without it a probed profile would fit plans the
presets reject as out of memory."""


def _device_facts(cuda: bool, local_rank: int, local_world: int) -> dict[str, Any]:
    """Name, memory, SM count and intra-node link kind of this rank's device."""
    if cuda:
        import torch
        free, total = torch.cuda.mem_get_info(local_rank)
        return {"name": torch.cuda.get_device_name(local_rank), "memory_bytes": int(total),
                "sms": torch.cuda.get_device_properties(local_rank).multi_processor_count,
                "usable_fraction": min(free / total, GPU_USABLE_CAP),
                "link_kind": host.gpu_link_kind(local_world) if local_rank == 0 else "pcie"}
    import torch
    mem = host.meminfo()
    threads = torch.get_num_threads()
    return {"name": f"{host.cpu_name()} ({threads} thread{'s' if threads > 1 else ''} per rank)",
            "memory_bytes": mem["MemTotal"] // local_world, "threads": threads,
            "usable_fraction": mem.get("MemAvailable", mem["MemTotal"]) / mem["MemTotal"], "link_kind": "loopback"}


def _overheads(device: Any, sync: Callable[[], None], plan: Any, world: int) -> tuple[dict, dict]:
    """Per-op overheads (plain and DTensor, on a 1-D mesh over all ranks) and elementwise kernel costs, each the
    median over ranks (all ranks measure at once, as they would train)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from hardware_profiles import measure_overheads as O
    from hardware_profiles.measure_recompute import checkpoint_overheads, mesh_slice_seconds
    mesh = init_device_mesh(device.type, (world,))
    # checkpointing's host cost (measure_recompute.host_clock; on GPUs the cost model sets it against the backward's
    # kernels)
    ckpt = checkpoint_overheads(device, sync, plan)
    local = ({**O.op_overheads(device, sync, plan, mesh), **O.ddp_overheads(device, sync, plan), **ckpt,
              "mesh_slice": mesh_slice_seconds(device, sync, plan)}, O.kernel_costs(device, sync, plan))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, local)
    over = {k: statistics.median(r[0][k] for r in everyone) for k in local[0]}
    kern = {k: tuple(statistics.median(r[1][k][i] for r in everyone) for i in range(2)) for k in local[1]}
    return over, kern


def run_rank(cfg: dict[str, Any], step: Callable[[str], None]) -> dict[str, Any] | None:
    """Measure everything on this (already initialised) rank; rank 0 returns the raw results, others None."""
    import torch
    import torch.distributed as dist
    from hardware_profiles import measure as M
    from hardware_profiles import measure_collectives as C

    cuda = cfg["backend"] == "nccl"
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world, local_rank = cfg["local_world"], rank % cfg["local_world"]
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    plan = M.plan_for(cfg["quick"], cuda)
    raw: dict[str, Any] = {"world": world, "local_world": local_world, "backend": cfg["backend"],
                           "device": _device_facts(cuda, local_rank, local_world), "matmul": {}, "curves": {}}
    for dt, sizes in plan.matmul_sizes.items():
        raw["matmul"][dt] = _gather_median(M.matmul_rates(dt, sizes, device, sync, plan))
        step(f"matmul {dt}")
    if cuda:  # GEMMs by shape: K swept at whole waves (fit.gemm_depth_model)
        raw["gemm_depths"] = _gemm_depths(raw["device"]["sms"], device, sync, plan)
        step("GEMM depths")
    raw["copy"] = _gather_median(M.copy_rates(plan.copy_bytes, device, sync, plan))
    step("memory copy")
    raw["overhead"], raw["kernels"] = _overheads(device, sync, plan, world)
    if not cuda:  # linears at the main dtype; on GPUs that is bf16, whose curve matmul_efficiency already is
        local = M.linear_rates(plan.matmul_sizes["fp32"], device, sync, plan, raw["overhead"])
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, local)
        raw["linear"] = [(f, statistics.median(r[i][1] for r in everyone),
                          statistics.median(r[i][2] for r in everyone)) for i, (f, _, _) in enumerate(local)]
        if plan.bf16_linear_sizes:  # bf16 is not fp32 at another peak on CPUs: its own linears and kernels
            raw["bf16"] = _bf16_rates(device, sync, plan, raw["overhead"], world)
    step("op overheads")
    if cfg.get("shapes"):
        raw.update(_model_shapes(cfg["shapes"], device, sync, plan, raw["overhead"], cuda, world))
        step("model shapes")
    intra, inter = _node_groups(world, local_world)
    levels = [("intra_node", intra)] + ([("inter_node", inter)] if world > local_world else [])
    if world == 1:  # nothing to communicate with: the links come from --links-from
        levels = []
    for level, group in levels:
        raw["curves"][level] = {}
        for name in plan.collectives:
            samples = C.collective_samples(name, plan.collective_bytes, device, sync, plan, group)
            raw["curves"][level][name] = C.expected_curve(samples)
            if name == "all_reduce" and level == "intra_node" and cfg.get("repeat_all_reduce"):
                again = C.collective_samples(name, plan.collective_bytes, device, sync, plan, group)
                raw["all_reduce_runs"] = [samples, again]
            step(f"{name} ({level.replace('_', '-')})")
    if not cuda and world > 1:  # ranks sharing a host's cores arrive apart at each collective
        raw["sync_wait"] = C.sync_wait_points(device, plan, intra)
        step("sync wait")
    return raw if rank == 0 else None


def _gemm_depths(sms: int, device: Any, sync: Callable[[], None], plan: Any,
                 depths: Sequence[int] | None = None) -> dict[str, Any]:
    """The GEMM depth sweep's shape and its [(K, seconds)] (median over ranks), for `fit.gemm_depth_model`."""
    from hardware_profiles import shapes as S
    m, n = S.depth_sweep_shape(sms)
    rows = S.gemm_depth_sweep(sms, device, sync, plan, depths or S.GEMM_DEPTHS)
    return {"m": m, "n": n, "seconds": _gather_median(rows)}


def _bf16_rates(device: Any, sync: Callable[[], None], plan: Any, overhead: dict[str, float],
                world: int) -> dict[str, Any]:
    """CPU ranks: nn.Linear rates and elementwise kernel costs at bf16 (median over ranks), for the profile's
    `by_precision.bf16`."""
    import torch.distributed as dist
    from hardware_profiles import measure as M
    from hardware_profiles.measure_overheads import bf16_kernel_costs
    local = (M.linear_rates(plan.bf16_linear_sizes, device, sync, plan, overhead, dtype="bf16"),
             bf16_kernel_costs(device, sync, plan),
             M.attention_rates(plan.bf16_attention_lengths, device, sync, plan, overhead, dtype="bf16",
                               head_dims=plan.bf16_attention_head_dims))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, local)
    med = statistics.median

    def rates(j: int) -> list[tuple]:  # the key fields, then the medians of the two rates
        return [(*row[:-2], med(r[j][i][-2] for r in everyone), med(r[j][i][-1] for r in everyone))
                for i, row in enumerate(local[j])]
    return {"linear": rates(0), "attention": rates(2),
            "kernels": {k: tuple(med(r[1][k][j] for r in everyone) for j in range(2)) for k in local[1]}}


def _model_shapes(shapes: dict[str, list], device: Any, sync: Callable[[], None], plan: Any,
                  overhead: dict[str, float], cuda: bool, world: int) -> dict[str, Any]:
    """The model's GEMM and attention shapes timed at the main dtype and its norms in fp32 (median over ranks), and
    on CUDA the per-kernel floor."""
    import torch.distributed as dist
    from hardware_profiles import shapes as S
    prec = "bf16" if cuda else "fp32"
    host = (0.0, 0.0) if cuda else (overhead.get("forward", 0.0), overhead.get("backward", 0.0))
    local = (S.gemm_seconds(shapes["gemms"], prec, device, sync, plan, host[0]),
             S.attention_seconds(shapes["attentions"], prec, device, sync, plan, host),
             S.norm_seconds(shapes.get("norms", ()), device, sync, plan, host),
             S.reduce_seconds(shapes.get("reduces", ()), prec, device, sync, plan, host[0]))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, local)
    med = lambda j, i, c: statistics.median(r[j][i][c] for r in everyone)  # noqa: E731
    out: dict[str, Any] = {
        "matmul_shapes": [(*row[:5], med(0, i, 5), *row[6:]) for i, row in enumerate(local[0])],
        "attention_shapes": [(*row[:6], med(1, i, 6), med(1, i, 7)) for i, row in enumerate(local[1])],
        "norm_shapes": [(*row[:5], med(2, i, 5), med(2, i, 6)) for i, row in enumerate(local[2])],
        "reduce_shapes": [(*row[:3], med(3, i, 3)) for i, row in enumerate(local[3])]}
    if cuda:
        out["kernel_floor"] = S.kernel_floor(device, plan)
    return out


def _init_and_run(rank: int, world: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    """Entry point of a spawned local rank: results and progress go to the parent through `q`."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # ranks share the host's cores; one thread each keeps them from fighting
    try:
        if cfg["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(cfg["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        try:
            raw = run_rank(cfg, (lambda label: q.put(("step", label))) if rank == 0 else (lambda label: None))
        finally:
            dist.destroy_process_group()
        if raw is not None:
            q.put(("result", raw))
    except BaseException as e:  # the parent turns this into one line
        q.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _total_steps(cfg: dict[str, Any], levels: int) -> int:
    from hardware_profiles.measure import plan_for
    plan = plan_for(cfg["quick"], cfg["backend"] == "nccl")
    sync = cfg["backend"] != "nccl" and levels > 0
    return (len(plan.matmul_sizes) + 2 + (cfg["backend"] == "nccl") + bool(cfg.get("shapes"))
            + levels * len(plan.collectives) + sync)


class _Bar:
    """A rich progress bar on stderr (or nothing when `show` is false)."""

    def __init__(self, total: int, show: bool):
        self.progress = None
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            self.progress = Progress(TextColumn("profiling"), BarColumn(), TextColumn("{task.description}"),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("starting ranks", total=total)

    def step(self, label: str) -> None:
        """Advance one step; `label` is the step just finished."""
        if self.progress is not None:
            self.progress.update(self.task, advance=1, description=label)

    def close(self) -> None:
        """Remove the bar."""
        if self.progress is not None:
            self.progress.stop()


def _collect(procs: list[Any], q: Any, bar: _Bar, timeout_s: float) -> dict[str, Any]:
    """Wait for rank 0's result, advancing the bar; a failed rank becomes a ProfileError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            msg = q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise ProfileError(f"plan profile: rank {procs.index(dead[0])} exited with status "
                                   f"{dead[0].exitcode} before finishing; rerun with fewer --nproc")
            continue
        if msg[0] == "step":
            bar.step(msg[1])
        elif msg[0] == "result":
            return msg[1]
        else:
            raise ProfileError(f"plan profile: rank {msg[1]} failed: {msg[2]}")
    raise ProfileError(f"plan profile: no result after {timeout_s:.0f} s; is the machine overloaded?")


def profile_local(nproc: int = 2, backend: str = "gloo", quick: bool = False, name: str | None = None,
                  repeat_all_reduce: bool = False, progress: bool = True, timeout_s: float = 600.0,
                  shapes: dict[str, list] | None = None, links_from: Cluster | None = None) -> ProbeResult:
    """Start `nproc` local ranks, measure them, and return the measured cluster (nothing is written); `shapes`
    ({"gemms": [(b, M, N, K, layout)], "attentions": [(b*h, s_q, s_k, d, causal)]}) are also timed."""
    import multiprocessing as mp
    start = time.perf_counter()
    cfg = {"backend": backend, "quick": quick, "local_world": nproc, "repeat_all_reduce": repeat_all_reduce,
           "shapes": shapes}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_init_and_run, args=(r, nproc, port, cfg, q), daemon=True) for r in range(nproc)]
    bar = _Bar(_total_steps(cfg, 1 if nproc > 1 else 0), progress)
    try:
        for p in procs:
            p.start()
        raw = _collect(procs, q, bar, timeout_s)
        for p in procs:
            p.join(timeout=30)
    finally:
        bar.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return _result(raw, name, time.perf_counter() - start, links_from)


def profile_torchrun(quick: bool, backend: str, name: str | None, progress: bool,
                     shapes: dict[str, list] | None = None) -> ProbeResult | None:
    """Measure under torchrun (env:// rendezvous); rank 0 returns the result, other ranks None."""
    import torch
    import torch.distributed as dist
    start = time.perf_counter()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local_world:
        raise ProfileError(f"plan profile: WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % local_world)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    cfg = {"backend": backend, "quick": quick, "local_world": local_world, "shapes": shapes}
    bar = _Bar(_total_steps(cfg, 1 if world == local_world else 2), progress and rank == 0)
    try:
        raw = run_rank(cfg, bar.step)
    finally:
        bar.close()
        dist.destroy_process_group()
    return None if raw is None else _result(raw, name, time.perf_counter() - start)


def _result(raw: dict[str, Any], name: str | None, elapsed: float, links_from: Cluster | None = None) -> ProbeResult:
    return ProbeResult(cluster=build_cluster(raw, name, links_from), header=header(raw, elapsed, links_from),
                       elapsed_s=elapsed, raw=raw)


# ---- the command -------------------------------------------------------------------------------------------------

def _summary(result: ProbeResult, path: str) -> str:
    c = result.cluster
    i = c.intra_node
    best = ", ".join(f"{dt} {v / 1e9:.1f}" for dt, v in c.device.peak_flops.items())
    return (f"wrote {path} ({c.name}: {c.nodes} node(s) x {c.devices_per_node} {c.device.name}) in "
            f"{result.elapsed_s:.1f} s\n  intra-node link ({i.kind}): {i.bandwidth / 1e9:.3f} GB/s per rank, "
            f"{i.latency * 1e6:.1f} us per step\n  best matmul GFLOP/s per rank: {best}; memory copy "
            f"{c.device.memory_bandwidth / 1e9:.1f} GB/s" + (f"\n  ranks' wait at a collective: {_sync_wait_text(c)}"
                                                             if c.device.sync_wait else "")
            + (f"\n  GEMMs by shape: K loop at {c.device.matmul.best_efficiency:.3f} of the bf16 peak, "
               f"{c.device.matmul.k_overhead:.0f} of K per output tile beyond it" if c.device.matmul else ""))


def _sync_wait_text(c: Cluster) -> str:
    """The profile's `sync_wait` in words: "0.39 ms after 0.4 ms of compute, ..."."""
    return ", ".join(f"{w * 1e3:.2f} ms after {t * 1e3:.1f} ms of compute" for t, w in c.device.sync_wait)


def merged_shapes(paths: Sequence[str], quick: bool, shapes_for: Callable[[str, bool], dict[str, list]]
                  ) -> dict[str, list]:
    """The GEMM, attention, norm and bias-gradient shapes of several model files in one table (`--model` repeated),
    each shape once."""
    shapes: dict[str, list] = {"gemms": [], "attentions": [], "norms": [], "reduces": []}
    for path in paths:
        for key, rows in shapes_for(path, quick).items():
            shapes[key] += [r for r in rows if r not in shapes[key]]
    return shapes


def main(argv: Sequence[str] | None = None,
         shapes_for: Callable[[str, bool], dict[str, list]] | None = None) -> int:
    """Run `plan profile` with `argv` (the arguments after `profile`); returns the exit status. `shapes_for(path,
    quick)` gives a model file's GEMM and attention shapes for `--model` (the planner passes it in)."""
    import torch
    args = _parser().parse_args(list(argv or []))
    out = Path(args.output)  # flags first: tracing several --model files takes a while
    why = unwritable_output(args.output)  # as given: Path drops a trailing separator
    if why:
        raise ProfileError(f"-o {args.output}: {why}; give a file path in a folder you can write to")
    for given in [args.links_from, *(args.model or [])]:  # writing an input would destroy it
        if given and out.exists() and os.path.exists(given) and os.path.samefile(given, out):
            raise ProfileError(f"-o {args.output} is also this command's input {given}; pick another file")
    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ProfileError("--backend nccl needs CUDA GPUs and none are visible; use --backend gloo for CPU ranks")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.links_from and torchrun:
        raise ProfileError("--links-from keeps a preset's links for a one-rank profile run by `plan profile --nproc "
                           "1`; under torchrun the ranks measure this machine's own: drop --links-from")
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() if backend == "nccl" else 2)
    links_from = None
    if not torchrun:  # every flag checked before the (slow) tracing of --model files
        if nproc < 1 or (nproc == 1 and not args.links_from):
            raise ProfileError(f"--nproc {nproc}: collectives need at least 2 ranks (with one GPU, add --links-from "
                               "PRESET to keep that profile's links, e.g. --links-from dgx-h100)")
        if nproc > 1 and args.links_from:
            raise ProfileError(f"--links-from keeps a preset's links for a one-rank profile, and {nproc} ranks "
                               "measure this machine's own: drop --links-from (or use --nproc 1)")
        if nproc == 1:
            from hardware_profiles.load import load_cluster
            try:
                links_from = load_cluster(args.links_from)
            except ProfileError as e:  # load names the flag it usually serves (--cluster)
                raise ProfileError(str(e).replace("--cluster:", "--links-from:", 1)) from None
        if backend == "nccl" and nproc > torch.cuda.device_count():
            raise ProfileError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPUs are visible")
        if backend == "gloo" and nproc > (os.cpu_count() or 1) * 4:
            raise ProfileError(f"--nproc {nproc}: more than 4 ranks per CPU core would measure contention")
    shapes = None
    if args.model is not None:
        if shapes_for is None:
            raise ProfileError("--model needs the planner to trace the model; run it as `plan profile --model ...`")
        shapes = merged_shapes(args.model, args.quick, shapes_for)
    if torchrun:
        result = profile_torchrun(args.quick, backend, args.name, progress=True, shapes=shapes)
        if result is None:
            return 0
    else:
        result = profile_local(nproc, backend, args.quick, args.name, shapes=shapes, links_from=links_from)
    from hardware_profiles.load import save_cluster
    save_cluster(result.cluster, out, header=result.header)
    print(_summary(result, str(out)))
    return 0
