"""`plan --calibration FILE` scales predictions by the ratio `plan measure --calibrate` recorded for the profile."""
import json
import os

from planner.cli import main as plan_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py")
ARGS = [GPT, "--cluster", "cpu-local", "--precision", "fp32", "--batch-size", "8",
        "--force", "dp=2,tp=1,pp=1,zero=0,mbs=4,recompute=none,sp=0,schedule=1f1b"]


def _step(path):
    with open(path) as f:
        return json.load(f)["predicted"]


def test_calibration_scales_the_prediction(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"cluster": "cpu-local", "entries": [], "step_time_scale": 1.5}))
    assert plan_main(ARGS + ["-o", str(tmp_path / "a.json")]) == 0
    assert plan_main(ARGS + ["--calibration", str(cal), "-o", str(tmp_path / "b.json")]) == 0
    a, b = _step(tmp_path / "a.json"), _step(tmp_path / "b.json")
    assert abs(b["step_time_s"] - 1.5 * a["step_time_s"]) < 1e-12
    assert abs(b["mfu"] - a["mfu"] / 1.5) < 1e-12
    assert b["peak_memory_bytes"] == a["peak_memory_bytes"]
    assert any("calibrated" in s for s in b["assumptions"])
    capsys.readouterr()


def test_calibration_for_another_cluster_is_refused(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"cluster": "dgx-h100", "entries": [], "step_time_scale": 1.5}))
    assert plan_main(ARGS + ["--calibration", str(cal)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dgx-h100" in err and "--calibrate" in err
    assert plan_main(ARGS + ["--calibration", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_binary_file_or_an_absurd_scale_is_refused_in_one_line(tmp_path, capsys):
    """A non-UTF-8 file raised UnicodeDecodeError; Infinity and 1e308 (json reads both) scaled every prediction."""
    cal = tmp_path / "cal.json"
    cal.write_bytes(b"\xff\xfe\x00\x01")
    assert plan_main(ARGS + ["--calibration", str(cal)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a calibration file (UnicodeDecodeError)" in err
    for scale, shown in (("Infinity", "inf"), ("1e308", "1e+308"), ("0.001", "0.001"),
                         ("1" + "0" * 400, "of 401 digits")):
        cal.write_text('{"cluster": "cpu-local", "entries": [], "step_time_scale": %s}' % scale)
        assert plan_main(ARGS + ["--calibration", str(cal)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"step_time_scale {shown} is outside 0.01..100" in err, err
        assert "Traceback" not in err
