"""Predicted vs measured step time for a matrix of plans of a small GPT on the cpu-local profile (2 ranks), and the
plan-applied DDP step next to a hand-written DDP step.

    python benchmarks/executor_predicted_vs_measured.py [--steps 12] [--quick]

Plans come from the planner CLI (`plan MODEL --cluster cpu-local --force ...`, i.e. the cost model's prediction is
what the plan carries); each is run with `plan measure`. The DDP comparison runs both loops in one 2-rank job,
alternating blocks of steps so machine load hits both alike, and prints the median step of each and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
# and "dp2" without zero=0 once ran the search's pick, ZeRO-3.
MATRIX = [
    ("dp2", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=none"),
    ("dp2 zero1", "dp=2,tp=1,pp=1,zero=1,mbs=4,recompute=none"),
    ("dp2 zero3", "dp=2,tp=1,pp=1,zero=3,mbs=4,recompute=none"),
    ("tp2", "dp=1,tp=2,pp=1,mbs=8,recompute=none,sp=0"),
    ("tp2 sp", "dp=1,tp=2,pp=1,mbs=8,recompute=none,sp=1"),
    ("pp2 1f1b mbs2", "dp=1,tp=1,pp=2,mbs=2,recompute=none,schedule=1f1b"),
    ("dp2 recompute", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=full"),
]
BATCH = 8


def pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def matrix(tmp: str, steps: int, names: list[str] | None) -> list[dict]:
    model = os.path.join(tmp, "gpt_small.py")
    with open(model, "w") as f:
        f.write(MODEL)
    rows = []
    for name, force in MATRIX:
        if names and name not in names:
            continue
        plan = os.path.join(tmp, name.replace(" ", "_") + ".json")
        p = run(["plan", model, "--cluster", "cpu-local", "--batch-size", str(BATCH), "--precision", "fp32",
                 "--force", force, "-o", plan])
        if p.returncode:
            rows.append({"plan": name, "error": p.stderr.strip().splitlines()[-1]})
            continue
        out = plan.replace(".json", ".measured.json")
        p = run(["plan", "measure", plan, model, "--steps", str(steps), "--warmup", "3", "-o", out])
        if p.returncode:
            rows.append({"plan": name, "error": p.stderr.strip().splitlines()[-1]})
            continue
        d = json.load(open(out))
        rows.append({"plan": name, "predicted_s": d["predicted"].get("step_time_s"),
                     "measured_s": d["measured"]["step_time_s"], "error": d["error"]["step_time"],
                     "spread_s": d["measured"]["step_time_spread_s"],
                     "pred_mem": d["predicted"].get("peak_memory_bytes"),
                     "meas_mem": d["measured"]["peak_memory_bytes"], "mem_error": d["error"]["peak_memory"]})
        print(f"  measured {name}", flush=True)
    return rows


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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             os.path.abspath(__file__), "--ddp-rank", "--steps", str(steps)], env=env)
    if p.returncode:
        raise SystemExit(p.stderr[-2000:])
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", nargs="*", help="plan names from the matrix")
    ap.add_argument("--ddp-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-matrix", action="store_true")
    args = ap.parse_args()
    if args.ddp_rank:
        return ddp_rank(max(args.steps, 8) * 2)
    print(f"small GPT (4 layers, h=128, V=512, s=64), batch {BATCH}, fp32, cpu-local profile, 2 ranks x 1 thread")
    if not args.skip_matrix:
        with tempfile.TemporaryDirectory() as tmp:
            rows = matrix(tmp, args.steps, args.only)
        print(f"{'plan':16} {'predicted':>10} {'measured':>10} {'error':>8} {'spread':>9} {'mem pred':>9} "
              f"{'mem meas':>9} {'mem err':>8}")
        errs = []
        for r in rows:
            if "predicted_s" not in r:
                print(f"{r['plan']:16} failed: {r['error']}")
                continue
            e = r["error"]
            errs.append(abs(e)) if e is not None else None
            fmt = lambda v, s=1e3, u="ms": "-" if v is None else f"{v * s:.1f} {u}"
            print(f"{r['plan']:16} {fmt(r['predicted_s']):>10} {fmt(r['measured_s']):>10} "
                  f"{pct(e):>8} {fmt(r['spread_s']):>9} "
                  f"{fmt(r['pred_mem'], 2**-20, 'MiB'):>9} {fmt(r['meas_mem'], 2**-20, 'MiB'):>9} "
                  f"{pct(r['mem_error']):>8}")
        if errs:
            print(f"median |step-time error| over {len(errs)} plans: {statistics.median(errs) * 100:.0f}%")
    d = ddp_compare(args.steps)
    print(f"DDP step: hand-written {d['hand_s'] * 1e3:.2f} ms, plan-applied {d['plan_s'] * 1e3:.2f} ms, "
          f"ratio {d['plan_s'] / d['hand_s']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
