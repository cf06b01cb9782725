"""`plan MODEL.py --summary` end to end in a subprocess: the table for a good model, and for every kind of bad
model file one line on stderr, exit status 2 and no traceback."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADER = """
import torch
import torch.nn as nn
"""

BAD_FILES = {
    "syntax": ("import torch\n\ndef build_model(:\n    return None\n", r"bad\.py:3: syntax error"),
    "no_build": (HEADER + "def sample_batch(b):\n    return torch.randn(b, 4), torch.randn(b, 2)\n",
                 r"defines no build_model\(\)"),
    "no_batch": (HEADER + "def build_model():\n    return nn.Linear(4, 2)\n", r"defines no sample_batch\(\)"),
    "build_raises": (HEADER + "def build_model():\n    raise RuntimeError('out of ideas')\n\n"
                     "def sample_batch(b):\n    return torch.randn(b, 4), torch.randn(b, 2)\n",
                     r"build_model\(\) raised RuntimeError: out of ideas \(line 5\)"),
    "untraceable": (HEADER + textwrap.dedent("""
        class Gate(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                h = self.fc(x)
                if h.sum() > 0:
                    h = h * 2
                return h

        def build_model():
            return Gate()

        def sample_batch(b):
            return torch.randn(b, 8), torch.randn(b, 8)
        """), r"bad\.py:12: at `if h\.sum\(\) > 0:`: cannot trace the model \(torch\.export: .*torch\.fx: .*"
              r"torch\.where / torch\.cond"),
    "wrong_shapes": (HEADER + "def build_model():\n    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 10))\n\n"
                     "def sample_batch(b):\n    return torch.randn(b, 48), torch.randint(0, 10, (b,))\n",
                     r"forward\(\) failed on the inputs from sample_batch\(\) \[\(1, 48\)\] at op .*torch\.nn\.Linear"
                     r".*make sample_batch return inputs of the shapes"),
}


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


def test_summary_of_the_gpt_example():
    result = _plan("examples/gpt.py", "--summary")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("parameters", "FLOPs per sample", "activation memory per sample", "ops", "repeated blocks",
                  "torch.export"):
        assert label in out
    assert "867,072" in out and "h.* x 4" in out


def test_missing_file():
    result = _plan("does/not/exist.py", "--summary")
    assert result.returncode == 2
    assert "no such model file" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_model_files(tmp_path, case):
    text, pattern = BAD_FILES[case]
    path = tmp_path / "bad.py"
    path.write_text(text)
    result = _plan(str(path), "--summary")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("plan: error: ")
    assert re.search(pattern, lines[0]), lines[0]
