"""Options checked before any work starts, and bounded work (issue 30, parts 2 and 4).

Every refused case is exit 2 with one line naming the flag and no traceback, before
torchrun starts or a search runs, and leaves nothing behind in the folder it was given.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
LIMIT_AS = 3 * 2**30  # subprocesses that would expand 1e9 ranks die here instead of taking the machine

pytestmark = pytest.mark.filterwarnings("ignore")


def tiny(cluster: str = "cpu:2", **top) -> dict:
    return {"model": "gpt-tiny", "cluster": cluster, "global_batch": 4, "seq_len": 16, "microbatches": 4,
            "dtype": "fp32", "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}],
            **top}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    from piper_sim.api import compile

    path = str(tmp_path_factory.mktemp("plan") / "plan.json")
    compile(tiny()).save(path)
    return path


def _no_work(*a, **k):
    raise AssertionError("the work started before the options were checked")


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, dirs, fs in os.walk(root) for f in fs + dirs}


def refused(argv: list[str], tmp_path, capsys, *needles: str) -> str:
    """main(argv) is exit 2 with one line holding ``needles``, no traceback, nothing created."""
    from piper_sim.cli import main

    before = _files(tmp_path)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("piper-sim"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    assert _files(tmp_path) == before, _files(tmp_path) - before
    return lines[0]


# ------------------------------------------------------------------ run: every option before launch


# id -> (argv after `run PLAN`, files and folders to make first ("d/" a folder), text the line must hold)
RUN_CASES: dict[str, tuple[list[str], list[str], str]] = {
    "clip-negative": (["--clip-grad-norm", "-1"], [], "--clip-grad-norm"),
    "clip-zero": (["--clip-grad-norm", "0"], [], "--clip-grad-norm"),
    "clip-nan": (["--clip-grad-norm", "nan"], [], "--clip-grad-norm"),
    "clip-inf": (["--clip-grad-norm", "inf"], [], "--clip-grad-norm"),
    "trace-folder": (["--trace", "{tmp}/d"], ["d/"], "--trace"),
    "timeline-folder": (["--timeline", "{tmp}/d"], ["d/"], "--timeline"),
    "trace-missing-folder": (["--trace", "{tmp}/no/such/dir/t.json"], [], "does not exist"),
    "trace-existing": (["--trace", "{tmp}/t.json"], ["t.json"], "--force"),
    "timeline-existing": (["--timeline", "{tmp}/t.png"], ["t.png"], "--force"),
    "kineto-file": (["--kineto", "{tmp}/f"], ["f"], "--kineto"),
    "profile-file": (["--profile", "{tmp}/f"], ["f"], "--profile"),
    "save-file": (["--save", "{tmp}/f"], ["f"], "--save"),
    "save-under-a-file": (["--save", "{tmp}/f/ckpt"], ["f"], "--save"),
    "kineto-earlier-traces": (["--kineto", "{tmp}/d"], ["d/", "d/rank0.pt.trace.json"], "--force"),
    "profile-earlier-traces": (["--profile", "{tmp}/d"], ["d/", "d/rank1.json"], "--force"),
}


def _make(tmp_path, paths: list[str]) -> None:
    for p in paths:
        if p.endswith("/"):
            (tmp_path / p).mkdir()
        else:
            (tmp_path / p).write_text("earlier output")


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_run_refuses_bad_options_before_launch(case, tmp_path, plan_file, capsys, monkeypatch):
    args, make, needle = RUN_CASES[case]
    _make(tmp_path, make)
    monkeypatch.setattr("executor.lifetime.run_launcher", _no_work)
    refused(["run", plan_file, *(a.format(tmp=tmp_path) for a in args)], tmp_path, capsys, needle)


def test_run_force_replaces_earlier_outputs(tmp_path, plan_file, monkeypatch):
    """With --force the same outputs launch, and the workers get --force too."""
    from piper_sim.cli import main

    _make(tmp_path, ["t.json", "d/", "d/rank0.pt.trace.json"])
    launched = []
    monkeypatch.setattr("executor.lifetime.run_launcher", lambda cmd, env=None: launched.append(cmd) or 0)
    assert main(["run", plan_file, "--trace", str(tmp_path / "t.json"), "--kineto", str(tmp_path / "d"),
                 "--force", "--clip-grad-norm", "0.5"]) == 0
    assert "--force" in launched[0] and launched[0][launched[0].index("--clip-grad-norm") + 1] == "0.5"
    # a new --save folder (parents created by the checkpoint) and a new trace in an existing folder launch
    assert main(["run", plan_file, "--save", str(tmp_path / "runs" / "ckpt"), "--trace", str(tmp_path / "new.json")]) == 0
    assert "--force" not in launched[1]


def test_worker_refuses_bad_outputs_before_its_process_group(tmp_path, plan_file):
    """The torchrun worker runs the same checks (preflight) before any process group."""
    (tmp_path / "f").write_text("x")
    env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    r = subprocess.run([sys.executable, "-m", "executor", plan_file, "--save", str(tmp_path / "f")], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--save" in r.stderr, r.stderr[-2000:]


def _save_with_static_bytes(plan, path: str, nbytes: float) -> str:
    plan.classes[0].static_memory["params_bytes"] = nbytes
    plan.save(path)
    return path


def test_run_refuses_a_plan_larger_than_the_node_memory(tmp_path, capsys, monkeypatch):
    """CPU ranks: the node's RAM; GPU ranks: the cluster's GPU memory. One line before launch."""
    from piper_sim.api import compile
    from piper_sim.cli.run import least_need_bytes, node_memory_bytes

    monkeypatch.setattr("executor.lifetime.run_launcher", _no_work)
    plan = compile(tiny())
    assert 0 < least_need_bytes(plan.classes[0]) < node_memory_bytes()
    cpu = _save_with_static_bytes(plan, str(tmp_path / "cpu.json"), 1e15)
    refused(["run", cpu], tmp_path, capsys, "2 CPU rank(s) per node need at least", "GiB of RAM")
    gpu = _save_with_static_bytes(compile(tiny("h100:1x2")), str(tmp_path / "gpu.json"), 1e12)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    refused(["run", gpu, "--device", "cuda"], tmp_path, capsys, "pipeline rank 0 needs at least", "H100")


def test_least_need_is_below_the_simulated_peak():
    """The launch check's bound never exceeds what the simulator says a rank holds."""
    from piper_sim.api import compile
    from piper_sim.cli.run import least_need_bytes
    from piper_sim.simulator import simulate

    for s in (tiny(), tiny(seq_len=128), {**tiny(), "microbatches": 2, "directives": [{"op": "data_parallel", "degree": 2, "zero": 1}]}):
        plan = compile(s)
        sim = simulate(plan, "unit:F=1,BI=1,BW=1,comm=0")
        for st in sim.rank_stats:
            assert least_need_bytes(plan.class_of(st.rank)) <= st.peak_memory_bytes * (1 + 1e-9), s


