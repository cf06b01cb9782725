"""`plan MODEL.py ...`: trace, (search,) predict, print, write plan.json and the timeline.

The flow is the product's: model file -> OpGraph (planner.trace) -> Cluster (hardware_profiles) -> search over plans
scored by the cost model (planner.search, cost_model) -> plan.json. No logic lives only here.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Sequence

from planner.cli import ArgParser
from planner.errors import PlanError
from planner.plan import RECOMPUTE, check_output
from planner.search.space import check_batch_size

FORCE_KEYS = {
    "dp": int, "tp": int, "pp": int, "zero": int, "mbs": int, "recompute": str, "schedule": str, "vp": int,
    "sp": int, "recompute_blocks": int,
}
"""`--force` keys and their types (see `plan --help`)."""


def parse_force(text: str | None) -> dict[str, Any]:
    """Parse `--force K=V,...` into a dict; unknown keys or bad values raise PlanError."""
    out: dict[str, Any] = {}
    if text is None:
        return out
    if not text.replace(",", "").strip():
        raise PlanError(f"--force {text!r} pins nothing; give KEY=VALUE pairs (e.g. --force dp=2,tp=4) or leave it out")
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise PlanError(f"--force: {item!r} is not KEY=VALUE (e.g. --force dp=2,tp=4)")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in FORCE_KEYS:
            raise PlanError(f"--force: unknown key {key!r} (known: {', '.join(FORCE_KEYS)})")
        if key in out:
            raise PlanError(f"--force: {key} given twice")
        kind = FORCE_KEYS[key]
        try:
            v = kind(value)
        except ValueError:
            raise PlanError(f"--force: {key}={value!r} must be an integer") from None
        if kind is int and (v < 0 or (v == 0 and key not in ("zero", "sp"))):
            raise PlanError(f"--force: {key}={v} must be {'0 or more' if key in ('zero', 'sp') else 'positive'}")
        if key == "zero" and v > 3:
            raise PlanError(f"--force: zero={v}; ZeRO stages are 0, 1, 2, 3")
        if key == "sp" and v not in (0, 1):
            raise PlanError(f"--force: sp={v}; use sp=0 or sp=1")
        if key == "recompute" and v not in RECOMPUTE:
            raise PlanError(f"--force: recompute={v!r}; use none, attention, selective or full")
        if key == "schedule" and v not in ("gpipe", "1f1b", "interleaved"):
            raise PlanError(f"--force: schedule={v!r}; use gpipe, 1f1b or interleaved")
        out[key] = v
    if "recompute_blocks" in out:
        if out.setdefault("recompute", "full") not in ("full", "selective"):
            raise PlanError(f"--force recompute_blocks={out['recompute_blocks']} needs recompute=full or selective, "
                            f"not recompute={out['recompute']} (it is how many blocks of each stage full "
                            "recomputation re-runs)")
    return out


def default_precision(device: Any) -> str:
    """bf16, unless the device trains slower at bf16 than at fp32 (CPU ranks), then fp32: an nn.Linear's forward
    and backward at the largest size the profile measured at bf16 (`by_precision`), against the same at fp32 (a
    matrix unit can make the bf16 forward faster while its backward is several times slower); without those
    curves, the two peaks."""
    from hardware_profiles.schema import interp_log
    bf16, fp32 = device.peak_flops.get("bf16"), device.peak_flops.get("fp32")
    if not fp32 or not bf16:
        return "fp32" if fp32 else "bf16"
    r = device.rates("bf16")
    if r is not None and r.linear_efficiency and r.linear_backward_efficiency and device.linear_efficiency \
            and device.linear_backward_efficiency:
        flops = r.linear_efficiency[-1][0]

        def seconds(peak, fwd, bwd):  # one linear: forward flops, backward twice that
            return flops / (peak * interp_log(fwd, flops)) + 2 * flops / (peak * interp_log(bwd, flops))
        slower = seconds(bf16, r.linear_efficiency, r.linear_backward_efficiency) > \
            seconds(fp32, device.linear_efficiency, device.linear_backward_efficiency)
        return "fp32" if slower else "bf16"
    return "fp32" if bf16 < fp32 else "bf16"


def unmeasured_precision_note(cluster: Any, precision: str) -> str:
    """One line: this CPU profile has no rates measured at `precision`, so its fp32 curves price it."""
    return (f"note: the profile {cluster.name} measured no {precision} rates on its CPU ranks (by_precision); its "
            f"linears, matmuls and elementwise kernels are priced with the fp32 curves at the {precision} peak, "
            f"which on CPUs can be several times off: re-measure with `plan profile`")


def read_calibration(path: str, cluster_name: str) -> float:
    """The step_time_scale recorded by `plan measure --calibrate` for this cluster; PlanError if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise PlanError(f"--calibration {path}: cannot read it ({e.strerror}); write one with "
                        "`plan measure PLAN MODEL --calibrate FILE`") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--calibration {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # binary, a 5000-digit number, deep nesting
        raise PlanError(f"--calibration {path}: not a calibration file ({type(e).__name__}); give one that "
                        "`plan measure ... --calibrate FILE` wrote") from None
    if not isinstance(data, dict):
        raise PlanError(f"--calibration {path}: expected a JSON object written by `plan measure --calibrate`")
    if "cluster" not in data or "step_time_scale" not in data:
        raise PlanError(f"--calibration {path}: not a calibration file (no cluster and step_time_scale in it); give "
                        "one that `plan measure ... --calibrate FILE` wrote")
    if data.get("cluster") != cluster_name:
        raise PlanError(f"--calibration {path}: recorded for cluster {data.get('cluster')!r}, not "
                        f"{cluster_name!r}; calibrate on this profile with `plan measure ... --calibrate`")
    scale = data.get("step_time_scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise PlanError(f"--calibration {path}: no positive step_time_scale in it; record a run with "
                        "`plan measure ... --calibrate`")
    if not SCALE_BOUNDS[0] <= scale <= SCALE_BOUNDS[1]:  # also Infinity, which json reads
        shown = f"{scale:.3g}" if isinstance(scale, float) or scale < 10 ** 6 else f"of {len(str(scale))} digits"
        raise PlanError(f"--calibration {path}: step_time_scale {shown} is outside {SCALE_BOUNDS[0]:g}.."
                        f"{SCALE_BOUNDS[1]:g}: a measured step that far from the prediction means the profile does not "
                        "describe the machine, not a factor to apply; profile it (`plan profile`) and re-measure")
    return float(scale)


SCALE_BOUNDS = (0.01, 100.0)
"""The calibration factors `plan --calibration` applies: measured/predicted step time within a factor of 100."""


def calibrate(result: Any, scale: float, source: str) -> Any:
    """The search result with every prediction scaled by the calibration factor (rankings do not change)."""
    from dataclasses import replace
    cands = [(plan, pred.calibrated(scale, source)) for plan, pred in result.candidates]
    best_pred = result.best_prediction.calibrated(scale, source)
    best = replace(result.best, predicted=best_pred.to_dict())
    fallbacks = [(plan, pred.calibrated(scale, source)) for plan, pred in result.fallbacks]
    evaluated = [replace(e, step_time_s=e.step_time_s * scale) for e in result.evaluated]
    return replace(result, best=best, best_prediction=best_pred, candidates=cands, fallbacks=fallbacks,
                   evaluated=evaluated)


def dry_run_gate(result: Any, model_file: Any, output: str) -> tuple[Any, str]:
    """Before `-o` writes: dry-run the best plan (`executor.dry_run`: the executor's own apply_plan on fake tensors
    under a fake process group); when it fails, the next-best candidate that passes, then the search's fallbacks
    (other configurations), with a note. Returns the result to report and write, and a status line; PlanError
    (nothing written) when none passes."""
    import time
    from dataclasses import replace

    from executor.dry_run import first_that_runs
    from planner.search.outer import candidate_label
    t0 = time.perf_counter()
    tried = [(result.best, result.best_prediction)] + result.candidates[1:] + result.fallbacks
    plans = [plan for plan, _ in tried]
    unchecked: list[str] = []

    def say(i: int, plan: Any, stage: int | None = None, stages: int = 0) -> None:
        # the dry run of a large model takes seconds (minutes for a deep pipeline): say what is running
        if sys.stderr.isatty():
            at = "" if stage is None else f", pipeline stage {stage + 1} of {stages}"
            print(f"\r\033[Kdry run: candidate {i + 1} on fake tensors at world {plan.world_size}{at} ...", end="",
                  file=sys.stderr, flush=True)
    i, failures = first_that_runs(plans, model_file, os.path.basename(output), notes=unchecked, on_start=say,
                                  on_stage=say)
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    took = time.perf_counter() - t0
    if i is None:
        more = f" (the other {len(plans) - 1} candidates failed too)" if len(plans) > 1 else ""
        raise PlanError(f"{failures[0]}{more}; {output} not written (`--no-check` writes it without the dry run)")
    if unchecked:
        result = replace(result, notes=[*result.notes, unchecked[-1]])
    ok = "ok, partly (see the note)" if unchecked else "ok"
    if i == 0:
        return result, f"dry run: {ok} ({took:.1f} s)"
    plan, pred = tried[i]
    top = len(result.candidates)
    failed = "the only candidate" if top == 1 else f"all {top} candidates"
    which = (f"candidate {i + 1} of the top {top} (the best that passes)" if i < top else
             f"{candidate_label(plan)}, the fastest plan of a configuration no candidate had ({failed} failed),")
    note = f"the best plan failed the dry run, so {which} is the plan: {failures[0]}"
    result = replace(result, best=replace(plan, predicted=pred.to_dict()), best_prediction=pred,
                     notes=[*result.notes, note])
    passed = f"candidate {i + 1}" if i < top else candidate_label(plan)
    return result, f"dry run: {ok} for {passed} ({took:.1f} s; the best failed, see the note)"


def memory_ignored_note(pred: Any, cluster: Any) -> str:
    """What `--ignore-memory` means for the plan it printed."""
    from planner.search.outer import format_bytes
    usable = cluster.device.usable_memory_bytes
    if pred.fits:
        return (f"--ignore-memory: this plan fits anyway ({format_bytes(pred.peak_memory_bytes)} of "
                f"{format_bytes(usable)} usable); run without --ignore-memory to write it")
    return (f"--ignore-memory: this plan needs {format_bytes(pred.peak_memory_bytes)} per device, one "
            f"{cluster.device.name} has {format_bytes(usable)} usable: shardwise's executor would run out of memory "
            "here, so the step time is a what-if (a runtime that keeps fewer activations), and no plan is written")


def build_parser() -> ArgParser:
    """The `plan` argument parser."""
    p = ArgParser(
        prog="plan",
        description="Find the fastest parallelization plan (DP/TP/PP, ZeRO, micro-batching, recompute) for a "
                    "PyTorch model on a cluster, predict its step time and memory, and write it as plan.json.\n\n"
                    "Other commands:\n"
                    "  plan profile [--nproc N] [--backend nccl|gloo] -o cluster.yaml   measure this machine\n"
                    "  plan measure plan.json MODEL.py [--steps N] [-o measured.json]   run a plan, compare\n"
                    "  plan schema [-o plan.schema.json]                                plan.json's JSON Schema\n"
                    "  plan export plan.json --to torchtitan|megatron|deepspeed|accelerate [-o FILE]   "
                    "as a trainer's config\n"
                    "  plan check plan.json MODEL.py                                    dry-run a plan",
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL.py",
                   help="model file defining build_model() and sample_batch(batch_size)")
    p.add_argument("--summary", action="store_true",
                   help="print the traced model's parameters, FLOPs, activation memory and repeated blocks")
    p.add_argument("--cluster", metavar="PRESET|YAML",
                   help="cluster profile: a preset name (e.g. dgx-a100-80gb) or a YAML file from `plan profile`")
    p.add_argument("--nodes", type=int, metavar="N", help="override the profile's node count")
    p.add_argument("--attention", metavar="KERNEL",
                   help="price SDPA with this attention kernel of the profile instead of the one it names: one it "
                        "lists (the H100 preset: cudnn, flash2, flash3) or `unfused` (separate GEMMs, softmax and "
                        "dropout over the s x s scores: a run without FlashAttention)")
    p.add_argument("--batch-size", type=int, metavar="B", help="global batch size (samples per optimizer step)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                   help="training precision (bf16/fp16 keep fp32 master weights and Adam state); default bf16, "
                        "or fp32 on a device whose profile measured bf16 slower than fp32 (CPU ranks)")
    p.add_argument("--max-grad-norm", type=float, default=None, metavar="NORM",
                   help="clip the gradients to this global norm before each optimizer step, as "
                        "torch.nn.utils.clip_grad_norm_ (Megatron-LM's --clip-grad, nanoGPT's grad_clip, "
                        "usually 1.0); the plan records it, the executor applies it and the prediction prices it "
                        "(one pass over the gradients and one scalar all-reduce); default: no clipping")
    p.add_argument("--force", metavar="K=V,...", action="append",
                   help="pin choices (repeatable: --force dp=2 --force pp=2 pins both): dp, tp, pp, zero (0-3), mbs, recompute (none|attention|selective|full; "
                        "attention: only the SDPA calls re-run, Megatron-LM's selective), schedule "
                        "(gpipe|1f1b|interleaved), vp (virtual stages), sp (0|1), recompute_blocks (N: full "
                        "recomputation of only the first N blocks of each pipeline stage, as Megatron-LM's "
                        "--recompute-method block, the others none, or selective with recompute=selective; "
                        "unforced, the search recomputes only the blocks each stage's memory needs)")
    p.add_argument("--ignore-memory", action="store_true",
                   help="rank candidates as if device memory were unlimited and print the fastest with the memory "
                        "it needs: a what-if, e.g. the step time of a published run whose runtime (fused kernels) "
                        "keeps fewer activations than shardwise's executor; writes no plan (-o is refused)")
    p.add_argument("--top", type=int, default=None, metavar="K", help="show the K best candidates (default 5)")
    p.add_argument("--explain", action="store_true", help="say why the winner beats the runner-up")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop searching after S seconds and return the best plan so far (default 60)")
    p.add_argument("--calibration", metavar="CALIBRATION.json",
                   help="scale predicted step times by the measured/predicted ratio that `plan measure "
                        "--calibrate` recorded for this cluster profile")
    p.add_argument("-o", "--output", metavar="plan.json", help="write the chosen plan here")
    p.add_argument("--no-check", action="store_true",
                   help="write the plan without the dry run that -o runs first (the executor applies the plan on "
                        "fake tensors under a fake process group and runs one micro-batch; a plan that fails is not "
                        "written, the next-best candidate that passes is; see `plan check`)")
    p.add_argument("--timeline", metavar="trace.json",
                   help="write the simulated step as a Chrome trace (open in Perfetto or chrome://tracing)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw every candidate the search predicted (step time vs peak memory per device) with the "
                        "usable memory, the Pareto front, the chosen plan and the --top K; .png, .svg or .pdf; "
                        "needs matplotlib: pip install 'shardwise[plot]'")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON on stdout (plan, prediction, top-K candidates, search stats, "
                        "notes, assumptions); messages go to stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: Sequence[str]) -> int:
    """Run `plan MODEL.py ...`; returns the exit status."""
    args = build_parser().parse_args(argv)
    forced = parse_force(",".join(args.force) if args.force is not None else None)
    if args.batch_size is not None:
        check_batch_size(args.batch_size)  # before tracing
    if args.summary and not args.cluster:
        ignored = [flag for flag, given in (("-o", args.output), ("--timeline", args.timeline), ("--force", args.force),
                                            ("--batch-size", args.batch_size is not None), ("--nodes", args.nodes),
                                            ("--calibration", args.calibration), ("--explain", args.explain),
                                            ("--no-check", args.no_check), ("--precision", args.precision),
                                            ("--top", args.top is not None),
                                            ("--max-grad-norm", args.max_grad_norm is not None),
                                            ("--time-budget", args.time_budget is not None))
                   if given]
        if ignored:
            raise PlanError(f"--summary alone only inspects the model, so {', '.join(ignored)} would do nothing; "
                            "add --cluster to plan as well")
    if args.cluster == "":
        raise PlanError("--cluster is empty; give a preset name (e.g. dgx-a100-80gb) or the path of a YAML file "
                        "written by `plan profile`")
    if not args.summary and not args.cluster:
        raise PlanError("--cluster is required to plan (a preset such as dgx-a100-80gb, or a YAML file); "
                        "use --summary alone to only inspect the model")
    if args.cluster and args.batch_size is None:
        raise PlanError("--batch-size is required to plan: the global batch per optimizer step")
    if args.attention and not args.cluster:
        raise PlanError("--attention picks the cluster profile's attention kernel: give --cluster and --batch-size")
    if args.plot and not args.cluster:
        raise PlanError("--plot draws the search's candidates: give --cluster and --batch-size")
    if args.json and args.summary:
        raise PlanError("--json prints the plan report only; run --summary without --json")
    args.top = 5 if args.top is None else args.top  # defaults set here: --summary alone refuses them when given
    args.time_budget = 60.0 if args.time_budget is None else args.time_budget
    if args.top < 1:
        raise PlanError(f"--top must be >= 1 (the candidates to show), got {args.top}")
    if args.ignore_memory and args.output:
        raise PlanError("--ignore-memory predicts plans that may not fit the device, and -o writes only plans that "
                        "run: drop one of them")
    if args.ignore_memory and not args.cluster:
        raise PlanError("--ignore-memory changes the search: give --cluster and --batch-size")
    if args.max_grad_norm is not None and not 0 < args.max_grad_norm < float("inf"):
        raise PlanError(f"--max-grad-norm must be a positive number (the global gradient norm to clip to, e.g. "
                        f"1.0; leave it out for no clipping), got {args.max_grad_norm}")
    if not args.time_budget > 0 or args.time_budget == float("inf"):
        raise PlanError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    outputs = [(flag, path) for flag, path in (("-o", args.output), ("--timeline", args.timeline),
                                               ("--plot", args.plot)) if path is not None]
    for flag, path in outputs:  # before any work, so that a bad path loses no search and no file is half-written
        check_output(path, flag, inputs=[args.model, args.cluster, args.calibration])
    if len({os.path.abspath(path) for _, path in outputs}) < len(outputs):
        raise PlanError(f"{' and '.join(flag for flag, _ in outputs)} name the same file; give each its own")
    if args.plot:  # before the search: a missing matplotlib costs nothing
        from planner.search_plot import check_plot_path
        check_plot_path(args.plot)
    cluster = None
    if args.cluster:  # a bad profile fails fast, before the (slower) trace
        from hardware_profiles.load import load_cluster
        cluster = load_cluster(args.cluster, nodes=args.nodes)
        if args.attention:
            cluster = cluster.with_attention_kernel(args.attention)
    scale = read_calibration(args.calibration, cluster.name) if cluster and args.calibration else None
    precision = args.precision or (default_precision(cluster.device) if cluster else "bf16")
    precision_note = ""
    if cluster and args.precision is None and precision != "bf16":
        why = ("measured nn.Linear forward + backward is slower at bf16 than at fp32"
               if cluster.device.rates("bf16") is not None else "bf16 peak is below its fp32 peak"
               if cluster.device.peak_flops.get("bf16") else "peak_flops has no bf16 entry")
        precision_note = f"note: --precision not given; using {precision}: on {cluster.device.name} the profile's {why}"
    elif cluster and precision != "fp32" and not {"bf16", "fp16"} & set(cluster.device.peak_flops):
        precision_note = (f"note: the profile's peak_flops has no bf16 or fp16 entry, so {precision} matmuls are "
                          "priced at its fp32 peak; add the 16-bit peak (datasheet) or re-measure with `plan profile`")
    if cluster and precision != "fp32" and cluster.intra_node.kind == "loopback" and \
            cluster.device.rates(precision) is None:  # CPU ranks: fp32's curves say little about bf16's rates
        precision_note = "\n".join(filter(None, (precision_note, unmeasured_precision_note(cluster, precision))))
    quiet = contextlib.ExitStack()
    if args.json:  # stdout is the JSON alone: what the model file prints while it runs goes to stderr
        quiet.enter_context(contextlib.redirect_stdout(sys.stderr))
    with quiet:
        result, said = _search_and_write(args, cluster, forced, scale, precision, precision_note)
    if result is None:
        return 0
    if args.json:
        from planner.report import format_json
        print(format_json(result, explain=args.explain, top=args.top))
    else:
        from planner.report import format_result
        print(format_result(result, explain=args.explain, top=args.top))
    for line in said:
        print(line, file=sys.stderr if args.json else sys.stdout)  # with --json, stdout is the JSON alone
    return 0


def _search_and_write(args: Any, cluster: Any, forced: dict, scale: float | None, precision: str,
                      precision_note: str) -> tuple[Any, list[str]]:
    """Trace the model (and print --summary), search, and write the outputs: (the search result, a line per file
    written), or (None, []) for --summary alone."""
    from planner.model_file import load_model_file
    from planner.trace import trace_model

    model_file = load_model_file(args.model)
    graph = trace_model(model_file)
    if args.summary:
        from planner.summary import format_summary
        print(format_summary(graph))
    if cluster is None:
        return None, []

    from cost_model.model import CostModel
    from planner.search import search

    cost_model = CostModel(cluster)
    kept = max(args.top, 2) if args.explain else args.top  # --explain compares with the runner-up, whatever --top
    result = search(graph, cluster, cost_model, batch_size=args.batch_size, precision=precision,
                    forced=forced, top_k=kept, time_budget_s=args.time_budget, progress=sys.stderr.isatty(),
                    model_path=model_file.path, ignore_memory=args.ignore_memory,
                    max_grad_norm=args.max_grad_norm or 0.0)
    if args.ignore_memory:
        result.notes.append(memory_ignored_note(result.best_prediction, cluster))
    if precision_note:  # after the search: an error before it stays one line
        print(precision_note, file=sys.stderr)
    if scale is not None:
        result = calibrate(result, scale, args.calibration)
    said: list[str] = []  # outputs are written before the report: `plan ... -o p.json | head` still writes them
    try:
        result = write_outputs(args, result, graph, cost_model, cluster, model_file, scale, said)
    except BaseException:
        for line in said:  # what was written before the failure
            print(line, file=sys.stderr)
        raise
    return result, said


def write_outputs(args: Any, result: Any, graph: Any, cost_model: Any, cluster: Any, model_file: Any,
                  scale: float | None, said: list[str]) -> Any:
    """Write -o (after the dry run unless --no-check), --timeline and --plot; append a line per file to `said`;
    return the result, whose best plan the dry run may have replaced by the next candidate that passes."""
    if args.output:
        if not args.no_check:
            result, checked = dry_run_gate(result, model_file, args.output)
            said += [checked] if checked else []
        result.best.save(args.output)
        said.append(f"wrote {args.output}")
    if args.timeline:
        from cost_model.timeline import write_chrome_trace
        prediction = cost_model.predict(graph, result.best, timeline=True)
        if scale is not None:
            prediction = prediction.calibrated(scale, args.calibration)
        write_chrome_trace(prediction, args.timeline)
        said.append(f"wrote {args.timeline} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        from planner.search_plot import plot_search
        plot_search(result, cluster.device.usable_memory_bytes, args.plot, top_k=args.top,
                    title=f"{os.path.basename(args.model)} on {cluster.name} ({cluster.nodes} node(s) x "
                          f"{cluster.devices_per_node}), global batch {args.batch_size}")
        said.append(f"wrote {args.plot} ({len(result.evaluated)} candidates)")
    return result


if __name__ == "__main__":
    from planner.cli import main as _main
    sys.exit(_main(sys.argv[1:]))

