"""Single-GPU predicted vs measured step time and peak memory (issue 10 item 6, issue 9 item 8), in one command for a
machine with one GPU:

    python benchmarks/gpu_predicted_vs_measured.py [--out DIR] [--only gpt-124M,llama-1B] [--steps 12]
        [--no-profile | --reuse-profiles] [--no-compile] [--cluster YAML] [--deadline S]
        [--trace-run RUN[,RUN...]] [--tiny]

1. `plan profile --backend nccl --model MODEL ...` once: this GPU's matmul and memory curves plus the models' own
   GEMM and attention shapes (the profile the plans are made with; DIR/profile.yaml, with the date and the GPU
   written in, to ship as a preset update);
2. for each model, bf16, one micro-batch, without and with full recompute (`--recompute` picks the levels):
   `plan --force dp=1,...` writes the plan (its prediction) and `plan measure` runs it (CUDA events,
   `torch.cuda.max_memory_allocated`);
3. the smallest GPT once more under `plan measure --compile` (torch.compile per block) against its eager step;
4. with `--trace-run RUN[,RUN...]`, each such run once more under `plan measure --trace`, and its device time by
   kernel family and idle time per step;
5. for each GPT, the host's time to issue each op of its block at its shapes next to the probe's tiny ones
   (`host_calls.py`).
After the profile it prints the models' GEMMs that miss the profile's GEMM model most (`gemm_model_check.py`).

Prints one table (predicted, measured, error for step time and peak memory), then one per pass (forward, backward:
the pass on the device between CUDA events, the predicted kernels alone, the host's time to issue it; a device pass
no longer than its host issue time waited for the host), and writes DIR/results.json. The
models are the bundled GPT (examples/gpt.py) at GPT-2's 124M, 350M and 1.5B shapes (Radford et al. 2019, Table 2)
and the bundled Llama (examples/llama.py) at Llama 3.2 1B's shape (16 layers, dim 2048, 32/8 heads, FFN 8192,
vocabulary 128256; Meta's model card). `--tiny` runs small shapes on whatever device there is (a smoke test of
the script itself, e.g. on CPU); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # planner.plan, from this checkout, installed or not
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
PLAN = [sys.executable, "-m", "planner.cli"]  # this checkout's code
GPT = """
import sys
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig, sample_batch as _sample
CFG = GPTConfig(n_layer={layers}, n_embd={hidden}, n_head={heads}, vocab_size={vocab}, block_size={seq})
def build_model():
    return GPT(CFG)
def sample_batch(b):
    return _sample(b, CFG)
"""
LLAMA = """
import sys
sys.path.insert(0, {examples!r})
from llama import Llama, LlamaConfig, sample_batch as _sample
CFG = LlamaConfig(n_layer={layers}, dim={hidden}, n_head={heads}, n_kv_head={kv}, ffn_dim={ffn}, vocab_size={vocab},
                  seq_len={seq})
def build_model():
    return Llama(CFG)
def sample_batch(b):
    return _sample(b, CFG)
