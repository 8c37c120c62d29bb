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
             "dropped-send": (_drop_send, "lacks SEND.F.s0.mb1"),
             "duplicated-op": (_duplicate_op, "appears 2 times"),
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


@pytest.mark.slow  # ~37 s; the fast set keeps the bad-input corpus (test_bad_input_corpus_exit_2_one_line)
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


# ------------------------------------------------------------------ bad-input corpus: exit 2, one line


def _s(**top) -> str:
    """The tiny pp2 strategy with top-level fields replaced (None removes one)."""
    s = {**tiny(), **top}
    return json.dumps({k: v for k, v in s.items() if v is not None})


def _d(*directives, **top) -> str:
    """A strategy with these directives instead of the tiny one's."""
    return _s(directives=list(directives), **top)


PIPE = {"op": "pipeline", "degree": 2}
SCHED = {"op": "schedule", "name": "1f1b"}
GOOD = _s()

# id -> (file contents by name ("s.json" is the input), argv with {tmp}, {s}, {plan}, env, text the line must hold)
CORPUS: dict[str, tuple[dict, list, dict, str]] = {
    # strategy: top-level fields
    "seed-list": ({"s.json": _s(seed=[1])}, ["compile", "{s}"], {}, "'seed'"),
    "seed-null": ({"s.json": _s(seed=None) .replace('"dtype"', '"seed": null, "dtype"')}, ["compile", "{s}"], {},
                  "'seed'"),
    "seed-float": ({"s.json": _s(seed=1.7)}, ["compile", "{s}"], {}, "'seed'"),
    "seed-bool": ({"s.json": _s(seed=True)}, ["compile", "{s}"], {}, "'seed'"),
    "seed-negative": ({"s.json": _s(seed=-1)}, ["compile", "{s}"], {}, "'seed'"),
    "name-number": ({"s.json": _s(name=5)}, ["compile", "{s}"], {}, "'name'"),
    "global-batch-1e30": ({"s.json": _s(global_batch=10**30)}, ["compile", "{s}"], {}, "'global_batch'"),
    "global-batch-bool": ({"s.json": _s(global_batch=True)}, ["compile", "{s}"], {}, "'global_batch'"),
    "global-batch-float": ({"s.json": _s(global_batch=4.0)}, ["compile", "{s}"], {}, "'global_batch'"),
    "global-batch-nan": ({"s.json": _s(global_batch=float("nan"))}, ["compile", "{s}"], {}, "'global_batch'"),
    "seq-len-inf": ({"s.json": _s(seq_len=float("inf"))}, ["compile", "{s}"], {}, "'seq_len'"),
    "microbatches-zero": ({"s.json": _s(microbatches=0)}, ["compile", "{s}"], {}, "'microbatches'"),
    "dtype-unknown": ({"s.json": _s(dtype="fp8")}, ["compile", "{s}"], {}, "'dtype'"),
    "model-number": ({"s.json": _s(model=3)}, ["compile", "{s}"], {}, "'model'"),
    "model-unknown": ({"s.json": _s(model="gpt-nope")}, ["compile", "{s}"], {}, "gpt-nope"),
    "cluster-unknown": ({"s.json": _s(cluster="tpu:4")}, ["compile", "{s}"], {}, "tpu:4"),
    "unknown-field": ({"s.json": _s(foo=1)}, ["compile", "{s}"], {}, "foo"),
    "directives-object": ({"s.json": _s(directives={})}, ["compile", "{s}"], {}, "'directives'"),
    "top-level-list": ({"s.json": "[1, 2]"}, ["compile", "{s}"], {}, "JSON object"),
    # strategy: directives
    "op-list": ({"s.json": _d({"op": ["pipeline"]})}, ["compile", "{s}"], {}, "'op'"),
    "op-missing": ({"s.json": _d({"degree": 2})}, ["compile", "{s}"], {}, "'op'"),
    "op-unknown": ({"s.json": _d({"op": "pipelin"})}, ["compile", "{s}"], {}, "pipelin"),
    "degree-bool": ({"s.json": _d({"op": "pipeline", "degree": True}, SCHED)}, ["compile", "{s}"], {}, "'degree'"),
    "degree-float": ({"s.json": _d({"op": "pipeline", "degree": 2.0}, SCHED)}, ["compile", "{s}"], {}, "'degree'"),
    "stages-per-rank-float": ({"s.json": _d({**PIPE, "stages_per_rank": 1.5}, SCHED)}, ["compile", "{s}"], {},
                              "'stages_per_rank'"),
    "placement-unknown": ({"s.json": _d({**PIPE, "placement": "x"}, SCHED)}, ["compile", "{s}"], {}, "'placement'"),
    "layers-per-stage-bool": ({"s.json": _d({**PIPE, "layers_per_stage": [1, True]}, SCHED)}, ["compile", "{s}"], {},
                              "'layers_per_stage'"),
    "pipeline-unknown-field": ({"s.json": _d({**PIPE, "degre": 2}, SCHED)}, ["compile", "{s}"], {}, "degre"),
    "zero-true": ({"s.json": _d({"op": "data_parallel", "degree": 2, "zero": True}, cluster="cpu:2")},
                  ["compile", "{s}"], {}, "'zero'"),
    "zero-float": ({"s.json": _d({"op": "data_parallel", "degree": 2, "zero": 1.0}, cluster="cpu:2")},
                   ["compile", "{s}"], {}, "'zero'"),
    "zero-4": ({"s.json": _d({"op": "data_parallel", "degree": 2, "zero": 4}, cluster="cpu:2")},
               ["compile", "{s}"], {}, "'zero'"),
    "bucket-mb-true": ({"s.json": _d({"op": "data_parallel", "degree": 2, "bucket_mb": True}, cluster="cpu:2")},
                       ["compile", "{s}"], {}, "'bucket_mb'"),
    "bucket-mb-nan": ({"s.json": _d({"op": "data_parallel", "degree": 2, "bucket_mb": float("nan")},
                                    cluster="cpu:2")}, ["compile", "{s}"], {}, "'bucket_mb'"),
    "bucket-mb-string": ({"s.json": _d({"op": "data_parallel", "degree": 2, "bucket_mb": "1"}, cluster="cpu:2")},
                         ["compile", "{s}"], {}, "'bucket_mb'"),
    "schedule-name-number": ({"s.json": _d(PIPE, {"op": "schedule", "name": 3})}, ["compile", "{s}"], {}, "'name'"),
    "schedule-unknown": ({"s.json": _d(PIPE, {"op": "schedule", "name": "2f2b"})}, ["compile", "{s}"], {}, "2f2b"),
    "order-slots-ints": ({"s.json": _d(PIPE, SCHED, {"op": "order", "pp_rank": 0, "slots": [1, 2]})},
                         ["compile", "{s}"], {}, "'slots'"),
    "order-slots-string": ({"s.json": _d(PIPE, SCHED, {"op": "order", "pp_rank": 0, "slots": "0F0"})},
                           ["compile", "{s}"], {}, "'slots'"),
    "order-pp-rank-5-of-2": ({"s.json": _d(PIPE, SCHED, {"op": "order", "pp_rank": 5, "slots": ["0F0", "0B0"]})},
                             ["compile", "{s}"], {}, "pp_rank 5"),
    "order-pp-rank-negative": ({"s.json": _d(PIPE, SCHED, {"op": "order", "pp_rank": -1, "slots": ["0F0"]})},
                               ["compile", "{s}"], {}, "'pp_rank'"),
    "place-microbatches-one": ({"s.json": _d(PIPE, SCHED, {"op": "place", "stage": 0, "pp_rank": 0,
                                                           "microbatches": [1]})}, ["compile", "{s}"], {},
                               "'microbatches'"),
    "place-stage-string": ({"s.json": _d(PIPE, SCHED, {"op": "place", "stage": "a", "pp_rank": 0})},
                           ["compile", "{s}"], {}, "'stage'"),
    "recompute-stages-int": ({"s.json": _d(PIPE, SCHED, {"op": "recompute", "stages": 5})}, ["compile", "{s}"], {},
                             "'stages'"),
    "recompute-stages-99": ({"s.json": _d(PIPE, SCHED, {"op": "recompute", "stages": [99]})}, ["compile", "{s}"],
                            {}, "99"),
    "recompute-stages-bool": ({"s.json": _d(PIPE, SCHED, {"op": "recompute", "stages": [True]})},
                              ["compile", "{s}"], {}, "'stages'"),
    "replicate-stages": ({"s.json": _d(PIPE, SCHED, {"op": "replicate", "degree": 1, "stages": [0]})},
                         ["compile", "{s}"], {}, "stages"),
    "stream-kind-unknown": ({"s.json": _d(PIPE, SCHED, {"op": "stream", "kind": "X", "name": "y"})},
                            ["compile", "{s}"], {}, "'kind'"),
    "stream-name-number": ({"s.json": _d(PIPE, SCHED, {"op": "stream", "kind": "SEND", "name": 3})},
                           ["compile", "{s}"], {}, "'name'"),
    "split-zero": ({"s.json": _d(PIPE, SCHED, {"op": "split", "microbatches": 0})}, ["compile", "{s}"], {},
                   "'microbatches'"),
    # files
    "deeply-nested-json": ({"s.json": "[" * 100000 + "]" * 100000}, ["compile", "{s}"], {}, "nested"),
    "directory-as-input": ({}, ["compile", "{tmp}"], {}, "directory"),
    "missing-file": ({}, ["compile", "{tmp}/nope.json"], {}, "not found"),
    "binary-file": ({"s.json": b"\xff\xfe\x00garbage"}, ["compile", "{s}"], {}, "s.json"),
    "empty-file": ({"s.json": ""}, ["compile", "{s}"], {}, "malformed JSON"),
    "expand-directory": ({}, ["expand", "{tmp}"], {}, "directory"),
    "yaml-cluster-malformed": ({"c.yaml": "gpu: [h100\nnodes: 1\n", "s.json": _s(cluster="{tmp}/c.yaml")},
                               ["compile", "{s}"], {}, "c.yaml"),
    "yaml-cluster-list": ({"c.yaml": "- 1\n- 2\n", "s.json": _s(cluster="{tmp}/c.yaml")}, ["compile", "{s}"], {},
                          "c.yaml"),
    "yaml-cluster-nodes-float": ({"c.yaml": "gpu: h100\nnodes: 1.5\ngpus_per_node: 2\n",
                                  "s.json": _s(cluster="{tmp}/c.yaml")}, ["compile", "{s}"], {}, "nodes"),
    # outputs
    "compile-o-directory": ({"s.json": GOOD}, ["compile", "{s}", "-o", "{tmp}"], {}, "directory"),
    "compile-o-dev-full": ({"s.json": GOOD}, ["compile", "{s}", "-o", "/dev/full"], {}, "/dev/full"),
    "compile-o-missing-folder": ({"s.json": GOOD}, ["compile", "{s}", "-o", "{tmp}/no/plan.json"], {}, "no/plan.json"),
    "simulate-trace-directory": ({}, ["simulate", "{plan}", "--trace", "{tmp}"], {}, "directory"),
    "simulate-timeline-directory": ({}, ["simulate", "{plan}", "--timeline", "{tmp}"], {}, "directory"),
    # simulate / show
    "costmodel-nan": ({}, ["simulate", "{plan}", "--costmodel", "unit:F=nan"], {}, "F"),
    "costmodel-inf": ({}, ["simulate", "{plan}", "--costmodel", "unit:F=inf"], {}, "F"),
    "costmodel-negative": ({}, ["simulate", "{plan}", "--costmodel", "unit:F=-1"], {}, "unit"),
    "costmodel-missing-file": ({}, ["simulate", "{plan}", "--costmodel", "{tmp}/nope.json"], {}, "nope.json"),
    "simulate-strategy-not-plan": ({"s.json": GOOD}, ["simulate", "{s}"], {}, "not a piper-sim plan"),
    "show-rank-99": ({}, ["show", "{plan}", "--rank", "99"], {}, "99"),
    "show-rank-negative": ({}, ["show", "{plan}", "--rank", "-1"], {}, "-1"),
    "show-rank-word": ({}, ["show", "{plan}", "--rank", "one"], {}, "'one'"),
    # run: refused before torchrun starts
    "run-steps-0": ({}, ["run", "{plan}", "--steps", "0"], {}, "--steps"),
    "run-steps-negative": ({}, ["run", "{plan}", "--steps", "-3"], {}, "--steps"),
    "run-nproc-0": ({}, ["run", "{plan}", "--nproc", "0"], {}, "--nproc"),
    "run-nnodes-0": ({}, ["run", "{plan}", "--nnodes", "0"], {}, "--nnodes"),
    "run-timeout-nan": ({}, ["run", "{plan}", "--timeout", "nan"], {}, "--timeout"),
    "run-timeout-0": ({}, ["run", "{plan}", "--timeout", "0"], {}, "--timeout"),
    "run-save-every-negative": ({}, ["run", "{plan}", "--save-every", "-1"], {}, "--save-every"),
    "run-keep-0": ({}, ["run", "{plan}", "--keep", "0"], {}, "--keep"),
    "run-fault-no-such-op": ({}, ["run", "{plan}"], {"PIPER_FAULT": "1:0:F.s9.mb0"}, "F.s9.mb0"),
    "run-fault-no-such-rank": ({}, ["run", "{plan}"], {"PIPER_FAULT": "5:0:F.s0.mb0"}, "rank 5"),
    "run-fault-malformed": ({}, ["run", "{plan}"], {"PIPER_FAULT": "x:y"}, "PIPER_FAULT"),
    "run-fault-bad-mode": ({}, ["run", "{plan}"], {"PIPER_FAULT": "0:0:F.s0.mb0:explode"}, "explode"),
    "run-fault-step-beyond": ({}, ["run", "{plan}", "--steps", "2"], {"PIPER_FAULT": "0:5:F.s0.mb0"}, "step 5"),
    "run-ckpt-kill-malformed": ({}, ["run", "{plan}"], {"PIPER_CKPT_KILL": "0:2:nowhere"}, "PIPER_CKPT_KILL"),
    "run-resume-missing": ({}, ["run", "{plan}", "--resume", "{tmp}/nope"], {}, "does not exist"),
    "run-directory-as-plan": ({}, ["run", "{tmp}"], {}, "directory"),
    "run-max-restarts-without-save": ({}, ["run", "{plan}", "--max-restarts", "1"], {}, "--save"),
    "run-max-restarts-negative": ({}, ["run", "{plan}", "--max-restarts", "-1"], {}, "--max-restarts"),
    "explore-global-batch-0": ({}, ["explore", "--model", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "0",
                                    "--seq-len", "16"], {}, "--global-batch"),
    "explore-workers-word": ({}, ["explore", "--model", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4",
                                  "--seq-len", "16", "--workers", "all"], {}, "--workers"),
}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    from piper_sim.api import compile

    path = str(tmp_path_factory.mktemp("plan") / "plan.json")
    compile(tiny()).save(path)
    return path


