"""Data parallelism and ZeRO 0-3 on one rank: flat parameter buffers and their collectives.

Every stage's parameters live in flat buffers (`executor.stage.FlatParams`; one dense, one of
the expert shard), cut into the plan's buckets: ``AR``/``RS`` ops sync a bucket's gradients
(ZeRO-0: all-reduce; 1-3: reduce-scatter into the rank's shard), ``AG`` ops gather a bucket's
parameters (ZeRO-3: a unit, the header's ``zero3_buckets``, for one forward or backward, dropped
after the last piece using it). With a single data-parallel rank the buffers still hold the
parameters the optimizer steps (no sync op).

Overlap: a gradient bucket reduces during the backward that completes it (DDP-style, a
post-accumulate hook per parameter, `grad_ready`); ZeRO-1/2 parameter gathers of the previous
step's update run beside the next step's forward, which waits for a bucket just before the
first module using it (`await_params`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from executor.collectives import all_gather_flat, group_ranks, reduce_scatter_flat
from executor.parallel.axis import Axis, Handler, Posted
from executor.stage import FlatParams
from piper_sim.plan import BACKWARD_KINDS, Instruction, PlanError

SYNC_KINDS = ("ALLREDUCE", "REDUCE_SCATTER")


def flat_tag(ins: Instruction) -> str:
    """Key suffix of the flat parameters a bucket op works on: "" dense, ".e" the expert shard."""
    return ".e" if ins.experts else ""


def is_grad_sync(ins: Instruction) -> bool:
    """A data-parallel gradient sync (a bucket's; tensor- and context-parallel collectives have
    names, not buckets)."""
    return ins.kind in SYNC_KINDS and ins.bucket >= 0


class DataParallel(Axis):
    """The flat buffers of this rank's stages, their gradient syncs and parameter gathers."""

    def __init__(self, rt):
        self.rt = rt
        self.norm_weights: dict | None = None
        if rt.clip_grad_norm is not None:
            self._setup_clipping()
        self.flats = self._build_flats(rt.header.zero)
        self.bucket_parts = self._bucket_parts()
        self.releases: dict[tuple[str, int, int, int], list[tuple[FlatParams, int]]] = {}
        self._setup_grad_overlap()
        self._setup_param_gates()

    def handlers(self) -> dict[str, Handler]:
        return {"ALLREDUCE": self.sync, "REDUCE_SCATTER": self.sync, "ALL_GATHER": self.gather}

    def norm_share(self, name: str) -> float:
        """Hybrid sharding: each of the dp / dp_shard replicas holds the same reduced shard,
        so each counts 1/replicas of its square (ZeRO's disjoint shards count whole)."""
        layout = self.rt.layout
        return layout.dp_shard / layout.dp if layout.dp_shard else 1.0

    # ------------------------------------------------------------------ set-up
    def _setup_clipping(self) -> None:
        """Clipping by the global norm needs every gradient of the step before any update:
        each OPT also waits for all of this rank's backward and gradient-sync ops, and the
        first OPT of the step all-reduces the squared norm over every rank (its own group,
        made here on every rank alike)."""
        rt = self.rt
        compute = rt.prog.streams.get("compute", [])
        backward = [i.id for i in compute if i.kind in BACKWARD_KINDS]
        syncs = [i.id for lst in rt.prog.streams.values() for i in lst if i.kind in SYNC_KINDS]
        opts = [k for k, i in enumerate(compute) if i.kind == "OPT"]
        last_backward = max((k for k, i in enumerate(compute) if i.kind in BACKWARD_KINDS), default=-1)
        if opts and min(opts) < last_backward:
            raise PlanError("--clip-grad-norm needs every backward before the first OPT in the compute order")
        rt.prog.streams["compute"] = [
            dataclasses.replace(i, deps=list(dict.fromkeys([*i.deps, *backward, *syncs]))) if i.kind == "OPT" else i
            for i in compute]
        world = tuple(range(rt.plan.world_size))
        key = ("clip", world)
        if key not in rt.comms.groups:
            rt.comms.groups[key] = dist.new_group(list(world), timeout=timedelta(seconds=rt.timeout_s))
        self.clip_group = rt.comms.groups[key]

    def grad_norm(self):
        """The global gradient norm (sum of squares over every shard and stage, all ranks); a
        generator that yields the all-reduce's work."""
        sq = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        if self.norm_weights is None:  # the other axes' shares (`Axis.norm_share`), once
            def share(name: str) -> float:
                return math.prod(axis.norm_share(name) for axis in self.rt.axes)
            self.norm_weights = {key: fp.norm_weights(share) for key, fp in self.flats.items()}
        for key, fp in self.flats.items():
            if fp.counts_in_norm():
                g = fp.stepped_grad()
                w = self.norm_weights[key]
                if w is None:
                    sq += torch.dot(g.float(), g.float()).double() if g.numel() else 0.0
                else:
                    sq += torch.dot(g.double() * g.double(), w)
        yield dist.all_reduce(sq, group=self.clip_group, async_op=True)
        return float(sq.sqrt())

    def _build_flats(self, zero: int) -> dict[tuple[int, str], FlatParams]:
        rt = self.rt
        syncs: dict[tuple[int, str], list[Instruction]] = {}
        for lst in rt.prog.streams.values():
            for ins in lst:
                if is_grad_sync(ins):
                    syncs.setdefault((ins.stage, flat_tag(ins)), []).append(ins)
        unit_buckets = rt.header.zero3_buckets
        if zero == 3 and syncs and unit_buckets is None:
            raise PlanError("this ZeRO-3 plan predates per-unit gathers (no meta.zero3_buckets); recompile it")
        flats = {}
        for s, stage in sorted(rt.stages.items()):
            dense, experts = stage.named_parameters()
            for tag, named in (("", dense), (".e", experts)):
                if not named:
                    continue
                ops = syncs.get((s, tag), [])
                # hybrid sharding: the reduce-scatters (shard group) cut the buffer; the
                # all-reduces of the reduced shards cross the replicas (`sync`)
                ops = [i for i in ops if i.kind == "REDUCE_SCATTER"] or ops
                group = group_ranks(ops[0].group) if ops else ()
                sync = "none" if not ops else "allreduce" if ops[0].kind == "ALLREDUCE" else "shard"
                numels = None
                if zero == 3 and ops:
                    named, numels = _by_bucket(named, unit_buckets[s][tag])
                elif ops:
                    numels = _cuts(sum(p.numel() for _, p in named), ops)
                n_buckets = len({i.bucket for i in ops})  # RS: one per bucket and micro-batch
                flats[(s, tag)] = FlatParams(
                    key=f"s{s}{tag}" + (f".ep{rt.ep_index}" if tag else ""), names=[n for n, _ in named],
                    params=[p for _, p in named], n_buckets=max(n_buckets, 1), group=group, sync=sync,
                    index=group.index(rt.rank) if group else 0, zero=zero,
                    stream=ops[0].stream if ops else "dp", bucket_numels=numels)
        return flats

    def _bucket_parts(self) -> dict[tuple[int, str, int], list[int]]:
        """ZeRO-3: the pieces of its stage that use each bucket, in piece order."""
        out: dict[tuple[int, str, int], list[int]] = {}
        parts = self.rt.header.stage_parts
        for s, by_tag in enumerate(self.rt.header.zero3_buckets or []):
            for tag, buckets in by_tag.items():
                for b, segs in enumerate(buckets):
                    out[(s, tag, b)] = [i for i, piece in enumerate(parts[s]) if set(piece) & set(segs)]
        return out

    def _setup_grad_overlap(self) -> None:
        """Bucket -> the parameters it covers (slices of the flat buffer; ZeRO-3's
        per-unit buckets already reduce right after their unit's backward), and a
        post-accumulate hook on each that tells the runtime a gradient is final. On CUDA the
        backward's hooks run on autograd's device thread: off until tested there."""
        self.overlap_grads = os.environ.get("PIPER_OVERLAP_GRADS", "0" if self.rt.cuda else "1") == "1"
        self.bucket_members: dict[tuple[int, str, int], set[int]] = {}
        self.param_buckets: dict[int, list[tuple[tuple[int, str, int], FlatParams]]] = {}
        self.running: tuple[str, set[int]] | None = None  # (backward op id, params it writes)
        self.running_done: set[int] = set()
        self.early_streams = sorted({i.stream for lst in self.rt.prog.streams.values() for i in lst
                                     if i.kind in SYNC_KINDS and i.dep_progress < 1.0})
        if not self.overlap_grads or not self.early_streams:
            return
        for (s, tag), fp in self.flats.items():
            if fp.sync == "none" or fp.per_bucket:
                continue
            for b in range(fp.n_buckets):
                members = fp.params_in_bucket(b)
                self.bucket_members[(s, tag, b)] = {id(p) for p in members}
                for p in members:
                    self.param_buckets.setdefault(id(p), []).append(((s, tag, b), fp))
        for fp in self.flats.values():
            for p in fp.params:
                if id(p) in self.param_buckets:
                    p.register_post_accumulate_grad_hook(self.grad_ready)

    def _setup_param_gates(self) -> None:
        """ZeRO-1/2 with overlapped parameter gathers (plan ALL_GATHERs with ``needed_by``): the
        step starts by gathering the shards the previous step's optimizer updated, and the
        forward waits for a bucket's gather just before the first module using it (a zoo
        stage's per-layer hook; other stages wait for all of them before their first forward).
        After the last step (and before a check or checkpoint) `gather_parameters` does the
        gathers the next step would have done."""
        self.gates = [i for lst in self.rt.prog.streams.values() for i in lst if i.kind == "ALL_GATHER" and i.needed_by]
        self.gate_streams = sorted({i.stream for i in self.gates})
        self.gate_ids: dict[str, list[str]] = {}  # compute op id -> the gathers it waits for
        self.param_gates: dict[int, list[str]] = {}  # id(parameter) -> gathers writing it
        self.params_stale = False
        self.gates_open: set[str] = set()  # gathers waited for this step (CUDA: by the compute stream)
        for ins in self.gates:
            self.gate_ids.setdefault(ins.needed_by, []).append(ins.id)
            for p in self.flats[(ins.stage, flat_tag(ins))].params_in_bucket(ins.bucket):
                self.param_gates.setdefault(id(p), []).append(ins.id)
        self.gated_stages = {s for s, stage in self.rt.stages.items() if hasattr(stage, "before_step")}
        if self.param_gates:
            for s in self.gated_stages:
                self.rt.stages[s].before_step = self.await_params

    # ------------------------------------------------------------------ step hooks
    def begin_step(self) -> None:
        self.releases = {}
        self.gates_open = set()
        if self.gate_ids:  # the previous step's parameter gathers go out before any compute
            self._issue_gathers()

    def before_issue(self, ins: Instruction) -> None:
        if ins.id in self.gate_ids and ins.stage not in self.gated_stages:
            self._await_gathers(set(self.gate_ids[ins.id]))  # a stage without per-module hooks

    def end_step(self) -> None:
        self.params_stale = bool(self.gate_ids)  # this step's updates are gathered by the next

    def leftovers(self) -> list[Any]:
        return [self.releases] if self.releases else []

    # ------------------------------------------------------------------ parameter gathers
    def await_params(self, params) -> None:
        """Before a forward step: wait for the gathers of these parameters (issuing them if
        their stream has not yet)."""
        if len(self.gates_open) == len(self.gates):
            return
        self._await_gathers({g for p in params for g in self.param_gates.get(id(p), ())})

    def _await_gathers(self, ids: set[str]) -> None:
        rt = self.rt
        ids = ids - self.gates_open
        if not ids:
            return
        self._issue_gathers()
        while any(g not in rt.done for g in ids):
            token, t_end, err = rt.wait_any(rt.prog.streams, rt.ptr)
            rt.completed(token, t_end, err)
        if rt.cuda:  # the compute stream waits for the gathers' streams
            for g in ids:
                torch.cuda.current_stream(rt.device).wait_event(rt.cuda_events[g][1])
        self.gates_open |= ids

    def _issue_gathers(self) -> None:
        """Issue every overlapped gather heading its stream (all in flight at once: later
        buckets arrive while the forward runs)."""
        rt = self.rt
        for name in self.gate_streams:
            lst = rt.prog.streams[name]
            while rt.ptr[name] < len(lst) and name not in rt.busy:
                head = lst[rt.ptr[name]]
                if not head.needed_by or any(d not in rt.done for d in head.deps):
                    break
                rt.ptr[name] += 1
                rt.issue(head)

    def gather_parameters(self) -> None:
        """Bring the full parameters up to date after a step whose gathers are overlapped
        with the next step's forward (no-op otherwise): every gated bucket all-gathered now,
        in plan order on every rank."""
        if not self.params_stale:
            return
        for posted in [self.gather(ins) for ins in self.gates]:
            posted.work.wait()
        self.params_stale = False

    # ------------------------------------------------------------------ gradient overlap
    def grad_ready(self, p) -> None:
        """A parameter's gradient is final for the running backward op: issue the head of
        each gradient-sync stream whose bucket is complete now, in plan order."""
        if self.running is None or id(p) not in self.running[1]:
            return
        rt = self.rt
        self.running_done.add(id(p))
        running_id, writes = self.running
        for name in self.early_streams:
            lst = rt.prog.streams[name]
            while rt.ptr[name] < len(lst) and name not in rt.busy:
                ins = lst[rt.ptr[name]]
                if ins.kind not in SYNC_KINDS or ins.dep_progress >= 1.0 \
                        or running_id not in ins.deps or any(d not in rt.done for d in ins.deps if d != running_id):
                    break
                members = self.bucket_members.get((ins.stage, flat_tag(ins), ins.bucket))
                if members is None or not (members & writes) <= self.running_done:
                    break
                rt.ptr[name] += 1
                rt.issue(ins)

    def writing(self, op_id: str, params) -> _Running:
        """While backward op ``op_id`` writes the gradients of ``params``."""
        return _Running(self, op_id, {id(p) for p in params} if self.bucket_members else set())

    def weight_hook(self):
        """What `backward_weight` calls as each gradient is final (None: nothing overlaps)."""
        return self.grad_ready if self.bucket_members else None

    # ------------------------------------------------------------------ ZeRO-3 storage
    def grads_for(self, s: int, parts) -> None:
        """ZeRO-3: gradient storage for the buckets the backward of these pieces writes (the
        last went to a reduce-scatter)."""
        for (st, tag), fp in self.flats.items():
            if st == s and fp.per_bucket:
                for b in range(fp.n_buckets):
                    if set(self.bucket_parts[(s, tag, b)]) & set(parts):
                        fp.grad_acquire(b)

    def release(self, letter: str, s: int, m: int, part: int) -> None:
        """ZeRO-3: drop the units whose last user in this pass was piece ``part``."""
        for fp, b in self.releases.pop((letter, s, m, part), []):
            fp.release(b)

    # ------------------------------------------------------------------ instructions
    def sync(self, ins: Instruction) -> Posted:
        fp = self.flats[(ins.stage, flat_tag(ins))]
        b = ins.bucket
        pg = self.rt.comms.group(ins.stream, ins.group)
        if ins.kind == "ALLREDUCE" and fp.sync == "shard":  # hybrid sharding: the reduced shard, over its replicas
            return Posted(dist.all_reduce(fp.shard_grad_piece(b), group=pg, async_op=True))
        if ins.kind == "ALLREDUCE":
            return Posted(dist.all_reduce(fp.grad_bucket(b), group=pg, async_op=True))
        # the bucket's gradients so far go (the bucket restarts from zero); their reduced
        # shard is added to the shard's gradient, which sums the step's micro-batches
        send = self._take_grads_in_compute_order(ins, fp, b)
        work, out = reduce_scatter_flat(send, fp.index, len(fp.group), group=pg, async_op=True)
        return Posted(work, lambda: fp.add_shard_grad(b, out))

    def _take_grads_in_compute_order(self, ins: Instruction, fp: FlatParams, b: int) -> torch.Tensor:
        """CUDA: the take runs on the compute stream, after every backward issued so far
        (a later micro-batch's may already add to the bucket: that goes too), and the
        reduce-scatter's stream waits for it."""
        if not self.rt.cuda:
            return fp.take_grad_bucket(b, last=ins.mb < 0)
        compute, mine = self.rt.cuda_streams["compute"], self.rt.cuda_streams[ins.stream]
        with torch.cuda.stream(compute):
            send = fp.take_grad_bucket(b, last=ins.mb < 0)
        mine.wait_stream(compute)
        send.record_stream(mine)
        return send

    def gather(self, ins: Instruction) -> Posted:
        s, tag, b = ins.stage, flat_tag(ins), ins.bucket
        fp = self.flats[(s, tag)]
        if ins.direction:  # ZeRO-3: gather a unit for one forward / backward, dropped after the last piece using it
            fp.acquire(b)
            users = self.bucket_parts[(s, tag, b)]
            last = users[-1] if ins.direction == "F" else users[0]
            self.releases.setdefault((ins.direction, s, ins.mb, last), []).append((fp, b))  # mb: the consumer's
        pg = self.rt.comms.group(ins.stream, ins.group)
        return Posted(all_gather_flat(fp.bucket(b), fp.shard_piece(b), fp.index, len(fp.group), group=pg,
                                      async_op=True))


