"""Loading model files: the convention, and one clear ModelError per kind of bad file."""
from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest
import torch

from planner.errors import ModelError
from planner.model_file import Batches, batch, build, default_loss, load_model_file

GOOD = """
import torch
import torch.nn as nn

def build_model():
    return nn.Linear(4, 2)

def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
"""


def _write(tmp_path, text: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_good_file_builds_on_meta_and_uses_default_loss(tmp_path):
    mf = load_model_file(_write(tmp_path, GOOD))
    model = build(mf, "meta")
    assert next(model.parameters()).device.type == "meta"
    inputs, targets = batch(mf, 3)
    assert inputs.shape == (3, 4) and targets.shape == (3,)
    assert mf.loss_fn is default_loss


def test_default_loss_picks_cross_entropy_or_mse():
    logits, ids = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), ids.reshape(-1))
    assert torch.allclose(default_loss(logits, ids), expected)
    out, target = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.allclose(default_loss(out, target), torch.nn.functional.mse_loss(out, target))
    assert torch.allclose(default_loss({"logits": logits}, ids), expected)


def test_missing_file_and_wrong_extension(tmp_path):
    with pytest.raises(ModelError, match="no such model file"):
        load_model_file(str(tmp_path / "nope.py"))
    txt = tmp_path / "model.txt"
    txt.write_text(GOOD)
    with pytest.raises(ModelError, match="must be a .py file"):
        load_model_file(str(txt))


