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
  named by its op id (what ``torch.profiler.record_function(op_id)`` records) around one
  ``cpu_op`` per kernel, each around its ``cudaLaunchKernel`` (``cuda_runtime``);
- on the device (pid = rank, tid = the CUDA stream id, ``args.stream``/``args.device``/
  ``args.correlation``/``args.External id`` as Kineto writes them): the op's kernels;
  ops of one plan stream that overlap in time (the executor keeps asynchronous comms in
  flight together) go to extra streams (`trace.lanes`). Comm kernels are named as NCCL's
  (``ncclDevKernel_SendRecv``, ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``...) with NCCL's
  record args (``Collective name``, ``In msg nelems``, ``dtype``...), so HTA counts them as
  communication. The plan's fields (op id, kind, stage, mb, bytes, flops, peer) ride along
  in ``args``;
- memory: Kineto's ``[memory]`` instant events (``Total Allocated``, ``Bytes``) and a
  ``ph: "C"`` counter in GB that Perfetto draws as a track.

Two levels. With the plan that ran (``plan=``, `kernel_level`; what a simulation writes),
a compute op is the kernels of its operator profile (`piper_sim.kineto_kernels`: names,
``Input Dims``) scaled to fill exactly its simulated ``[start, end]``; one eager host
launches every op in device order, LAUNCH_US a kernel, as far ahead of the device as a
QUEUE_DEPTH-kernel launch queue allows; a dependency on another stream is a
``cudaEventRecord`` after the source's last launch, a ``cudaStreamWaitEvent`` before the
op's first, and a ``Stream Wait Event`` (``cuda_sync``) on the waiting stream, as
torch.profiler records them with CUDA sync events on. So HTA's kernel breakdown, idle-time
breakdown, queue length and critical path apply too. Without it (a measured run: the
executor knows ops, not kernels), each op is one kernel named by its op id (``F.s3.mb5``),
launched from its ``posted`` time.

Times are µs with ns decimals, like Kineto's; the device's start from
``otherData.device_offset_us`` (DEVICE_LEAD_US or more: room for the first launches), host
events on whole µs. HTA rounds times to whole µs when it loads a trace, as it does for real
ones, so every launch lands a whole µs before its kernel (the queue length never goes
negative). `read_kineto_traces` reads a directory back into the event schema (one row per
plan op).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from costmodel.dtypes import DTYPES
from piper_sim.kineto_kernels import KernelLevel, input_dims, kernel_level
from piper_sim.trace import (COMPUTE_KINDS, event_args, events_to_dataframe, lane_name, lanes, memory_counters,
                             stream_order)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["HOST_PID_BASE", "NCCL_KERNELS", "LAUNCH_US", "QUEUE_DEPTH", "DEVICE_LEAD_US", "kineto_trace",
           "write_kineto_traces", "read_kineto_traces", "stream_ids"]

log = logging.getLogger(__name__)
HOST_PID_BASE = 100000
CORRELATION_BASE = 1 << 24
COMPUTE_STREAM_ID = 7  # the default CUDA stream's id in Kineto traces
LAUNCH_US = 10  # host µs of one eager aten op and its kernel launch
QUEUE_DEPTH = 1024  # kernels a CUDA stream's launch queue holds (HTA's CUDA_MAX_LAUNCH_QUEUE_PER_STREAM)
Item = tuple  # a device kernel: (name, cpu op, ts µs, dur µs, kernel args, cpu op args)
DEVICE_LEAD_US = 50.0  # the device timeline starts this long after the host's ProfilerStep
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


def _slot(h: float, du: float, at: int) -> dict[str, float]:
    """``ts``/``dur`` of a runtime call in the cpu op ``[h, h + du]``: whole µs (HTA rounds
    times to µs), ``[at, at + 2]`` into a full LAUNCH_US op (1: cudaStreamWaitEvent, 4: the
    launch, 7: cudaEventRecord), the whole op when the host is squeezed."""
    if du >= LAUNCH_US:
        return {"ts": h + at, "dur": 2.0}
    return {"ts": h, "dur": du}


