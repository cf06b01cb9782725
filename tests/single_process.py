"""What `plan measure`'s worker computes, on one process: the reference the distributed runs must equal."""
import torch


def reference_losses(model_path, steps: int, batch_size: int) -> list[float]:
    """Same seeds, same data, AdamW(lr=1e-3) (the worker's defaults), the model file's loss; one loss per step."""
    from executor.worker import BUILD_SEED, DATA_SEED
    from planner.model_file import batch, build, load_model_file
    mf = load_model_file(str(model_path))
    torch.manual_seed(BUILD_SEED)
    model = build(mf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(DATA_SEED)
    losses = []
    for _ in range(steps):
        x, y = batch(mf, batch_size)
        loss = mf.loss_fn(model(**x) if isinstance(x, dict) else model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
