"""Loading a user's MODEL.py: `build_model()`, `sample_batch(batch_size)`, optional `loss_fn(outputs, targets)`.

Every failure becomes a `ModelError` with one line naming the problem and the fix (missing file, syntax error with
its line, missing functions, `build_model` raising).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from planner.errors import ModelError


@dataclass(frozen=True)
class ModelFile:
    """The callables a model file provides."""

    path: str
    """Absolute path of the file."""
    build_model: Callable[[], torch.nn.Module]
    """Builds the model."""
    sample_batch: Callable[[int], tuple[Any, Any]]
    """Returns (inputs, targets) for a batch size."""
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """The file's `loss_fn`, or `default_loss`."""


def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """Cross-entropy when outputs are logits over classes and targets integer ids, else MSE."""
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    if isinstance(outputs, dict):
        outputs = outputs.get("logits", next(iter(outputs.values())))
    if hasattr(outputs, "logits"):
        outputs = outputs.logits
    if not torch.is_floating_point(targets) and outputs.dim() == targets.dim() + 1:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
    return F.mse_loss(outputs, targets.to(outputs.dtype))


def frame_in_file(exc: BaseException, path: str) -> tuple[int, str] | None:
    """(line number, source line) of the deepest traceback frame of `exc` inside the file `path`, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # follow chained causes: export wraps the user's error
        seen.add(id(exc))
        # an op run from a traced graph (executor.graph_ops) carries the model code's stack as text: its line is
        # deeper than any frame of the model file the interpreter runs under
        stack = getattr(exc, "source_stack", "")
        for m in reversed(list(re.finditer(r'File "([^"]+)", line (\d+)[^\n]*\n\s*([^\n]*)', stack))):
            if os.path.abspath(m.group(1)) == path:
                return int(m.group(2)), m.group(3).strip()
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            if os.path.abspath(frame.filename) == path and frame.lineno is not None:
                return frame.lineno, (frame.line or "").strip()
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def _where(exc: BaseException, path: str) -> str:
    """' (line N)' of the deepest frame inside the model file, if any."""
    found = frame_in_file(exc, path)
    return f" (line {found[0]})" if found else ""


def load_model_file(path: str) -> ModelFile:
    """Import MODEL.py and check it follows the convention; raises ModelError otherwise."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such model file; pass a .py file that defines build_model() and "
                         "sample_batch(batch_size)")
    if not path.endswith(".py"):
        raise ModelError(f"{path}: a model file must be a .py file defining build_model() and sample_batch()")
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "shardwise_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ModelError(f"{path}:{e.lineno}: syntax error in the model file: {e.msg}") from None
    except Exception as e:
        raise ModelError(f"{path}: importing the model file raised {type(e).__name__}: {e}{_where(e, path)}") \
            from None
    missing = [f for f in ("build_model", "sample_batch") if not callable(getattr(module, f, None))]
    if missing:
        raise ModelError(f"{path}: defines no {missing[0]}(); a model file must define build_model() -> "
                         "nn.Module and sample_batch(batch_size) -> (inputs, targets)")
    loss = getattr(module, "loss_fn", None)
    return ModelFile(path=path, build_model=module.build_model, sample_batch=module.sample_batch,
                     loss_fn=loss if callable(loss) else default_loss)


def build(model_file: ModelFile, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Call build_model() with `device` as the default device (use "meta" to allocate nothing)."""
    try:
        with torch.device(device):
            model = model_file.build_model()
    except Exception as e:
        raise ModelError(f"{model_file.path}: build_model() raised {type(e).__name__}: {e}"
                         f"{_where(e, model_file.path)}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"{model_file.path}: build_model() returned {type(model).__name__}, not a "
                         "torch.nn.Module")
    return model


def batch(model_file: ModelFile, batch_size: int) -> tuple[Any, Any]:
    """Call sample_batch(batch_size) and check it returns (inputs, targets)."""
    try:
        out = model_file.sample_batch(batch_size)
    except Exception as e:
        raise ModelError(f"{model_file.path}: sample_batch({batch_size}) raised {type(e).__name__}: {e}"
                         f"{_where(e, model_file.path)}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ModelError(f"{model_file.path}: sample_batch() must return a pair (inputs, targets), got "
                         f"{type(out).__name__}")
    return out[0], out[1]


class Batches:
    """`batch` on a random stream of its own (torch's CPU generator state, seeded `seed`), so that every rank draws
    the same data whatever random numbers its part of the model draws in between: under pipelining a stage with
    dropout and one without would otherwise sample different batches from the second step on, and train one
    stage's inputs against another stage's targets."""

    def __init__(self, model_file: ModelFile, seed: int):
        self.model_file = model_file
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._state = torch.get_rng_state()

    def __call__(self, batch_size: int) -> tuple[Any, Any]:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._state)
            out = batch(self.model_file, batch_size)
            self._state = torch.get_rng_state()
        return out
