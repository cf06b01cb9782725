"""What several test files share: a small GPT model file, and what `plan measure`'s worker computes on one process
(the reference the distributed runs must equal)."""
import textwrap

import torch

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
        loss = mf.loss_fn(model(**x) if isinstance(x, dict) else model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if evaluated is not None:
        x, y = first
        model.eval()
        with torch.no_grad():
            evaluated.append(mf.loss_fn(model(**x) if isinstance(x, dict) else model(x), y).item())
    return losses
