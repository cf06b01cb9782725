"""`plan measure` says why a launched job failed, in one line, even when a rank dies below Python."""
import pytest
import torch

from executor.cli import failure_reason

TORCHRUN_SIGSEGV = """[W] some warning
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
executor.worker FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_15:00:01
  host      : vm
  rank      : 1 (local_rank: 1)
  exitcode  : -11 (pid: 1234)
  error_file: <N/A>
  traceback : Signal 11 (SIGSEGV) received by PID 1234
============================================================
"""


def test_a_ranks_own_line_comes_first():
    assert failure_reason("noise\nshardwise rank 0: ValueError: bad\n" + TORCHRUN_SIGSEGV, 1) == \
        "shardwise rank 0: ValueError: bad"


def test_a_crash_below_python_names_rank_and_signal():
    why = failure_reason(TORCHRUN_SIGSEGV, 1)
    assert why.startswith("rank 1") and "exitcode -11" in why and "SIGSEGV" in why


def test_otherwise_the_last_meaningful_line():
    assert failure_reason("first\nsecond\n=====\n", 1) == "second"
    assert failure_reason("", 3) == "exit status 3"


TORCHRUN_NO_WORKER = """/usr/bin/python3: Error while finding module specification for 'executor.worker' \
(ModuleNotFoundError: __path__ attribute not found on 'executor' while trying to find 'executor.worker')
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
executor.worker FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1234)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_rank_that_cannot_import_its_program_says_so():
    """Not torchrun's "To enable traceback" boilerplate: the rank's own line names the module it could not find."""
    why = failure_reason(TORCHRUN_NO_WORKER, 1)
    assert why.startswith("/usr/bin/python3: Error while finding module specification for 'executor.worker'")
    assert failure_reason("ModuleNotFoundError: No module named 'executor'\n" + TORCHRUN_NO_WORKER.split("\n", 2)[2],
                          1) == "ModuleNotFoundError: No module named 'executor'"


def _a_plan(tmp_path):
    import os
    from planner.cli import main as plan_main
    gpt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt.py")
    out = tmp_path / "plan.json"
    assert plan_main([gpt, "--cluster", "cpu-local", "--batch-size", "4", "--precision", "fp32", "--force",
                      "dp=2,zero=0,mbs=2", "--no-check", "-o", str(out)]) == 0
    return gpt, out


def _fake_launch(write: bool, rc: int):
    import json

    def launch(plan_path, model_path, world, steps, warmup, threads, result, timeout=None, trace=None, compile=None, debug=False):
        if write:
            with open(result, "w") as f:
                json.dump({"step_time_s": 0.01, "peak_memory_bytes": 1, "memory_bytes": {"peak": 1},
                           "losses": [1.0] * steps, "step_times_s": [0.01] * steps, "notes": []}, f)
        return rc, TORCHRUN_SIGSEGV
    return launch


def test_a_rank_dying_after_the_result_was_written_is_a_note_not_a_failure(tmp_path, monkeypatch, capsys):
    """Rank 0 writes the result only after every rank's measurement arrived; a crash in shutdown loses nothing."""
    import executor.cli as cli
    gpt, plan = _a_plan(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(cli, "launch", _fake_launch(write=True, rc=-11))
    assert cli.main([str(plan), gpt, "--steps", "2", "--warmup", "1"]) == 0
    err = capsys.readouterr().err
    assert "exited abnormally after the measurement was complete" in err and "SIGSEGV" in err


def test_no_result_is_a_failure(tmp_path, monkeypatch, capsys):
    import executor.cli as cli
    gpt, plan = _a_plan(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(cli, "launch", _fake_launch(write=False, rc=-11))
    assert cli.main([str(plan), gpt, "--steps", "2", "--warmup", "1"]) == 1
    assert "the job failed" in capsys.readouterr().err


def test_the_results_are_written_before_the_report(tmp_path, monkeypatch, capsys):
    # -o and --calibrate were written after the report was formatted: a failure there lost the run's results
    import json

    import executor.cli as cli
    import executor.measure
    gpt, plan = _a_plan(tmp_path)
    monkeypatch.setattr(cli, "launch", _fake_launch(write=True, rc=0))

    def broken(*args, **kwargs):
        raise BrokenPipeError
    monkeypatch.setattr(executor.measure, "format_report", broken)
    out, cal = tmp_path / "measured.json", tmp_path / "calibration.json"
    with pytest.raises(BrokenPipeError):
        cli.main([str(plan), gpt, "--steps", "2", "--warmup", "1", "-o", str(out), "--calibrate", str(cal)])
    assert json.loads(out.read_text())["measured"]["step_time_s"] == 0.01
    assert len(json.loads(cal.read_text())["entries"]) == 1


def test_a_timeout_stops_the_ranks_too(tmp_path, capsys):
    # a SIGKILL to torchrun alone left its ranks (each in a session of its own) training to the end: `--timeout 6`
    # of a 100000-step job returned after minutes, with the ranks' result
    import os
    import time
    from planner.cli import main as plan_main
    mlp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "mlp.py")
    plan = tmp_path / "plan.json"
    assert plan_main([mlp, "--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32", "--no-check",
                      "-o", str(plan)]) == 0
    start = time.monotonic()
    assert plan_main(["measure", str(plan), mlp, "--steps", "100000", "--timeout", "6"]) == 1
    assert time.monotonic() - start < 120  # the job's 100000 steps take several minutes here
    assert "ran past --timeout 6 s" in capsys.readouterr().err
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "executor.worker" in line and str(plan) in line:
            ranks.append(line)
    assert not ranks


def test_an_executor_py_in_the_cwd_does_not_stand_in_for_shardwise(tmp_path, monkeypatch, capsys):
    """torchrun runs `python -m executor.worker`, which put the cwd first on sys.path: every rank failed to find
    executor.worker beside the user's own executor.py. The ranks now run with PYTHONSAFEPATH=1."""
    import os
    from planner.cli import main as plan_main
    mlp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "mlp.py")
    plan = tmp_path / "plan.json"
    assert plan_main([mlp, "--cluster", "cpu-local", "--batch-size", "8", "--precision", "fp32", "--force",
                      "dp=1,mbs=8", "--no-check", "-o", str(plan)]) == 0
    (tmp_path / "executor.py").write_text("# the user's own helpers\n")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert plan_main(["measure", str(plan), mlp, "--steps", "2", "--warmup", "1"]) == 0, capsys.readouterr().err


