"""Cluster profiles: presets load and match their cited sources, YAML round trips, `--nodes`, and every bad input
ends in one ProfileError line naming the field path."""
import pytest

from hardware_profiles import Cluster, ProfileError, list_presets, load_cluster, save_cluster
from hardware_profiles.load import dump_cluster
from planner.cli import main as plan_main

PRESETS = ("cpu-local", "dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "hgx-h200", "pcie-l40s")


def test_every_preset_is_listed_and_loads():
    assert set(PRESETS) <= set(list_presets())
    for name in list_presets():
        c = load_cluster(name)
        assert isinstance(c, Cluster) and c.name == name and c.nodes == 1
        assert c.device.usable_memory_bytes < c.device.memory_bytes


@pytest.mark.parametrize("preset,key,expected", [
    # hardware_specs.csv rows (each preset's YAML comment cites the same row)
    ("dgx-a100-80gb", "bf16", 312e12),   # A100_SXM_80GB.bf16_fp16_dense_tflops
    ("dgx-a100-40gb", "tf32", 156e12),   # A100_SXM_40GB.tf32_dense_tflops
    ("dgx-h100", "bf16", 989e12),        # H100_SXM_80GB.bf16_fp16_dense_tflops
    ("dgx-h100", "fp8", 1979e12),        # H100_SXM_80GB.fp8_dense_tflops
    ("hgx-h200", "bf16", 989e12),        # H200_SXM_141GB.bf16_fp16_dense_tflops
    ("pcie-l40s", "bf16", 362.05e12),    # NVIDIA L40S datasheet, dense
])
def test_peaks_match_sources(preset, key, expected):
    assert load_cluster(preset).device.peak_flops[key] == expected


def test_memory_bandwidth_and_links_match_sources():
    a80, a40, h100, h200 = (load_cluster(p) for p in ("dgx-a100-80gb", "dgx-a100-40gb", "dgx-h100", "hgx-h200"))
    # the totals CUDA reports (what `plan profile` reads), a little under the datasheets' binary gigabytes
    assert (a80.device.memory_bytes, a40.device.memory_bytes) == (int(79.15 * 2**30), 40536 * 2**20)
    assert (h100.device.memory_bytes, h200.device.memory_bytes) == (81089 * 2**20, 150109880320)
    for c, datasheet_gib in ((a80, 80), (a40, 40), (h100, 80), (h200, 141)):
        assert 0.97 * datasheet_gib * 2**30 < c.device.memory_bytes < datasheet_gib * 2**30
    assert (a80.device.memory_bandwidth, a40.device.memory_bandwidth) == (2.039e12, 1.555e12)
    assert (h100.device.memory_bandwidth, h200.device.memory_bandwidth) == (3.35e12, 4.8e12)
    assert a80.intra_node.bandwidth == 234.89e9          # nccl_measured_bandwidth.csv A100_node_nccl_tests 16 GiB
    assert a80.inter_node.bandwidth == 24e9              # NVIDIA_GTC24_reference "200Gb RDMA"
    assert h100.inter_node.bandwidth == 48e9             # NVIDIA_GTC24_reference "400Gb RDMA"
    assert a80.intra_node.latency == 3.4e-6              # tuning.cc hwLat Ring/NVLink/Simple
    assert load_cluster("pcie-l40s").intra_node.kind == "pcie"
    assert a80.device.matmul_efficiency == ((1.073741824e11, 0.869),)   # A100.mamf_bf16_measured 271.2/312


def test_measured_curves_are_the_reference_rows():
    ar = load_cluster("dgx-a100-80gb").curve("all_reduce", "intra_node", 8)
    assert ar is not None and len(ar.points) == 20
    assert ar.points[0] == (32768, 43.83e-6) and ar.points[-1] == (17179869184, 127997e-6)
    # busbw of the last point = S/t * 2(n-1)/n reproduces the 234.89 GB/s the CSV reports
    s, t = ar.points[-1]
    assert s / t * 2 * 7 / 8 == pytest.approx(234.89e9, rel=1e-3)
    h = load_cluster("hgx-h200").curve("all_reduce", "intra_node", 8)
    assert h is not None and h.points[-1][0] == 16 * 2**30
    assert h.points[-1][0] / h.points[-1][1] == pytest.approx(275.58e9, rel=1e-3)   # algbw of the 16 GiB row


@pytest.mark.parametrize("name", PRESETS)
def test_round_trip(tmp_path, name):
    c = load_cluster(name)
    path = tmp_path / "c.yaml"
    save_cluster(c, path, header="a header\nof two lines")
    assert path.read_text().startswith("# a header\n# of two lines\n")
    assert load_cluster(str(path)) == c
    assert not [p for p in tmp_path.iterdir() if p.name != "c.yaml"]   # no temporary file left behind


def test_nodes_override():
    c = load_cluster("dgx-a100-80gb", nodes=16)
    assert (c.nodes, c.world_size) == (16, 128)
    assert c.device == load_cluster("dgx-a100-80gb").device
    with pytest.raises(ProfileError, match="--nodes"):
        load_cluster("dgx-a100-80gb", nodes=0)


def _write_variant(tmp_path, old, new):
    text = dump_cluster(load_cluster("dgx-a100-80gb"))
    assert old in text, old
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


def _error(spec):
    with pytest.raises(ProfileError) as e:
        load_cluster(spec)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("cluster: {name: x, nodes: 1\ndevice:\n  name: [unclosed\n")
    assert "malformed YAML at line" in _error(str(path))


def test_duplicate_key_names_the_file_key_and_line(tmp_path, capsys):
    # plain YAML keeps the last of two equal keys silently: a typo'd second memory_bytes would win unseen
    path = _write_variant(tmp_path, "memory_bytes: 84986665369", "memory_bytes: 84986665369\n  memory_bytes: 80e9")
    line = 1 + next(i for i, t in enumerate(open(path).read().splitlines()) if t.strip() == "memory_bytes: 80e9")
    msg = _error(path)
    assert path in msg and "'memory_bytes'" in msg and f"line {line}:" in msg and f"line {line - 1})" in msg
    assert plan_main(["examples/mlp.py", "--cluster", path, "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "given twice" in err
    merged = tmp_path / "merged.yaml"  # a merge key (<<) overriding on purpose is not a duplicate
    merged.write_text("a: &x {k: 1}\nb:\n  <<: *x\n  k: 2\n")
    from hardware_profiles.load import parse_yaml
    assert parse_yaml(merged.read_text(), "merged.yaml")["b"] == {"k": 2}


@pytest.mark.parametrize("old,new,expected", [
    ("  memory_bandwidth: 2039000000000.0\n", "", "device.memory_bandwidth: missing key"),
    ("memory_bytes: 84986665369", "memory_bytes: 80000000000\n  color: green", "device.color: unknown key"),
    ("bandwidth: 234890000000.0", "bandwidth: 0", "links.intra_node.bandwidth: must be > 0"),
    ("bandwidth: 24000000000.0", "bandwidth: -24e9", "links.inter_node.bandwidth: must be > 0"),
    ("memory_bytes: 84986665369", "memory_bytes: 80GB", "device.memory_bytes: got the string '80GB'"),
    ("memory_bytes: 84986665369", "memory_bytes: 80", "device.memory_bytes: 80 is under 64 MiB"),
    ("latency: 3.4e-06", "latency: 3.4", "links.intra_node.latency: 3.4 s is implausibly large"),
    ("kind: nvswitch", "kind: nvlink5", "links.intra_node.kind"),
    ("group_size: 8", "group_size: 0", "collectives[0].group_size: must be > 0"),
    ("attention: {forward_efficiency: 0.73, backward_efficiency: 0.63, block: 128, kernel: flash2}",
     "attention: {kernel: flash9}",  # said 'attention.forward_efficiency: missing key'
     "device.attention.kernel: 'flash9' comes without its forward_efficiency and backward_efficiency"),
])
def test_bad_field_names_its_path(tmp_path, old, new, expected):
    assert expected in _error(_write_variant(tmp_path, old, new))


def test_exponent_without_dot_reads_as_number(tmp_path):
    # PyYAML alone reads 80e9 as a string; profiles are written by people who type 80e9
    c = load_cluster(_write_variant(tmp_path, "memory_bytes: 84986665369", "memory_bytes: 80e9"))
    assert c.device.memory_bytes == 80_000_000_000 and isinstance(c.device.memory_bytes, int)


def test_unknown_preset_lists_the_presets():
    msg = _error("nosuch")
    assert "nosuch" in msg and all(p in msg for p in PRESETS)
    assert "no such file" in _error("missing/cluster.yaml")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert "empty" in _error(str(path))


def test_save_into_missing_folder_makes_it(tmp_path):
    """As every command's outputs (`plan -o`, `--timeline`, `plan measure --plot`): the missing folders are made."""
    path = tmp_path / "new" / "dir" / "x.yaml"
    save_cluster(load_cluster("cpu-local"), str(path))
    assert load_cluster(str(path)).name == load_cluster("cpu-local").name


def test_save_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ProfileError, match="cannot write"):
        save_cluster(load_cluster("cpu-local"), str(tmp_path / "afile" / "x.yaml"))


def test_cli_profile_bad_output_and_flag(capsys, tmp_path):
    (tmp_path / "afile").write_text("")
    bad = str(tmp_path / "afile" / "x.yaml")
    assert plan_main(["profile", "-o", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "afile is a file, not a folder" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        plan_main(["profile", "--nproc", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nproc" in err
    assert plan_main(["profile", "--nproc", "1", "-o", "x.yaml"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err


def test_cli_plan_unknown_cluster_lists_presets(capsys):
    # the profile is checked before the model is traced, so this is quick and names every preset
    assert plan_main(["examples/gpt.py", "--cluster", "nosuch", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "nosuch" in err and all(p in err for p in PRESETS)


def test_h200_preset_carries_the_figures_measured_on_an_h200():
    d = load_cluster("hgx-h200").device  # plan profile --backend nccl, one H200 SXM, 2026-11-26 and 2026-11-27
    assert d.matmul.best_efficiency == 0.807 and max(e for _, e in d.matmul_efficiency) == 0.807
    assert d.kernel_floor == 1.12e-6 and d.kernel_costs == {"adamw": (8.3e-12, 0.0), "widen": (2.83e-12, 2.83e-12)}
    # the copy curve over rotating buffers: 4.27 TB/s at 2 GB, slower for small copies
    assert d.memory_efficiency[-1] == (2.147e9, 0.890) and d.memory_efficiency[0][1] < 0.2
    assert d.op_overhead.function_mode_op == 2.0e-6 and d.op_overhead.checkpoint_call_forward == 0.0
