"""The event schema shared by simulated and measured runs, and what is drawn from it.

One row per executed op (`EVENT_COLUMNS`): ``rank, stream, op_id, kind, stage, mb,
start, end, bytes, flops, peer`` with times in seconds from the start of the step.
For a comm op ``start`` is when data starts to move (all members arrived, or both sides
of a send/recv posted); a back end may add ``posted`` (when the op was issued on its
stream). ``peer`` is the other side of a SEND/RECV (-1 otherwise).

Memory samples (`MEMORY_COLUMNS`): ``rank, time, bytes`` — bytes held by activations and
other transient buffers (the plan's ``alloc``/``free``) after each change; the static
model states live in the per-rank results.

Outputs: `events_to_dataframe`, `write_chrome_trace` (Perfetto / chrome://tracing),
`plot_timeline` (a pipeline picture in the style of the DualPipe / zero-bubble papers)
and `plot_memory`. pandas and matplotlib are imported inside the functions.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

EVENT_COLUMNS = ("rank", "stream", "op_id", "kind", "stage", "mb", "start", "end", "bytes", "flops", "peer")
MEMORY_COLUMNS = ("rank", "time", "bytes")
COMPUTE_KINDS = ("F", "B", "BI", "BW", "OPT")
P2P_KINDS = ("SEND", "RECV")

# Block colours of the timeline, close to the DualPipe / zero-bubble figures.
KIND_COLORS = {
    "F": "#f6b26b", "B": "#6fa8dc", "BI": "#9fc5e8", "BW": "#93c47d", "OPT": "#999999",
    "SEND": "#e06666", "RECV": "#e06666", "ALLREDUCE": "#8e7cc3", "REDUCE_SCATTER": "#8e7cc3",
    "ALL_GATHER": "#b4a7d6", "ALL_TO_ALL": "#c27ba0",
}
LEGEND = (("F", "forward"), ("B", "backward"), ("BI", "backward input"), ("BW", "backward weight"),
          ("OPT", "optimizer"), ("SEND", "send/recv"), ("ALLREDUCE", "DP collective"),
          ("ALL_TO_ALL", "all-to-all"))


def events_to_dataframe(rows: Iterable[Sequence[Any] | dict[str, Any]],
                        extra_columns: Sequence[str] = ()) -> "pd.DataFrame":
    """Rows (tuples in `EVENT_COLUMNS` + `extra_columns` order, or dicts) -> DataFrame
    sorted by (rank, start, end)."""
    import pandas as pd

    columns = list(EVENT_COLUMNS) + list(extra_columns)
    rows = list(rows)
    if rows and isinstance(rows[0], dict):
        df = pd.DataFrame(rows)
        missing = [c for c in EVENT_COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"event rows lack columns {missing}; the schema is {', '.join(EVENT_COLUMNS)}")
    else:
        df = pd.DataFrame(rows, columns=columns)
    df = df.astype({"rank": "int64", "stage": "int64", "mb": "int64", "peer": "int64",
                    "start": "float64", "end": "float64", "bytes": "float64", "flops": "float64"})
    return df.sort_values(["rank", "start", "end"], kind="stable").reset_index(drop=True)


def memory_to_dataframe(samples: Iterable[tuple[int, float, float]]) -> "pd.DataFrame":
    import pandas as pd

    return pd.DataFrame(list(samples), columns=list(MEMORY_COLUMNS))


def save_figure(fig, path: str, dpi: int) -> None:
    """Save a matplotlib figure atomically (format from the extension) and close it."""
    import matplotlib.pyplot as plt

    from piper_sim.files import atomic_path

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=os.path.splitext(path)[1][1:] or plt.rcParams["savefig.format"])
    finally:
        plt.close(fig)


# --------------------------------------------------------------------- chrome trace


def stream_order(streams: Iterable[str]) -> list[str]:
    """compute first, then recv/send, then collectives (ep, dp), then the rest, by name."""
    def key(s: str) -> tuple[int, str]:
        head = s.split(".", 1)[0]
        return ({"compute": 0, "p2p": 1, "recv": 1, "send": 2, "ep": 3, "dp": 4}.get(head, 5), s)
    return sorted(set(streams), key=key)


def chrome_trace(df: "pd.DataFrame", flows: bool = True, name: str = "piper-sim") -> dict[str, Any]:
    """The Chrome trace event dict: X events in µs, one process per rank, one thread per
    stream, flow arrows from each SEND to its RECV."""
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for rank in sorted(df["rank"].unique().tolist()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for i, stream in enumerate(stream_order(df.loc[df["rank"] == rank, "stream"])):
            tids[(rank, stream)] = i
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": i, "args": {"sort_index": i}})
    cols = ["rank", "stream", "op_id", "kind", "stage", "mb", "start", "end", "bytes", "flops", "peer"]
    sends: dict[tuple[int, int, str], tuple[int, float]] = {}
    recvs: list[tuple[int, int, str, int, float]] = []
    for rank, stream, op, kind, stage, mb, start, end, nbytes, flops, peer in df[cols].itertuples(index=False):
        ts, te = _us(start), _us(end)
        tid = tids[(rank, stream)]
        args: dict[str, Any] = {"kind": kind}
        if stage >= 0:
            args["stage"] = int(stage)
        if mb >= 0:
            args["mb"] = int(mb)
        if nbytes:
            args["bytes"] = float(nbytes)
        if flops:
            args["flops"] = float(flops)
        if peer >= 0:
            args["peer"] = int(peer)
        cat = "compute" if kind in COMPUTE_KINDS else "comm"
        events.append({"ph": "X", "name": op, "cat": cat, "pid": int(rank), "tid": tid,
                       "ts": ts, "dur": round(te - ts, 3), "args": args})
        if flows and kind == "SEND":
            sends[(int(rank), int(peer), op[len("SEND."):])] = (tid, ts)
        elif flows and kind == "RECV":
            recvs.append((int(peer), int(rank), op[len("RECV."):], tid, ts))
    for flow_id, (src, dst, match, tid, ts) in enumerate(sorted(recvs, key=lambda r: (r[4], r[0], r[1], r[2]))):
        send = sends.get((src, dst, match))
        if send is None:
            continue
        events.append({"ph": "s", "id": flow_id, "name": "p2p", "cat": "p2p", "pid": src, "tid": send[0],
                       "ts": send[1]})
        events.append({"ph": "f", "bp": "e", "id": flow_id, "name": "p2p", "cat": "p2p", "pid": dst,
                       "tid": tid, "ts": ts})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"generator": name}}


def write_chrome_trace(df: "pd.DataFrame", path: str, flows: bool = True, name: str = "piper-sim") -> None:
    """Write a Chrome trace JSON file that Perfetto (ui.perfetto.dev) and chrome://tracing open."""
    from piper_sim.files import atomic_write

    with atomic_write(path) as f:
        json.dump(chrome_trace(df, flows=flows, name=name), f, separators=(",", ":"))


