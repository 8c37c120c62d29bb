"""The event schema shared by simulated and measured runs, and what is drawn from it.

One row per executed op (`EVENT_COLUMNS`): ``rank, stream, op_id, kind, stage, mb,
start, end, bytes, flops, peer`` with times in seconds from the start of the step.
For a comm op ``start`` is when data starts to move (all members arrived, or both sides
of a send/recv posted); a back end may add ``posted`` (when the op was issued on its
stream). ``peer`` is the other side of a SEND/RECV (-1 otherwise).

Memory samples (`MEMORY_COLUMNS`): ``rank, time, bytes`` — bytes held by activations and
other transient buffers (the plan's ``alloc``/``free``) after each change; the static
model states live in the per-rank results.

Outputs: `events_to_dataframe`, `write_chrome_trace` (Perfetto / chrome://tracing; per-rank
Kineto-shaped traces for HolisticTraceAnalysis are in `piper_sim.kineto`), `plot_timeline`
(a pipeline picture in the style of the DualPipe / zero-bubble papers) and `plot_memory`.
The plot functions take ``ax=`` and return the matplotlib Figure; they never select a
backend. pandas and matplotlib are imported inside the functions.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from costmodel.memory import GiB
from piper_sim.plan import COMPUTE_KINDS, P2P_KINDS

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

EVENT_COLUMNS = ("rank", "stream", "op_id", "kind", "stage", "mb", "start", "end", "bytes", "flops", "peer")
MEMORY_COLUMNS = ("rank", "time", "bytes")

# Block colours of the timeline, close to the DualPipe / zero-bubble figures.
KIND_COLORS = {
    "F": "#f6b26b", "B": "#6fa8dc", "BI": "#9fc5e8", "BW": "#93c47d", "OPT": "#999999",
    "SEND": "#e06666", "RECV": "#e06666", "ALLREDUCE": "#674ea7", "REDUCE_SCATTER": "#8e7cc3",
    "ALL_GATHER": "#b4a7d6", "ALL_TO_ALL": "#c27ba0",
}
LEGEND = (("F", "forward"), ("B", "backward"), ("BI", "backward input"), ("BW", "backward weight"),
          ("OPT", "optimizer"), ("SEND", "send/recv"), ("ALLREDUCE", "all-reduce"),
          ("REDUCE_SCATTER", "reduce-scatter"), ("ALL_GATHER", "all-gather"), ("ALL_TO_ALL", "all-to-all"))


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


def union_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    cur_s = cur_e = None  # the interval being merged, kept in locals (a hot loop at 25K rows)
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if cur_e is not None and s <= cur_e:
            if e > cur_e:
                cur_e = e
        else:
            if cur_e is not None:
                out.append((cur_s, cur_e))
            cur_s, cur_e = s, e
    if cur_e is not None:
        out.append((cur_s, cur_e))
    return out


def uncovered_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of the ``comm`` intervals not covered by ``compute`` (both unions, as
    `union_intervals` returns them)."""
    total, j = 0.0, 0
    for s, e in comm:
        covered = 0.0
        while j < len(compute) and compute[j][1] <= s:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < e:
            covered += min(e, compute[k][1]) - max(s, compute[k][0])
            k += 1
        total += (e - s) - covered
    return total


def exposed_comm(rows: Iterable[tuple[int, str, float, float]]) -> dict[int, float]:
    """Exposed communication per rank: the time some communication op (any kind outside
    `COMPUTE_KINDS`) is in flight while no compute op runs on that rank — the union of the
    comm intervals less the union of the compute intervals. ``rows``: ``(rank, kind, start,
    end)``. The one definition for simulated (`SimResult.rank_stats`) and measured
    (executor trace) steps."""
    comp: dict[int, list[tuple[float, float]]] = {}
    comm: dict[int, list[tuple[float, float]]] = {}
    compute_kinds = frozenset(COMPUTE_KINDS)
    for rank, kind, start, end in rows:
        if rank not in comp:  # both lists, in order of the ranks' first rows
            comp[rank], comm[rank] = [], []
        (comp if kind in compute_kinds else comm)[rank].append((start, end))
    return {r: uncovered_time(union_intervals(comm[r]), union_intervals(comp[r])) for r in comp}


def memory_to_dataframe(samples: Iterable[tuple[int, float, float]]) -> "pd.DataFrame":
    import pandas as pd

    return pd.DataFrame(list(samples), columns=list(MEMORY_COLUMNS))