def test_syntax_error_names_the_line(tmp_path):
    path = _write(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    with pytest.raises(ModelError, match=r"model\.py:3: syntax error"):
        load_model_file(path)


def test_missing_functions(tmp_path):
    with pytest.raises(ModelError, match=r"defines no build_model\(\)"):
        load_model_file(_write(tmp_path, "def sample_batch(b):\n    return 1, 2\n"))
    with pytest.raises(ModelError, match=r"defines no sample_batch\(\)"):
        load_model_file(_write(tmp_path, "def build_model():\n    return None\n", "m2.py"))


def test_build_model_raising_and_returning_a_non_module(tmp_path):
    mf = load_model_file(_write(tmp_path, GOOD.replace("return nn.Linear(4, 2)", "raise ValueError('boom')")))
    with pytest.raises(ModelError, match=r"build_model\(\) raised ValueError: boom \(line 6\)"):
        build(mf, "meta")
    mf = load_model_file(_write(tmp_path, GOOD.replace("return nn.Linear(4, 2)", "return 3"), "m2.py"))
    with pytest.raises(ModelError, match="returned int, not a torch.nn.Module"):
        build(mf, "meta")


def test_sample_batch_must_return_a_pair(tmp_path):
    mf = load_model_file(_write(tmp_path, GOOD.replace("return torch.randn(batch_size, 4), torch.randint(0, 2, "
                                                       "(batch_size,))", "return torch.randn(batch_size, 4)")))
    with pytest.raises(ModelError, match=r"must return a pair \(inputs, targets\)"):
        batch(mf, 2)


def test_sibling_imports_work():
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    mf = load_model_file(os.path.join(examples, "gpt3_175b.py"))
    inputs, targets = batch(mf, 1)
    assert inputs.shape == (1, 2048)


def test_batches_draw_the_same_data_whatever_the_model_draws_in_between(tmp_path):
    """Two pipeline stages' ranks: one draws dropout masks between batches, the other does not; both must sample
    the same batches (they train one stage's inputs against the other stage's targets)."""
    mf = load_model_file(_write(tmp_path, GOOD))
    torch.manual_seed(0)
    quiet, busy = Batches(mf, 7), Batches(mf, 7)
    for _ in range(3):
        a, b = quiet(2), busy(2)
        torch.rand(100)  # the busy rank's dropout
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    before = torch.get_rng_state()
    busy(2)
    assert torch.equal(before, torch.get_rng_state()), "sampling a batch moved the model's random stream"


def test_sample_batch_must_return_batch_size_samples(tmp_path):
    """dim 0 of every input and target tensor (also inside tuples and dicts) must be the batch size asked for."""
    wrong = load_model_file(_write(tmp_path, GOOD.replace("return torch.randn(batch_size, 4), torch.randint(0, 2, "
                                                          "(batch_size,))",
                                                          "return torch.randn(3, 4), torch.randint(0, 2, (3,))")))
    with pytest.raises(ModelError, match=r"sample_batch\(1\) returned a batch of 3 samples \(dim 0 of its inputs\); "
                                         r"make it return batch_size samples"):
        batch(wrong, 1)
    batch(wrong, 3)
    empty = load_model_file(_write(tmp_path, GOOD.replace("batch_size, 4", "0, 4"), "m2.py"))
    with pytest.raises(ModelError, match=r"returned a batch of 0 samples \(dim 0 of its inputs\)"):
        batch(empty, 2)
    nested = load_model_file(_write(tmp_path, """
        import torch
        import torch.nn as nn

        def build_model():
            return nn.Linear(4, 2)

        def sample_batch(batch_size):
            return ({"x": torch.randn(batch_size, 4), "scale": torch.tensor(2.0)},
                    (torch.randn(batch_size), torch.randn(5)))
        """, "m3.py"))
    with pytest.raises(ModelError, match=r"sample_batch\(2\) returned a batch of 5 samples \(dim 0 of its targets\)"):
        batch(nested, 2)


def test_sys_exit_at_import_names_the_exit_code(tmp_path):
    with pytest.raises(ModelError, match=r"model\.py: importing the model file called sys\.exit\(3\) \(line 2\); a "
                                         r"model file must not exit when imported"):
        load_model_file(_write(tmp_path, "import sys\nsys.exit(3)\n"))
    mf = load_model_file(_write(tmp_path, GOOD.replace("return nn.Linear(4, 2)", "raise SystemExit('no')"), "m2.py"))
    with pytest.raises(ModelError, match=r"build_model\(\) called sys\.exit\('no'\) \(line 6\)"):
        build(mf, "meta")
    with pytest.raises(KeyboardInterrupt):  # still stops the planner
        load_model_file(_write(tmp_path, "raise KeyboardInterrupt\n", "m3.py"))


def test_model_with_no_parameters_is_refused(tmp_path):
    mf = load_model_file(_write(tmp_path, GOOD.replace("nn.Linear(4, 2)", "nn.ReLU()")))
    for device in ("meta", "cpu"):
        with pytest.raises(ModelError, match=r"build_model\(\) returned a module with no parameters: nothing to "
                                             r"train"):
            build(mf, device)
    assert build(dataclasses.replace(mf, user_file=False), "meta") is not None  # made in code: unchecked


def test_model_with_every_parameter_frozen_is_refused(tmp_path):
    frozen = GOOD.replace("return nn.Linear(4, 2)", "return nn.Linear(4, 2).requires_grad_(False)")
    mf = load_model_file(_write(tmp_path, frozen))
    for device in ("meta", "cpu"):
        with pytest.raises(ModelError, match=r"no parameter of the model requires grad \(all 2 have "
                                             r"requires_grad=False\); unfreeze the ones to train"):
            build(mf, device)
    some = GOOD.replace("return nn.Linear(4, 2)", "m = nn.Linear(4, 2)\n    m.bias.requires_grad_(False)\n"
                                                  "    return m")
    assert build(load_model_file(_write(tmp_path, some, "m2.py")), "meta").weight.requires_grad


def test_binary_non_utf8_and_directory_model_files(tmp_path):
    binary = tmp_path / "binary.py"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ModelError, match=r"binary\.py: is not a text file \(it holds null bytes\); pass a Python "
                                         r"source file saved as UTF-8$"):
        load_model_file(str(binary))
    latin = tmp_path / "latin.py"
    latin.write_bytes(b'x = "\xe9"\n')
    with pytest.raises(ModelError, match=r"latin\.py: is not UTF-8 text \(invalid continuation byte at byte 5\); "
                                         r"save the model file as UTF-8$"):
        load_model_file(str(latin))
    cookie = tmp_path / "cookie.py"
    cookie.write_bytes(b'# -*- coding: latin-1 -*-\n' + GOOD.encode() + b'NAME = "\xe9"\n')
    assert build(load_model_file(str(cookie)), "meta") is not None  # a declared encoding is fine
    folder = tmp_path / "adir.py"
    folder.mkdir()
    with pytest.raises(ModelError, match=r"adir\.py: is a directory, not a model file; pass the \.py file inside"):
        load_model_file(str(folder))