def read_chrome_trace(path: str) -> "pd.DataFrame":
    """Read a trace written by `write_chrome_trace` (simulated or measured) back into the
    event schema."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    streams = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows = []
    for e in events:
        if e.get("ph") != "X":
            continue
        a = e.get("args", {})
        start = e["ts"] / 1e6
        rows.append((e["pid"], streams.get((e["pid"], e["tid"]), str(e["tid"])), e["name"], a.get("kind", ""),
                     a.get("stage", -1), a.get("mb", -1), start, start + e["dur"] / 1e6, a.get("bytes", 0.0),
                     a.get("flops", 0.0), a.get("peer", -1)))
    return events_to_dataframe(rows)


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 3)


# --------------------------------------------------------------------- pictures


def _pick_ranks(df: "pd.DataFrame", ranks: Sequence[int] | None, max_ranks: int) -> list[int]:
    present = sorted(df["rank"].unique().tolist())
    if ranks is not None:
        return [r for r in ranks if r in set(present)]
    if len(present) <= max_ranks:
        return present
    step = -(-len(present) // max_ranks)
    return present[::step]


def _row_name(stream: str, kind: str) -> str:
    """Timeline row of an event: compute, p2p (all send/recv streams), or its stream."""
    if kind in COMPUTE_KINDS:
        return "compute"
    return "p2p" if kind in P2P_KINDS else stream


def plot_timeline(df: "pd.DataFrame", path: str, title: str = "", ranks: Sequence[int] | None = None,
                  max_ranks: int = 16, comm: bool = True) -> None:
    """One row per rank (compute) plus thin rows for comm (send/recv together, then each
    collective stream; rows without time are left out); blocks coloured by kind with
    micro-batch numbers. With more than `max_ranks` ranks, pass `ranks` (e.g. one
    per rank class); otherwise an even sample is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    shown = _pick_ranks(df, ranks, max_ranks)
    df = df.assign(row=[_row_name(s, k) for s, k in zip(df["stream"], df["kind"])])
    rows: list[tuple[int, str, float]] = []  # (rank, row name, height)
    for r in shown:
        sub = df[df["rank"] == r]
        busy = (sub["end"] - sub["start"]).groupby(sub["row"]).sum()
        names = stream_order(sub["row"])
        rows += [(r, s, 1.0) for s in names if s == "compute"]
        if comm:  # comm rows that carry any time
            rows += [(r, s, 0.35) for s in names if s != "compute" and busy.get(s, 0) > 0]
    t_end = float(df["end"].max()) if len(df) else 1.0
    t_end = t_end if t_end > 0 else 1.0
    height = sum(h for _, _, h in rows) + 0.15 * len(rows)
    fig, ax = plt.subplots(figsize=(14, max(2.0, 0.42 * height + 1.2)))
    y, yticks, ylabels = 0.0, [], []
    boxes: dict[tuple[str, bool], list] = {}  # (kind, framed) -> block outlines
    labels = 0
    min_w = t_end * 1e-4  # keep zero-length ops visible as hairlines
    for r, stream, h in rows:
        sub = df[(df["rank"] == r) & (df["row"] == stream)]
        y -= h + 0.15
        for kind, s, e, mb in zip(sub["kind"], sub["start"], sub["end"], sub["mb"]):
            e = max(e, s + min_w)
            boxes.setdefault((kind, h == 1.0), []).append([(s, y), (e, y), (e, y + h), (s, y + h)])
            if h == 1.0 and mb >= 0 and e - s > t_end * 0.008 and labels < 3000:
                ax.text((s + e) / 2, y + h / 2, str(int(mb)), ha="center", va="center", fontsize=6,
                        in_layout=False)
                labels += 1
        yticks.append(y + h / 2)
        ylabels.append(f"rank {r}" if h == 1.0 else stream)
    for (kind, framed), verts in boxes.items():
        ax.add_collection(PolyCollection(verts, facecolors=KIND_COLORS.get(kind, "#cccccc"),
                                         edgecolors="black" if framed else "none", linewidths=0.3))
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=7)
    ax.set_xlim(0, t_end)
    ax.set_ylim(y - 0.2, 0.1)
    ax.set_xlabel("time (s)")
    ax.set_title(title or "timeline")
    kinds = set(df["kind"])
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=lab) for k, lab in LEGEND
               if k in kinds or (k == "SEND" and "RECV" in kinds)
               or (k == "ALLREDUCE" and kinds & {"REDUCE_SCATTER", "ALL_GATHER"})]
    fig_h = fig.get_size_inches()[1]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles) or 1, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig_h, 1, 1))
    save_figure(fig, path, dpi=130)


