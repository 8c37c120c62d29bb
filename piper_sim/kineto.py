"""Traces in the shape torch.profiler (Kineto) writes, one file per rank, so that
HolisticTraceAnalysis, TensorBoard's profiler plugin and Perfetto read simulated and
measured runs like real ones.

`write_kineto_traces(df, out_dir)` writes ``rank{R}.pt.trace.json`` for every rank of an
event frame (`piper_sim.trace.EVENT_COLUMNS`; a folded simulation has one rank per rank
class, and its file stands for the whole class). Each file has:

- the Kineto header: ``schemaVersion``, ``distributedInfo`` (``backend``, ``rank``,
  ``world_size``: HTA requires the rank), ``deviceProperties``, ``displayTimeUnit``,
  ``baseTimeNanoseconds``, ``traceName``;
- on the host (pid ``HOST_PID_BASE + rank``): a ``ProfilerStep#N`` span over the step on
  the main thread and, on one thread per plan stream, every op as a ``user_annotation``
  named by its op id (what ``torch.profiler.record_function(op_id)`` records, from the
  op's ``posted`` time to its start, cut at the thread's next launch) around a
  ``cudaLaunchKernel`` (``cuda_runtime``);
- on the device (pid = rank, tid = the CUDA stream id, ``args.stream``/``args.device``/
  ``args.correlation``/``args.External id`` as Kineto writes them): one ``kernel`` per
  op that took time; ops of one plan stream that overlap in time (the executor keeps
  asynchronous comms in flight together) go to extra streams (`trace.lanes`). Compute
  kernels are named by their op id (``F.s3.mb5``); comm kernels as NCCL's
  (``ncclDevKernel_SendRecv``, ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``...) with NCCL's
  record args (``Collective name``, ``In msg nelems``, ``dtype``...), so HTA
  counts them as communication. The plan's fields (op id, kind, stage, mb, bytes, flops,
  peer) ride along in ``args``;
- memory: Kineto's ``[memory]`` instant events (``Total Allocated``, ``Bytes``) and a
  ``ph: "C"`` counter in GB that Perfetto draws as a track.

Times are µs from the start of the step with ns decimals, like Kineto's. HTA rounds them
to whole µs when it loads a trace, as it does for real ones. `read_kineto_traces` reads a
directory back into the event schema.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from costmodel.dtypes import DTYPES
from piper_sim.trace import (COMPUTE_KINDS, event_args, events_to_dataframe, lane_name, lanes, memory_counters,
                             stream_order)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["HOST_PID_BASE", "NCCL_KERNELS", "kineto_trace", "write_kineto_traces", "read_kineto_traces",
           "stream_ids"]

log = logging.getLogger(__name__)
HOST_PID_BASE = 100000
CORRELATION_BASE = 1 << 24
COMPUTE_STREAM_ID = 7  # the default CUDA stream's id in Kineto traces
# NCCL (>= 2.19) device kernel names as Kineto records them; all-to-all runs as grouped send/recv.
NCCL_KERNELS = {
    "SEND": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
    "RECV": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
    "ALL_TO_ALL": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
    "ALLREDUCE": "ncclDevKernel_AllReduce_Sum_{dt}_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
    "REDUCE_SCATTER": "ncclDevKernel_ReduceScatter_Sum_{dt}_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
    "ALL_GATHER": "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
}
# torch's record_param_comms names ("Collective name" in Kineto's NCCL kernel args)
COLLECTIVE_NAMES = {"SEND": "send", "RECV": "recv", "ALL_TO_ALL": "all_to_allv", "ALLREDUCE": "allreduce",
                    "REDUCE_SCATTER": "reduce_scatter_tensor_coalesced", "ALL_GATHER": "all_gather_into_tensor"}


def stream_ids(streams: Iterable[str]) -> dict[str, int]:
    """CUDA stream id of each plan stream: compute on 7 (the default stream in Kineto
    traces), the others from 13 up in `stream_order`. All are > 0, as HTA needs."""
    ids: dict[str, int] = {}
    nxt = 13
    for s in stream_order(streams):
        if s == "compute":
            ids[s] = COMPUTE_STREAM_ID
        else:
            ids[s] = nxt
            nxt += 1
    return ids


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 3)


def kineto_trace(df: "pd.DataFrame", rank: int, *, step: int = 0, world_size: int | None = None,
                 backend: str = "nccl", dtype: str = "bf16", memory: "pd.DataFrame | None" = None,
                 static_bytes: float = 0.0, device_name: str = "", name: str = "piper-sim",
                 step_end: float | None = None) -> dict[str, Any]:
    """The Kineto-shaped trace dict of one rank (see the module doc). ``df``: the event
    frame (all ranks or this one); ``memory``: `trace.MEMORY_COLUMNS` samples;
    ``static_bytes``: the rank's model states, added to the memory counter; ``step_end``:
    end of the ``ProfilerStep`` span (default: the last event of any rank)."""
    sub = df[df["rank"] == rank].sort_values(["start", "end"], kind="stable")
    sub = sub.assign(lane=lanes(sub))  # ops of one stream in flight together get their own CUDA streams
    world = int(world_size if world_size is not None else max(int(df["rank"].max()) + 1, 1))
    host, dev = HOST_PID_BASE + int(rank), int(rank)
    base = stream_ids(sub["stream"])
    sids = {(s, 0): sid for s, sid in base.items()}
    nxt = max(base.values(), default=COMPUTE_STREAM_ID) + 1
    for s, k in sorted({(s, int(k)) for s, k in zip(sub["stream"], sub["lane"]) if k > 0}):
        sids[(s, k)] = nxt
        nxt += 1
    host_tids = {s: i + 2 for i, s in enumerate(stream_order(sub["stream"]))}
    dt = DTYPES.get(dtype, DTYPES["fp32"])
    nccl_dt, torch_dt, elt = dt.nccl_name, dt.profiler_name, dt.bytes
    end_all = float(df["end"].max()) if len(df) else 0.0
    t_end = _us(end_all if step_end is None else step_end)

    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": host, "tid": 0, "args": {"name": f"rank {rank} host"}},
        {"ph": "M", "name": "process_sort_index", "pid": host, "tid": 0, "args": {"sort_index": 2 * rank}},
        {"ph": "M", "name": "thread_name", "pid": host, "tid": 1, "args": {"name": "main thread"}},
        {"ph": "M", "name": "process_name", "pid": dev, "tid": 0, "args": {"name": f"GPU {dev} (rank {rank})"}},
        {"ph": "M", "name": "process_labels", "pid": dev, "tid": 0, "args": {"labels": "CUDA"}},
        {"ph": "M", "name": "process_sort_index", "pid": dev, "tid": 0, "args": {"sort_index": 2 * rank + 1}},
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": host, "tid": 1,
         "ts": 0.0, "dur": t_end, "args": {"External id": CORRELATION_BASE - 1}},
    ]
    for s, tid in host_tids.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": host, "tid": tid, "args": {"name": f"issue {s}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": host, "tid": tid, "args": {"sort_index": tid}})
    for (s, k), sid in sids.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": sid,
                   "args": {"name": f"stream {sid} {lane_name(s, k)}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": dev, "tid": sid, "args": {"sort_index": sid}})

    cols = ["stream", "op_id", "kind", "stage", "mb", "start", "end", "bytes", "flops", "peer", "lane"]
    posted = sub["posted"].tolist() if "posted" in sub.columns else sub["start"].tolist()
    # the host annotation of an op (its record_function) runs from its launch to its start on the
    # device, cut at the next launch on the same issuing thread
    launch = [min(_us(p if p == p else s), _us(s)) for p, s in zip(posted, sub["start"])]  # NaN: at start
    next_launch = [float("inf")] * len(sub)
    by_thread: dict[str, list[int]] = {}
    for i, stream in enumerate(sub["stream"]):
        by_thread.setdefault(stream, []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: launch[i])
        for a_, b_ in zip(idx, idx[1:]):
            next_launch[a_] = launch[b_]
    # correlation ids in Kineto's range: HTA downcasts the column and then stores event
    # indices in it, which fails under pandas 3 when small ids made it int8/int16
    for i, (corr, row) in enumerate(zip(range(CORRELATION_BASE, CORRELATION_BASE + len(sub)),
                                        sub[cols].itertuples(index=False))):
        stream, op, kind, stage, mb, start, end, nbytes, flops, peer, lane = row
        ts, te, tp = _us(start), _us(end), launch[i]
        plan_args: dict[str, Any] = {"op_id": op, **event_args(kind, stage, mb, nbytes, flops, peer)}
        tid, sid = host_tids[stream], sids[(stream, int(lane))]
        idle = te <= ts  # took no time: no kernel; the annotation keeps where it sat on the device
        ev.append({"ph": "X", "cat": "user_annotation", "name": op, "pid": host, "tid": tid, "ts": tp,
                   "dur": round(max(0.0, min(ts, next_launch[i]) - tp), 3),
                   "args": {"External id": corr, **plan_args, **({"device_ts": ts} if idle else {})}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": host, "tid": tid,
                   "ts": tp, "dur": 0.0, "args": {"External id": corr, "correlation": corr, "cbid": 211}})
        if idle:
            continue
        if kind in COMPUTE_KINDS:
            kname, extra = op, {}
        else:
            kname = NCCL_KERNELS.get(kind, "ncclDevKernel_Generic(ncclDevComm*, unsigned long, ncclWork*)")
            kname = kname.format(dt=nccl_dt)
            nelems = int(nbytes // elt) if nbytes else 0
            extra = {"Collective name": COLLECTIVE_NAMES.get(kind, kind.lower()), "In msg nelems": nelems,
                     "Out msg nelems": nelems, "dtype": torch_dt, "Process Group Name": stream}
        ev.append({"ph": "X", "cat": "kernel", "name": kname, "pid": dev, "tid": sid, "ts": ts,
                   "dur": round(te - ts, 3),
                   "args": {"queued": 0, "device": dev, "context": 1, "stream": sid, "correlation": corr,
                            "External id": corr, **extra, **plan_args}})
        ev.append({"ph": "f", "id": corr, "pid": dev, "tid": sid, "ts": ts, "cat": "ac2g",
                   "name": "ac2g", "bp": "e"})
        ev.append({"ph": "s", "id": corr, "pid": host, "tid": tid, "ts": tp, "cat": "ac2g", "name": "ac2g"})

    if memory is not None and len(memory):
        mem = memory[memory["rank"] == rank].drop_duplicates("time", keep="last")
        prev = 0.0
        for t, b in zip(mem["time"], mem["bytes"]):
            total = static_bytes + float(b)
            ev.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": host, "tid": 1,
                       "ts": _us(t), "args": {"Device Type": 1, "Device Id": dev, "Addr": 0, "Bytes": int(b - prev),
                                              "Total Allocated": int(total), "Total Reserved": int(total)}})
            prev = float(b)
        ev += memory_counters(mem, {rank: static_bytes})

    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": backend, "rank": int(rank), "world_size": world},
        "deviceProperties": [{"id": dev, "name": device_name or f"{name} device"}],
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": 0,
        "traceName": f"rank{rank}.pt.trace.json",
        "otherData": {"generator": name},
        "traceEvents": ev,
    }


def write_kineto_traces(df: "pd.DataFrame", out_dir: str, *, ranks: Sequence[int] | None = None,
                        **kwargs: Any) -> list[str]:
    """Write ``out_dir/rank{R}.pt.trace.json`` for each rank of ``df`` (or ``ranks``);
    keyword arguments as `kineto_trace` (``static_bytes`` may be a dict rank -> bytes).
    Returns the paths. One event per line, keys with a space after the colon: HTA finds a
    file's rank with a regex on ``"rank": N``."""
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "rank*.pt.trace.json")):
        os.remove(old)  # a directory is one run: no stale ranks from an earlier, larger one
    static = kwargs.pop("static_bytes", None)
    step_end = kwargs.pop("step_end", float(df["end"].max()) if len(df) else 0.0)
    paths = []
    for r in (sorted(df["rank"].unique().tolist()) if ranks is None else ranks):
        sb = static.get(r, 0.0) if isinstance(static, dict) else float(static or 0.0)
        data = kineto_trace(df, int(r), static_bytes=sb, step_end=step_end, **kwargs)
        path = os.path.join(out_dir, f"rank{r}.pt.trace.json")
        events = data.pop("traceEvents")
        with open(path, "w") as f:
            f.write("{\n")
            for k, v in data.items():
                f.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
            f.write('  "traceEvents": [\n')
            f.write(",\n".join("  " + json.dumps(e) for e in events))
            f.write("\n  ]\n}\n")
        paths.append(path)
    log.debug("wrote %d Kineto-shaped traces in %s", len(paths), out_dir)
    return paths