@pytest.mark.parametrize("case", list(CORPUS))
def test_bad_input_corpus_exit_2_one_line(case, tmp_path, plan_file, capsys, monkeypatch):
    from piper_sim.cli import main

    files, argv, env, needle = CORPUS[case]
    fill = {"tmp": str(tmp_path), "s": str(tmp_path / "s.json"), "plan": plan_file}
    for name, content in files.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content.replace("{tmp}", str(tmp_path)))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("executor.lifetime.run_launcher", _no_launch)  # `run` must refuse before launching torchrun
    try:
        rc = main([a.format(**fill) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("piper-sim"), lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err


def _no_launch(*a, **k):
    raise AssertionError("torchrun was launched for a bad input")


# ------------------------------------------------------------------ resource limits


def test_plans_beyond_the_size_limits_are_refused_at_once():
    """100,000 micro-batches (146 s and a MemoryError at 5.5 GB before) and bucket_mb 1e-6 are
    refused in well under a second, naming the limit."""
    import time

    from piper_sim.api import compile
    from piper_sim.strategy import StrategyError

    compile(tiny())  # imports done
    for sched in ("1f1b", "dualpipev", "zbv"):
        t = time.perf_counter()
        with pytest.raises(StrategyError, match="MAX_PLAN_INSTRUCTIONS"):
            compile(tiny(sched=sched, m=100_000))
        assert time.perf_counter() - t < 1.0
    moe = {**tiny(sched="dualpipev", m=8192), "model": "moe-tiny", "cluster": "cpu:4", "global_batch": 2 * 8192}
    moe["directives"] += [{"op": "data_parallel", "degree": 2}, {"op": "expert_parallel", "degree": 2}]
    with pytest.raises(StrategyError, match="MAX_PLAN_INSTRUCTIONS"):
        compile(moe)
    dp = {**tiny(m=2), "cluster": "cpu:2", "global_batch": 4,
          "directives": [{"op": "data_parallel", "degree": 2, "bucket_mb": 1e-6}]}
    t = time.perf_counter()
    with pytest.raises(StrategyError, match="MAX_BUCKETS_PER_STAGE"):
        compile(dp)
    assert time.perf_counter() - t < 2.0


def test_size_estimate_is_close_to_the_compiled_plan():
    """The estimate the limit is checked on stays within a factor 1.5 of the real size."""
    from piper_sim.api import as_strategy, compile
    from piper_sim.compiler import estimated_instructions
    from piper_sim.models import get_config

    moe = {**tiny(sched="dualpipev", m=8), "model": "moe-tiny", "cluster": "cpu:4", "global_batch": 16}
    moe["directives"] += [{"op": "data_parallel", "degree": 2}, {"op": "expert_parallel", "degree": 2}]
    for s in (tiny(m=64), tiny(sched="dualpipev", m=64), tiny(sched="zbv", m=64), tiny(sched="dualpipe", m=64),
              tiny(pp=4, sched="interleaved_1f1b", m=64), moe):
        plan = compile(s)
        real = sum(len(lst) for c in plan.classes for lst in c.streams.values())
        est = estimated_instructions(as_strategy(s), get_config(s["model"]))
        assert real / 1.5 <= est <= real * 1.5, (s["directives"], est, real)


def test_run_refuses_more_ranks_than_this_node_holds(tmp_path, capsys, monkeypatch):
    from piper_sim.api import compile
    from piper_sim.checks import MAX_CPU_RANKS_PER_CORE
    from piper_sim.cli import main

    cores = len(os.sched_getaffinity(0))
    n = MAX_CPU_RANKS_PER_CORE * cores + 1
    path = str(tmp_path / "wide.json")
    compile({**tiny(m=1), "cluster": f"cpu:{n}", "global_batch": n,
             "directives": [{"op": "data_parallel", "degree": n}]}).save(path)
    monkeypatch.setattr("executor.lifetime.run_launcher", _no_launch)
    assert main(["run", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MAX_CPU_RANKS_PER_CORE" in err and f"{n:,} CPU ranks" in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU: two ranks cannot each have one
    assert main(["run", plan_path_2ranks(tmp_path), "--device", "cuda"]) == 2
    assert "need 2 GPUs but this node has 1" in capsys.readouterr().err


def plan_path_2ranks(tmp_path) -> str:
    from piper_sim.api import compile

    path = str(tmp_path / "pp2.json")
    compile(tiny()).save(path)
    return path
