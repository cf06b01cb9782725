"""Single-GPU predicted vs measured step time and peak memory (issue 10 item 6, issue 9 item 8), in one command for a
machine with one GPU:

    python benchmarks/gpu_predicted_vs_measured.py [--out DIR] [--only gpt-124M,llama-1B] [--steps 12]
                                                  [--no-profile] [--cluster YAML] [--tiny]

1. `plan profile --backend nccl --model MODEL` once per model: this GPU's matmul and memory curves plus the model's
   own GEMM and attention shapes (the profile each model's plans are made with; DIR/profile-NAME.yaml, with the
   date and the GPU written in, to ship as a preset update);
2. for each model, bf16, one micro-batch, with and without full recompute: `plan --force dp=1,...` writes the plan
   (its prediction) and `plan measure` runs it (CUDA events, `torch.cuda.max_memory_allocated`);
3. the smallest GPT once more under `plan measure --compile` (torch.compile per block) against its eager step.

Prints one table (predicted, measured, error for step time and peak memory) and writes DIR/results.json. The
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


def run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


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


def measure(out: str, name: str, model: str, cluster: str, batch: int, recompute: str, steps: int,
            compile_: bool = False, precision: str = "bf16") -> dict:
    tag = f"{name} {recompute}" + (" compiled" if compile_ else "")
    plan = os.path.join(out, tag.replace(" ", "_") + ".plan.json")
    p = run(PLAN + [model, "--cluster", cluster, "--batch-size", str(batch), "--precision", precision, "--force",
                    f"dp=1,tp=1,pp=1,zero=0,mbs={batch},recompute={recompute}", "-o", plan])
    if p.returncode:
        return {"run": tag, "error": "plan: " + last_line(p)}
    result = plan.replace(".plan.json", ".measured.json")
    p = run(PLAN + ["measure", plan, model, "--steps", str(steps), "--warmup", "3", "-o", result]
            + (["--compile"] if compile_ else []))
    if p.returncode:
        return {"run": tag, "error": "measure: " + last_line(p)}
    with open(result) as f:
        d = json.load(f)
    return {"run": tag, "predicted_s": d["predicted"].get("step_time_s"), "measured_s": d["measured"]["step_time_s"],
            "step_error": d["error"]["step_time"], "predicted_mem": d["memory"]["peak"]["predicted"],
            "measured_mem": d["memory"]["peak"]["measured"], "mem_error": d["error"]["peak_memory"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-results", help="folder for profiles, plans and results.json")
    ap.add_argument("--only", help="comma-separated model names (default: all)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-profile", action="store_true", help="plan with --cluster instead of profiling")
    ap.add_argument("--cluster", default="dgx-h100",
                    help="profile used with --no-profile, and whose links a one-GPU profile keeps (default dgx-h100)")
    ap.add_argument("--tiny", action="store_true", help="small shapes: a smoke test of this script")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    models = TINY if args.tiny else MODELS
    names = args.only.split(",") if args.only else list(models)
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU)"
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {gpu}, torch {torch.__version__}, {precision}",
          flush=True)
    rows = []
    for name in names:
        template, shape, batch = models[name]
        model = model_file(args.out, name, template, shape)
        cluster = args.cluster
        if not args.no_profile:
            cluster = os.path.join(args.out, f"profile-{name}.yaml")
            t0 = time.perf_counter()
            p = run(PLAN + ["profile", "--nproc", "1", "--links-from", args.cluster, "-o", cluster, "--model", model]
                    + (["--backend", "nccl"] if torch.cuda.is_available() else []) + (["--quick"] if args.tiny else []))
            if p.returncode:
                rows.append({"run": name, "error": "profile: " + last_line(p)})
                continue
            print(f"  profiled {name} in {time.perf_counter() - t0:.0f} s", flush=True)
        cluster = one_device(args.out, cluster)
        for recompute in ("none", "full"):
            rows.append(measure(args.out, name, model, cluster, batch, recompute, args.steps, precision=precision))
            print(f"  measured {rows[-1]['run']}", flush=True)
        if name == names[0]:
            rows.append(measure(args.out, name, model, cluster, batch, "none", args.steps, True, precision))
            print(f"  measured {rows[-1]['run']}", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{'run':24} {'predicted':>10} {'measured':>10} {'error':>7} {'mem pred':>9} {'mem meas':>9} {'error':>7}")
    for r in rows:
        if "error" in r and "predicted_s" not in r:
            print(f"{r['run']:24} failed: {r['error']}")
            continue
        print(f"{r['run']:24} {r['predicted_s'] * 1e3:8.1f}ms {r['measured_s'] * 1e3:8.1f}ms {r['step_error']:+7.1%} "
              f"{r['predicted_mem'] / 2**30:7.2f}G {r['measured_mem'] / 2**30:7.2f}G {r['mem_error']:+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