# ------------------------------------------------------------------ explore and validate: before the search


EXPLORE = ["explore", "--model", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16"]

EXPLORE_CASES: dict[str, tuple[list[str], list[str], str]] = {
    "cp-zero": (["--cp", "0"], [], "--cp"),
    "tp-word": (["--tp", "3,x"], [], "--tp"),
    "tp-empty-item": (["--tp", "1,,2"], [], "--tp"),
    "zero-4": (["--zero", "4"], [], "--zero"),
    "emit-best-file": (["--emit-best", "{tmp}/f"], ["f"], "--emit-best"),
    "csv-folder": (["--csv", "{tmp}/d"], ["d/"], "--csv"),
    "plot-missing-folder": (["--plot", "{tmp}/no/p.png"], [], "--plot"),
}


@pytest.mark.parametrize("case", list(EXPLORE_CASES))
def test_explore_refuses_bad_options_before_searching(case, tmp_path, capsys, monkeypatch):
    args, make, needle = EXPLORE_CASES[case]
    _make(tmp_path, make)
    monkeypatch.setattr("piper_sim.explore.explore", _no_work)
    refused([*EXPLORE, *(a.format(tmp=tmp_path) for a in args)], tmp_path, capsys, needle)


def test_explore_lists_parse_to_integers(monkeypatch):
    from piper_sim.cli import main

    seen = {}
    monkeypatch.setattr("piper_sim.explore.explore", lambda *a, **k: seen.update(k) or _no_work())
    with pytest.raises(AssertionError):
        main([*EXPLORE, "--tp", "1,2", "--cp", "1", "--zero", "0,3"])
    assert (seen["tp_degrees"], seen["cp_degrees"], seen["zero_levels"]) == ([1, 2], [1], [0, 3])


def test_validate_creates_nothing_on_refusal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("piper_sim.cli.validation.validate_one", _no_work)
    refused(["validate", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")], tmp_path, capsys,
            "missing.json")
    (tmp_path / "s.json").write_text(json.dumps(tiny()))
    (tmp_path / "f").write_text("x")
    refused(["validate", str(tmp_path / "s.json"), "--out", str(tmp_path / "f")], tmp_path, capsys, "--out")


# ------------------------------------------------------------------ bounded work


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


def _huge_plans(tmp_path, plan_file) -> dict[str, str]:
    """The tiny plan claiming 1e9 ranks, two ways, re-hashed (an edit the hash cannot catch)."""
    from piper_sim.plan import Plan, _hash

    def edit(name: str, change) -> str:
        d = Plan.load(plan_file).to_json()
        change(d)
        d["hash"] = _hash({k: d[k] for k in ("kernels", "layout", "meta", "classes") if k in d})
        path = str(tmp_path / f"{name}.json")
        with open(path, "w") as f:
            json.dump(d, f)
        return path

    return {"dp-1e9": edit("dp-1e9", lambda d: d["layout"].update(dp=10**9)),
            "ranks-1e9": edit("ranks-1e9", lambda d: d["classes"][0].update(ranks=[[0, 10**9]])),
            "ranks-cancelling": edit("ranks-cancelling",
                                     lambda d: d["classes"][0].update(ranks=[[0, 10**9], [0, -10**9]]))}


def test_plans_of_1e9_ranks_are_refused_at_once(tmp_path, plan_file):
    """Refused by Plan.load before any rank list exists (22 GB and the OOM killer before);
    then simulate, run and the worker, each one line and exit 2."""
    import tracemalloc

    from piper_sim.plan import Plan, PlanError

    worker_env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "1"}
    for name, path in _huge_plans(tmp_path, plan_file).items():
        tracemalloc.start()
        t = time.perf_counter()
        with pytest.raises(PlanError, match="MAX_WORLD_SIZE"):
            Plan.load(path)
        took, peak = time.perf_counter() - t, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{name}: refused in {took * 1e3:.1f} ms, {peak / 2**20:.1f} MiB traced")
        assert took < 5 and peak < 500 * 2**20
        if name == "ranks-cancelling":
            continue  # the entry points share Plan.load: two plans show it
        for argv, env in ((["-m", "piper_sim.cli", "simulate", path], ENV), (["-m", "piper_sim.cli", "run", path], ENV),
                          (["-m", "executor", path], worker_env)):
            r = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120,
                               preexec_fn=_limited, check=False)
            assert r.returncode == 2, (argv, r.returncode, r.stderr[-2000:])
            assert r.stderr.count("\n") == 1 and "MAX_WORLD_SIZE" in r.stderr and "Traceback" not in r.stderr


