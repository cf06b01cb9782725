"""Output paths and flag values are checked before any work: a path that cannot be written, or that is one of the
command's inputs, and a flag value that makes no sense, are one line and exit status 2, and no file the user had
is changed (`plan`, `plan measure`, `plan export`, cluster files)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from planner.cli import main
from planner.errors import PlanError
from planner.plan import check_output, schedule_problem, write_atomic
from planner.search.space import MAX_MICROBATCHES, groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "mlp.py")
PLAN = [MLP, "--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32"]


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    err = [line for line in captured.err.strip().splitlines() if line.startswith("plan")]
    assert len(err) == 1 and err[0].startswith("plan: error: "), captured.err
    assert "Traceback" not in captured.err
    return err[0]


def test_check_output(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for path, match in (("", "is empty"), (tmp_path, "it is a directory"), (afile / "x.json", "is a file, not a folder")):
        with pytest.raises(PlanError, match=match):
            check_output(path, "-o")
    with pytest.raises(PlanError, match="also this command's input"):
        check_output(afile, "-o", inputs=[str(afile)])
    check_output(tmp_path / "new" / "x.json", "-o")  # a missing folder is created when written


def test_an_output_ending_in_a_separator_is_refused(mlp_plan, tmp_path, monkeypatch, capsys):
    # `-o newdir/` wrote a file named newdir: realpath drops the separator
    monkeypatch.chdir(tmp_path)
    for argv in (PLAN + ["--no-check", "-o", "newdir/"], PLAN + ["--no-check", "--timeline", "newdir/"],
                 ["export", str(mlp_plan), "--to", "deepspeed", "-o", "newdir/"],
                 ["measure", str(mlp_plan), MLP, "-o", "newdir/"], ["profile", "--quick", "-o", "newdir/"]):
        assert main(argv) == 2
        assert " newdir/: it ends in '/', which names a folder, not a file" in _one_line(capsys)
    with pytest.raises(PlanError, match="names a folder"):
        write_atomic("newdir/", "{}\n")
    assert os.listdir(tmp_path) == []


def test_schema_checks_its_output_as_every_command_does(tmp_path, monkeypatch, capsys):
    # `plan schema -o ""` printed the schema and exited 0
    monkeypatch.chdir(tmp_path)
    assert main(["schema", "-o", ""]) == 2
    assert "-o is empty; give a file path" in _one_line(capsys)
    assert main(["schema", "-o", "newdir/"]) == 2
    assert "-o newdir/: it ends in '/'" in _one_line(capsys)
    assert os.listdir(tmp_path) == []


def test_plan_refuses_unwritable_outputs_before_searching(tmp_path, capsys):
    kept = tmp_path / "kept.json"
    kept.write_text("mine")
    assert main(PLAN + ["-o", str(tmp_path)]) == 2
    assert "it is a directory" in _one_line(capsys)
    assert main(PLAN + ["-o", str(kept), "--timeline", str(tmp_path)]) == 2  # the plan was written first before
    assert "--timeline" in _one_line(capsys) and kept.read_text() == "mine"
    assert main(PLAN + ["-o", str(kept), "--timeline", str(kept)]) == 2
    assert "same file" in _one_line(capsys)
    model = tmp_path / "model.py"
    model.write_text(open(MLP).read())
    assert main([str(model)] + PLAN[1:] + ["-o", str(model)]) == 2
    assert "would destroy it" in _one_line(capsys) and model.read_text() == open(MLP).read()

    # a folder access() calls writable where no file can be made (/proc, /sys, a read-only mount): the audit's
    # --plot /sys/p.png searched, wrote -o over kept.json, then died with a traceback (exit 1)
    import tempfile
    real = tempfile.mkstemp
    sealed = tmp_path / "sealed"
    sealed.mkdir()

    def mkstemp(*a, dir=None, **k):
        if dir is not None and os.path.realpath(dir) == os.path.realpath(sealed):
            raise PermissionError(13, "Permission denied")
        return real(*a, dir=dir, **k)
    import unittest.mock
    with unittest.mock.patch("tempfile.mkstemp", mkstemp):
        for flag in ("--plot", "--timeline", "-o"):
            extra = ["-o", str(kept)] if flag != "-o" else []
            assert main(PLAN + extra + [flag, str(sealed / "out.png")]) == 2
            assert f"{flag} {sealed / 'out.png'}: no file can be made in {sealed} (Permission denied)" \
                in _one_line(capsys) and kept.read_text() == "mine"


@pytest.mark.parametrize("flags,match", [
    (["--top", "0"], "--top must be >= 1"),
    (["--time-budget", "0"], "--time-budget must be a positive"),
    (["--time-budget", "nan"], "--time-budget must be a positive"),
    (["--force", ""], "pins nothing"),
    (["--force", ","], "pins nothing"),
])
def test_plan_refuses_meaningless_flag_values(flags, match, capsys):
    assert main(PLAN + flags) == 2
    assert match in _one_line(capsys)


def test_forced_virtual_stages_pipeline(capsys):
    # vp > 1 asks for a pipeline: the search must not answer with pp = 1 (it did, silently)
    gpt = os.path.join(ROOT, "examples", "gpt.py")
    assert main([gpt] + PLAN[1:] + ["--force", "schedule=interleaved,vp=2", "--json", "--no-check"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["mesh"]["pp"] > 1 and report["plan"]["virtual_stages"] == 2


def test_huge_batches_keep_the_micro_batch_count_bounded():
    # 10^11 samples in micro-batches of 1 would take the pipeline simulation hours per candidate
    per_group = groups((2, 1, 2), 10 ** 11, 6, {})
    assert per_group and max(g.num_microbatches for g in per_group) <= MAX_MICROBATCHES
    with pytest.raises(PlanError, match="micro-batches per step"):
        groups((2, 1, 2), 10 ** 11, 6, {"mbs": 1})


def test_the_search_offers_only_schedules_the_executor_runs(capsys):
    # torch's Schedule1F1B stops at launch below pp micro-batches: the search ranked such 1F1B plans (GPT-2 XL at
    # dp4 pp4 mbs4 of a batch of 16, third of four), and a forced one was caught only by the dry run of -o
    offered = {(g.mbs, g.schedule, g.vp) for g in groups((4, 1, 4), 16, 48, {})}
    assert (4, "gpipe", 1) in offered and (4, "1f1b", 1) not in offered and (1, "1f1b", 1) in offered
    assert all(schedule_problem(s, 4, 16 // (4 * mbs)) is None for mbs, s, _ in offered)
    gpt = os.path.join(ROOT, "examples", "gpt.py")
    assert main([gpt] + PLAN[1:] + ["--force", "pp=2,mbs=8,schedule=1f1b", "--no-check"]) == 2
    assert _one_line(capsys).endswith("schedule 1f1b needs at least pp=2 micro-batches per step, got 1 (--batch-size "
                                      "8 / (dp 1 x mbs 8)); raise --batch-size, lower mbs or use schedule=gpipe")


def test_the_schedule_error_names_a_mesh_the_micro_batch_size_fits():
    # on 8 devices pp=2 leaves dp 4, 2 or 1: mbs 8 of a batch of 8 fits dp 1 only, where 1F1B lacks micro-batches
    # (the message named dp 4, "got 0", which the micro-batch size had ruled out)
    from planner.search.space import forced_schedule_problem
    forced = {"pp": 2, "mbs": 8, "schedule": "1f1b"}
    assert forced_schedule_problem([(4, 1, 2), (2, 2, 2), (1, 4, 2)], 8, forced).endswith(
        "got 1 (--batch-size 8 / (dp 1 x mbs 8)); raise --batch-size, lower mbs or use schedule=gpipe")
    assert forced_schedule_problem([(4, 1, 2)], 8, forced) is None


def test_cluster_file_that_is_not_text_or_not_a_file(tmp_path, capsys):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main([MLP, "--cluster", str(binary), "--batch-size", "8"]) == 2
    assert "not a UTF-8 text file" in _one_line(capsys)
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    assert main([MLP, "--cluster", str(folder), "--batch-size", "8"]) == 2
    assert "is a directory" in _one_line(capsys)


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "plan.json"
    assert main(PLAN + ["-o", str(path), "--no-check"]) == 0
    return path


def test_export_never_writes_over_its_plan(mlp_plan, capsys):
    before = mlp_plan.read_text()
    assert main(["export", str(mlp_plan), "--to", "deepspeed", "-o", str(mlp_plan)]) == 2
    assert "would destroy it" in _one_line(capsys) and mlp_plan.read_text() == before


def test_export_never_writes_over_the_model_file_its_plan_names(tmp_path, capsys):
    # without --model, export reads the plan's model file (its sequence length) and then wrote -o over it
    model, plan = tmp_path / "model.py", tmp_path / "plan.json"
    model.write_text(open(MLP).read())
    assert main([str(model)] + PLAN[1:] + ["--force", "pp=1", "--no-check", "-o", str(plan)]) == 0
    capsys.readouterr()
    for target in ("megatron", "deepspeed"):
        assert main(["export", str(plan), "--to", target, "-o", str(model)]) == 2
        assert "would destroy it" in _one_line(capsys) and model.read_text() == open(MLP).read()
    model.unlink()  # a model file that is gone: said, not silently left out
    assert main(["export", str(plan), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")]) == 0
    assert f"note: the plan's model file {model} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    (["--steps", "2", "--warmup", "2"], "must be more than --warmup"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--timeout", "0"], "--timeout must be a positive"),
    (["--plot", "x.txt"], ".png, .svg or .pdf"),
])
def test_measure_refuses_before_launching(mlp_plan, flags, match, capsys):
    assert main(["measure", str(mlp_plan), MLP] + flags) == 2
    assert match in _one_line(capsys)


def test_measure_refuses_a_gpu_plan_without_cuda(mlp_plan, tmp_path, monkeypatch, capsys):
    # it launched the plan's 8 ranks as gloo CPU processes in bf16, silently
    import torch

    import executor.cli
    from planner.plan import Mesh, Plan
    launched = []
    monkeypatch.setattr(executor.cli, "launch", lambda *a, **k: launched.append(a) or (1, "not launched"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu = tmp_path / "gpu.json"
    Plan(mesh=Mesh(dp=8), global_batch_size=8, microbatch_size=1, num_microbatches=1,
         cluster={"name": "dgx-a100-80gb", "nodes": 1, "devices_per_node": 8}).save(gpu)
    assert main(["measure", str(gpu), MLP]) == 2
    assert (f"{gpu}: the plan was made for NVIDIA A100-SXM4-80GB GPUs (dgx-a100-80gb), and this machine has no "
            "CUDA; re-plan with `--cluster cpu-local` or a profile from `plan profile`") in _one_line(capsys)
    mine = tmp_path / "mine.json"  # a profile file's own name: --cluster says what it is
    Plan.from_dict(dict(Plan.load(gpu).to_dict(), cluster={"name": "my-lab", "nodes": 1, "devices_per_node": 8})) \
        .save(mine)
    assert main(["measure", str(mine), MLP, "--cluster", "dgx-h100"]) == 2
    assert "made for NVIDIA H100" in _one_line(capsys)
    # a plan records its cluster's device and link kind (plans made from a profile file included)
    assert Plan.load(mlp_plan).cluster["link"] == "loopback"
    lab = tmp_path / "lab.json"
    Plan.from_dict(dict(Plan.load(gpu).to_dict(), cluster={"name": "my-lab", "nodes": 1, "devices_per_node": 8,
                                                           "device": "NVIDIA H100 80GB HBM3", "link": "nvswitch"})) \
        .save(lab)
    assert main(["measure", str(lab), MLP]) == 2
    assert "made for NVIDIA H100 80GB HBM3 GPUs (my-lab)" in _one_line(capsys)
    assert not launched
    assert main(["measure", str(mine), MLP, "--steps", "2", "--warmup", "1"]) == 1  # nothing says: launched
    assert main(["measure", str(mlp_plan), MLP, "--steps", "2", "--warmup", "1"]) == 1  # cpu-local: launched
    assert len(launched) == 2


def test_measure_checks_its_outputs_before_launching(mlp_plan, tmp_path, capsys):
    notjson = tmp_path / "calibration.json"
    notjson.write_text("[1, 2]")
    assert main(["measure", str(mlp_plan), MLP, "--calibrate", str(notjson)]) == 2
    assert "not a calibration file" in _one_line(capsys) and notjson.read_text() == "[1, 2]"
    for other in ({"cluster": "cpu-local"}, json.loads(mlp_plan.read_text())):  # other JSON objects: never rewritten
        notjson.write_text(json.dumps(other))
        assert main(["measure", str(mlp_plan), MLP, "--calibrate", str(notjson)]) == 2
        assert "not a calibration file" in _one_line(capsys) and json.loads(notjson.read_text()) == other
    assert main(["measure", str(mlp_plan), MLP, "--cluster", "nosuch"]) == 2  # was ignored without --trace
    assert "--cluster: no preset or file named 'nosuch'" in _one_line(capsys)
    assert main(["measure", str(mlp_plan), MLP, "-o", str(tmp_path)]) == 2
    assert "it is a directory" in _one_line(capsys)
    before = mlp_plan.read_text()
    assert main(["measure", str(mlp_plan), MLP, "-o", str(mlp_plan)]) == 2
    assert "would destroy it" in _one_line(capsys) and mlp_plan.read_text() == before
    for entries, why in (([{"cluster": "cpu-local"}], "entries[0] has no ratio"),  # a KeyError after the run
                         ([3], "entries[0] is not an object (int)"),
                         ([{"cluster": "cpu-local", "ratio": "1.5"}], "entries[0] ratio is '1.5', not a positive")):
        notjson.write_text(json.dumps({"entries": entries}))
        assert main(["measure", str(mlp_plan), MLP, "--calibrate", str(notjson)]) == 2
        assert why in _one_line(capsys)
    same = tmp_path / "same.json"  # -o and --calibrate merged into one file
    assert main(["measure", str(mlp_plan), MLP, "-o", str(same), "--calibrate", str(same)]) == 2
    assert "-o and --calibrate name the same file; give each its own" in _one_line(capsys) and not same.exists()


def test_an_error_on_cpu_ranks_is_the_only_line(tmp_path, capsys):
    # cpu-local's default precision note used to come before the model was read: an error then made two lines
    assert main([str(tmp_path / "missing.py")] + PLAN[1:5]) == 2  # no --precision: the note applies
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _writers():
    """Each way an output is written through a temp file: (name, write(path))."""
    import matplotlib.pyplot as plt

    from executor import plots
    from hardware_profiles import load_cluster, save_cluster
    from planner import search_plot
    from planner.plan import write_atomic

    def figure(save):
        def write(path):
            fig = plt.figure(figsize=(1, 1))
            try:
                save(fig, path)
            finally:
                plt.close(fig)
        return write
    return {"write_atomic": lambda path: write_atomic(path, "{}\n"),
            "search_plot": figure(search_plot._save),
            "measure_plot": figure(plots._save),
            "save_cluster": lambda path: save_cluster(load_cluster("cpu-local"), path)}


@pytest.mark.parametrize("writer", ["write_atomic", "search_plot", "measure_plot", "save_cluster"])
def test_outputs_get_the_usual_mode_and_keep_a_replaced_files(writer, tmp_path):
    pytest.importorskip("matplotlib")
    write = _writers()[writer]
    old = os.umask(0o022)
    try:
        new = tmp_path / "new.png"
        write(new)
        assert new.stat().st_mode & 0o777 == 0o644  # as open() gives, not mkstemp's 0600
        kept = tmp_path / "kept.png"
        kept.write_text("old")
        kept.chmod(0o640)
        write(kept)
        assert kept.stat().st_mode & 0o777 == 0o640 and kept.read_bytes() != b"old"
    finally:
        os.umask(old)


@pytest.mark.parametrize("writer", ["write_atomic", "search_plot", "measure_plot", "save_cluster"])
def test_every_writer_makes_a_missing_folder(writer, tmp_path):
    """One rule for every output (plan -o, --timeline, --plot, plan profile -o, plan measure --plot): plan profile
    -o and plan measure --plot refused a missing folder while the others made it."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "new" / "deeper" / "out.png"
    _writers()[writer](path)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["out.png"]


