"""Predicted vs measured step time and peak memory for a matrix of plans of a small GPT on 2 CPU ranks, against a
profile measured first (`plan profile`), and the plan-applied DDP step next to a hand-written DDP step.

    python benchmarks/executor_predicted_vs_measured.py [--steps 12] [--quick-profile] [--cluster NAME_OR_YAML]
                                                        [--trace DIR]

Each plan is written by the planner CLI (`plan MODEL --cluster PROFILE --force ...`: the prediction is what the
plan carries) and run with `plan measure`, which measures the peak memory with torch's MemTracker. Every run
prints the load average (os.getloadavg, 1 minute) before and after it: step times are only meaningful when the
machine is quiet; memory does not depend on load. With a fresh profile, a plain single-process step of the model
(REFERENCE, two at once) is timed right after the profile and before each run, and each row prints that time over
the first ('machine': 1.30x means the machine runs the same step 30 % slower than when it was profiled); nothing
is corrected with it. The DDP comparison runs both loops in one 2-rank job,
alternating blocks of steps so machine load hits both alike, and prints the median step of each and their ratio.
With `--trace DIR` each plan is measured under `plan measure --trace DIR/PLAN` (torch.profiler adds time to every
step) and a second table gives, per plan, the milliseconds of one step on each track (compute, tp / dp / pp comm,
optimizer), predicted and measured on rank 0: where the prediction's error comes from.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
PLAN = [sys.executable, "-m", "planner.cli"]  # this checkout's code, whatever `plan` is installed
MODEL = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
from gpt import GPT, GPTConfig, sample_batch as _sample
CFG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=64)
def build_model():
    return GPT(CFG)
def sample_batch(b):
    return _sample(b, CFG)
"""
# Every key that shapes the step is forced (zero, mbs, recompute, sp): a key left out is chosen by the search,
# and "dp2" without zero=0 once ran the search's pick, ZeRO-3. 2 ranks only: the profile measures 2 (a 4-rank
# job on a 2-core machine measures contention, not the plan).
MATRIX = [
    ("dp2", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=none"),
    ("dp2 zero1", "dp=2,tp=1,pp=1,zero=1,mbs=4,recompute=none"),
    ("dp2 zero3", "dp=2,tp=1,pp=1,zero=3,mbs=4,recompute=none"),
    ("dp2 zero3 2mb", "dp=2,tp=1,pp=1,zero=3,mbs=2,recompute=none"),
    ("tp2", "dp=1,tp=2,pp=1,mbs=8,recompute=none,sp=0"),
    ("tp2 sp", "dp=1,tp=2,pp=1,mbs=8,recompute=none,sp=1"),
    ("pp2 1f1b mbs2", "dp=1,tp=1,pp=2,mbs=2,recompute=none,schedule=1f1b"),
    ("dp2 recompute", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=full"),
    ("dp2 recompute 2/4", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute_blocks=2"),
    ("dp2 selective", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=selective"),
    ("dp2 sel+full 2/4", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=selective,recompute_blocks=2"),
    ("dp2 attention", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=attention"),
    ("dp2 clip", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=none", ["--max-grad-norm", "1.0"]),
]
BATCH = 8


def pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def load() -> float:
    return os.getloadavg()[0]


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV)


REFERENCE = MODEL + """
import statistics, time, torch, torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
m = build_model()
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
x, y = sample_batch(4)
ts = []
for i in range(25):
    t0 = time.perf_counter()
    out = m(x)
    F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ts.append(time.perf_counter() - t0)
print(statistics.median(ts[5:]))
"""
"""One plain training step of the benchmark's model (batch 4, one thread, no torch.distributed), the median of 20:
how fast this machine runs the model at a moment. Nothing is corrected with it; it is printed so that a row's error
can be read against how the machine's speed moved since the profile (a shared VM's does, by tens of percent)."""


def reference_ms() -> float:
    """Milliseconds of REFERENCE, run by two processes at once (both cores busy, as the profile and the 2-rank
    runs have them); their mean."""
    procs = [subprocess.Popen([sys.executable, "-c", REFERENCE], stdout=subprocess.PIPE, text=True,
                              env=dict(ENV, OMP_NUM_THREADS="1")) for _ in range(2)]
    return statistics.mean(float(p.communicate()[0].split()[-1]) for p in procs) * 1e3


def profile(tmp: str, quick: bool) -> str:
    """A fresh CPU profile of 2 gloo ranks; returns its path."""
    out = os.path.join(tmp, "cluster.yaml")
    t0, l0 = time.perf_counter(), load()
    p = run(PLAN + ["profile", "--nproc", "2", "-o", out] + (["--quick"] if quick else []))
    if p.returncode:
        raise SystemExit(f"plan profile failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    print(f"profile: {'quick' if quick else 'full'} in {time.perf_counter() - t0:.0f} s, load {l0:.2f} -> "
          f"{load():.2f}", flush=True)
    waits = [line for line in p.stdout.splitlines() if "ranks' wait" in line]
    if waits:
        print(f"profile: {waits[0].strip()}", flush=True)
    return out


def speed_line(ref: float) -> str:
    return f"machine: a plain step of the model (REFERENCE) takes {ref:.1f} ms (two at once)"


def track_ms(path: str) -> dict[str, float]:
    """Milliseconds per track of a trace written by `plan measure --trace` (spans summed, process 0's or the
    lowest measured rank's)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    pid = min(e["pid"] for e in events if e.get("ph") == "X")
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
             and e["pid"] == pid}
    out: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] == pid:
            track = names.get(e["tid"], str(e["tid"]))
            out[track] = out.get(track, 0.0) + e["dur"] / 1e3
    return out


def matrix(tmp: str, cluster: str, steps: int, names: list[str] | None, trace: str | None = None,
           ref0: float | None = None) -> list[dict]:
    """Plan and measure each row of MATRIX; with `ref0` (REFERENCE's time when the profile was taken) each row also
    records the machine's speed just before its run relative to then (`speed`: above 1, slower now)."""
    model = os.path.join(tmp, "gpt_small.py")
    with open(model, "w") as f:
        f.write(MODEL)
    rows = []
    for name, force, *more in MATRIX:  # more: other `plan` flags (gradient clipping)
        if names and name not in names:
            continue
        plan = os.path.join(tmp, name.replace(" ", "_") + ".json")
        p = run(PLAN + [model, "--cluster", cluster, "--batch-size", str(BATCH), "--precision", "fp32",
                        "--force", force, "-o", plan] + (more[0] if more else []))
        if p.returncode:
            rows.append({"plan": name, "error": p.stderr.strip().splitlines()[-1]})
            continue
        out = plan.replace(".json", ".measured.json")
        ref = reference_ms() if ref0 else None
        before = load()
        where = os.path.join(trace, name.replace(" ", "_")) if trace else None
        p = run(PLAN + ["measure", plan, model, "--steps", str(steps), "--warmup", "3", "-o", out]
                + (["--trace", where, "--cluster", cluster] if where else []))  # the timeline on this profile
        after = load()
        if p.returncode:
            rows.append({"plan": name, "error": p.stderr.strip().splitlines()[-1]})
            continue
        d = json.load(open(out))
        rows.append({"plan": name, "predicted_s": d["predicted"].get("step_time_s"),
                     "measured_s": d["measured"]["step_time_s"], "error": d["error"]["step_time"],
                     "spread_s": d["measured"]["step_time_spread_s"], "memory": d["memory"],
                     "mem_error": d["error"]["peak_memory"], "load": (before, after),
                     "speed": ref / ref0 if ref0 else None})
        if where:
            rows[-1]["tracks"] = (track_ms(os.path.join(where, "predicted.json")),
                                  track_ms(os.path.join(where, "measured_rank0.json")))
        print(f"  measured {name}", flush=True)
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'plan':17} {'predicted':>9} {'measured':>9} {'error':>6} {'spread':>8} {'mem pred':>9} "
          f"{'mem meas':>9} {'mem err':>7}  {'load before/after':>17} {'machine':>7}  memory by category "
          "(predicted/measured MiB)")
    errs, mem_errs = [], []
    mib = lambda v: "-" if v is None else f"{v / 2**20:.2f}"
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
    speed = lambda v: "-" if v is None else f"{v:.2f}x"
    for r in rows:
        if "predicted_s" not in r:
            print(f"{r['plan']:17} failed: {r['error']}")
            continue
        if r["error"] is not None:
            errs.append(abs(r["error"]))
        if r["mem_error"] is not None:
            mem_errs.append(abs(r["mem_error"]))
        m = r["memory"]
        cats = "  ".join(f"{k[:5]} {mib(v['predicted'])}/{mib(v['measured'])}" for k, v in m.items() if k != "peak")
        print(f"{r['plan']:17} {ms(r['predicted_s']):>6} ms {ms(r['measured_s']):>6} ms {pct(r['error']):>6} "
              f"{ms(r['spread_s']):>5} ms {mib(m['peak']['predicted']):>5} MiB {mib(m['peak']['measured']):>5} MiB "
              f"{pct(r['mem_error']):>7}  {r['load'][0]:8.2f}/{r['load'][1]:<8.2f} {speed(r.get('speed')):>7}  {cats}")
    if errs:
        print(f"median |step-time error| over {len(errs)} plans: {statistics.median(errs) * 100:.0f}%")
    if mem_errs:
        print(f"median |peak-memory error| over {len(mem_errs)} plans: {statistics.median(mem_errs) * 100:.1f}%")
    traced = [r for r in rows if "tracks" in r]
    if traced:
        tracks = ("compute", "tp comm", "dp comm", "pp comm", "optimizer")
        print(f"\nms per step by track on rank 0, predicted/measured (measured under torch.profiler)\n{'plan':17} "
              + " ".join(f"{t:>15}" for t in tracks))
        for r in traced:
            pred, meas = r["tracks"]
            print(f"{r['plan']:17} " + " ".join(f"{pred.get(t, 0.0):7.1f}/{meas.get(t, 0.0):<7.1f}" for t in tracks))


def ddp_rank(steps: int) -> None:
    """One rank of the DDP comparison (run under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, sample_batch

    from executor import apply_plan
    from planner.model_file import default_loss
    from planner.plan import Mesh, Plan
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=64)
    plan = Plan(mesh=Mesh(dp=2), global_batch_size=BATCH, microbatch_size=BATCH // 2, num_microbatches=1,
                precision="fp32")
    torch.manual_seed(0)
    runner = apply_plan(GPT(cfg), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    torch.manual_seed(0)
    hand = DDP(GPT(cfg))
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-4)
    rank = dist.get_rank()
    x, y = sample_batch(BATCH, cfg)
    xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]

    def hand_step() -> float:
        t0 = time.perf_counter()
        loss = default_loss(hand(xs), ys)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)  # the same loss logging the runner does
        float(loss)
        return time.perf_counter() - t0

    def plan_step() -> float:
        t0 = time.perf_counter()
        runner.step(x, y)
        return time.perf_counter() - t0

    th, tp = [], []
    for block in range(steps // 4 + 2):
        for _ in range(4):
            (th if block % 2 == 0 else tp).append(hand_step() if block % 2 == 0 else plan_step())
        for _ in range(4):
            (tp if block % 2 == 0 else th).append(plan_step() if block % 2 == 0 else hand_step())
    th, tp = th[4:], tp[4:]  # warm-up
    if rank == 0:
        print(json.dumps({"hand_s": statistics.median(th), "plan_s": statistics.median(tp)}))
    dist.destroy_process_group()


def ddp_compare(steps: int) -> dict:
    env = dict(ENV, OMP_NUM_THREADS="1")
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             os.path.abspath(__file__), "--ddp-rank", "--steps", str(steps)], env=env)
    if p.returncode:
        raise SystemExit(p.stderr[-2000:])
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", nargs="*", help="plan names from the matrix")
    ap.add_argument("--cluster", help="use this profile instead of measuring a fresh one")
    ap.add_argument("--quick-profile", action="store_true", help="plan profile --quick (fewer sizes)")
    ap.add_argument("--save-profile", metavar="YAML", help="also keep the fresh profile here (for a later look)")
    ap.add_argument("--trace", metavar="DIR", help="measure under `plan measure --trace DIR/PLAN` and print the "
                    "milliseconds per track, predicted and measured")
    ap.add_argument("--ddp-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-matrix", action="store_true")
    ap.add_argument("--skip-ddp", action="store_true", help="leave out the hand-written DDP comparison")
    args = ap.parse_args()
    if args.save_profile and not os.path.isdir(os.path.dirname(os.path.abspath(args.save_profile))):
        ap.error(f"--save-profile {args.save_profile}: its folder does not exist; create it or pick another")
    if args.ddp_rank:
        return ddp_rank(max(args.steps, 8) * 2)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: small GPT (4 layers, h=128, V=512, s=64), "
          f"batch {BATCH}, fp32, 2 CPU ranks x 1 thread")
    if not args.skip_matrix:
        with tempfile.TemporaryDirectory() as tmp:
            cluster = args.cluster or profile(tmp, args.quick_profile)
            if args.save_profile and not args.cluster:
                shutil.copyfile(cluster, args.save_profile)
            ref0 = None if args.cluster else reference_ms()  # right after the profile
            if ref0:
                print(speed_line(ref0) + "; column 'machine': that time before each run over this one", flush=True)
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)  # plan measure wants the parent; make it, as the user asked
            rows = matrix(tmp, cluster, args.steps, args.only, args.trace, ref0)
        report(rows)
    if not args.skip_ddp:
        before = load()
        d = ddp_compare(args.steps)
        print(f"DDP step: hand-written {d['hand_s'] * 1e3:.2f} ms, plan-applied {d['plan_s'] * 1e3:.2f} ms, "
              f"ratio {d['plan_s'] / d['hand_s']:.3f} (target <= 1.05), load {before:.2f} -> {load():.2f}")


if __name__ == "__main__":
    main()
