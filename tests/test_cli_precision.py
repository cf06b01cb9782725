"""Without --precision, `plan` uses bf16 unless the profile measured bf16 slower than fp32 (CPU ranks)."""
import json
import os

from planner.cli import main as plan_main
from planner.cli_plan import default_precision

GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt.py")


def test_default_precision_rule():
    assert default_precision({"bf16": 312e12, "fp32": 19.5e12}) == "bf16"
    assert default_precision({"bf16": 1.8e9, "fp32": 89e9}) == "fp32"
    assert default_precision({"fp32": 89e9}) == "fp32"


def test_cpu_profile_defaults_to_fp32_and_says_so(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert plan_main([GPT, "--cluster", "cpu-local", "--batch-size", "8", "--force", "dp=2,zero=0,mbs=4",
                      "-o", str(out)]) == 0
    assert json.loads(out.read_text())["precision"] == "fp32"
    assert "using fp32" in capsys.readouterr().err
