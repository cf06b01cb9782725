"""Loading a user's MODEL.py: `build_model()`, `sample_batch(batch_size)`, optional `loss_fn(outputs, targets)`.

Every failure becomes a `ModelError` with one line naming the problem and the fix (missing file, a directory, binary
or non-UTF-8 text, syntax error with its line, sys.exit at import, missing functions, `build_model` raising or
returning a model with nothing to train, `sample_batch` returning the wrong number of samples, a `loss_fn` that is a
class or not callable).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from planner.errors import ModelError


SHARDWISE_PACKAGES = ("planner", "cost_model", "executor", "hardware_profiles")
"""shardwise's top-level packages, which a file of the same name beside a model file must not shadow."""


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
    user_file: bool = False
    """Loaded by `load_model_file`: `build` and `batch` then refuse a model with nothing to train and a batch of
    another size (a ModelFile made in code, such as a test's probe, may trace a module without parameters)."""


IGNORE_INDEX = -100
"""The target F.cross_entropy leaves out by default (padding, as Hugging Face labels it)."""


def logits_of(outputs: Any) -> Any:
    """The logits in a model's outputs, as `default_loss` reads them: the tensor itself, the first element of a
    tuple/list, a dict's "logits" (else its first value), or `.logits`; None from an empty tuple or dict."""
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0] if outputs else None
    if isinstance(outputs, dict):
        outputs = outputs.get("logits", next(iter(outputs.values()), None))
    if hasattr(outputs, "logits"):
        outputs = outputs.logits
    return outputs


def class_targets(logits: Any, targets: Any) -> bool:
    """Whether `targets` are class indices for `logits` (one dimension fewer, integer), which `default_loss` reads
    as a cross-entropy."""
    return isinstance(targets, torch.Tensor) and isinstance(logits, torch.Tensor) \
        and not torch.is_floating_point(targets) and logits.dim() == targets.dim() + 1


def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """Cross-entropy when outputs are logits over classes and targets integer ids (IGNORE_INDEX left out), else MSE."""
    outputs = logits_of(outputs)
    if class_targets(outputs, targets):  # any integer dtype: cross_entropy itself takes int64 (or uint8) only
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1).long())
    return F.mse_loss(outputs, targets.to(outputs.dtype))


def summed_cross_entropy(outputs: Any, targets: Any) -> torch.Tensor:
    """`default_loss`'s cross-entropy summed over the targets it counts, not averaged (the executor divides by the
    global batch's count); class-index targets only."""
    logits = logits_of(outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), reduction="sum")


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


def first_line(exc: BaseException, limit: int = 160) -> str:
    """'Type: the first non-empty line of its message', shortened."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exit_call(e: SystemExit) -> str:
    """How the code called sys.exit: 'sys.exit(3)', 'sys.exit()'."""
    return f"sys.exit({'' if e.code is None else repr(e.code)})"


def _check_text(path: str) -> None:
    """Raise ModelError unless the file at `path` is readable Python source text (UTF-8 or its coding cookie)."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        raise ModelError(f"{path}: cannot read the model file: {e.strerror}; pass a readable .py file") from None
    if b"\0" in source:
        raise ModelError(f"{path}: is not a text file (it holds null bytes); pass a Python source file saved as "
                         "UTF-8")
    try:
        source.decode("utf-8")
    except UnicodeDecodeError as e:
        try:
            importlib.util.decode_source(source)  # another encoding its coding cookie declares
        except (SyntaxError, UnicodeDecodeError, LookupError):
            raise ModelError(f"{path}: is not UTF-8 text ({e.reason} at byte {e.start}); save the model file as "
                             "UTF-8") from None


