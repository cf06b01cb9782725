"""executor: apply a plan with torch.distributed (DDP, FSDP2, DTensor TP/SP, pipelining), train, and measure.

Reads a `Plan` and the model; never imports the search or the cost model, so a hand-written plan and a searched plan
go through the same code.

    from executor import apply_plan
    runner = apply_plan(build_model(), "plan.json", optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                        example_inputs=one_micro_batch)  # tp exports the model with it
    loss = runner.step(inputs, targets)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.runner import Runner, apply_plan

__all__ = ["apply_plan", "Runner"]


def __getattr__(name: str):
    # lazy, so `plan measure` can validate input before importing torch.distributed machinery
    if name in __all__:
        from executor import runner
        return getattr(runner, name)
    raise AttributeError(name)