def save_figure(fig, path: str | None, dpi: int):
    """Save a matplotlib figure atomically (format from the extension) when ``path`` is
    given; returns the figure (never touches pyplot or the backend)."""
    if path:
        from piper_sim.files import atomic_path

        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=os.path.splitext(path)[1][1:] or "png")
    return fig


# --------------------------------------------------------------------- chrome trace


def stream_order(streams: Iterable[str]) -> list[str]:
    """compute first, then recv/send, then collectives (ep, dp), then the rest, by name."""
    def key(s: str) -> tuple[int, str]:
        head = s.split(".", 1)[0]
        return ({"compute": 0, "p2p": 1, "recv": 1, "send": 2, "ep": 3, "dp": 4}.get(head, 5), s)
    return sorted(set(streams), key=key)


def lanes(df: "pd.DataFrame") -> list[int]:
    """Lane of each event within its (rank, stream): 0, unless it starts before an earlier
    event of that stream has ended (a back end may keep several ops of one stream in flight,
    like the executor's asynchronous comms on CPU); then the first lane that is free. One
    thread/CUDA stream per lane keeps each one's slices disjoint, as Perfetto and HTA need."""
    out = [0] * len(df)
    ends: dict[tuple[int, str], list[float]] = {}
    starts, stops = df["start"].tolist(), df["end"].tolist()
    ranks, streams = df["rank"].tolist(), df["stream"].tolist()
    order = sorted(range(len(df)), key=lambda i: (starts[i], stops[i]))
    for i in order:
        key = (int(ranks[i]), streams[i])
        start, end = float(starts[i]), float(stops[i])
        lane_ends = ends.setdefault(key, [])
        for lane, e in enumerate(lane_ends):
            if start >= e - 1e-12:
                break
        else:
            lane = len(lane_ends)
            lane_ends.append(0.0)
        lane_ends[lane] = max(end, start)
        out[i] = lane
    return out


def lane_name(stream: str, lane: int) -> str:
    """Thread name of a stream's lane: the stream, then ``stream #2``, ``#3``..."""
    return stream if lane == 0 else f"{stream} #{lane + 1}"


def chrome_trace(df: "pd.DataFrame", flows: bool = True, name: str = "piper-sim",
                 memory: "pd.DataFrame | None" = None, static_bytes: dict[int, float] | None = None) -> dict[str, Any]:
    """The Chrome trace event dict: X events in µs, one process per rank, one thread per
    stream, flow arrows from each SEND to its RECV; with ``memory`` (`MEMORY_COLUMNS`), a
    ``memory (GB)`` counter track per rank (plus its ``static_bytes``)."""
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str, int], int] = {}
    lane = lanes(df)
    df = df.assign(lane=lane)
    for rank in sorted(df["rank"].unique().tolist()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        sub = df[df["rank"] == rank]
        i = 0
        for stream in stream_order(sub["stream"]):
            for k in range(int(sub.loc[sub["stream"] == stream, "lane"].max()) + 1):
                tids[(rank, stream, k)] = i
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i,
                               "args": {"name": lane_name(stream, k)}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": i,
                               "args": {"sort_index": i}})
                i += 1
    cols = ["rank", "stream", "op_id", "kind", "stage", "mb", "start", "end", "bytes", "flops", "peer", "lane"]
    sends: dict[tuple[int, int, str], tuple[int, float]] = {}
    recvs: list[tuple[int, int, str, int, float]] = []
    for rank, stream, op, kind, stage, mb, start, end, nbytes, flops, peer, k in df[cols].itertuples(index=False):
        ts, te = _us(start), _us(end)
        tid = tids[(rank, stream, k)]
        args = event_args(kind, stage, mb, nbytes, flops, peer)
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
    if memory is not None:
        events += memory_counters(memory, static_bytes)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"generator": name}}


def event_args(kind: str, stage: int, mb: int, nbytes: float, flops: float, peer: int) -> dict[str, Any]:
    """A trace event's plan fields, the ones that apply (shared by the Chrome and Kineto writers)."""
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
    return args