def test_an_error_in_the_model_files_own_code_is_named_and_exits_2(tmp_path, monkeypatch, capsys):
    """Class ids beyond the logits raised in the loss after launch: exit 1 with no word of the model file (the dry
    run runs on fake tensors, which hold no values)."""
    import importlib.util

    import torch

    import executor.cli as cli
    from executor.worker import MODEL_CODE, model_file_frame
    from planner.model_file import default_loss, summed_cross_entropy
    path = tmp_path / "bad_loss.py"
    path.write_text("import torch.nn.functional as F\n\ndef loss_fn(out, y):\n    return F.cross_entropy(out, y)\n\n\n"
                    "def through_shardwise():\n    from planner.plan import Plan\n    Plan.load('/nonexistent.json')\n")
    spec = importlib.util.spec_from_file_location("bad_loss", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    logits, ids = torch.zeros(2, 4), torch.tensor([1, 9])
    # summed_cross_entropy: the default loss over a padded batch (Runner._token_scale)
    for fn, where in ((mod.loss_fn, "bad_loss.py line 4, in loss_fn"), (default_loss, "the default loss"),
                      (summed_cross_entropy, "the default loss")):
        with pytest.raises(IndexError) as e:
            fn(logits, ids)
        said = model_file_frame(e.value, str(path))
        assert said.startswith(MODEL_CODE + where) and "fix the model file" in said
    with pytest.raises(Exception) as e:  # raised below shardwise's own code (the plan's doing): not the model's
        mod.through_shardwise()
    assert model_file_frame(e.value, str(path)) == ""

    gpt, plan = _a_plan(tmp_path)
    capsys.readouterr()
    line = f"shardwise rank 1: IndexError: Target 9 is out of bounds.{said}\n"
    monkeypatch.setattr(cli, "launch", lambda *a, **k: (1, line))
    assert cli.main([str(plan), gpt, "--steps", "2", "--warmup", "1"]) == 2
    assert "Target 9 is out of bounds. [raised in the model's code: the default loss" in capsys.readouterr().err


def test_a_non_finite_loss_is_said(tmp_path, monkeypatch, capsys):
    """The report and measured.json said nothing of a model whose loss was nan at every step."""
    import json

    import executor.cli as cli
    gpt, plan = _a_plan(tmp_path)
    capsys.readouterr()

    def launch(plan_path, model_path, world, steps, warmup, threads, result, *a, **k):
        with open(result, "w") as f:
            json.dump({"step_time_s": 0.01, "peak_memory_bytes": 1, "memory_bytes": {"peak": 1},
                       "losses": [2.0, float("nan"), float("nan")], "step_times_s": [0.01] * 3, "notes": []}, f)
        return 0, ""
    monkeypatch.setattr(cli, "launch", launch)
    out = tmp_path / "m.json"
    assert cli.main([str(plan), gpt, "--steps", "3", "--warmup", "1", "-o", str(out)]) == 0
    assert "note: the loss is nan from step 2: the model computes a non-finite loss" in capsys.readouterr().out
    assert any("non-finite loss" in n for n in json.loads(out.read_text())["measured"]["notes"])


def test_a_quoted_message_is_cut_at_a_word():
    # the loss-parallel fallback note quoted 200 characters of torch's message: "... Please use the ), so the ..."
    from executor.errors import shorten
    said = shorten("DTensor does not support this op. Please use the full_tensor() method " + "x" * 200, 60)
    assert said == "DTensor does not support this op. Please use the ..." and shorten("short\nmore", 60) == "short"


def test_more_cpu_ranks_than_cores_is_said(monkeypatch):
    """4 gloo ranks on 2 cores take turns on them: plan measure says so (a fresh user read 3.8x the prediction with
    nothing saying why)."""
    import os

    from executor.cli import oversubscribed
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert oversubscribed(2, 1) is None
    note = oversubscribed(4, 1)
    assert note.startswith("4 rank(s) x 1 thread(s) on 2 CPU core(s)") and "at most 2 rank(s)" in note
    assert oversubscribed(1, 2) is None and "at most 1 rank(s)" in oversubscribed(2, 2)