def _cuts(numel: int, syncs: list[Instruction]) -> list[int] | None:
    """Elements of each gradient bucket, in proportion to the plan's bucket bytes (the
    compiler's cuts, `piper_sim.ir._buckets`); None when they are equal (FlatParams' equal
    slices, the layout of checkpoints saved before uneven buckets)."""
    size = {i.bucket: i.bytes for i in syncs}
    if len(set(size.values())) == 1:
        return None
    total = sum(size.values())
    ends = itertools.accumulate(size[b] for b in range(len(size)))
    bounds = [0, *(round(numel * e / total) for e in ends)]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _by_bucket(named: list[tuple[str, Any]], buckets: list[list[str]]) -> tuple[list[tuple[str, Any]], list[int]]:
    """Parameters reordered bucket by bucket (a bucket lists segment names, e.g.
    ``layers.3`` or ``layers.3.pre``; a parameter belongs to its unit) and each bucket's
    element count."""
    unit_bucket = {}
    for b, segs in enumerate(buckets):
        for seg in segs:
            unit_bucket[".".join(seg.split(".")[:2]) if seg.startswith(("layers.", "mtp.")) else seg] = b

    def bucket_of(name: str) -> int:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else parts[0]
        key = "mtp.0" if key == "mtp_embed" else key  # the embedding's copy counts in mtp.0 (compiler.stage_costs)
        if key not in unit_bucket:  # a user model's unit: the unit path the name starts with
            key = max((u for u in unit_bucket if name.startswith(u + ".")), key=len)
        return unit_bucket[key]

    ordered = sorted(named, key=lambda kv: bucket_of(kv[0]))  # stable: model order inside a bucket
    numels = [0] * len(buckets)
    for name, p in ordered:
        numels[bucket_of(name)] += p.numel()
    return ordered, numels


class _Running:
    """While a backward op runs: the parameters it writes, for `DataParallel.grad_ready`."""

    def __init__(self, dp: DataParallel, op_id: str, params: set[int]):
        self.dp, self.op_id, self.params = dp, op_id, params

    def __enter__(self):
        if self.params:
            self.dp.running, self.dp.running_done = (self.op_id, self.params), set()
        return self

    def __exit__(self, *exc):
        self.dp.running = None
        return False
