"""The `plan` command: a thin face over the planner, the profiler and the executor.

    plan MODEL.py --cluster PRESET_OR_YAML --batch-size B ...   plan a model (see `plan MODEL.py --help`)
    plan profile [--nproc N] [--backend nccl|gloo] -o cluster.yaml
    plan measure plan.json MODEL.py [--steps N] [-o measured.json]
    plan schema [-o plan.schema.json]
    plan export plan.json --to torchtitan|megatron|deepspeed|accelerate [-o FILE]
    plan check plan.json MODEL.py

Bad input of any kind ends with one line on stderr and exit status 2 (a traceback only with `--debug`).
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from typing import NoReturn, Sequence

SUBCOMMANDS = ("profile", "measure", "schema", "export", "check")


class ArgParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _user_errors() -> tuple[type[BaseException], ...]:
    from executor.errors import ExecutorError
    from hardware_profiles.schema import ProfileError
    from planner.errors import ModelError, PlanError
    return (ModelError, PlanError, ProfileError, ExecutorError)


def _model_shapes(path: str, quick: bool) -> dict[str, list]:
    """GEMM, attention, norm and bias-gradient shapes of a model file, traced at batch 1, for `plan profile --model`:
    at 1, 4 and 16 samples on a machine with CUDA (one sample on CPU ranks, where a GEMM of 16 samples of a real
    model takes seconds a call, and with `--quick`, which also takes fewer shapes)."""
    import torch

    from cost_model.work import graph_bias_grads, graph_norms, graph_shapes
    from planner.model_file import load_model_file
    from planner.trace import trace_model
    graph = trace_model(load_model_file(path), 1)
    scales = (1, 4, 16) if torch.cuda.is_available() and not quick else (1,)
    gemms, attentions = graph_shapes(graph, limit=6 if quick else 32, scales=scales)
    norms, biases = graph_norms(graph, scales), graph_bias_grads(graph, scales)
    return {"gemms": gemms, "attentions": attentions[:2] if quick else attentions,
            "norms": norms[:2] if quick else norms, "reduces": biases[:2] if quick else biases}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `plan` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    errors = _user_errors()
    with warnings.catch_warnings(record=True) as caught:  # a model file's warnings: shown unless an error follows
        status = _main(argv, debug, errors)
    if status != 2 or debug:  # after a one-line error they would make it several lines
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return status


def _main(argv: list[str], debug: bool, errors: tuple) -> int:
    try:
        if argv and argv[0] == "profile":
            from hardware_profiles.probe import main as run
            return run(argv[1:], shapes_for=_model_shapes)
        if argv and argv[0] == "measure":
            from executor.cli import main as run
            from planner.predicted_timeline import predicted_timeline
            return run(argv[1:], predicted_timeline=predicted_timeline)
        if argv and argv[0] == "schema":
            from planner.plan_schema import main as run
            return run(argv[1:])
        if argv and argv[0] == "export":
            from planner.export import main as run
            return run(argv[1:])
        if argv and argv[0] == "check":
            from executor.cli_check import main as run
            return run(argv[1:])
        if argv and argv[0].isidentifier() and not os.path.exists(argv[0]):  # a word, not a path or file name
            near = difflib.get_close_matches(argv[0], SUBCOMMANDS, n=1, cutoff=0.6)
            if near:  # `plan mesure ...` would otherwise be planned as a model file named "mesure"
                from planner.errors import PlanError
                raise PlanError(f"unknown command '{argv[0]}'; did you mean `plan {near[0]}`? (commands: "
                                f"{', '.join(SUBCOMMANDS)}; anything else is a model file)")
        from planner.cli_plan import main as run
        return run(argv)
    except errors as e:
        if debug:  # the traceback too, but still the bad-input status
            import traceback
            traceback.print_exc()
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("plan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `plan ... | head`: the reader left; say nothing (Python docs, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
