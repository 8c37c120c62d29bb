"""Where the simulated step goes, per published run: compute by operator class, comm by kind,
exposed comm, bubble, optimizer.

    python benchmarks/published/breakdown.py [--only ID[,ID...]]

For every suite entry (``run.py``'s strategies and cost models) it prints, for the busiest
pipeline rank (most compute time: the stage that sets a pipeline's pace; every DP/TP peer of it
runs the same ops; ``pp`` names it), in milliseconds per step:

``step``     the simulated step time; ``err`` the suite's error (simulated / published - 1)
``gemm``, ``attn``, ``mem``, ``launch``   the kernel-table price of the compute ops (standalone,
             before the overlap slowdown), split by operator class (``costmodel.operators``)
``other``    compute ops priced whole (no kernel table), ``opt`` the optimizer step
``straggle`` compute time added by waiting for the job's slowest GPU (the fleet's speed spread,
             ``costmodel.stragglers``: the standalone sum x (slowest_factor - 1))
``slow``     compute time added by the overlap slowdown (compute_s - the standalone sum - straggle)
``comm:K``   busy time of each comm kind on that rank (overlapped or not)
``exposed``  comm not hidden behind compute; ``bubble`` idle compute stream less exposed comm
``exp:G``    exposed time of one comm group's streams alone (pp: the send/recv streams; dp, tp,
             ep, cp): their busy time with no compute op running (groups in flight together each
             count it, so they can sum to more than ``exposed``)

It is a diagnostic: numbers per run explain an error, they are never fitted to it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import run as suite_run  # noqa: E402  (benchmarks/published/run.py)

COMPUTE = ("F", "B", "BI", "BW", "OPT")


def _kernel_split(cm, rows) -> dict[str, float]:
    """Seconds of one kernel table by operator class (gemm, attn, mem, launch)."""
    out: dict[str, float] = defaultdict(float)
    for row in rows:
        cls = row[0]
        key = "gemm" if cls == "gemm" else "attn" if cls.startswith("attn") else "mem"
        t = cm.kernels_time([row])
        launch = row[4] * cm.gpu.launch_s
        out[key] += t - launch
        out["launch"] += launch
    return out


def _stream_group(stream: str) -> str:
    """A comm stream's group: pp (its send.* / recv.* streams), else the stream's name (dp, tp, ep, cp)."""
    head = stream.split(".", 1)[0]
    return "pp" if head in ("send", "recv", "p2p") else head


def breakdown(entry: dict) -> dict[str, float]:
    """Milliseconds per step of rank 0 by component (see the module docstring)."""
    from costmodel.stragglers import slowest_factor
    from piper_sim.api import compile
    from piper_sim.simulator import simulate
    from piper_sim.trace import uncovered_time, union_intervals

    strategy = suite_run.strategy_of(entry)
    plan = compile(strategy)
    cm_spec = suite_run._costmodel_for(entry, strategy, "analytic")
    from costmodel.model import get_costmodel
    from costmodel.hardware import parse_cluster

    cm = get_costmodel(cm_spec, parse_cluster(strategy["cluster"]))
    sim = simulate(plan, cm)
    out: dict[str, float] = defaultdict(float)
    st = max(sim.rank_stats, key=lambda r: r.compute_s)
    cls = plan.classes[st.pp_rank]
    for ins in cls.instructions():
        if ins.kind == "OPT":
            continue
        if ins.kind in COMPUTE:
            if ins.kernels:
                for k, v in _kernel_split(cm, plan.kernels[ins.kernels]).items():
                    out[k] += v
            else:
                out["other"] += cm.compute_time(ins.kind, ins.flops, ins.bytes, tuple(ins.gemm) or None)
    ev = sim.events
    r0 = ev[ev["rank"] == st.rank]
    for kind, grp in r0.groupby("kind"):
        dur = float((grp["end"] - grp["start"]).sum())
        if kind == "OPT":
            out["opt"] += dur
        elif kind not in COMPUTE:
            out[f"comm:{kind}"] += dur
    compute = union_intervals(zip(r0[r0["kind"].isin(COMPUTE)]["start"], r0[r0["kind"].isin(COMPUTE)]["end"]))
    comm = r0[~r0["kind"].isin(COMPUTE)]
    for group, grp in comm.groupby(comm["stream"].map(_stream_group)):
        out[f"exp:{group}"] = uncovered_time(union_intervals(zip(grp["start"], grp["end"])), compute)
    standalone = sum(out[k] for k in ("gemm", "attn", "mem", "launch", "other", "opt"))
    out["straggle"] = standalone * (slowest_factor(plan.layout.world_size, cm.gpu.speed_spread) - 1.0)
    out["slow"] = st.compute_s - standalone - out["straggle"]
    out["exposed"], out["bubble"], out["step"] = st.comm_exposed_s, st.idle_s, sim.step_time_s
    value = suite_run.METRICS[entry["metric"]].value(sim, plan)
    ms = {k: 1e3 * v for k, v in out.items()}
    ms["err"] = 100.0 * (value / float(entry["published"]) - 1.0)
    ms["pp"] = st.pp_rank
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", metavar="ID", help="entry ids (comma-separated, or repeat)")
    args = ap.parse_args(argv)
    suite = suite_run.load_suite()
    suite_run.register_models(suite)
    only = {i.strip() for a in args.only or [] for i in a.split(",") if i.strip()}
    cols = ["pp", "step", "err", "gemm", "attn", "mem", "launch", "other", "opt", "straggle", "slow", "exposed", "bubble"]
    rows = []
    for e in suite.entries:
        if only and e["id"] not in only:
            continue
        try:
            rows.append((e["id"], breakdown(e)))
        except Exception as exc:  # a report: one failing entry must not stop the others
            print(f"{e['id']}: ERROR {type(exc).__name__}: {exc}", file=sys.stderr)
    w = max([len(i) for i, _ in rows] + [2])
    print(f"{'id':<{w}} " + " ".join(f"{c:>8}" for c in cols) + "  comm busy by kind; exposed by stream group (ms)")
    for i, ms in rows:
        comm = " ".join(f"{k[5:]}={v:.0f}" for k, v in sorted(ms.items()) if k.startswith("comm:"))
        comm += "; exposed " + " ".join(f"{k[4:]}={v:.0f}" for k, v in sorted(ms.items()) if k.startswith("exp:"))
        cells = [f"{ms[c]:>8.0f}" if c == "pp" else f"{ms.get(c, 0.0):>+8.1f}" if c == "err"
                 else f"{ms.get(c, 0.0):>8.1f}" for c in cols]
        print(f"{i:<{w}} " + " ".join(cells) + "  " + comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
