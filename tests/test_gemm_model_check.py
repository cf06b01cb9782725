"""benchmarks/gemm_model_check.py: a profile's GEMM model against the model GEMMs `plan profile --model` timed."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from cost_model import kernels
from hardware_profiles import load_cluster, save_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gemm_model_check import main  # noqa: E402


def test_each_timed_gemm_is_set_beside_the_model_that_never_saw_it(tmp_path, capsys):
    cluster = load_cluster("dgx-h100")
    dev = cluster.device
    shapes = [(1, 2048, 6144, 2048), (1, 2048, 2048, 6144), (1, 6144, 2048, 2048)]
    slow = {shapes[0]: 1.10, shapes[1]: 1.20, shapes[2]: 0.95}  # measured over the model's time
    rows = tuple((*g, "bf16", kernels.gemm_time(dev, g, "bf16") * slow[g], "nt") for g in shapes)
    path = tmp_path / "gpu.yaml"
    save_cluster(dataclasses.replace(cluster, device=dataclasses.replace(dev, matmul_shapes=rows)), path)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "best_efficiency 0.801, k_overhead 192" in out  # the preset's shape model, not the rows
    assert "+10.0%" in out and "+20.0%" in out and "-5.0%" in out
    assert "3 GEMMs: mean |error| 11.7%, signed mean +8.3%, worst +20.0%" in out
    assert main([str(path), "--top", "1"]) == 0
    assert capsys.readouterr().out.count(" nt ") == 1


@pytest.mark.parametrize("args, said", [
    (["dgx-h100"], "has no matmul_shapes; profile with `plan profile --model MODEL.py`"),
    (["no-such-profile"], "no-such-profile"),
])
def test_a_profile_it_cannot_check_is_one_line(args, said, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
