"""`plan measure` says why a launched job failed, in one line, even when a rank dies below Python."""
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
