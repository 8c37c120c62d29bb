"""Robustness: atomic outputs, plan validation in every back end, strict input checks
(a bad-input corpus: exit 2 and one line), resource limits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from piper_sim.files import atomic_write, write_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}

pytestmark = pytest.mark.filterwarnings("ignore")


def tiny(pp: int = 2, sched: str = "1f1b", m: int = 4, **extra) -> dict:
    return {"model": "gpt-tiny", "cluster": f"cpu:{pp}", "global_batch": m, "seq_len": 16, "microbatches": m,
            "dtype": "fp32", "directives": [{"op": "pipeline", "degree": pp}, {"op": "schedule", "name": sched}],
            **extra}


# ------------------------------------------------------------------ atomic outputs


def test_atomic_write_leaves_the_previous_file_on_error(tmp_path):
    path = tmp_path / "out.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("new, half")
            raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary file left behind
    write_text(path, "new")
    assert path.read_text() == "new"
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_atomic_write_refuses_directories_and_names_full_devices(tmp_path):
    with pytest.raises(IsADirectoryError) as e:
        write_text(tmp_path, "x")
    assert e.value.filename == str(tmp_path)
    write_text("/dev/null", "through a device, not replaced")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    if os.path.exists("/dev/full"):
        with pytest.raises(OSError) as e:
            write_text("/dev/full", "x" * 100000)
        assert e.value.filename == "/dev/full"
        assert not os.path.isfile("/dev/full")


KILL_BEFORE_RENAME = """
import os, signal, sys
from piper_sim.api import compile
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before the rename
compile(json.loads(sys.argv[2])).save(sys.argv[1])
"""


def test_killed_plan_save_keeps_the_previous_plan(tmp_path):
    from piper_sim.api import compile
    from piper_sim.plan import Plan

    path = str(tmp_path / "plan.json")
    compile(tiny(m=4)).save(path)
    before = open(path).read()
    r = subprocess.run([sys.executable, "-c", "import json\n" + KILL_BEFORE_RENAME, path, json.dumps(tiny(m=8))],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert open(path).read() == before
    assert Plan.load(path).meta["microbatches"] == 4
    # the CLI writes through the same helper: a fresh compile still replaces it whole
    out = subprocess.run([sys.executable, "-m", "piper_sim.cli", "compile", _strategy_file(tmp_path, tiny(m=8)),
                          "-o", path], env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Plan.load(path).meta["microbatches"] == 8


def _strategy_file(tmp_path, s: dict, name: str = "s.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(s))
    return str(p)


def test_simulator_outputs_are_written_atomically(tmp_path, monkeypatch):
    """A failing figure writer leaves the previous trace/picture and no temporary file."""
    from piper_sim.api import compile
    from piper_sim.simulator import simulate

    sim = simulate(compile(tiny()), "unit:F=1,BI=1,BW=1,comm=0")
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    sim.write_trace(str(trace))
    sim.plot_timeline(str(png))
    assert json.loads(trace.read_text())["traceEvents"] and png.read_bytes()[:4] == b"\x89PNG"
    old = png.read_bytes()
    import matplotlib.figure

    def boom(self, fname, **kw):
        open(fname, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", boom)
    with pytest.raises(OSError) as e:
        sim.plot_timeline(str(png))
    assert e.value.filename == str(png)
    assert png.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.png"]


# ------------------------------------------------------------------ plan validation in every back end


def _rename_op(d):
    for i in d["classes"][0]["streams"]["compute"]:
        if i["id"] == "F.s0.mb1":
            i["id"] = "F.s0.mbX"


def _drop_send(d):
    d["classes"][0]["streams"]["send.pp1"].pop(1)


def _duplicate_op(d):
    lst = d["classes"][0]["streams"]["compute"]
    lst.insert(3, dict(lst[2]))


def _rename_dep(d):
    ins = next(i for i in d["classes"][1]["streams"]["compute"] if i.get("deps"))
    ins["deps"] = [ins["deps"][0] + "x"] + ins["deps"][1:]


def _swap_recvs(d):
    lst = d["classes"][1]["streams"]["recv.pp0"]
    lst[0], lst[1] = lst[1], lst[0]


def _pp3(d):
    d["layout"]["pp"] = 3


def _bad_peer(d):
    d["classes"][0]["streams"]["send.pp1"][0]["peer"] = 7


BAD_PLANS = {"renamed-op": (_rename_op, "depends on F.s0.mb1"),
             "dropped-send": (_drop_send, "has no matching SEND.F.s0.mb1"),
             "duplicated-op": (_duplicate_op, "appears twice"),
             "renamed-dep": (_rename_dep, "which this rank does not run"),
             "swapped-recvs": (_swap_recvs, "deadlock"),
             "layout-pp3": (_pp3, "layout.pp=3 but the plan has 2 rank classes"),
             "peer-out-of-range": (_bad_peer, "has peer 7")}


def _bad_plan_files(tmp_path) -> dict[str, str]:
    """The tiny pp2 plan edited each way and re-hashed (an edit the hash cannot catch)."""
    from piper_sim.api import compile

    base = compile(tiny()).to_json()
    paths = {}
    for name, (edit, _) in BAD_PLANS.items():
        d = json.loads(json.dumps(base))
        edit(d)
        d["hash"] = _rehash(d)
        paths[name] = str(tmp_path / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(d, f)
    return paths


def _rehash(d: dict) -> str:
    from piper_sim.plan import _hash

    return _hash({k: d[k] for k in ("kernels", "layout", "meta", "classes") if k in d})


def _one_line_exit_2(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


def test_every_back_end_refuses_the_same_bad_plans(tmp_path):
    """simulate, `piper-sim run` and a torchrun worker (before any process group) refuse
    each edited plan with exit 2 and one line naming the problem."""
    import time

    from piper_sim.simulator import simulate
    from piper_sim.validate import PlanValidationError, load_valid_plan

    worker_env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "1"}  # nobody listens there: a rendezvous attempt would fail otherwise
    for name, path in _bad_plan_files(tmp_path).items():
        needle = BAD_PLANS[name][1]
        with pytest.raises(PlanValidationError, match=needle.split(" ")[0]):
            load_valid_plan(path)
        if name == "layout-pp3":  # the simulator checks the layout itself, too
            from piper_sim.plan import Plan

            with pytest.raises(PlanValidationError, match="layout.pp=3"):
                simulate(Plan.load(path), "unit:F=1,BI=1,BW=1,comm=0")
        sim = subprocess.run([sys.executable, "-m", "piper_sim.cli", "simulate", path], env=ENV,
                             capture_output=True, text=True, timeout=120)
        _one_line_exit_2(sim, needle, "invalid plan")
        run = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", path], env=ENV,
                             capture_output=True, text=True, timeout=120)
        _one_line_exit_2(run, needle)
        t = time.monotonic()
        worker = subprocess.run([sys.executable, "-m", "executor", path], env=worker_env, capture_output=True,
                                text=True, timeout=120)
        _one_line_exit_2(worker, needle, "refused")
        assert time.monotonic() - t < 30