def load_model_file(path: str) -> ModelFile:
    """Import MODEL.py and check it follows the convention; raises ModelError otherwise."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such model file; pass a .py file that defines build_model() and "
                         "sample_batch(batch_size)")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a directory, not a model file; pass the .py file inside it that defines "
                         "build_model() and sample_batch(batch_size)")
    if not path.endswith(".py"):
        raise ModelError(f"{path}: a model file must be a .py file defining build_model() and sample_batch()")
    _check_text(path)
    folder = os.path.dirname(path)
    for package in SHARDWISE_PACKAGES:  # cached before the folder goes first on sys.path: a cost_model.py beside
        importlib.import_module(package)  # the model would otherwise stand in for shardwise's own package
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
        at = f":{e.lineno}" if e.lineno else ""
        raise ModelError(f"{path}{at}: syntax error in the model file: {e.msg}") from None
    except SystemExit as e:  # a script's sys.exit() would end the planner silently with its status
        raise ModelError(f"{path}: importing the model file called {_exit_call(e)}{_where(e, path)}; a model file "
                         "must not exit when imported: put script code under if __name__ == \"__main__\":") \
            from None
    except Exception as e:
        raise ModelError(f"{path}: importing the model file raised {type(e).__name__}: {e}{_where(e, path)}") \
            from None
    missing = [f for f in ("build_model", "sample_batch") if not callable(getattr(module, f, None))]
    if missing:
        raise ModelError(f"{path}: defines no {missing[0]}(); a model file must define build_model() -> "
                         "nn.Module and sample_batch(batch_size) -> (inputs, targets)")
    loss = getattr(module, "loss_fn", None)
    _check_loss_fn(path, loss)
    return ModelFile(path=path, build_model=module.build_model, sample_batch=module.sample_batch,
                     loss_fn=default_loss if loss is None else loss, user_file=True)


def _check_loss_fn(path: str, loss: Any) -> None:
    """Refuse a `loss_fn` that is a class or not callable: a class would be called as its constructor (or the
    default loss used in its place without a word)."""
    if loss is None:
        return
    if isinstance(loss, type):
        name = loss.__name__
        raise ModelError(f"{path}: loss_fn is the class {name}, not a loss function; write loss_fn = {name}() (an "
                         "instance) or def loss_fn(outputs, targets)")
    if not callable(loss):
        raise ModelError(f"{path}: loss_fn is a {type(loss).__name__} ({str(loss)[:40]!r}), not callable; define "
                         "loss_fn(outputs, targets) returning the loss, or leave it out for the default (cross-entropy "
                         "or MSE)")


def build(model_file: ModelFile, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Call build_model() with `device` as the default device (use "meta" to allocate nothing). A build that fails
    on meta but not on the CPU (transformers' `from_pretrained`, which refuses the meta device; an `__init__` that
    reads a tensor's values, as `.item()` on a stochastic-depth schedule) is built on the CPU and moved to meta:
    its weights are allocated for as long as the build takes, once per process: later meta builds copy it."""
    meta = torch.device(device).type == "meta"
    if meta and model_file.path in _meta_copies:
        return copy.deepcopy(_meta_copies[model_file.path])
    try:
        model = _build_on(model_file, device)
    except ModelError as e:
        if not meta:
            raise
        try:
            with _env(USE_HUB_KERNELS="0"):  # transformers' hub kernels refuse a model moved to meta at .train()
                model = _build_on(model_file, "cpu")
            if isinstance(model, torch.nn.Module):
                replace_tensors(model, lambda t: torch.empty_like(t, device="meta"))
        except ModelError:
            raise e from None
        built_on_cpu.add(model_file.path)
        if isinstance(model, torch.nn.Module):
            _meta_copies[model_file.path] = copy.deepcopy(model)
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"{model_file.path}: build_model() returned {type(model).__name__}, not a "
                         "torch.nn.Module")
    if model_file.user_file:
        _check_trainable(model_file.path, model)
    return model


@dataclass(frozen=True)
class Prepared:
    """What `prepare_for_training` changed in a model, as notes for the user."""

    widened: str | None = None
    """`hold_fp32`'s note: the model was built in 16 bits and is held in fp32."""
    cache_off: str | None = None
    """The model's Hugging Face config asked for a KV cache, turned off."""

    @property
    def notes(self) -> list[str]:
        return [n for n in (self.widened, self.cache_off) if n]


def prepare_for_training(model: torch.nn.Module) -> Prepared:
    """What every plan assumes of a model, done in place where the model differs; the planner's trace and the
    executor both call it, so they run the same model: 16-bit parameters held in fp32 (`hold_fp32`), and a
    Hugging Face model's `config.use_cache` off (its KV cache serves generation; in training its forward returns a
    DynamicCache that torch.export cannot trace, as Hugging Face's Trainer turns it off under gradient
    checkpointing)."""
    config = getattr(model, "config", None)
    cache = None
    if getattr(config, "use_cache", None) is True:
        config.use_cache = False
        cache = ("the model's config.use_cache was on: turned off for training (its KV cache is for generation; set "
                 "use_cache=False in the config to silence this)")
    return Prepared(hold_fp32(model), cache)


LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes `hold_fp32` widens."""


def hold_fp32(model: torch.nn.Module) -> str | None:
    """Hold a model built in 16 bits (`.to(torch.bfloat16)`, `torch_dtype=torch.bfloat16`) in fp32, in place: its
    bf16/fp16 parameters and buffers become fp32 ones, a tensor shared by several modules staying shared. Every
    plan trains fp32 master weights and Adam state (bf16/fp16 plans compute under autocast, as torchtitan and
    Megatron-LM do), and the planner prices that, so the planner's trace, the dry run and the executor all widen
    the model the same way. The tensors are replaced, not converted through `Module._apply`, which fails on the
    dry run's fake parameters ("Couldn't swap"). Returns what was widened, for a note; None when nothing was."""
    widened: dict[str, int] = {}

    def wide(t: torch.Tensor) -> torch.Tensor | None:
        if t.dtype not in LOW_PRECISION:
            return None
        if isinstance(t, torch.nn.Parameter):
            key = str(t.dtype).removeprefix("torch.")
            widened[key] = widened.get(key, 0) + t.numel()
        return t.detach().float()
    made = replace_tensors(model, wide)
    if not made:
        return None
    kinds = " and ".join(f"{n / 1e6:.3g}M {d}" for d, n in widened.items()) or "buffers"
    return (f"the model holds {kinds} parameters: they are trained as fp32 master weights with fp32 Adam state, "
            "as the plan prices them (a bf16/fp16 plan computes in 16 bits under autocast), and bf16/fp16 batch "
            "tensors are widened to fp32 with them")


