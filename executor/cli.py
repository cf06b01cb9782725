"""`plan measure PLAN.json MODEL.py [--steps N] [-o measured.json] [--trace DIR] [--plot FILE.png]`: launch the
ranks a plan needs, train N steps on `sample_batch` data, and print predicted vs measured side by side (with
`--trace`, also the measured step beside the predicted one as traces on the same tracks; with `--plot`, a picture).

Everything that can be checked without starting processes is checked first (the plan loads and is runnable, the
model file loads, the plan was made for this model, its tp layout is one the executor applies, enough
GPUs, or CPUs for a plan made for CPU ranks): bad input is one line and exit status 2. Ranks
run under `torchrun --standalone` (a free port per job, so parallel runs never collide), one thread each by default;
when a rank raises, it prints one line and exits, torchrun stops the others, and this command prints that line and
exits 1.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from executor.errors import ExecutorError


def _parser():
    from planner.cli import ArgParser
    p = ArgParser(prog="plan measure", description=(
        "Launch the ranks PLAN needs (torchrun), train STEPS steps of MODEL on sample_batch data with the plan's "
        "parallelism, and print the predicted step time and memory (from the plan) next to the measured ones."))
    p.add_argument("plan", help="plan.json written by `plan ... -o`")
    p.add_argument("model", help="the model file the plan was made for (build_model, sample_batch)")
    p.add_argument("--steps", type=int, default=10, help="training steps, warm-up included (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (default 2)")
    p.add_argument("-o", "--output", help="write predicted/measured/error as JSON here (atomically)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per rank (default 1: ranks share the cores)")
    p.add_argument("--calibrate", metavar="CALIBRATION.json",
                   help="also record the measured step time next to the predicted one in this calibration file "
                        "(its step_time_scale is the median measured/predicted ratio for the plan's cluster)")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--trace", metavar="DIR",
                   help="profile the steps after warm-up with torch.profiler and write, in DIR: measured_rankR.json "
                        "(one step per rank, the median one), predicted.json (the cost model's timeline of the "
                        "plan) on the same tracks (compute, tp/dp/pp comm, bubble, optimizer), compare.json (both "
                        "in one file for https://ui.perfetto.dev), compare.png (with matplotlib) and "
                        "profiler_rankR.json (the raw profiler traces); the profiler adds some time to each step")
    p.add_argument("--cluster", metavar="PRESET|YAML",
                   help="the cluster profile the plan was made for, for --trace's predicted timeline (default: the "
                        "preset the plan names; pass your file when the plan was made from one: a CPU profile keeps the "
                        "preset's name, cpu-local)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw predicted vs measured step time with its compute / exposed comm / bubble / optimizer "
                        "split (the measured split needs --trace); needs matplotlib (pip install 'shardwise[plot]')")
    p.add_argument("--compile", metavar="BACKEND", nargs="?", const="inductor", type=_backend,
                   help="torch.compile each repeated block (backend: inductor when not named; aot_eager, eager "
                        "...) to compare with the eager step: the prediction prices eager kernels")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p


def _backend(value: str) -> str:
    """--compile's value, refused where it is one of the command's files: `--compile plan.json model.py` took the
    plan as the backend and then said only that the model argument was missing."""
    import argparse
    if value.endswith((".json", ".py")) or os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a file, not a torch.compile backend: put --compile after the "
                                         "plan and model files, or name a backend (--compile inductor)")
    return value


def check_inputs(plan_path: str, model_path: str, cluster_spec: str | None = None):
    """Load and cross-check plan and model file before anything is launched; returns the Plan. `cluster_spec`
    (--cluster) names the profile the plan was made for when the plan's own cluster name is no preset."""
    from executor.plan_checks import check_plan_matches_model, check_runnable, check_tp_plan
    from planner.model_file import build, load_model_file
    from planner.plan import Plan
    plan = Plan.load(plan_path)
    check_runnable(plan)
    model_file = load_model_file(model_path)
    model = build(model_file, "meta")
    check_plan_matches_model(plan, model)
    check_tp_plan(plan, model)
    import torch
    if torch.cuda.is_available() and plan.world_size > torch.cuda.device_count():
        raise ExecutorError(f"plan needs {plan.world_size} GPUs, this machine has {torch.cuda.device_count()}; "
                            "multi-node plans run with torchrun on each node and executor.apply_plan")
    if not torch.cuda.is_available():
        check_cpu_plan(plan, plan_path, cluster_spec)
    return plan