def memory_counters(memory: "pd.DataFrame", static_bytes: dict[int, float] | None = None,
                    pid_of: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """``ph: "C"`` events: each rank's memory in GB (transient + static) after every change."""
    out: list[dict[str, Any]] = []
    for rank in sorted(memory["rank"].unique().tolist()):
        sub = memory[memory["rank"] == rank].drop_duplicates("time", keep="last")
        base = float((static_bytes or {}).get(rank, 0.0))
        pid = (pid_of or {}).get(rank, int(rank))
        out.append({"ph": "C", "name": "memory (GB)", "pid": pid, "tid": 0, "ts": 0.0,
                    "args": {"allocated": round(base / 1e9, 6)}})
        for t, b in zip(sub["time"], sub["bytes"]):
            out.append({"ph": "C", "name": "memory (GB)", "pid": pid, "tid": 0, "ts": _us(t),
                        "args": {"allocated": round((base + float(b)) / 1e9, 6)}})
    return out


def write_chrome_trace(df: "pd.DataFrame", path: str, flows: bool = True, name: str = "piper-sim",
                       memory: "pd.DataFrame | None" = None, static_bytes: dict[int, float] | None = None) -> None:
    """Write a Chrome trace JSON file that Perfetto (ui.perfetto.dev) and chrome://tracing open."""
    from piper_sim.files import atomic_write

    with atomic_write(path) as f:
        json.dump(chrome_trace(df, flows=flows, name=name, memory=memory, static_bytes=static_bytes), f,
                  separators=(",", ":"))


def read_chrome_trace(path: str) -> "pd.DataFrame":
    """Read a trace written by `write_chrome_trace` (simulated or measured) back into the
    event schema."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    streams = {(e["pid"], e["tid"]): re.sub(r" #\d+$", "", e["args"]["name"]) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # a stream's lanes are one stream
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
#
# Figures are built with matplotlib.figure.Figure, not pyplot: no backend is selected or
# switched (a notebook's inline plots keep working), nothing stays open, and the returned
# Figure shows itself once in a notebook. Pass ``ax=`` to draw into your own axes.

TIME_UNITS = {"s": 1.0, "ms": 1e3, "µs": 1e6}
GIB = GiB  # memory pictures are in GiB, as torch.cuda reports memory


def time_scale(t_end: float, unit: str | None = None) -> tuple[float, str]:
    """(factor, axis label) for times in seconds: ``unit`` "s", "ms", "µs", or "units" (a
    unit cost model: times are in its units, not seconds); None picks s/ms/µs by ``t_end``."""
    if unit == "units":
        return 1.0, "time (cost-model units)"
    if unit is None:
        unit = "s" if t_end >= 1 else "ms" if t_end >= 1e-3 else "µs"
    if unit not in TIME_UNITS:
        raise ValueError(f"time unit {unit!r}: use one of s, ms, µs, units")
    return TIME_UNITS[unit], f"time ({unit})"


def new_figure(ax: Any = None, figsize: tuple[float, float] = (12, 4), nrows: int = 1,
               sharex: bool = True) -> tuple[Any, Any]:
    """(figure, axes): ``ax`` and its figure when given, else a new pyplot-free Figure with
    ``nrows`` axes (an array when nrows > 1)."""
    if ax is not None:
        return ax.figure if not isinstance(ax, (list, tuple)) else ax[0].figure, ax
    from matplotlib.figure import Figure

    _notebook_display()
    fig = Figure(figsize=figsize)
    axes = fig.subplots(nrows, 1, sharex=sharex, squeeze=nrows == 1)
    return fig, (axes if nrows == 1 else list(axes[:, 0]))


def _notebook_display() -> None:
    """In IPython, make sure a returned Figure renders as a PNG even when pyplot was never
    imported (the inline backend registers that formatter only when it is activated)."""
    import sys

    if "IPython" not in sys.modules:
        return
    try:
        from IPython import get_ipython
        from matplotlib.figure import Figure

        ip = get_ipython()
        if ip is None:
            return
        png = ip.display_formatter.formatters["image/png"]
        try:
            png.lookup_by_type(Figure)
        except KeyError:
            png.for_type(Figure, lambda fig: _png_bytes(fig))
    except Exception:  # noqa: BLE001 - display is a convenience, never an error
        return


def _png_bytes(fig: Any) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _save(fig: Any, path: str | None, dpi: int) -> Any:
    return save_figure(fig, path, dpi)


def _pick_ranks(df: "pd.DataFrame", ranks: Sequence[int] | None, max_ranks: int) -> list[int]:
    present = sorted(df["rank"].unique().tolist())
    if ranks is not None:
        return [r for r in ranks if r in set(present)]
    if len(present) <= max_ranks:
        return present
    step = -(-len(present) // max_ranks)
    return present[::step]


COMM_ROW, A2A_ROW = "comm", "all-to-all"
ROW_HEIGHT = {"compute": 1.0, COMM_ROW: 0.4, A2A_ROW: 0.22}
MIN_MARK_PX = 2.0  # the narrowest mark drawn, in pixels at the figure's dpi: no event vanishes
A2A_JOIN_PX = 6.0  # all-to-alls closer than this (pixels) draw as one mark
MAX_LANES = 4  # sub-rows of a comm row for comm ops whose marks would cover each other


def _row_name(stream: str, kind: str) -> str:
    """Timeline row of an event: compute, all-to-all (expert dispatch/combine, aggregated),
    or comm (send/recv and the other collectives of every stream, coloured by kind)."""
    if kind in COMPUTE_KINDS:
        return "compute"
    return A2A_ROW if kind == "ALL_TO_ALL" else COMM_ROW


def min_mark_width(ax: Any, span: float, dpi: float, px: float = MIN_MARK_PX) -> float:
    """The data width of ``px`` pixels on ``ax`` (x from 0 to ``span``) saved at ``dpi``."""
    width_in = ax.figure.get_figwidth() * ax.get_position().width
    return px * span / max(width_in * dpi, 1.0)


def mark_extent(start: float, end: float, min_w: float) -> tuple[float, float, float]:
    """(left, right, free) of a comm mark without an outline: at least ``min_w`` wide; a wide
    op ends ``min_w / 2`` early so back-to-back ops stay apart; ``free``: where the next mark
    of its lane may start."""
    if end - start >= 2 * min_w:
        return start, end - min_w / 2, end
    right = start + max(end - start, min_w)
    return start, right, right + min_w / 2


def mark_lanes(starts: Sequence[float], ends: Sequence[float], min_w: float, max_lanes: int = MAX_LANES) -> list[int]:
    """Lane of each mark (`mark_extent`) so that marks of one row do not cover each other: the
    first lane free at its start, at most ``max_lanes`` (then the lane that frees first)."""
    out = [0] * len(starts)
    free: list[float] = []
    for i in sorted(range(len(starts)), key=lambda i: (starts[i], ends[i])):
        s, _, f = mark_extent(starts[i], ends[i], min_w)
        lane = next((k for k, at in enumerate(free) if s >= at - 1e-12 * max(abs(at), 1.0)), None)
        if lane is None:
            if len(free) < max_lanes:
                lane = len(free)
                free.append(0.0)
            else:
                lane = min(range(len(free)), key=free.__getitem__)
        free[lane] = max(free[lane], f)
        out[i] = lane
    return out


def comm_lanes(kinds: Sequence[str], starts: Sequence[float], ends: Sequence[float], min_w: float) -> list[int]:
    """Lanes of a comm row: send/recv in the top lanes, the collectives under them, each group
    laid out by `mark_lanes` (so a send never hides among collectives)."""
    out = [0] * len(kinds)
    top = 0
    for group in (True, False):
        idx = [i for i, k in enumerate(kinds) if (k in P2P_KINDS) == group]
        if not idx:
            continue
        lane = mark_lanes([starts[i] for i in idx], [ends[i] for i in idx], min_w)
        for i, k in zip(idx, lane):
            out[i] = top + k
        top += max(lane) + 1
    return out


def aggregate_marks(starts: Sequence[float], ends: Sequence[float], min_w: float,
                    join: float | None = None) -> list[tuple[float, float, int]]:
    """(start, end, events) spans covering every interval, each drawn at least ``min_w`` wide;
    intervals closer than ``join`` (default ``min_w``) join one span (a burst of all-to-alls
    is one mark)."""
    join = min_w if join is None else join
    spans: list[list[float]] = []
    for s, e in sorted(zip(starts, ends)):
        e = max(e, s + min_w)
        if spans and s <= spans[-1][1] + join:
            spans[-1][1] = max(spans[-1][1], e)
            spans[-1][2] += 1
        else:
            spans.append([s, e, 1])
    return [(s, e, int(n)) for s, e, n in spans]


def _stage_layout(df: "pd.DataFrame") -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """(index of each (rank, stage) among the rank's stages, {rank: micro-batch count} for
    ranks whose two stages see disjoint micro-batches: DualPipe's two model copies)."""
    comp = df[df["kind"].isin(COMPUTE_KINDS) & (df["stage"] >= 0)]
    index: dict[tuple[int, int], int] = {}
    mirror: dict[int, int] = {}
    for rank, sub in comp.groupby("rank"):
        mbs = {int(s): set(g["mb"][g["mb"] >= 0].tolist()) for s, g in sub.groupby("stage")}
        stages = sorted(mbs)
        if len(stages) == 2 and not (mbs[stages[0]] & mbs[stages[1]]) and all(mbs.values()):
            mirror[int(rank)] = int(max(max(v) for v in mbs.values())) + 1
        for i, st in enumerate(stages):
            index[(int(rank), st)] = i
    return index, mirror


def chunk_of(df: "pd.DataFrame") -> list[int]:
    """Model chunk of each compute event on its rank (-1 for comm): the stage's index among
    the rank's stages (interleaved, ZB-V, DualPipeV: 0 = the first/downward chunk); when a
    rank's two stages see disjoint micro-batches (DualPipe's two model copies), the
    direction: 0 for micro-batches entering at the first rank, 1 for the reverse direction."""
    index, mirror = _stage_layout(df)
    out = []
    for rank, kind, stage, mb in zip(df["rank"], df["kind"], df["stage"], df["mb"]):
        if kind not in COMPUTE_KINDS or stage < 0:
            out.append(-1)
        elif rank in mirror:
            out.append(int(mb >= (mirror[rank] + 1) // 2) if mb >= 0 else 0)
        else:
            out.append(index.get((int(rank), int(stage)), 0))
    return out


def _shade(color: str, chunk: int) -> str:
    """The kind's colour for chunk 0, darker for each further chunk (the DualPipe figures
    shade the reverse direction)."""
    from matplotlib.colors import to_hex, to_rgb

    if chunk <= 0:
        return color
    k = min(0.3 * chunk, 0.6)
    return to_hex(tuple(c * (1 - k) for c in to_rgb(color)))


def plot_timeline(df: "pd.DataFrame", path: str | None = None, title: str = "", ranks: Sequence[int] | None = None,
                  max_ranks: int = 16, comm: bool = True, *, ax: Any = None, time_unit: str | None = None,
                  chunks: bool = True, pairs: bool = True, dpi: int = 130) -> Any:
    """The step as a pipeline picture, in the style of the DualPipe / zero-bubble papers.
    Returns the matplotlib Figure (and writes it to ``path`` when given).

    One row per rank (compute) plus, under it, a thin ``comm`` row (send/recv and every
    collective, coloured by kind; ops whose marks would cover each other go in sub-rows)
    and a thinner ``all-to-all`` row (expert dispatch/combine, bursts joined into one mark);
    in the comm row, send/recv lie above the collectives (`comm_lanes`);
    comm rows without time are left out. Blocks coloured by kind with micro-batch numbers.
    No event vanishes: every mark is at least `MIN_MARK_PX` pixels wide at ``dpi``; each
    compute and comm op is its own mark. ``chunks``: the second model chunk (interleaved,
    ZB-V, DualPipeV) or DualPipe's reverse direction is drawn darker (`chunk_of`). ``pairs``:
    when the frame has a ``pair`` column (`SimResult.events` does: the plan slot of ops that
    run as an overlapped F&B pair, -1 otherwise), each pair is framed. ``time_unit``: see
    `time_scale` ("units" for a unit cost model). With more than ``max_ranks`` ranks pass
    ``ranks`` (e.g. one per rank class); otherwise an even sample is drawn. ``ax``: draw
    into these axes instead of a new figure. Each mark's collection has ``gid``
    ``"rank R/ROW"`` (ROW: compute, comm, all-to-all)."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch, Rectangle

    shown = _pick_ranks(df, ranks, max_ranks)
    df = df.assign(row=[_row_name(s, k) for s, k in zip(df["stream"], df["kind"])],
                   chunk=chunk_of(df) if chunks else [0] * len(df))
    t_end = float(df["end"].max()) if len(df) else 1.0
    t_end = t_end if t_end > 0 else 1.0
    scale, xlabel = time_scale(t_end, time_unit)
    span = t_end * scale
    own = ax is None
    # the data width of MIN_MARK_PX: from the caller's axes, or (own figure, 14 in wide) from
    # an axes narrower than tight_layout leaves it, so the drawn marks end up wider
    min_w = min_mark_width(ax, span, dpi) if not own else MIN_MARK_PX * span / (14 * 0.8 * dpi)
    rows: list[tuple[int, str, float]] = []  # (rank, row name, height)
    lane_of: dict[tuple[int, str], list[int]] = {}
    for r in shown:
        sub = df[df["rank"] == r]
        busy = (sub["end"] - sub["start"]).groupby(sub["row"]).sum()
        names = [n for n in ("compute", COMM_ROW, A2A_ROW) if n in set(sub["row"])]
        rows += [(r, s, ROW_HEIGHT[s]) for s in names if s == "compute"]
        if not comm:
            continue
        for name in names:  # comm rows that carry any time
            if name == "compute" or busy.get(name, 0) <= 0:
                continue
            h = ROW_HEIGHT[name]
            if name == COMM_ROW:
                c = sub[sub["row"] == name]
                lane = comm_lanes(c["kind"].tolist(), (c["start"] * scale).tolist(), (c["end"] * scale).tolist(),
                                  min_w)
                lane_of[(r, name)] = lane
                h = max(h, min(0.2 * (max(lane) + 1), 0.8))  # sub-rows stay readable
            rows.append((r, name, h))
    height = sum(h for _, _, h in rows) + 0.15 * len(rows)
    fig, ax = new_figure(ax, figsize=(14, max(2.0, 0.42 * height + 1.2)))
    y, yticks, ylabels = 0.0, [], []
    # (rank, row, kind, framed, chunk) -> block outlines: one collection per rank row and colour
    boxes: dict[tuple[int, str, str, bool, int], list] = {}
    frames: list[tuple[float, float, float, float]] = []
    labels = 0
    has_pairs = pairs and "pair" in df.columns
    for r, row, h in rows:
        sub = df[(df["rank"] == r) & (df["row"] == row)]
        y -= h + 0.15
        starts, ends = (sub["start"] * scale).tolist(), (sub["end"] * scale).tolist()
        if row == A2A_ROW:
            for s, e, _ in aggregate_marks(starts, ends, min_w, join=A2A_JOIN_PX / MIN_MARK_PX * min_w):
                boxes.setdefault((r, row, "ALL_TO_ALL", False, 0), []).append(
                    [(s, y), (e, y), (e, y + h), (s, y + h)])
        else:
            lane = lane_of.get((r, row)) or [0] * len(sub)
            n = max(lane, default=0) + 1
            for kind, s, e, mb, ch, k in zip(sub["kind"], starts, ends, sub["mb"], sub["chunk"], lane):
                s, e = (s, max(e, s + min_w)) if row == "compute" else mark_extent(s, e, min_w)[:2]
                y0 = y + h - (k + 1) * h / n
                boxes.setdefault((r, row, kind, row == "compute", max(int(ch), 0)), []).append(
                    [(s, y0), (e, y0), (e, y0 + h / n), (s, y0 + h / n)])
                if row == "compute" and mb >= 0 and e - s > span * 0.008 and labels < 3000:
                    ax.text((s + e) / 2, y + h / 2, str(int(mb)), ha="center", va="center", fontsize=6,
                            color="white" if ch >= 1 and kind != "F" else "black", in_layout=False)
                    labels += 1
        if has_pairs and row == "compute":
            paired = sub[sub["pair"] >= 0]
            for _, g in paired.groupby("pair"):
                frames.append((g["start"].min() * scale, y, (g["end"].max() - g["start"].min()) * scale, h))
        yticks.append(y + h / 2)
        ylabels.append(f"rank {r}" if row == "compute" else row)
    for (r, row, kind, framed, ch), verts in boxes.items():
        ax.add_collection(PolyCollection(verts, facecolors=_shade(KIND_COLORS.get(kind, "#cccccc"), ch),
                                         edgecolors="black" if framed else "none", linewidths=0.3,
                                         gid=f"rank {r}/{row}"))
    for x0, y0, w, h in frames:
        ax.add_patch(Rectangle((x0, y0 - 0.04), w, h + 0.08, fill=False, edgecolor="black", linewidth=1.6,
                               zorder=3))
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=7)
    ax.set_xlim(0, span)
    ax.set_ylim(y - 0.2, 0.1)
    ax.set_xlabel(xlabel)
    ax.set_title(title or "timeline")
    drawn = set(df.loc[df["rank"].isin(shown) & (df["row"].isin({row for _, row, _ in rows})), "kind"])
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=lab) for k, lab in LEGEND
               if k in drawn or (k == "SEND" and "RECV" in drawn)]
    if chunks and (df["chunk"] >= 1).any():
        mirror = bool(_stage_layout(df)[1])
        handles.append(Patch(facecolor=_shade("#bbbbbb", 1), edgecolor="black",
                             label="reverse direction (darker)" if mirror else "second chunk (darker)"))
    if frames:
        handles.append(Patch(facecolor="none", edgecolor="black", linewidth=1.6, label="overlapped F&B pair"))
    if own:
        fig_h = fig.get_size_inches()[1]
        fig.legend(handles=handles, loc="lower center", ncol=len(handles) or 1, fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.35 / fig_h, 1, 1))
    elif handles:
        ax.legend(handles=handles, loc="upper right", fontsize=6, ncol=2)
    return _save(fig, path, dpi)


def plot_memory(memory: "pd.DataFrame", path: str | None = None, title: str = "",
                static_bytes: dict[int, float] | None = None, ranks: Sequence[int] | None = None,
                max_ranks: int = 16, *, ax: Any = None, t_end: float | None = None, time_unit: str | None = None,
                dpi: int = 130) -> Any:
    """Memory over the step per rank, in GiB (2**30 bytes, torch's unit), from zero, over real
    time: the static model states (``static_bytes``: rank -> bytes) as a grey band, the
    transient bytes (activations and buffers, the plan's alloc/free) on top, as a step
    function through every change (an alloc and a free at the same instant count once, at
    their net); each panel marks its peak. The simulator changes memory per op (an op's
    alloc when it is issued, its free when it ends), so a 1F1B steady state, where each
    backward's free meets the next forward's alloc, is flat. One panel per rank; ``ax``: one
    Axes (all ranks as lines) or one Axes per rank. ``t_end``: end of the step (default:
    the last change). Returns the Figure."""
    shown = _pick_ranks(memory, ranks, max_ranks)
    last = float(memory["time"].max()) if len(memory) else 0.0
    t_end = max(float(t_end or 0.0), last) or 1.0
    scale, xlabel = time_scale(t_end, time_unit)
    overlay = ax is not None and not isinstance(ax, (list, tuple))
    fig, axes = new_figure(ax, figsize=(12, 0.5 + 1.1 * max(len(shown), 1)), nrows=max(len(shown), 1))
    axes = [axes] * len(shown) if overlay else ([axes] if not isinstance(axes, list) else axes)
    top = 0.0
    for i, (r, a) in enumerate(zip(shown, axes)):
        sub = memory[memory["rank"] == r].drop_duplicates("time", keep="last")
        base = float((static_bytes or {}).get(r, 0.0)) / GIB
        ts = [0.0] + [t * scale for t in sub["time"]] + [t_end * scale]
        vs = [0.0] + [b / GIB for b in sub["bytes"]]
        vs.append(vs[-1])
        total = [base + v for v in vs]
        top = max(top, max(total))
        if overlay:
            a.step(ts, total, where="post", label=f"rank {r}", linewidth=1)
            continue
        color = f"C{i % 10}"
        if base > 0:
            a.fill_between(ts, 0, base, step="post", color="#cccccc", linewidth=0, label="model states")
        a.fill_between(ts, base, total, step="post", color=color, alpha=0.45, linewidth=0, label="activations")
        a.step(ts, total, where="post", color=color, linewidth=1)
        k = max(range(len(total)), key=total.__getitem__)
        a.axhline(total[k], color=color, linestyle=":", linewidth=0.8)
        a.annotate(f"peak {total[k]:.1f} GiB", (ts[k], total[k]), xytext=(2, 2), textcoords="offset points",
                   fontsize=6, color="black")
        a.set_ylabel(f"rank {r}\nGiB", fontsize=7)
        a.tick_params(labelsize=7)
    for a in (axes[:1] if overlay else axes):
        a.set_ylim(0, top * 1.08 if top > 0 else 1.0)
        a.set_xlim(0, t_end * scale)
    if axes:
        axes[-1].set_xlabel(xlabel)
        axes[0].set_title(title or ("memory per rank (GiB): model states + activations" if static_bytes
                                    else "memory per rank (GiB): activations"))
        if overlay:
            axes[0].set_ylabel("GiB")
            axes[0].legend(fontsize=7, ncol=min(len(shown), 8) or 1, loc="upper right")
        else:
            axes[0].legend(fontsize=7, loc="upper right", ncol=2)
    if ax is None:
        fig.tight_layout()
    return _save(fig, path, dpi)