"""
# name: (template, shape, batch). Batches fill an 80 GB GPU without recompute (bf16 autocast, fp32 AdamW states).
MODELS = {
    "gpt-124M": (GPT, dict(layers=12, hidden=768, heads=12, vocab=50257, seq=1024), 16),
    "gpt-350M": (GPT, dict(layers=24, hidden=1024, heads=16, vocab=50257, seq=1024), 8),
    "gpt-1.5B": (GPT, dict(layers=48, hidden=1600, heads=25, vocab=50257, seq=1024), 4),
    "llama-1B": (LLAMA, dict(layers=16, hidden=2048, heads=32, kv=8, ffn=8192, vocab=128256, seq=2048), 4),
}
TINY = {
    "gpt-124M": (GPT, dict(layers=2, hidden=64, heads=2, vocab=128, seq=32), 4),
    "llama-1B": (LLAMA, dict(layers=2, hidden=64, heads=4, kv=2, ffn=128, vocab=128, seq=32), 4),
}


def run(cmd: list[str], log: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `cmd`, keep its output in `log` (a failure's whole story travels with the results)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output is bytes even with text=True
        text = [x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        p = subprocess.CompletedProcess(cmd, 124, text[0], text[1] + f"\ntimed out after {timeout:.0f} s")
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + p.stdout + "\n" + p.stderr)
    return p


def last_line(p: subprocess.CompletedProcess) -> str:
    return (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["?"])[-1]


def model_file(out: str, name: str, template: str, shape: dict) -> str:
    path = os.path.join(out, name.replace("-", "_").replace(".", "_") + ".py")
    with open(path, "w") as f:
        f.write(template.format(examples=os.path.join(ROOT, "examples"), **shape))
    return path


def one_device(out: str, cluster: str) -> str:
    """A copy of a profile (preset name or YAML) with one device: single-device plans need a 1-device cluster."""
    import yaml
    path = cluster if cluster.endswith((".yaml", ".yml")) else \
        os.path.join(ROOT, "hardware_profiles", "presets", cluster + ".yaml")
    with open(path) as f:
        profile = yaml.safe_load(f)
    profile["cluster"].update(nodes=1, devices_per_node=1)
    copy = os.path.join(out, "1dev-" + os.path.basename(path))
    with open(copy, "w") as f:
        yaml.safe_dump(profile, f)
    return copy


def make_plan(out: str, tag: str, model: str, cluster: str, batch: int, recompute: str, precision: str) -> dict:
    """`plan --force` for one run (CPU work: runs beside the GPU's)."""
    plan = os.path.join(out, tag.replace(" ", "_") + ".plan.json")
    p = run(PLAN + [model, "--cluster", cluster, "--batch-size", str(batch), "--precision", precision, "--force",
                    f"dp=1,tp=1,pp=1,zero=0,mbs={batch},recompute={recompute}", "-o", plan],
            os.path.join(out, "logs", tag.replace(" ", "_") + ".plan.log"))
    return {"run": tag, "error": "plan: " + last_line(p)} if p.returncode else {"run": tag, "plan": plan}


def measure(out: str, planned: dict, model: str, steps: int, compile_: bool = False) -> dict:
    """`plan measure` of one planned run (GPU work: one at a time)."""
    tag = planned["run"]
    if "error" in planned:
        return planned
    result = planned["plan"].replace(".plan.json", ".measured.json")
    p = run(PLAN + ["measure", planned["plan"], model, "--steps", str(steps), "--warmup", "3", "-o", result]
            + (["--compile"] if compile_ else []), os.path.join(out, "logs", tag.replace(" ", "_") + ".measure.log"))
    if p.returncode:
        return {"run": tag, "error": "measure: " + last_line(p)}
    with open(result) as f:
        d = json.load(f)
    return {"run": tag, "predicted_s": d["predicted"].get("step_time_s"), "measured_s": d["measured"]["step_time_s"],
            "step_error": d["error"]["step_time"], "predicted_mem": d["memory"]["peak"]["predicted"],
            "measured_mem": d["memory"]["peak"]["measured"], "mem_error": d["error"]["peak_memory"],
            "passes": d.get("passes", {})}


def pass_table(rows: list[dict]) -> str:
    """Per pass, predicted vs measured: the pass on the device (CUDA events, waits for the host included), the
    predicted kernels alone, and the host's issue time (`executor.measure.passes`); ms."""
    head = (f"{'run':24} {'pass':8} {'device pred':>11} {'meas':>7} {'error':>7} {'kernels':>8} "
            f"{'host pred':>9} {'meas':>7} {'error':>7}")
    lines = [head]

    def ms(x):
        return f"{x * 1e3:.1f}" if x is not None else "-"

    def err(x):
        return f"{x:+.1%}" if x is not None else "-"
    for r in rows:
        for name, p in (r.get("passes") or {}).items():
            d, k, h = p["device"], p["kernels"], p["host"]
            lines.append(f"{r['run']:24} {name:8} {ms(d['predicted']):>11} {ms(d['measured']):>7} "
                         f"{err(d['error']):>7} {ms(k['predicted']):>8} {ms(h['predicted']):>9} "
                         f"{ms(h['measured']):>7} {err(h['error']):>7}")
    return "\n".join(lines) if len(lines) > 1 else ""


def table(rows: list[dict]) -> str:
    lines = [f"{'run':24} {'predicted':>10} {'measured':>10} {'error':>7} {'mem pred':>9} {'mem meas':>9} {'error':>7}"]
    for r in rows:
        if "predicted_s" not in r:
            lines.append(f"{r['run']:24} {r.get('error', 'not run')}")
            continue
        mem = (f"{r['predicted_mem'] / 2**30:7.2f}G {r['measured_mem'] / 2**30:7.2f}G {r['mem_error']:+7.1%}"
               if r["measured_mem"] is not None else f"{r['predicted_mem'] / 2**30:7.2f}G {'-':>9} {'-':>7}")
        lines.append(f"{r['run']:24} {r['predicted_s'] * 1e3:8.1f}ms {r['measured_s'] * 1e3:8.1f}ms "
                     f"{r['step_error']:+7.1%} {mem}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-results", help="folder for profiles, plans, logs and results.json")
    ap.add_argument("--only", help="comma-separated model names (default: all)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-profile", action="store_true", help="plan with --cluster instead of profiling")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    ap.add_argument("--recompute", default="none,full", metavar="LEVELS",
                    help="comma-separated recompute levels to measure each model at (none, attention, selective, "
                         "full; default none,full)")
    ap.add_argument("--cluster", default="dgx-h100",
                    help="profile used with --no-profile, and whose links a one-GPU profile keeps (default dgx-h100)")
    ap.add_argument("--deadline", type=float, default=None, metavar="S",
                    help="start no GPU job after S seconds (the rest are listed as not run); for a time-limited lease")
    ap.add_argument("--reuse-profiles", action="store_true",
                    help="keep a DIR/profile.yaml already there (measured earlier on this GPU) instead of profiling")
    ap.add_argument("--trace-run", metavar="RUN[,RUN...]",
                    help="afterwards, trace these measured runs (e.g. 'llama-1B none,gpt-124M none') and print where "
                         "their device time went by kernel, and how long the device idled (kernel_summary.py)")
    ap.add_argument("--tiny", action="store_true", help="small shapes: a smoke test of this script")
    args = ap.parse_args()
    t_start = time.perf_counter()
    late = lambda: args.deadline is not None and time.perf_counter() - t_start > args.deadline  # noqa: E731
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    models = TINY if args.tiny else MODELS
    levels = args.recompute.split(",")
    from planner.plan import RECOMPUTE
    if any(r not in RECOMPUTE for r in levels):
        ap.error(f"--recompute {args.recompute}: use any of {', '.join(RECOMPUTE)}")
    names = args.only.split(",") if args.only else list(models)
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU)"
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    if not torch.cuda.is_available():  # plan measure runs only plans whose ranks talk over loopback on CPUs
        from hardware_profiles.load import ProfileError, load_cluster
        try:
            kind = load_cluster(args.cluster).intra_node.kind
        except ProfileError as e:
            ap.error(str(e))
        if kind != "loopback":
            print(f"  no CUDA: links from cpu-local, not {args.cluster} ({kind})", flush=True)
            args.cluster = "cpu-local"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {gpu}, torch {torch.__version__}, {precision}",
          flush=True)
    from concurrent.futures import ThreadPoolExecutor
    planner = ThreadPoolExecutor(max_workers=4)
    jobs: list[tuple[str, object, bool, int]] = []  # (model file, future plan, compiled, level's index)
    clusters: dict[str, str] = {}  # model name -> the one-device profile its plans were made with
    rows: list[dict] = []

    def jobs_for(name: str, model: str, cluster: str, batch: int) -> None:
        """Plan this model's runs in the background (CPU), to be measured later (GPU)."""
        cluster = clusters[name] = one_device(args.out, cluster)
        variants = [(r, False) for r in levels] + ([("none", True)] if name == names[0] and not args.no_compile
                                                   else [])
        for recompute, compiled in variants:
            tag = f"{name} {recompute}" + (" compiled" if compiled else "")
            jobs.append((model, planner.submit(make_plan, args.out, tag, model, cluster, batch, recompute, precision),
                         compiled, levels.index(recompute)))

    # GPU work one job at a time: the profile first (all the models' shapes in one), planning on the CPU beside
    # the measurements
    files = {name: model_file(args.out, name, models[name][0], models[name][1]) for name in names}
    cluster = args.cluster
    if not args.no_profile:
        cluster = os.path.join(args.out, "profile.yaml")
        t0 = time.perf_counter()
        if args.reuse_profiles and os.path.exists(cluster):
            print("  kept the profile measured earlier", flush=True)
        else:
            p = run(PLAN + ["profile", "--nproc", "1", "--links-from", args.cluster, "-o", cluster]
                    + [a for name in names for a in ("--model", files[name])]
                    + (["--backend", "nccl"] if torch.cuda.is_available() else []) + (["--quick"] if args.tiny else []),
                    os.path.join(args.out, "logs", "profile.log"))
            if p.returncode:
                print(f"profile failed: {last_line(p)}")
                return 1
            print(f"  profiled {', '.join(names)} in {time.perf_counter() - t0:.0f} s", flush=True)
        from gemm_model_check import report as gemm_report  # its GEMM model against the models' own GEMMs
        from hardware_profiles.load import load_cluster
        profiled = load_cluster(cluster).device
        if profiled.matmul_shapes:
            print(gemm_report(profiled, top=12), flush=True)
    for name in names:
        jobs_for(name, files[name], cluster, models[name][2])
    # level by level (every model at the first level, then the next), the compiled run last: a deadline drops the
    # last levels, not the last models
    jobs.sort(key=lambda j: (j[2], j[3]))
    for model, future, compiled, _ in jobs:
        planned = future.result()
        if late():
            rows.append({"run": planned["run"], "error": "not run (deadline)"})
            continue
        t0 = time.perf_counter()
        rows.append(measure(args.out, planned, model, args.steps, compiled))
        print(f"  measured {rows[-1]['run']} in {time.perf_counter() - t0:.0f} s", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    planner.shutdown()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(table(rows))
    passes = pass_table(rows)
    if passes:
        print("per pass (a device pass no longer than its host issue time waited for the host):")
        print(passes)
    for name in names:  # the host's own time per call at each GPT's shapes (host_calls.py), seconds each
        kind, shape, batch = models[name]
        if kind is GPT and not late():
            import host_calls
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            print(f"{name}: host and device time per call at its shapes (micro-batch {batch})")
            print(host_calls.table(batch * shape["seq"], shape["seq"], shape["hidden"], shape["heads"],
                                   "bf16" if device.type == "cuda" else "fp32", device, 50), flush=True)
    for run_name in (args.trace_run.split(",") if args.trace_run else []):
        if not late():
            print(trace_run(args.out, run_name.strip(), files, clusters, rows), flush=True)
    return 0


def trace_run(out: str, run_name: str, files: dict[str, str], clusters: dict[str, str], rows: list[dict]) -> str:
    """`plan measure --trace` of one measured run (2 profiled steps after 3 warm-up), then where its device time
    went by kernel (`kernel_summary`), also written to DIR/kernels-RUN.txt."""
    from kernel_summary import report
    tag = run_name.replace(" ", "_")
    plan = os.path.join(out, tag + ".plan.json")
    if not any(r["run"] == run_name and "measured_s" in r for r in rows) or not os.path.exists(plan):
        return f"--trace-run {run_name}: no such measured run"
    folder = os.path.join(out, "trace-" + tag)
    name = run_name.split()[0]
    p = run(PLAN + ["measure", plan, files[name], "--steps", "5", "--warmup", "3", "--trace", folder,
                    "--cluster", clusters[name]],
            os.path.join(out, "logs", tag + ".trace.log"))
    if p.returncode:
        return f"--trace-run {run_name}: {last_line(p)}"
    with open(os.path.join(folder, "profiler_rank0.json")) as f:
        text = f"{run_name}, plan measure --trace:\n" + report(json.load(f), steps=2)
    with open(os.path.join(out, f"kernels-{tag}.txt"), "w") as f:
        f.write(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
