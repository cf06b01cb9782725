"""Loading model files: the convention, and one clear ModelError per kind of bad file."""
from __future__ import annotations

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