def test_models_strategies_and_clusters_past_the_limits_are_refused(tmp_path):
    from piper_sim.api import compile
    from piper_sim.checks import MAX_LAYERS
    from piper_sim.strategy import StrategyError

    model = tmp_path / "deep.json"
    model.write_text(json.dumps({"name": "deep", "n_layers": 10**9, "hidden": 64, "n_heads": 4, "n_kv_heads": 4,
                                 "ffn": 256, "vocab": 512, "max_seq": 128}))
    t = time.perf_counter()
    with pytest.raises(StrategyError, match=f"in 1..{MAX_LAYERS}"):
        compile(tiny(model=str(model)))
    with pytest.raises(StrategyError, match="MAX_WORLD_SIZE"):
        compile({**tiny("cpu:1000000"), "global_batch": 10**6, "microbatches": 1,
                 "directives": [{"op": "data_parallel", "degree": 10**6}]})
    assert time.perf_counter() - t < 5
    model.write_text(model.read_text().replace(str(10**9), str(MAX_LAYERS)))
    from piper_sim.sources import resolve_model

    assert resolve_model(str(model)).n_layers == MAX_LAYERS  # the limit itself is accepted


def test_explore_is_bounded(tmp_path, capsys, monkeypatch):
    """cpu:1000000 (past 150 s before) is refused at once; a search past the candidate limit too."""
    from piper_sim.explore import explore
    from piper_sim.strategy import StrategyError

    t = time.perf_counter()
    refused(["explore", "--model", "gpt-tiny", "--cluster", "cpu:1000000", "--global-batch", "4", "--seq-len", "16",
             "--quiet"], tmp_path, capsys, "MAX_WORLD_SIZE")
    assert time.perf_counter() - t < 5
    monkeypatch.setattr("piper_sim.explore.MAX_EXPLORE_CANDIDATES", 3)
    with pytest.raises(StrategyError, match="MAX_EXPLORE_CANDIDATES"):
        explore("gpt-tiny", "cpu:2", 4, 16, workers=1)


POOL_THEN_DIE = """
import os
from piper_sim.explore import _pool
pool = _pool(2, False)
print(" ".join(str(w.pid) for w in pool._pool), flush=True)
os.kill(os.getpid(), {sig})
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_explore_workers_end_with_the_explorer(sig):
    r = subprocess.run([sys.executable, "-c", POOL_THEN_DIE.format(sig=int(sig))], env=ENV, capture_output=True,
                       text=True, timeout=120, check=False)
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2, r.stderr[-2000:]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), [p for p in pids if _alive(p)]
