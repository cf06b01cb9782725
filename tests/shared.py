"""What several test files share: a small GPT model file, what `plan measure`'s worker computes on one process
(the reference the distributed runs must equal), and training many plans in one torchrun launch."""
import json
import os
import subprocess
import sys
import textwrap

import torch

def gpt_model_file(**config) -> str:
    """The text of a model file for examples/gpt.py's GPT with `GPTConfig(**config)` (`{examples!r}` left to
    format, as in SMALL_GPT)."""
    cfg = ", ".join(f"{k}={v!r}" for k, v in config.items())
    return textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {{examples!r}})
        from gpt import GPTConfig, build_model as _build, sample_batch as _batch
        CFG = GPTConfig({cfg})
        def build_model():
            return _build(CFG)
        def sample_batch(batch_size):
            return _batch(batch_size, CFG)
    """)



def rank_program_end(out_path: str) -> str:
    """The end of a rank program (which imported json, os and torch.distributed as dist): rank 0 writes `out` as
    JSON to `out_path` (a Python expression, e.g. `sys.argv[1]`); every rank leaves gloo before any tears it
    down; and none runs interpreter teardown, where a gloo worker thread still holding a Work's tensors can abort
    the rank ("terminate called without an active exception", about 1 run in 10) after the work is done."""
    return textwrap.dedent(f"""
        if dist.get_rank() == 0:
            with open({out_path}, "w") as f:
                json.dump(out, f)
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)
    """)

SMALL_GPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {examples!r})
    from gpt import GPT, GPTConfig, sample_batch as _sample
    CFG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    def build_model():
        return GPT(CFG)
    def sample_batch(b):
        return _sample(b, CFG)
""")
"""A 2-layer h=32 GPT from examples/gpt.py, as a model file's text (format `examples` with the examples folder)."""


def call(model, x):
    """The model on one batch's inputs as the executor passes them: a dict as keyword arguments, a tuple as
    positional ones, a tensor alone."""
    if isinstance(x, dict):
        return model(**x)
    return model(*x) if isinstance(x, tuple) else model(x)


def reference_losses(model_path, steps: int, batch_size: int, evaluated: list | None = None) -> list[float]:
    """Same seeds, same data, AdamW(lr=1e-3) (the worker's defaults), the model file's loss; one loss per step.
    `evaluated`: appended the loss on the first batch after the last step in eval mode (`Runner.evaluate`)."""
    from executor.worker import BUILD_SEED, DATA_SEED, STEP_SEED
    from planner.model_file import Batches, build, load_model_file
    mf = load_model_file(str(model_path))
    torch.manual_seed(BUILD_SEED)
    model = build(mf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(STEP_SEED)
    batches = Batches(mf, DATA_SEED)
    losses, first = [], None
    for _ in range(steps):
        x, y = batches(batch_size)
        first = first or (x, y)
        loss = mf.loss_fn(call(model, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if evaluated is not None:
        x, y = first
        model.eval()
        with torch.no_grad():
            evaluated.append(mf.loss_fn(call(model, x), y).item())
    return losses


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "zoo_worker.py")
LAUNCH_TIMEOUT_S = 900
"""One launch (tests/test_zoo.py: 15 models per mesh, two meshes at world 4, about two minutes here)."""
MAX_LAUNCHES = 3
"""Launches of one call when one dies (see `train_in_one_launch`)."""


def train_in_one_launch(jobs: list[dict], world: int, folder: str, steps: int) -> dict[str, dict]:
    """Train every job ({"name", "model", "plan"}) `steps` steps in one torchrun launch of tests/zoo_worker.py on
    `world` gloo ranks (a launch's start costs seconds here); job name -> the worker's result ({"losses", ...} or
    {"error", "where"}). When a launch dies (a rank killed by a signal: no Python error to record), the job it was
    running gets the launch's error and a new launch trains the jobs left, at most MAX_LAUNCHES in all."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    results: dict[str, dict] = {}
    for attempt in range(MAX_LAUNCHES):
        left = [j for j in jobs if j["name"] not in results]
        if not left:
            break
        jobs_path = os.path.join(folder, f"jobs{attempt}.json")
        with open(jobs_path, "w") as f:
            json.dump({"steps": steps, "jobs": left}, f)
        ended = None
        try:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   str(world), WORKER, jobs_path, folder], capture_output=True, text=True,
                                  timeout=LAUNCH_TIMEOUT_S, env=env, cwd=ROOT)
            if proc.returncode:
                ended = f"the launch died in this model: torchrun exited {proc.returncode}: {_died(proc.stderr)}"
        except subprocess.TimeoutExpired:
            ended = f"the launch was still in this model after {LAUNCH_TIMEOUT_S} s"
        for job in left:
            path = os.path.join(folder, job["name"] + ".json")
            if os.path.exists(path):
                with open(path) as f:
                    results[job["name"]] = json.load(f)
            elif ended and os.path.exists(os.path.join(folder, job["name"] + ".started")):
                results[job["name"]] = {"error": ended, "where": ""}  # the job the launch died in
                break
        if ended and ended.startswith("the launch was still"):
            break
    for job in jobs:
        results.setdefault(job["name"], {"error": f"not run: {MAX_LAUNCHES} launches died before it", "where": ""})
    return results


def _died(stderr: str) -> str:
    """The line of torchrun's report that says how a rank died (a signal), else its last line."""
    lines = [l.strip() for l in stderr.strip().splitlines() if l.strip()]
    signal = [l for l in lines if "Signal" in l and "received" in l]
    return (signal or lines or [""])[-1]