def plot_memory(memory: "pd.DataFrame", path: str, title: str = "", static_bytes: dict[int, float] | None = None,
                ranks: Sequence[int] | None = None, max_ranks: int = 16) -> None:
    """Memory over time per rank: transient bytes (plus each rank's static model states
    when `static_bytes` maps rank -> bytes), in GiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = _pick_ranks(memory, ranks, max_ranks)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    t_end = float(memory["time"].max()) if len(memory) else 1.0
    for r in shown:
        sub = memory[memory["rank"] == r].drop_duplicates("time", keep="last")  # no same-instant spikes
        base = (static_bytes or {}).get(r, 0.0)
        ts = [0.0] + sub["time"].tolist() + [t_end]
        vs = [0.0] + sub["bytes"].tolist()
        vs.append(vs[-1])
        ax.step(ts, [(base + v) / 2**30 for v in vs], where="post", label=f"rank {r}", linewidth=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GiB" + (" (model states + activations)" if static_bytes else " (activations)"))
    ax.set_title(title or "memory")
    ax.legend(fontsize=7, ncol=min(len(shown), 8) or 1, loc="upper right")
    ax.set_xlim(0, t_end if t_end > 0 else 1.0)
    fig.tight_layout()
    save_figure(fig, path, dpi=130)
