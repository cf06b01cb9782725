"""benchmarks/kernel_summary.py: a profiled GPU step's device time by kernel family (synthetic traces: the
kernel names are those torch.profiler records on NVIDIA GPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kernel_summary import device_steps, family, report, summarize  # noqa: E402


def _kernel(name: str, us: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": us, "pid": 0, "tid": 7}


TRACE = {"traceEvents": [
    _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", 300.0),
    _kernel("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT", 100.0),
    _kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4> >", 50.0),
    _kernel("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", 30.0),
    _kernel("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", 10.0),
    _kernel("void at::native::fused_adamw_kernel<float>", 8.0),
    _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 2.0),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999.0, "pid": 0, "tid": 1},  # host, not device
]}


def test_kernels_fall_into_their_families():
    by_family, by_name, n = summarize(TRACE)
    assert n == 7
    assert by_family["gemm"] == pytest.approx(400e-6) and by_family["attention"] == pytest.approx(50e-6)
    assert by_family["elementwise/reduce"] == pytest.approx(40e-6) and by_family["optimizer"] == pytest.approx(8e-6)
    assert by_family["communication"] == pytest.approx(2e-6) and "other" not in by_family
    assert family("some_custom_kernel") == "other"


def test_report_prints_per_step_times_and_reads_a_file(tmp_path):
    text = report(TRACE, steps=2, top=3)
    assert "7 kernels, 0.25 ms of device time per step (2 step(s) profiled)" in text
    assert text.splitlines()[-3].split()[0] == "0.150"  # the largest kernel, per step
    assert "no device kernels" in report({"traceEvents": TRACE["traceEvents"][-1:]})
    path = tmp_path / "profiler_rank0.json"
    path.write_text(json.dumps(TRACE))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_summary.py"), str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "gemm" in out.stdout
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_summary.py"),
                          str(tmp_path / "none.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_each_annotated_step_reports_its_device_idle_time():
    # kernels at 0-300 and 250-400 us overlap (busy 400), 500-550 is busy again, 600-700 lies outside the step:
    # the step spans 0-600 us on the device, kernels ran 450 us of it, the device idled 150 us
    def k(ts, dur):
        return {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts, "dur": dur}
    trace = {"traceEvents": [k(0, 300), k(250, 150), k(500, 50), k(600, 100),
                             {"ph": "X", "cat": "gpu_user_annotation", "name": "shardwise step 4", "ts": 0, "dur": 600},
                             {"ph": "X", "cat": "user_annotation", "name": "shardwise step 4", "ts": 0, "dur": 900}]}
    assert device_steps(trace) == [("shardwise step 4", pytest.approx(600e-6), pytest.approx(450e-6))]
    assert "shardwise step 4 on the device: 0.60 ms, kernels running 0.45 ms, idle 0.15 ms" in report(trace)


def test_gpu_benchmark_prints_each_pass_from_measured_json():
    from gpu_predicted_vs_measured import pass_table
    row = lambda p, m: {"predicted": p, "measured": m, "error": None if m is None else m / p - 1}  # noqa: E731
    passes = {"forward": {"device": row(0.040, 0.044), "kernels": row(0.039, None), "host": row(0.018, 0.030)}}
    lines = pass_table([{"run": "gpt-1.5B none", "passes": passes}, {"run": "llama-1B none", "error": "x"}]).split("\n")
    assert len(lines) == 2 and lines[1].split() == ["gpt-1.5B", "none", "forward", "40.0", "44.0", "+10.0%", "39.0",
                                                    "18.0", "30.0", "+66.7%"]
    assert pass_table([{"run": "cpu run", "passes": {}}]) == ""  # CPU ranks time no device passes