def read_kineto_traces(path: str) -> "pd.DataFrame":
    """Read a directory (or one file) written by `write_kineto_traces` back into the event
    schema, from the ops' host annotations and device kernels."""
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    rows = []
    for fp in files:
        with open(fp) as f:
            data = json.load(f)
        rank = data["distributedInfo"]["rank"]
        tnames = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"]
                  if e.get("ph") == "M" and e.get("name") == "thread_name"}
        kernels = {e["args"]["op_id"]: e for e in data["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") == "kernel" and "op_id" in e.get("args", {})}
        for e in data["traceEvents"]:
            a = e.get("args", {})
            if e.get("ph") != "X" or e.get("cat") != "user_annotation" or "op_id" not in a:
                continue
            k = kernels.get(a["op_id"])
            start = (k["ts"] if k else a.get("device_ts", e["ts"] + e["dur"])) / 1e6
            end = (k["ts"] + k["dur"]) / 1e6 if k else start
            stream = tnames.get((e["pid"], e["tid"]), "").removeprefix("issue ")
            rows.append({"rank": rank, "stream": stream, "op_id": a["op_id"], "kind": a["kind"],
                         "stage": a.get("stage", -1), "mb": a.get("mb", -1), "start": start, "end": end,
                         "bytes": a.get("bytes", 0.0), "flops": a.get("flops", 0.0), "peer": a.get("peer", -1),
                         "posted": e["ts"] / 1e6})
    return events_to_dataframe(rows, extra_columns=("posted",))
