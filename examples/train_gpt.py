"""Train the example GPT with a plan, from your own training loop.

    plan examples/gpt.py --cluster cpu-local --batch-size 8 --force dp=2 -o plan.json
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py plan.json [--steps 20] [--save ckpt/]

Every rank builds the same model (same seed), `apply_plan` shards it the way the plan says (DDP / FSDP2 ZeRO /
DTensor TP+SP / pipelining), and `runner.step` does forward, backward and the optimizer step. The optimizer is
passed as a factory because sharding replaces the parameters: the runner calls it with the ones this rank holds.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import CONFIG, build_model  # noqa: E402

from executor import apply_plan  # noqa: E402
from executor.errors import ExecutorError  # noqa: E402
from planner.errors import PlanError  # noqa: E402
from planner.plan import Plan  # noqa: E402


def main() -> None:
    """Parse arguments, apply the plan, train, print the report (rank 0)."""
    ap = argparse.ArgumentParser(description="train examples/gpt.py under a plan (run with torchrun)")
    ap.add_argument("plan", help="plan.json for examples/gpt.py")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--save", help="folder to save a checkpoint in at the end (any plan can load it)")
    ap.add_argument("--resume", help="checkpoint folder to resume from")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    plan = Plan.load(args.plan)
    one_micro_batch = torch.zeros(plan.microbatch_size, CONFIG.block_size, dtype=torch.long)  # tp exports with it
    runner = apply_plan(build_model(), plan, optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
                        example_inputs=one_micro_batch)
    if args.resume:
        runner.load(args.resume)
    rank = int(os.environ.get("RANK", "0"))
    shape = (runner.plan.global_batch_size, CONFIG.block_size + 1)
    held_out = torch.randint(0, CONFIG.vocab_size, shape, generator=torch.Generator().manual_seed(7))
    for step in range(runner.step_count, runner.step_count + args.steps):
        # the global batch, the same on every rank; seeded by the step, so a resumed run sees the batches an
        # unbroken one would
        tokens = torch.randint(0, CONFIG.vocab_size, shape, generator=torch.Generator().manual_seed(1000 + step))
        loss = runner.step(tokens[:, :-1], tokens[:, 1:])
        if step % 5 == 0:
            val = runner.evaluate(held_out[:, :-1], held_out[:, 1:])  # on every rank: it runs collectives
            norm = f", gradient norm {runner.grad_norm:.3f}" if runner.grad_norm is not None else ""
            if rank == 0:
                print(f"step {step}: loss {loss:.4f}, held-out loss {val:.4f}{norm}")
    if args.save:
        runner.save(args.save)
    if rank == 0:
        print(runner.report(warmup=2))
    torch.distributed.destroy_process_group()  # apply_plan started it; gloo ranks left to exit with it can abort


if __name__ == "__main__":
    try:
        main()
    except (ExecutorError, PlanError) as e:  # a plan that cannot run here (world size, model): one line per rank
        print(f"train_gpt.py rank {os.environ.get('RANK', '0')}: error: {e}", file=sys.stderr)
        sys.exit(2)
