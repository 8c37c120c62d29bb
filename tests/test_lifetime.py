"""No orphans: SIGKILL of torchrun or of `piper-sim run`, or SIGTERM of `piper-sim run`,
leaves no worker running (checked with ps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_executor import ROOT, save_plan, strategy

pytestmark = pytest.mark.filterwarnings("ignore")


def _procs_with(needle: str) -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of the live processes whose command line holds ``needle``."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True).stdout
    procs = {}
    for line in out.splitlines():
        pid, ppid, stat, args = line.split(None, 3)
        if needle in args and not stat.startswith("Z") and int(pid) != os.getpid():
            procs[int(pid)] = (int(ppid), args)
    return procs


def _start(plan: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "piper_sim.cli", "run", plan, "--steps", "100000", "--json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = proc.stdout.readline()  # the first step: every rank is training
    assert line.startswith("{") and json.loads(line)["step"] == 0, (line, proc.stderr.read()[-2000:])
    return proc


def _gone_within(needle: str, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = _procs_with(needle)
        if not left:
            return {}
        time.sleep(0.25)
    return _procs_with(needle)


@pytest.mark.parametrize("victim,sig", [("torchrun", signal.SIGKILL), ("piper-sim run", signal.SIGKILL),
                                        ("piper-sim run", signal.SIGTERM)])
def test_no_worker_outlives_its_launcher(tmp_path, victim, sig):
    plan = save_plan(tmp_path, "pp2", strategy(pp=2, sched="1f1b", m=4))
    proc = _start(plan)
    try:
        procs = _procs_with(plan)
        launcher = [p for p, (pp, a) in procs.items() if "executor.launch" in a and pp == proc.pid]
        workers = [p for p, (pp, a) in procs.items() if launcher and pp == launcher[0]]
        assert len(workers) == 2 and len(launcher) == 1, procs
        os.kill(proc.pid if victim == "piper-sim run" else launcher[0], sig)
        left = _gone_within(plan, 15)
        assert not left, f"alive 15 s after {sig.name} of {victim}: {left}"
        rc = proc.wait(timeout=30)
        if victim == "piper-sim run" and sig == signal.SIGTERM:
            assert rc == 128 + signal.SIGTERM, (rc, proc.stderr.read()[-2000:])
        elif victim == "torchrun":
            assert rc == 128 + signal.SIGKILL, rc  # torchrun's fate, as a shell would report it
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (from /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _workers_of(run_pid: int) -> list[int]:
    """The workers of ``piper-sim run`` ``run_pid``: its launcher's children."""
    return [w for launcher in _children(run_pid) for w in _children(launcher)]


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["piper-sim run", "torchrun"])
def test_no_worker_outlives_a_launcher_killed_while_they_start(tmp_path, victim):
    """SIGKILL of ``piper-sim run`` or of its torchrun 0.1-1 s after torchrun has spawned the
    workers (while they still import torch): no worker is left 10 s later. Workers used to
    record their parent only after importing torch, so one orphaned before that lived on
    (103 s, 144 s)."""
    plan = save_plan(tmp_path, f"pp2-{victim[:5]}", strategy(pp=2, sched="1f1b", m=4))
    left = {}
    for delay in (0.1, 0.3, 0.5, 1.0):
        proc = subprocess.Popen([sys.executable, "-m", "piper_sim.cli", "run", plan, "--steps", "100000"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            deadline = time.monotonic() + 120
            while len(_workers_of(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.01)
            assert len(_workers_of(proc.pid)) == 2, "the workers did not start"
            time.sleep(delay)
            os.kill(proc.pid if victim == "piper-sim run" else _children(proc.pid)[0], signal.SIGKILL)
            alive = _gone_within(plan, 10)
            if alive:
                left[delay] = alive
        finally:
            for pid in _procs_with(plan):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"alive 10 s after SIGKILL of {victim}: {left}"


def _run(plan: str, fault: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", plan, "--steps", "3", *extra], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", "PIPER_FAULT": fault})
    return r, time.monotonic() - t


def test_a_hung_rank_is_named_with_its_op_and_one_line_per_failure(tmp_path):
    """The rank left waiting names the hung rank and the op it hangs at (heartbeats) once
    --timeout has passed; no torchrun traceback; exit status 1."""
    plan = save_plan(tmp_path, "pp2", strategy(pp=2, sched="1f1b", m=4))
    r, elapsed = _run(plan, "1:1:F.s1.mb2:hang", "--timeout", "10")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "rank 1 is stuck at step 1, F.s1.mb2" in r.stderr and "(hung)" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3, lines  # the injection notice, the waiting rank's error, the summary
    assert lines[-1].startswith("piper-sim run: rank 1 hung (the diagnosis above names it)"), lines
    assert elapsed < 10 + 5 + 30, elapsed  # timeout + 5 s, plus start-up on two busy cores


def test_the_summary_names_the_rank_that_raised_not_the_lowest(tmp_path):
    """Rank 1 raises; ranks 0 and 2 fail within the same second because it is gone: the
    summary names rank 1 (torchrun's whole-second timestamps used to make it rank 0)."""
    plan = save_plan(tmp_path, "pp3", strategy(pp=3, sched="1f1b", m=4))
    r, _ = _run(plan, "1:1:B.s1.mb2:raise", "--timeout", "30")
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("piper-sim run: rank 1 failed first (exit code 1; its message is above)"), last


@pytest.mark.slow  # ~35 s: the fast set keeps the raised and hung rank reports (CI budget)
def test_a_killed_rank_is_named_and_verbose_shows_torchruns_report(tmp_path):
    plan = save_plan(tmp_path, "pp2", strategy(pp=2, sched="1f1b", m=4))
    r, _ = _run(plan, "0:1:F.s0.mb3:kill", "--timeout", "30")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("piper-sim run: rank 0 was killed by SIGKILL")
    assert "Traceback" not in r.stderr
    r, _ = _run(plan, "0:1:F.s0.mb3:kill", "--timeout", "30", "-v")
    assert r.returncode == 1 and "ChildFailedError" in r.stderr


def test_the_named_rank_is_one_killed_by_a_signal_torchrun_does_not_send():
    """torchrun's failure timestamps are whole seconds: a peer's error can look first."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from executor.launch import first_failure

    def failure(rank: int, code: int, t: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
        f.timestamp = t
        return f

    assert first_failure({0: failure(0, -9, 11), 1: failure(1, 1, 10)})[0] == 0  # SIGKILL: the cause
    assert first_failure({0: failure(0, -15, 11), 1: failure(1, 1, 10)})[0] == 1  # SIGTERM: torchrun's stop
    assert first_failure({0: failure(0, 1, 10), 1: failure(1, 1, 10)})[0] == 0  # a tie: the lower rank


def test_the_heartbeat_reads_frames_of_methods_the_runtime_has():
    """A renamed Runtime method (wait_any was _wait_any) made every waiting rank look hung."""
    from executor.heartbeat import INSTRUCTION_IN, WAITING_IN
    from executor.runtime import Runtime

    assert all(callable(getattr(Runtime, name, None)) for name in (*WAITING_IN, *INSTRUCTION_IN))


def test_the_named_rank_is_the_one_the_failure_records_blame(tmp_path, monkeypatch):
    """Within torchrun's whole second: the worker that raised first (its record's time), or
    the rank the heartbeat diagnoses name (hung, or no heartbeat), never a rank that waited."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from executor import failures
    from executor.launch import first_failure

    def failure(rank: int, code: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
        f.timestamp = 10
        return f

    monkeypatch.setenv(failures.FAILURE_DIR, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    failures.record(2, [], at=100.25)  # a peer that noticed rank 1 go
    failures.record(1, [], at=100.20)  # raised first
    tf = {0: failure(0, -15), 1: failure(1, 1), 2: failure(2, 1)}
    assert first_failure(tf, failures.read(str(tmp_path))) == (1, "failed first (exit code 1; its message is above)")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt: the old records do not count
    failures.record(0, [(2, "hung", "rank 2 is stuck ...")], at=200.0)
    failures.record(1, [(2, "hung", "rank 2 is stuck ..."), (1, "stopped", "")], at=199.0)
    assert [d["rank"] for d in failures.read(str(tmp_path))] in ([0, 1], [1, 0])
    tf = {0: failure(0, 1), 1: failure(1, 1), 2: failure(2, -15)}
    assert first_failure(tf, failures.read(str(tmp_path))) == (2, "hung (the diagnosis above names it)")
    assert first_failure({0: failure(0, -9), 2: failure(2, -15)}, failures.read(str(tmp_path)))[0] == 0
    assert first_failure(tf, [])[0] == 0  # no records (another node's ranks): torchrun's order


def test_torchruns_error_file_is_written_whole_and_parses(tmp_path, monkeypatch):
    """The rank's error file for torchrun's summary replaces the old one whole (torch's own
    handler opened it and then wrote: a rank killed between left it empty, and torchrun's agent
    died on the JSON); torch's ProcessFailure reads it back."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from executor.worker import _torchrun_error_file

    path = tmp_path / "error.json"
    path.write_text("")  # what a killed writer used to leave
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise RuntimeError("rank 1: boom")
    except RuntimeError as e:
        _torchrun_error_file(e)
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary file left
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: rank 1: boom" and failure.timestamp > 0
    assert "raise RuntimeError" in failure.message["extraInfo"]["py_callstack"]