def oversubscribed(world: int, threads: int) -> str | None:
    """A note when CPU ranks (no CUDA) would need more cores than this process may use: they then take turns on
    the cores, and every step runs long against a prediction that gives each rank its own."""
    import torch
    if torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if world * threads <= cores:
        return None
    return (f"{world} rank(s) x {threads} thread(s) on {cores} CPU core(s): the ranks take turns on the cores, so "
            "measured step times run long against the prediction, which gives each rank cores of its own; plan "
            f"for at most {cores // threads} rank(s) here (cpu-local: --nodes, or a `plan profile` of this machine)")


def check_cpu_plan(plan, plan_path: str, cluster_spec: str | None = None) -> None:
    """On a machine without CUDA, refuse a plan made for a GPU cluster: its ranks would train on CPUs over gloo
    (in the plan's precision) and measure nothing the plan predicted. CPU profiles link their ranks over loopback
    (`plan profile` on CPUs, cpu-local): the plan records its cluster's link kind and device (`cluster_record`);
    a plan written before it did is checked against the preset it names, else --cluster's profile, and let
    through when it names neither (built in code, or from a profile file): nothing says what it was made for."""
    from hardware_profiles.load import list_presets, load_cluster
    name, link = plan.cluster.get("name"), plan.cluster.get("link")
    if link is not None:
        device = plan.cluster.get("device", "its")
    else:
        spec = name if name in list_presets() else cluster_spec
        if not spec:
            return
        cluster = load_cluster(spec)
        link, device, name = cluster.intra_node.kind, cluster.device.name, cluster.name
    if link != "loopback":
        raise ExecutorError(f"{plan_path}: the plan was made for {device} GPUs ({name}), and this machine has no "
                            "CUDA; re-plan with `--cluster cpu-local` or a profile from `plan profile`")


def failure_reason(err: str, rc: int) -> str:
    """One line saying why a launched job failed: a rank's own `shardwise rank R: ...` line, else a rank's failed
    import, else torchrun's root cause (the rank and its exit code or signal: a crash below Python), else stderr's
    last line."""
    lines = err.splitlines()
    own = [l for l in lines if l.startswith("shardwise rank")]
    if own:
        return own[0]
    imports = [l.strip() for l in lines if "Error while finding module specification" in l or "No module named" in l]
    if imports:  # a rank that could not import its program: say so, not torchrun's "To enable traceback" line
        return imports[0]
    fields = {}
    for l in lines[next((i for i, l in enumerate(lines) if "Root Cause" in l), len(lines)):]:
        key, _, value = l.strip().partition(":")
        if key.strip() in ("rank", "exitcode", "traceback") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if fields:
        return "rank " + "; ".join(f"{v}" if k == "rank" else f"{k} {v}" for k, v in fields.items())
    tail = [l for l in lines if l.strip() and not set(l.strip()) <= set("=-")]
    return tail[-1] if tail else f"exit status {rc}"


TIMED_OUT = 124
"""`launch`'s exit status for a job stopped at its timeout (as timeout(1) exits)."""