def replace_tensors(model: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[int, Any]:
    """Replace, in place, each parameter and buffer `t` of `model` for which `fn(t)` gives a tensor by that tensor
    (a Parameter with `t`'s requires_grad for a parameter), once per tensor: one shared by several modules (a tied
    head) stays shared, which `Module._apply` does not keep across devices (`.to("meta")` of a CPU model unties
    it) and cannot do at all on fake parameters ("Couldn't swap"). Returns the new tensors by the old ones' ids."""
    made: dict[int, Any] = {}
    for module in model.modules():
        for table, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    new = fn(t)
                    if new is None:
                        continue
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new
                table[name] = made[id(t)]
    return made


def widen_floats(x: Any) -> Any:
    """`x` (a batch: tensors in dicts, lists and tuples) with its bf16/fp16 tensors in fp32: the batch of a model
    `hold_fp32` widened, whose first layer would otherwise meet fp32 weights with 16-bit inputs."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION else t, x)


_meta_copies: dict[str, torch.nn.Module] = {}
"""Per model file `build` built on the CPU, its model on meta, which later meta builds copy."""
built_on_cpu: set[str] = set()
"""Model files `build` built on the CPU because building on meta failed (said by the planner: `built_on_cpu_note`)."""


def built_on_cpu_note(path: str) -> str | None:
    """The note for a model file `build` had to build on the CPU, else None."""
    if path not in built_on_cpu:
        return None
    return ("build_model() fails on the meta device (transformers' from_pretrained refuses it; an __init__ may read "
            "a tensor's values), so the planner built it on the CPU, weights and all, each time it needed the model; "
            "build from the config (from_config) to plan without loading weights")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment variables set for the block, restored after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build_on(model_file: ModelFile, device: str | torch.device) -> Any:
    """build_model() under `device` as the default device; its failures as one-line ModelErrors."""
    try:
        with torch.device(device):
            return model_file.build_model()
    except SystemExit as e:
        raise ModelError(f"{model_file.path}: build_model() called {_exit_call(e)}{_where(e, model_file.path)}; "
                         "make it return the model") from None
    except Exception as e:
        raise ModelError(f"{model_file.path}: build_model() raised {first_line(e, 400)}"
                         f"{_where(e, model_file.path)}") from None


def _check_trainable(path: str, model: torch.nn.Module) -> None:
    """Refuse a model with no parameter to train (also on meta): training would fail later naming no fix."""
    params = list(model.parameters())
    if not params:
        raise ModelError(f"{path}: build_model() returned a module with no parameters: nothing to train; "
                         f"return the model whose weights to train ({type(model).__name__} has none)")
    if not any(p.requires_grad for p in params):
        raise ModelError(f"{path}: no parameter of the model requires grad (all {len(params)} have "
                         "requires_grad=False); unfreeze the ones to train (p.requires_grad_(True))")


def batch(model_file: ModelFile, batch_size: int) -> tuple[Any, Any]:
    """Call sample_batch(batch_size) and check it returns (inputs, targets)."""
    try:
        out = model_file.sample_batch(batch_size)
    except SystemExit as e:
        raise ModelError(f"{model_file.path}: sample_batch({batch_size}) called {_exit_call(e)}"
                         f"{_where(e, model_file.path)}; make it return (inputs, targets)") from None
    except Exception as e:
        raise ModelError(f"{model_file.path}: sample_batch({batch_size}) raised {type(e).__name__}: {e}"
                         f"{_where(e, model_file.path)}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ModelError(f"{model_file.path}: sample_batch() must return a pair (inputs, targets), got "
                         f"{type(out).__name__}")
    if model_file.user_file:
        _check_batch_size(model_file.path, batch_size, out[0], out[1])
    return out[0], out[1]


def _check_batch_size(path: str, batch_size: int, inputs: Any, targets: Any) -> None:
    """Refuse a batch whose tensors' dim 0 is not `batch_size`: the planner and the executor split batches along
    dim 0, so a batch of another size would be planned for silently."""
    for what, part in (("inputs", inputs), ("targets", targets)):
        wrong = next((n for n in _dim0_sizes(part) if n != batch_size), None)
        if wrong is not None:
            raise ModelError(f"{path}: sample_batch({batch_size}) returned a batch of {wrong} samples (dim 0 of its "
                             f"{what}); make it return batch_size samples")


def _dim0_sizes(x: Any) -> list[int]:
    """Dim 0 of each tensor in `x` (a tensor, or tuples, lists and dicts of them) that has a dim 0."""
    if isinstance(x, torch.Tensor):
        return [int(x.shape[0])] if x.dim() else []
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [n for v in x for n in _dim0_sizes(v)]
    return []


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