def _host_schedule(ops: list, dev_items: list[list[Item]], order: list[int], index: dict[str, int], level: KernelLevel | None,
                   posted: list[float], lead: float) -> tuple[list[list[int]], dict[tuple[int, int], float]]:
    """Host µs of each kernel's launch (its cpu op's start) and each cpu op's length.

    With a plan (``level``), one eager host issues every op in the order they start on the
    device (each on the thread of its stream), LAUNCH_US per kernel, as early as that order,
    the ops it depends on and the launch queue (QUEUE_DEPTH kernels per stream) allow: an
    eager run's host runs ahead of the device. Without one (a measured run), each thread
    issues from the op's posted time. Then, backwards, every launch is pulled before its
    kernel's start (where the host is slower than the simulated device: tiny kernels)."""
    def issuer(stream: str) -> str:
        return "host" if level is not None else stream

    launch_at: list[list[int]] = [[] for _ in ops]
    host_end = [0] * len(ops)
    last: dict[str, int] = {}
    ends: dict[str, list[float]] = {}  # device end of each kernel on the stream, in launch order
    for i in order:
        stream, op = ops[i].stream, ops[i].op_id
        lb = 0
        if level is not None:
            lb = max([host_end[index[d]] for d in level.deps.get(op, ()) if d in index] + [0])
        else:
            p = posted[i]
            lb = max(0, math.floor(_us(p if p == p else ops[i].start) + lead) - LAUNCH_US)
        prev = last.get(issuer(stream))
        q = ends.setdefault(stream, [])
        hs: list[int] = []
        for _, _, ts, dur, _, _ in dev_items[i] or [(None, None, _us(ops[i].start), 0.0, {}, {})]:
            h = max(lb, 0 if prev is None else prev + LAUNCH_US)
            if len(q) >= QUEUE_DEPTH:
                h = max(h, math.ceil(q[-QUEUE_DEPTH] + lead))
            hs.append(h)
            prev = h
            q.append(ts + dur)
        last[issuer(stream)] = prev
        launch_at[i] = hs
        host_end[i] = hs[-1] + LAUNCH_US
    seqs: dict[str, list[tuple[int, int]]] = {}
    for i in order:
        seqs.setdefault(issuer(ops[i].stream), []).extend((i, j) for j in range(len(launch_at[i])))
    span: dict[tuple[int, int], float] = {}
    for seq in seqs.values():
        nxt = math.inf
        for i, j in reversed(seq):
            items = dev_items[i]
            ts = items[j][2] if items else _us(ops[i].start)
            # the launch (at 0.4 of the cpu op) lands a whole µs before the kernel: HTA rounds times
            h = int(min(launch_at[i][j], math.ceil(ts + lead) - LAUNCH_US // 2, nxt - 1))
            launch_at[i][j] = h
            span[(i, j)] = float(min(LAUNCH_US, nxt - h))
            nxt = h
    return launch_at, span


def _device_items(ops: list, level: KernelLevel | None, dtype: str) -> list[list[Item]]:
    """Each op's kernels, filling its ``[start, end]`` (µs from the step's start; none for
    an op that took no time): with a ``level``, a compute op's profile kernels, each taking
    its share of the op by its cost-model time; otherwise one kernel, named by the op id for
    compute and as NCCL's for communication."""
    dt = DTYPES.get(dtype, DTYPES["fp32"])
    out: list[list[Item]] = []
    shared: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # Kernel objects are shared by a table's ops
    for stream, op, kind, stage, mb, start, end, nbytes, flops, peer, lane in ops:
        ts, te = _us(start), _us(end)
        items: list[Item] = []
        ks = level.kernels.get(op) if level is not None else None
        if te <= ts:
            pass
        elif ks:
            weights = [k.weight for k in ks] if any(k.weight > 0 for k in ks) else [1.0] * len(ks)
            total, acc, t0 = sum(weights), 0.0, ts
            for i, (k, w) in enumerate(zip(ks, weights)):
                acc += w
                t1 = te if i == len(ks) - 1 else round(ts + (te - ts) * acc / total, 3)
                if id(k) not in shared:
                    shared[id(k)] = ({"flops": k.flops, "bytes": k.bytes} if k.flops else {"bytes": k.bytes},
                                     {"Input Dims": input_dims(k), "Input type": [k.dtype]})
                items.append((k.name, k.cpu_op, t0, round(t1 - t0, 3), *shared[id(k)]))
                t0 = t1
        elif kind == "OPT" and level is not None and level.optimizer[0]:
            items.append((level.optimizer[0], level.optimizer[1], ts, round(te - ts, 3), {}, {}))
        elif kind in COMPUTE_KINDS:
            items.append((op, op, ts, round(te - ts, 3), {}, {}))
        else:
            kname = NCCL_KERNELS.get(kind, "ncclDevKernel_Generic(ncclDevComm*, unsigned long, ncclWork*)")
            nelems = int(nbytes // dt.bytes) if nbytes else 0
            coll = COLLECTIVE_NAMES.get(kind, kind.lower())
            extra = {"Collective name": coll, "In msg nelems": nelems, "Out msg nelems": nelems,
                     "dtype": dt.profiler_name, "Process Group Name": stream}
            items.append((kname.format(dt=dt.nccl_name), "nccl:" + coll, ts, round(te - ts, 3), extra,
                          {"Input Dims": [[nelems]], "Input type": [dt.profiler_name]}))
        out.append(items)
    return out


def kineto_trace(df: "pd.DataFrame", rank: int, *, step: int = 0, world_size: int | None = None,
                 backend: str = "nccl", dtype: str = "bf16", memory: "pd.DataFrame | None" = None,
                 static_bytes: float = 0.0, device_name: str = "", name: str = "piper-sim",
                 step_end: float | None = None, level: KernelLevel | None = None) -> dict[str, Any]:
    """The Kineto-shaped trace dict of one rank (see the module doc). ``df``: the event
    frame (all ranks or this one); ``memory``: `trace.MEMORY_COLUMNS` samples;
    ``static_bytes``: the rank's model states, added to the memory counter; ``step_end``:
    end of the ``ProfilerStep`` span (default: the last event of any rank); ``level``: the
    rank's kernels and dependencies (`kernel_level`), None for one kernel per op."""
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
         "ts": 0.0, "dur": 0.0, "args": {"External id": CORRELATION_BASE - 1}},
    ]
    step_event = ev[-1]
    for s, tid in host_tids.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": host, "tid": tid, "args": {"name": f"issue {s}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": host, "tid": tid, "args": {"sort_index": tid}})
    for (s, k), sid in sids.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": sid,
                   "args": {"name": f"stream {sid} {lane_name(s, k)}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": dev, "tid": sid, "args": {"sort_index": sid}})

    cols = ["stream", "op_id", "kind", "stage", "mb", "start", "end", "bytes", "flops", "peer", "lane"]
    ops = list(sub[cols].itertuples(index=False))
    posted = sub["posted"].tolist() if "posted" in sub.columns else sub["start"].tolist()
    corr = iter(range(CORRELATION_BASE, CORRELATION_BASE + (1 << 30)))

    dev_items = _device_items(ops, level, dtype)

    order = sorted(range(len(ops)), key=lambda i: (ops[i].start, ops[i].end, i))
    index = {ops[i].op_id: i for i in order}
    # device times are µs after `lead`: enough for the host to launch the first kernels
    lead = DEVICE_LEAD_US
    for _ in range(4):
        launch_at, span = _host_schedule(ops, dev_items, order, index, level, posted, lead)
        low = min((h for hs in launch_at for h in hs), default=0)
        if low >= 0:
            break
        lead += math.ceil(-low)
    step_event["dur"] = round(t_end + lead, 3)

    # cross-stream dependencies: cudaEventRecord after the dependency's last launch,
    # cudaStreamWaitEvent before the op's first, and the GPU's "Stream Wait Event". A stream
    # runs in order: one wait per source stream, on its dependency that ends last. HTA keeps
    # one sync per kernel, the last in time: the waits go in the order their sources end.
    records: dict[int, list[tuple[int, int]]] = {}  # op index -> (record corr, waiting stream id)
    waits: dict[int, list[tuple[int, int, int]]] = {}  # op index -> (wait corr, record corr, source stream)
    sid_of = [sids[(o.stream, int(o.lane))] for o in ops]
    if level is not None:
        for i in order:
            if not dev_items[i]:
                continue
            last: dict[int, int] = {}  # source stream -> its dependency that ends last
            for d in level.deps.get(ops[i].op_id, ()):
                j = index.get(d)
                if j is not None and dev_items[j] and sid_of[j] != sid_of[i]:
                    if sid_of[j] not in last or ops[j].end > ops[last[sid_of[j]]].end:
                        last[sid_of[j]] = j
            for j in sorted(last.values(), key=lambda j: (ops[j].end, j)):
                rc, wc = next(corr), next(corr)
                records.setdefault(j, []).append((rc, sid_of[i]))
                waits.setdefault(i, []).append((wc, rc, sid_of[j]))

    for i, (stream, op, kind, stage, mb, start, end, nbytes, flops, peer, lane) in enumerate(ops):
        plan_args: dict[str, Any] = {"op_id": op, **event_args(kind, stage, mb, nbytes, flops, peer)}
        tid, sid = host_tids[stream], sids[(stream, int(lane))]
        hs, items = launch_at[i], dev_items[i]
        a0 = float(hs[0])
        a1 = hs[-1] + span[(i, len(hs) - 1)]
        ext = next(corr)
        idle = not items  # took no time: no kernel; the annotation keeps where it sat on the device
        ev.append({"ph": "X", "cat": "user_annotation", "name": op, "pid": host, "tid": tid, "ts": a0,
                   "dur": round(a1 - a0, 3),
                   "args": {"External id": ext, **plan_args,
                            **({"device_ts": _us(start) + lead} if idle else {})}})
        if idle:
            continue
        for j, (kname, cpu_op, ts, dur, kargs, cargs) in enumerate(items):
            h, du, ts = float(hs[j]), span[(i, j)], round(ts + lead, 3)
            c, e = next(corr), next(corr)
            if level is not None:  # op level: the op's annotation holds its launch
                ev.append({"ph": "X", "cat": "cpu_op", "name": cpu_op, "pid": host, "tid": tid, "ts": h, "dur": du,
                           "args": {"External id": e, **cargs}})
            if j == 0:
                for n, (wc, rc, src) in enumerate(waits.get(i, ())):
                    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "pid": host,
                               "tid": tid, **_slot(h, du, 1), "args": {"External id": e, "correlation": wc, "cbid": 147}})
                    ev.append({"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": dev, "tid": sid,
                               "ts": float(math.floor(ts) - len(waits[i]) + n),  # whole µs, before the kernel
                               "dur": 0.0, "args": {"correlation": wc, "device": dev, "stream": sid, "event": rc,
                                                    "wait_on_stream": src,
                                                    "wait_on_cuda_event_record_corr_id": rc}})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": host, "tid": tid,
                       **_slot(h, du, 4), "args": {"External id": e, "correlation": c, "cbid": 211}})
            if j == len(items) - 1:
                for rc, _ in records.get(i, ()):
                    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaEventRecord", "pid": host,
                               "tid": tid, **_slot(h, du, 7), "args": {"External id": e, "correlation": rc, "cbid": 135}})
            ev.append({"ph": "X", "cat": "kernel", "name": kname, "pid": dev, "tid": sid, "ts": ts, "dur": dur,
                       "args": {"queued": 0, "device": dev, "context": 1, "stream": sid, "correlation": c,
                                "External id": e, **kargs, "op_id": op, "kind": kind,
                                **(plan_args if len(items) == 1 else {})}})
            ev.append({"ph": "f", "id": c, "pid": dev, "tid": sid, "ts": ts, "cat": "ac2g", "name": "ac2g", "bp": "e"})
            ev.append({"ph": "s", "id": c, "pid": host, "tid": tid, "ts": _slot(h, du, 4)["ts"], "cat": "ac2g",
                       "name": "ac2g"})

    if memory is not None and len(memory):
        mem = memory[memory["rank"] == rank].drop_duplicates("time", keep="last")
        prev_b = 0.0
        for t, b in zip(mem["time"], mem["bytes"]):
            total = static_bytes + float(b)
            ev.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": host, "tid": 1,
                       "ts": _us(t) + lead,
                       "args": {"Device Type": 1, "Device Id": dev, "Addr": 0, "Bytes": int(b - prev_b),
                                "Total Allocated": int(total), "Total Reserved": int(total)}})
            prev_b = float(b)
        counters = memory_counters(mem, {rank: static_bytes})
        for e in counters:
            e["ts"] = round(e["ts"] + lead, 3)
        ev += counters

    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": backend, "rank": int(rank), "world_size": world},
        "deviceProperties": [{"id": dev, "name": device_name or f"{name} device"}],
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": 0,
        "traceName": f"rank{rank}.pt.trace.json",
        "otherData": {"generator": name, "device_offset_us": lead,
                      "level": "kernel" if level is not None else "op"},
        "traceEvents": ev,
    }