def launch(plan_path: str, model_path: str, world: int, steps: int, warmup: int, threads: int,
           result: str, timeout: float | None = None, trace: str | None = None,
           compile: str | None = None, debug: bool = False) -> tuple[int, str]:
    """Run executor.worker on `world` ranks under torchrun; returns (exit status, captured stderr). `debug`: each
    failing rank prints its traceback too."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "executor.worker", os.path.abspath(plan_path), os.path.abspath(model_path),
           "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads), "--result", result]
    cmd += ["--trace", os.path.abspath(trace)] if trace else []
    cmd += ["--compile", compile] if compile else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHELASTIC_ERROR_FILE="")
    env.pop("TORCHELASTIC_ERROR_FILE")
    if debug:
        env["SHARDWISE_DEBUG"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.realpath(root) != os.path.realpath(os.getcwd()):  # (from a checkout's own folder, the cwd is us)
        env["PYTHONSAFEPATH"] = "1"  # `-m` puts the cwd first on sys.path: an executor.py there would stand in
        # for shardwise's executor package and every rank fail (Python 3.11+ honours it)
    proc = subprocess.Popen(cmd, stdout=None, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return TIMED_OUT, _stop(proc)
    except BaseException:  # Ctrl-C (which torchrun, in this process group, gets too)
        _stop(proc)
        raise
    return proc.returncode, err


STOP_GRACE_S = 40.0
"""Seconds torchrun gets to stop its ranks after SIGTERM (it gives them 30 s before it kills them itself)."""


def _stop(proc: subprocess.Popen) -> str:
    """Stop the job and return its stderr: SIGTERM to torchrun, which stops its ranks (each in a session of its own:
    a SIGKILL to torchrun alone left them training to the end, holding stderr open), then SIGKILL."""
    err = ""
    try:
        proc.terminate()
        _, err = proc.communicate(timeout=STOP_GRACE_S)  # reading stderr meanwhile: a full pipe would block torchrun
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when a second Ctrl-C interrupts the wait
        if proc.poll() is None:
            proc.kill()
    return err or ""


MAX_DRAWN_RANKS = 8
"""compare.png draws every measured rank up to this many, else one rank per pipeline stage."""


def check_outputs(args) -> None:
    """Output checks before anything runs (-o, --calibrate, --plot and matplotlib for it, --trace)."""
    from executor.measure import read_calibration_file
    from executor.plots import have_matplotlib
    from planner.plan import check_output
    from planner.search_plot import FORMATS, HINT
    outputs = [(flag, path) for flag, path in (("-o", args.output), ("--calibrate", args.calibrate),
                                               ("--plot", args.plot)) if path is not None]
    for flag, path in outputs:  # before the run: a path that cannot be written must not cost it
        check_output(path, flag, inputs=[args.plan, args.model, args.cluster])
    if len({os.path.realpath(path) for _, path in outputs}) < len(outputs):  # one would merge into the other
        raise ExecutorError(f"{' and '.join(flag for flag, _ in outputs)} name the same file; give each its own")
    if args.calibrate:
        read_calibration_file(args.calibrate)
    if args.plot and os.path.splitext(args.plot)[1].lower() not in FORMATS:
        raise ExecutorError(f"--plot {args.plot}: give a {', '.join(FORMATS[:-1])} or {FORMATS[-1]} file name")
    if args.plot and not have_matplotlib():
        raise ExecutorError(HINT)
    if args.trace:
        if args.calibrate:
            raise ExecutorError("--calibrate with --trace would record step times slowed by the profiler; run "
                                "them separately")
        if os.path.exists(args.trace) and not os.path.isdir(args.trace):
            raise ExecutorError(f"--trace {args.trace} is a file; give a folder (it is created if missing)")


def write_traces(args, plan, predicted: dict | None) -> dict:
    """After a --trace run: predicted.json, compare.json and (with matplotlib) compare.png in the trace folder;
    returns the `trace` block of measured.json (files and the measured step's split)."""
    from executor import trace
    from executor.plots import have_matplotlib, swimlanes
    from planner.plan import write_atomic
    measured = []
    for r in range(plan.world_size):
        with open(os.path.join(args.trace, f"measured_rank{r}.json")) as f:
            measured.append(json.load(f))
    split = trace.categories(trace.merge(None, measured))
    measured = trace.align(measured)
    files = [f"measured_rank{r}.json" for r in range(plan.world_size)]
    for name, doc in zip(files, measured):
        write_atomic(os.path.join(args.trace, name), json.dumps(doc) + "\n")
    if predicted is not None:
        write_atomic(os.path.join(args.trace, "predicted.json"), json.dumps(predicted) + "\n")
        files.append("predicted.json")
    both = trace.merge(predicted, measured)
    write_atomic(os.path.join(args.trace, "compare.json"), json.dumps(both) + "\n")
    files.append("compare.json")
    if have_matplotlib():
        m = plan.mesh
        title = f"dp {m.dp} x tp {m.tp} x pp {m.pp}: predicted (top) vs measured (bottom), one step"
        shown = measured
        if len(measured) > MAX_DRAWN_RANKS:  # one rank per pipeline stage: dp and tp rank 0
            shown = [measured[i * m.dp * m.tp] for i in range(m.pp)]
            title += ", measured: dp/tp rank 0 of each stage"
        swimlanes(trace.merge(predicted, shown), os.path.join(args.trace, "compare.png"), title)
        files.append("compare.png")
    return {"dir": args.trace, "files": files, "measured_categories": split,
            "predicted_categories": trace.categories(predicted) if predicted is not None else None}


def main(argv: Sequence[str] | None = None, predicted_timeline=None) -> int:
    """`plan measure`; returns the exit status. `predicted_timeline(plan, model_path, cluster_spec)` returns the
    cost model's Chrome trace of the plan and a note (the `plan` CLI passes planner.predicted_timeline; the
    executor itself never imports the cost model); without it --trace writes the measured side only."""
    args = _parser().parse_args(list(argv or []))
    if args.steps < 1 or args.warmup < 0:
        raise ExecutorError("--steps must be >= 1 and --warmup >= 0")
    if args.steps <= args.warmup:
        raise ExecutorError(f"--steps ({args.steps}) must be more than --warmup ({args.warmup}): the median is taken "
                            "over the steps after warm-up")
    if args.threads < 1:
        raise ExecutorError(f"--threads must be >= 1 (CPU threads per rank), got {args.threads}")
    if args.timeout is not None and not args.timeout > 0:
        raise ExecutorError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.compile:
        import torch._dynamo
        known = torch._dynamo.list_backends(exclude_tags=())
        if args.compile not in known:
            raise ExecutorError(f"--compile {args.compile}: not a torch.compile backend; use inductor (the default), "
                                "aot_eager or eager (all: torch._dynamo.list_backends(exclude_tags=()))")
    check_outputs(args)
    if args.cluster:  # read only for --trace and for GPU plans: a bad one is said whatever the flags
        from hardware_profiles.load import load_cluster
        load_cluster(args.cluster)
    plan = check_inputs(args.plan, args.model, args.cluster)
    predicted = None
    if args.trace and predicted_timeline is not None:
        predicted, note = predicted_timeline(plan, args.model, args.cluster)
        if note:
            print(f"note: {note}", file=sys.stderr)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    from executor.measure import compare, format_report, write_calibration
    from planner.plan import write_atomic
    print(f"plan measure: {plan.world_size} rank(s) (dp {plan.mesh.dp} x tp {plan.mesh.tp} x pp {plan.mesh.pp}), "
          f"{args.steps} steps ({args.warmup} warm-up)", flush=True)
    crowded = oversubscribed(plan.world_size, args.threads)
    if crowded:
        print(f"note: {crowded}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="shardwise-measure-") as tmp:
        result = os.path.join(tmp, "measured.json")
        t0 = time.perf_counter()
        rc, err = launch(args.plan, args.model, plan.world_size, args.steps, args.warmup, args.threads, result,
                         args.timeout, args.trace, args.compile, debug=args.debug)
        if not os.path.exists(result):
            elapsed = time.perf_counter() - t0
            why = (f"it ran past --timeout {args.timeout:g} s and was stopped; raise --timeout or lower --steps"
                   if rc == TIMED_OUT and args.timeout is not None and elapsed >= args.timeout else failure_reason(err, rc))
            print(f"plan measure: the job failed after {elapsed:.1f} s: {why}", file=sys.stderr)
            if args.debug:
                print(err, file=sys.stderr)
            from executor.worker import MODEL_CODE
            return 2 if MODEL_CODE in why else 1  # the model file's own code raised: bad input
        with open(result) as f:
            measured = json.load(f)
        if crowded:
            measured.setdefault("notes", []).append(crowded)
        if rc != 0:  # rank 0 writes the result only after every rank's measurement arrived: the run is complete
            note = (f"a rank exited abnormally after the measurement was complete (during shutdown): "
                    f"{failure_reason(err, rc)}")
            print(f"note: {note}", file=sys.stderr)
            measured.setdefault("notes", []).append(note)
    if args.trace:
        measured.setdefault("notes", []).append("--trace: the steps after warm-up ran under torch.profiler, which "
                                                "adds time to each step")
    bad = next((k for k, loss in enumerate(measured.get("losses", []), 1)
                if not isinstance(loss, (int, float)) or not math.isfinite(loss)), None)
    if bad is not None:  # timed all the same, but the model computes nan/inf: its kernels may not be the usual ones
        measured.setdefault("notes", []).append(
            f"the loss is {measured['losses'][bad - 1]} from step {bad}: the model computes a non-finite loss "
            "(check the model file's inputs, initialisation and loss), so these times are of a run that trains nothing")
    out = compare(plan, measured)
    if args.output:  # the results first: a failure formatting the report (or drawing) must not lose the run
        write_atomic(args.output, json.dumps(out, indent=1) + "\n")
    data = write_calibration(args.calibrate, plan, out) if args.calibrate else None
    print(format_report(plan, measured))
    if args.trace:
        out["trace"] = write_traces(args, plan, predicted)
        if args.output:  # again, with the trace block
            write_atomic(args.output, json.dumps(out, indent=1) + "\n")
        print(f"wrote {', '.join(out['trace']['files'])} in {args.trace} (the measured steps ran under "
              "torch.profiler; open compare.json in https://ui.perfetto.dev)")
    if args.plot:
        from executor.plots import measure_bars
        measure_bars([out], args.plot)
        print(f"wrote {args.plot}")
    if args.output:
        print(f"wrote {args.output}")
    if data is not None:
        print(f"calibration: {args.calibrate} step_time_scale = {data['step_time_scale']}")
    return 0