def test_files_named_like_shardwise_packages_beside_the_model_do_not_stand_in_for_them(tmp_path):
    """load_model_file puts the model's folder first on sys.path (sibling imports); a cost_model.py there made the
    planner's later `from cost_model.model import ...` fail. A fresh interpreter: this one has them all imported."""
    import subprocess
    import sys
    path = _write(tmp_path, GOOD)
    for name in ("planner", "cost_model", "executor", "hardware_profiles"):
        (tmp_path / f"{name}.py").write_text("# the user's own helpers\n")
    code = ("import sys; from planner.model_file import load_model_file; load_model_file(sys.argv[1]); "
            "import cost_model.model, executor.runner, hardware_profiles.load, planner.plan")
    run = subprocess.run([sys.executable, "-c", code, path], cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_loss_must_be_a_0_dim_tensor(tmp_path):
    """A per-sample loss (reduction="none") has one element at the traced batch of 1, and failed only later."""
    from planner.trace import trace_model
    vec = GOOD + "\ndef loss_fn(out, tgt):\n    return torch.nn.functional.cross_entropy(out, tgt, reduction='none')\n"
    with pytest.raises(ModelError, match=r"model\.py: loss_fn\(outputs, targets\) must return a 0-dim \(scalar\) "
                                         r"tensor, got shape \(1,\); reduce the loss in loss_fn \(e\.g\. with "
                                         r"\.mean\(\)\)$"):
        trace_model(load_model_file(_write(tmp_path, vec)), 1, progress=False)
    flt = GOOD + "\ndef loss_fn(out, tgt):\n    return 1.0\n"
    with pytest.raises(ModelError, match=r"must return a 0-dim \(scalar\) tensor, got float;"):
        trace_model(load_model_file(_write(tmp_path, flt, "m2.py")), 1, progress=False)


def test_loss_fn_that_is_a_class_or_not_callable_is_refused(tmp_path):
    """`loss_fn = nn.CrossEntropyLoss` was called as its constructor while tracing; a string was silently ignored
    (the default loss trained instead)."""
    with pytest.raises(ModelError, match=r"model\.py: loss_fn is the class CrossEntropyLoss, not a loss function; "
                                         r"write loss_fn = CrossEntropyLoss\(\) \(an instance\)"):
        load_model_file(_write(tmp_path, GOOD + "\nloss_fn = nn.CrossEntropyLoss\n"))
    with pytest.raises(ModelError, match=r"m2\.py: loss_fn is a str \('cross_entropy'\), not callable; define "
                                         r"loss_fn\(outputs, targets\)"):
        load_model_file(_write(tmp_path, GOOD + "\nloss_fn = 'cross_entropy'\n", "m2.py"))
    instance = load_model_file(_write(tmp_path, GOOD + "\nloss_fn = nn.CrossEntropyLoss()\n", "m3.py"))
    assert isinstance(instance.loss_fn, torch.nn.CrossEntropyLoss)


def test_a_raising_loss_fn_is_blamed_on_the_targets_only_for_a_shape_mismatch(tmp_path):
    from planner.trace import trace_model
    raising = GOOD + "\ndef loss_fn(out, tgt):\n    raise ValueError('bad loss')\n"
    with pytest.raises(ModelError, match=r"model\.py:12: loss_fn\(outputs, targets\) raised ValueError: bad loss with "
                                         r"outputs \[\(1, 2\)\] and targets \[\(1,\)\]; fix loss_fn \(the error is its "
                                         r"own, not the batch's\)$"):
        trace_model(load_model_file(_write(tmp_path, raising)), 1, progress=False)
    wrong = GOOD.replace("torch.randint(0, 2, (batch_size,))", "torch.randn(batch_size, 5)")
    with pytest.raises(ModelError, match=r"m2\.py: loss_fn\(outputs, targets\) raised .* with outputs \[\(1, 2\)\] "
                                         r"and targets \[\(1, 5\)\]; make sample_batch's targets match the model "
                                         r"output \(or define loss_fn in the model file\)$"):
        trace_model(load_model_file(_write(tmp_path, wrong, "m2.py")), 1, progress=False)