def test_measure_takes_a_plot_in_a_missing_folder(mlp_plan, tmp_path):
    import argparse

    from executor.cli import check_outputs
    pytest.importorskip("matplotlib")
    args = argparse.Namespace(plan=str(mlp_plan), model=MLP, cluster=None, output=None, calibrate=None,
                              plot=str(tmp_path / "new" / "bars.png"), trace=None)
    check_outputs(args)  # no error


@pytest.mark.parametrize("writer", ["write_atomic", "search_plot", "measure_plot", "save_cluster"])
def test_outputs_write_through_a_symlink(writer, tmp_path):
    pytest.importorskip("matplotlib")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "real.png"
    target.write_text("old")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    _writers()[writer](link)
    assert link.is_symlink() and os.path.samefile(link, target) and target.read_bytes() != b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link.png"]
    assert [p.name for p in elsewhere.iterdir()] == ["real.png"]  # no temp file left beside either


def test_plan_output_through_a_symlink(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main(PLAN + ["-o", str(link), "--no-check"]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["mesh"]


def test_debug_shows_the_traceback_but_keeps_status_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.py")] + PLAN[1:] + ["--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("plan: error: ")
    assert main(["export", str(tmp_path / "missing.json"), "--to", "deepspeed", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path):
    # the atomic rename would replace a device or a pipe (as root, -o /dev/null would replace /dev/null)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(PlanError, match="not a regular file"):
        check_output(str(fifo), "-o")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_profile_refuses_a_pipe_and_links_from_with_several_ranks(tmp_path, capsys):
    # the profile's -o got no check but its folder's: a pipe was replaced by a file after the whole profile ran
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["profile", "--quick", "-o", str(fifo)]) == 2
    assert "not a regular file" in _one_line(capsys) and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert main(["profile", "--quick", "--links-from", "dgx-h100", "-o", str(tmp_path / "p.yaml")]) == 2  # 2 ranks
    assert "drop --links-from" in _one_line(capsys) and not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("argv,match", [
    (["mesure", "plan.json", MLP], "did you mean `plan measure`"),
    (["chek"], "did you mean `plan check`"),
    (["./measure.py", "--cluster", "cpu-local", "--batch-size", "8"], "no such model file"),  # a path: no command
    (PLAN[:1] + ["--batch-size", str(10 ** 20), "--cluster", "cpu-local"], "above 1,000,000,000,000 samples"),
    ([MLP, "--summary", "-o", "x.json", "--force", "dp=2"], "-o, --force would do nothing"),
    ([MLP, "--summary", "--top", "3", "--time-budget", "5"], "--top, --time-budget would do nothing"),
])
def test_plan_names_a_misspelled_command_a_huge_batch_and_summary_flags(argv, match, capsys):
    # each was silent or misleading: "unrecognized arguments", a divisor loop over 10^10, no file written
    assert main(argv) == 2
    assert match in _one_line(capsys)


@pytest.mark.parametrize("force,match", [
    ("pp=8", "the model has 6 layers"),
    ("pp=2,vp=4", "needs 8 virtual stages"),
    ("vp=4", "at least 8 virtual stages"),
])
def test_forced_stages_beyond_the_layers_say_so(force, match, capsys):
    # they said "no micro-batch size / schedule fits ... lower --batch-size", or "no candidate plan could be built"
    gpt = os.path.join(ROOT, "examples", "gpt.py")
    assert main([gpt, "--cluster", "dgx-a100-80gb", "--batch-size", "16", "--force", force, "--no-check"]) == 2
    assert match in _one_line(capsys)


def test_outputs_are_written_before_the_report(tmp_path, capsys, monkeypatch):
    # `plan ... -o p.json | head`: the reader leaving while the report printed lost the plan (a BrokenPipeError)
    import planner.report
    def closed(*args, **kwargs):
        raise BrokenPipeError
    monkeypatch.setattr(planner.report, "format_result", closed)
    from planner.cli_plan import main as plan_main
    out = tmp_path / "p.json"
    with pytest.raises(BrokenPipeError):  # `plan`'s entry point then says nothing and exits 1
        plan_main(PLAN + ["-o", str(out), "--no-check"])
    assert json.loads(out.read_text())["mesh"]


def test_a_json_file_that_is_no_calibration_file_says_so(tmp_path, capsys):
    # it said "recorded for cluster None, not 'cpu-local'"
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    assert main(PLAN + ["--calibration", str(other)]) == 2
    assert "not a calibration file" in _one_line(capsys)


def test_a_model_files_warning_before_an_error_leaves_one_line(tmp_path, capsys):
    # mse_loss's broadcasting UserWarning (two lines: the warning and its source line) came before the error line
    bad = tmp_path / "warns.py"
    bad.write_text("import warnings\nimport torch\n\ndef build_model():\n    return torch.nn.Linear(4, 4)\n\n"
                   "def sample_batch(b):\n    warnings.warn('shapes differ')\n    return torch.randn(b, 4), torch.randn(b, 3)\n")
    assert main([str(bad)] + PLAN[1:]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plan: error: ") and "shapes differ" not in err
    ok = tmp_path / "warns_ok.py"  # without an error the warning is shown
    ok.write_text(bad.read_text().replace("torch.randn(b, 3)", "torch.randn(b, 4)"))
    with pytest.warns(UserWarning, match="shapes differ"):
        assert main([str(ok)] + PLAN[1:] + ["--no-check"]) == 0


def test_a_batch_no_dp_divides_is_named_as_the_cause(capsys):
    """Batch 7 on 8 devices leaves dp=1 meshes only, whose tp the tiny GPT gives no weight worth sharding: the error
    said 'with the forced keys {} ... relax --force' though nothing was forced, and never named the batch. Those tp
    are now solved sharded (a plan beats none), and a note names the batch as what ruled out data parallelism."""
    gpt = os.path.join(ROOT, "examples", "gpt.py")
    assert main([gpt, "--cluster", "dgx-a100-80gb", "--batch-size", "7", "--json", "--no-check"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["mesh"]["dp"] == 1 and report["plan"]["mesh"]["tp"] > 1
    note = next(n for n in report["notes"] if n.startswith("--batch-size 7"))
    assert "divides over no dp > 1 of the 8 devices" in note and "2 or 4 or 8" in note and "forced" not in note
    # with tp=1 forced no mesh is left: one line naming the batch and the forced key
    assert main([gpt, "--cluster", "dgx-a100-80gb", "--batch-size", "7", "--force", "tp=1"]) == 2
    line = _one_line(capsys)
    assert "with dp dividing --batch-size 7" in line and "(forced: tp=1)" in line




def test_force_may_be_repeated_and_a_key_given_twice_is_refused(tmp_path, capsys):
    # a second --force replaced the first: --force dp=2 --force pp=2 planned pp=2 alone, dp=2 dropped unsaid
    assert main(PLAN + ["--force", "dp=2", "--force", "dp=1"]) == 2
    assert "--force: dp given twice" in _one_line(capsys)
    out = tmp_path / "plan.json"
    assert main(PLAN + ["--force", "dp=1", "--force", "pp=2", "-o", str(out), "--no-check"]) == 0
    mesh = json.loads(out.read_text())["mesh"]
    assert (mesh["dp"], mesh["pp"]) == (1, 2)


def test_a_forced_schedule_with_pp_1_is_refused(capsys):
    # it was planned with a note saying the schedule was ignored (exit 0), while sp=1 with tp=1 was refused
    assert main(PLAN + ["--force", "schedule=interleaved,pp=1"]) == 2
    assert "--force schedule=interleaved needs a pipeline, and pp=1 is forced too" in _one_line(capsys)
    assert main(PLAN + ["--force", "vp=2,pp=1"]) == 2
    assert "--force vp=2 needs a pipeline" in _one_line(capsys)


@pytest.mark.parametrize("argv,match", [
    (["--cluster", "dgx-h10", "--batch-size", "8"], "no preset or file named 'dgx-h10' (did you mean dgx-h100?)"),
    (["--cluster", "", "--batch-size", "8"], "--cluster is empty; give a preset name"),
    (["--cluster", "cpu-local", "--batch-size", "8", "--force", "zero=-1"], "--force: zero=-1 must be 0 or more"),
])
def test_a_near_preset_name_an_empty_cluster_and_a_negative_zero_stage(argv, match, capsys):
    # the audit got a list of presets without a guess, '--cluster is required' for an empty one, and 'zero=-1 must be
    # positive' (0 is a ZeRO stage)
    assert main([MLP] + argv) == 2
    assert match in _one_line(capsys)