def write_kineto_traces(df: "pd.DataFrame", out_dir: str, *, ranks: Sequence[int] | None = None,
                        plan: Any = None, **kwargs: Any) -> list[str]:
    """Write ``out_dir/rank{R}.pt.trace.json`` for each rank of ``df`` (or ``ranks``);
    keyword arguments as `kineto_trace` (``static_bytes`` may be a dict rank -> bytes);
    ``plan``: the `piper_sim.plan.Plan` that ran, for kernel-level traces (`kernel_level`).
    Returns the paths. One event per line, keys with a space after the colon: HTA finds a
    file's rank with a regex on ``"rank": N``. Each file is written atomically."""
    from piper_sim.files import atomic_write

    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "rank*.pt.trace.json")):
        os.remove(old)  # a directory is one run: no stale ranks from an earlier, larger one
    static = kwargs.pop("static_bytes", None)
    step_end = kwargs.pop("step_end", float(df["end"].max()) if len(df) else 0.0)
    paths = []
    for r in (sorted(df["rank"].unique().tolist()) if ranks is None else ranks):
        sb = static.get(r, 0.0) if isinstance(static, dict) else float(static or 0.0)
        level = kernel_level(plan, int(r)) if plan is not None else None
        data = kineto_trace(df, int(r), static_bytes=sb, step_end=step_end, level=level, **kwargs)
        path = os.path.join(out_dir, f"rank{r}.pt.trace.json")
        events = data.pop("traceEvents")
        with atomic_write(path) as f:
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
    schema (one row per plan op, not per kernel), from the ops' host annotations and their
    device kernels (an op's start and end: its first kernel's start, its last one's end;
    ``posted``: when the host began launching it, on the same clock)."""
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    rows = []
    for fp in files:
        with open(fp) as f:
            data = json.load(f)
        rank = data["distributedInfo"]["rank"]
        offset = float(data.get("otherData", {}).get("device_offset_us", 0.0))
        tnames = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"]
                  if e.get("ph") == "M" and e.get("name") == "thread_name"}
        spans: dict[str, list[float]] = {}
        for e in data["traceEvents"]:
            if e.get("ph") == "X" and e.get("cat") == "kernel" and "op_id" in e.get("args", {}):
                s = spans.setdefault(e["args"]["op_id"], [math.inf, -math.inf])
                s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"])
        for e in data["traceEvents"]:
            a = e.get("args", {})
            if e.get("ph") != "X" or e.get("cat") != "user_annotation" or "op_id" not in a:
                continue
            k = spans.get(a["op_id"])
            start = (k[0] if k else a.get("device_ts", e["ts"] + e["dur"])) - offset
            end = (k[1] - offset) if k else start
            stream = tnames.get((e["pid"], e["tid"]), "").removeprefix("issue ")
            rows.append({"rank": rank, "stream": stream, "op_id": a["op_id"], "kind": a["kind"],
                         "stage": a.get("stage", -1), "mb": a.get("mb", -1), "start": start / 1e6,
                         "end": end / 1e6, "bytes": a.get("bytes", 0.0), "flops": a.get("flops", 0.0),
                         "peer": a.get("peer", -1), "posted": (e["ts"] - offset) / 1e6})
    return events_to_dataframe(rows, extra_columns=("posted",))
