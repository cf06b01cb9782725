"""Without --precision, `plan` uses bf16 unless the profile measured bf16 slower than fp32 (CPU ranks)."""
import json
import os

from planner.cli import main as plan_main
from planner.cli_plan import default_precision

GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt.py")


def test_default_precision_rule():
    import dataclasses

    from hardware_profiles.load import load_cluster
    from hardware_profiles.schema import PrecisionRates
    a100 = load_cluster("dgx-a100-80gb").device
    assert default_precision(a100) == "bf16"
    peaks = lambda **p: dataclasses.replace(a100, peak_flops=p)  # noqa: E731
    assert default_precision(peaks(bf16=1.8e9, fp32=89e9)) == "fp32"
    assert default_precision(peaks(fp32=89e9)) == "fp32"
    # measured bf16 linears: a faster forward (a matrix unit) does not make up for a backward 4x slower
    cpu = load_cluster("cpu-local").device
    fwd, bwd = ((1e6, 0.5), (1e8, 0.5)), ((1e6, 0.5), (1e8, 0.5))
    mine = dataclasses.replace(cpu, peak_flops={"fp32": 100e9, "bf16": 150e9}, linear_efficiency=fwd,
                               linear_backward_efficiency=bwd, by_precision={"bf16": PrecisionRates(
                                   linear_efficiency=fwd, linear_backward_efficiency=((1e6, 0.08), (1e8, 0.08)))})
    assert default_precision(mine) == "fp32"
    faster = dataclasses.replace(mine, by_precision={"bf16": PrecisionRates(
        linear_efficiency=fwd, linear_backward_efficiency=((1e6, 0.4), (1e8, 0.4)))})
    assert default_precision(faster) == "bf16"


def test_a_profile_slower_at_bf16_defaults_to_fp32_and_says_so(tmp_path, capsys):
    """CPU ranks without bf16 matrix units (most: ~100x slower than fp32): the cpu-local preset with its bf16
    peak set to 1/100 of fp32's. (This machine's own preset measures bf16 faster: AVX512-BF16.)"""
    import yaml
    from hardware_profiles.load import PRESET_DIR
    d = yaml.safe_load(open(PRESET_DIR / "cpu-local.yaml"))
    d["device"]["peak_flops"]["bf16"] = d["device"]["peak_flops"]["fp32"] / 100
    prof = tmp_path / "slow_bf16.yaml"
    prof.write_text(yaml.safe_dump(d))
    out = tmp_path / "p.json"
    assert plan_main([GPT, "--cluster", str(prof), "--batch-size", "8", "--force", "dp=2,zero=0,mbs=4",
                      "-o", str(out)]) == 0
    assert json.loads(out.read_text())["precision"] == "fp32"
    assert "using fp32" in capsys.readouterr().err


def _cpu_profile(tmp_path, bf16: bool):
    """cpu-local as a file, with or without its by_precision (bf16 rates measured on its CPU ranks)."""
    import yaml
    from hardware_profiles.load import PRESET_DIR
    d = yaml.safe_load(open(PRESET_DIR / "cpu-local.yaml"))
    if not bf16:
        d["device"].pop("by_precision", None)
    else:
        d["device"].setdefault("by_precision", {"bf16": {"linear_efficiency": [[6.5e4, 0.01], [3.4e7, 0.5]],
                                                         "linear_backward_efficiency": [[6.5e4, 0.01], [3.4e7, 0.5]]}})
    prof = tmp_path / f"cpu_{'bf16' if bf16 else 'fp32'}.yaml"
    prof.write_text(yaml.safe_dump(d))
    return str(prof)


def test_bf16_on_a_cpu_profile_without_bf16_rates_says_so_in_one_line(tmp_path, capsys):
    """A CPU profile measured before by_precision prices bf16 with its fp32 curves: plan says so; a profile that
    measured bf16 does not."""
    args = [GPT, "--batch-size", "8", "--precision", "bf16", "--force", "dp=2,zero=0,mbs=4", "-o",
            str(tmp_path / "p.json")]
    assert plan_main([*args[:1], "--cluster", _cpu_profile(tmp_path, False), *args[1:]]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "measured no bf16 rates" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: ")
    assert plan_main([*args[:1], "--cluster", _cpu_profile(tmp_path, True), *args[1:]]) == 0
    assert "measured no bf16 rates" not in capsys.readouterr().err
    assert plan_main([*args[:1], "--cluster", _cpu_profile(tmp_path, False), *args[1:4], "fp32",
                      *args[5:]]) == 0
    assert "measured no" not in capsys.readouterr().err


def test_a_16_bit_precision_on_a_profile_without_its_peak_says_so(tmp_path, capsys):
    # --precision bf16 on a profile with only an fp32 peak priced bf16 at the fp32 peak silently
    import yaml
    from hardware_profiles.load import PRESET_DIR
    d = yaml.safe_load(open(PRESET_DIR / "dgx-a100-80gb.yaml"))
    d["device"]["peak_flops"] = {"fp32": d["device"]["peak_flops"]["fp32"]}
    prof = tmp_path / "fp32_peak.yaml"
    prof.write_text(yaml.safe_dump(d))
    args = [GPT, "--cluster", str(prof), "--batch-size", "8", "--force", "dp=8,mbs=1"]
    assert plan_main(args + ["--precision", "bf16"]) == 0
    assert "note: the profile's peak_flops has no bf16 or fp16 entry, so bf16 matmuls are priced at its fp32 " \
           "peak" in capsys.readouterr().err
    assert plan_main(args) == 0  # no --precision: fp32, said once, in words
    err = capsys.readouterr().err
    assert "using fp32: on NVIDIA A100-SXM4-80GB the profile's peak_flops has no bf16 entry" in err
    assert "no bf16 or fp16 entry" not in err
