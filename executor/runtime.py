"""The per-rank runtime: replay one rank's instruction lists with torch.distributed.

One issuing thread walks all of the rank's streams and issues, in each stream's order, the
instructions whose dependencies are done: every ready one of each communication stream
first (they are asynchronous), then one compute op, then looks again. Compute runs
synchronously on this thread; communication is posted as async work (``isend``/``irecv``,
``all_reduce(async_op=True)``...) and is *done* when the backend reports completion, so it
overlaps with the compute that follows, like a stream. Nothing here knows the schedule's
name: the plan's lists and dependencies are the whole program. On CUDA each plan stream is
a CUDA stream, dependencies are CUDA events and communication is done as soon as it is
enqueued (its stream waits for it).

Instruction semantics (op ids from ``piper_sim.ir.op_id``; readable names only: what an op
does is in its typed fields ``stage``, ``mb``, ``part``, ``direction``, ``bucket``,
``experts``, ``block``, ``a2a``, never parsed from the id):
  F.s{s}.mb{m}[.p{i}]     forward of stage s (piece i) on micro-batch m
  B / BI .s{s}.mb{m}[.p{i}]  full backward / backward to inputs only of that piece
  BW.s{s}.mb{m}           weight gradients of every piece, from what BI kept
  OPT.s{s}                AdamW step of the stage's parameters (its shard under ZeRO)
  SEND/RECV.F.s{s}.mb{m}  stage s output -> stage s+1;  SEND/RECV.B.s{s}.mb{m}: grad of
                          stage s input -> stage s-1
  AR/RS/AG.s{s}[.e].b{b}  bucket b of the stage's flat gradients / parameters
  RS.s{s}.mb{m}|.i{i}[.e].b{b}  ZeRO-2/3: bucket b's gradients of micro-batch m (of the i-th
                          backward of the stage here, when it has several copies), reduce-
                          scattered into the shard's gradient, which sums the step's micro-batches
  AG.F|B.s{s}.i{i}[.e].b{b}  ZeRO-3 gather of bucket b (a unit: ``meta["zero3_buckets"]``)
                          before the i-th forward / backward of the stage here (``mb`` names
                          the consumer's micro-batch); dropped after the last piece using it
                          (a BI piece too: BW reads activations and gradients, not weights)

Recomputation (``meta["recompute"]``: stage -> mode): ``full`` checkpoints every layer /
expert block / head of the forward (``torch.utils.checkpoint``; a B recomputes them one at
a time; a BI runs its piece's forward again and keeps that graph for BW); ``selective``
checkpoints the attention cores only.
  A2A.F|B.s{s}.mb{m}.e{e}.dispatch|combine  expert-parallel token exchange
  TP.F|B|R.s{s}.mb{m}.{name}  a tensor-parallel collective: performed inside the stage's modules
                          (``executor.tensor_parallel``) during the piece before it; the op takes
                          the next one logged in that pass (R: a full recompute's, in the B pass),
                          checks its name and kind and records its measured times
  TP.s{s}.norms           sequence parallel: all-reduce of the stage's replicated gradients (norms)
                          over the TP group; the stage's gradient syncs wait for it
  CP.F|B|R.s{s}.mb{m}.l{l}.kv.ag|dkv.rs  a context-parallel K/V collective (or ring): performed
                          by the layer's attention (``executor.context_parallel``) inside its piece,
                          which the op waits for (the plan issues gathers before the piece); matched
                          like a TP op
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from executor.context_parallel import CP_STREAM, CPComm, context_stage, is_cp, reorder_after_pieces
from executor.collectives import Comms, Completions, all_gather_flat, group_ranks, reduce_scatter_flat
from executor.data import SyntheticData
from executor.lr import LRSchedule
from executor.stage import (FlatParams, Record, Stage, backward_full, backward_input, backward_weight,
                            set_lr)
from costmodel.dtypes import torch_dtype
from executor.tensor_parallel import TP_STREAM, Logged, TPComm, TPShard, is_tp, shard_stage, sharded_units
from executor.user_stage import UserData, UserStage, user_model_of
from piper_sim.models import config_from_meta
from piper_sim.plan import BACKWARD_KINDS, COMPUTE_KINDS, Instruction, Plan, PlanError, missing_fields

A2A_MIRROR = {"dispatch": "combine", "combine": "dispatch"}


def flat_tag(ins: Instruction) -> str:
    """Key suffix of the flat parameters a bucket op works on: "" dense, ".e" the expert shard."""
    return ".e" if ins.experts else ""


class InstructionError(RuntimeError):
    """An instruction failed on this rank; the message names the rank and the instruction."""

    def __init__(self, rank: int, step: int, ins: Instruction | None, cause: BaseException | str):
        what = f"instruction {ins.id} ({ins.kind}, stream {ins.stream})" if ins else "between instructions"
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"rank {rank}: step {step}: {what} failed: {detail}")
        self.rank, self.step, self.op_id = rank, step, ins.id if ins else ""


@dataclass
class Fault:
    """``PIPER_FAULT=rank:step:op_id[:raise|kill|hang]``: misbehave right before that op."""

    rank: int
    step: int
    op_id: str
    mode: str = "raise"

    @classmethod
    def from_env(cls) -> "Fault | None":
        spec = os.environ.get("PIPER_FAULT", "")
        if not spec:
            return None
        parts = spec.split(":")
        if len(parts) not in (3, 4) or parts[-1 if len(parts) == 4 else 0] == "":
            raise ValueError(f"PIPER_FAULT={spec!r}: expected rank:step:op_id[:raise|kill|hang]")
        mode = parts[3] if len(parts) == 4 else "raise"
        if mode not in ("raise", "kill", "hang"):
            raise ValueError(f"PIPER_FAULT mode {mode!r}: expected raise, kill or hang")
        return cls(int(parts[0]), int(parts[1]), parts[2], mode)


@dataclass
class Posted:
    """Async work an instruction posted, and what to do on the issuing thread when it ends."""

    work: Any
    then: Callable[[], None] | None = None


@dataclass
class MicroBatch:
    """Tensors of one (stage, micro-batch) between its forward and its backward."""

    vals: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    records: dict[str, Record] = field(default_factory=dict)
    targets: torch.Tensor | None = None
    backward_started: bool = False


@dataclass
class StepResult:
    step: int
    loss: float
    time_s: float
    events: list[dict[str, Any]]
    grad_norm: float | None = None  # global gradient norm before clipping (--clip-grad-norm)


class Runtime:
    """Everything one rank needs to run a plan's steps. ``record_ops``: wrap each plan op in
    ``torch.profiler.record_function(op_id)`` (``run --profile``), so profiled kernels join
    to plan ops."""

    record_ops = False

    def __init__(self, plan: Plan, rank: int, comms: Comms, device: torch.device,
                 timeout_s: float = 60.0, fault: Fault | None = None, clip_grad_norm: float | None = None,
                 lr_schedule: LRSchedule | None = None):
        self.plan, self.rank, self.comms, self.device = plan, rank, comms, device
        self.clip_grad_norm = clip_grad_norm
        self.lr_schedule = lr_schedule  # the learning rate of each step (None: the optimizer's own)
        self.timeout_s, self.fault = timeout_s, fault
        self.cuda = device.type == "cuda"
        self.prog = plan.program(rank)
        for ins in (i for lst in self.prog.streams.values() for i in lst):
            if missing_fields(ins):
                raise PlanError(f"instruction {ins.id} ({ins.kind}) lacks {', '.join(missing_fields(ins))}; "
                                "recompile the strategy")
        meta = plan.meta
        self.user_model = "user_model" in meta  # a user's annotated nn.Module (executor.user_stage)
        self.cfg = user_model_of(meta) if self.user_model else config_from_meta(meta)
        self.dtype = torch_dtype(meta["dtype"])
        self.layout = plan.layout
        self.dp_rank = self.prog.dp_rank
        self.microbatches = meta["microbatches"]
        self.mbs, self.seq = meta["micro_batch_size"], meta["seq_len"]
        # a context-parallel rank's loss is the mean of its s / cp tokens: 1 / cp of the sequence's
        self.loss_scale = 1.0 / (self.microbatches * self.layout.dp * self.layout.cp)
        ep = self.layout.ep
        self.ep_index = self.dp_rank % ep if ep > 1 else 0
        if self.user_model:
            self.data = UserData(self.cfg, self.seq, meta["global_batch"], meta["seed"], self.dtype)
            self.stages = {s: UserStage(self.cfg, s, meta["num_stages"], meta["stage_units"][s],
                                        meta["stage_parts"][s], device, self.dtype, meta["seed"])
                           for s in self.prog.stages}
        else:
            self.data = SyntheticData(self.cfg.vocab, self.seq, meta["global_batch"], meta["seed"])
            self.stages = {s: Stage(self.cfg, s, meta["num_stages"], meta["stage_units"][s], meta["stage_parts"][s],
                                    ep, self.ep_index, device, self.dtype, meta["seed"])
                           for s in self.prog.stages}
        self.tp: TPComm | None = None
        self.tp_shards: dict[int, TPShard] = {}
        if self.layout.tp > 1:
            self._setup_tensor_parallel()
        self.cp: CPComm | None = None
        if self.layout.cp > 1:
            self._setup_context_parallel()
        self.comm_logs = [c for c in (self.tp, self.cp) if c is not None]  # module collectives, logged per pass
        if clip_grad_norm is not None:
            self._setup_clipping()
        self.instructions = [i for lst in self.prog.streams.values() for i in lst]
        self.flats = self._build_flats(meta.get("zero", 0))
        # stage -> "full" | "selective" (plans without the meta field knew only full)
        self.recompute = {int(k): v for k, v in meta["recompute"].items()} if "recompute" in meta else \
            {i.stage: "full" for i in self.instructions if i.recompute}
        for s, stage in self.stages.items():
            stage.set_selective_recompute(self.recompute.get(s) == "selective")
        self.bucket_parts = self._bucket_parts()
        # gradient buckets reduce during the backward that completes them (DDP-style); on
        # CUDA the backward's hooks run on autograd's device thread: off until tested there
        self.overlap_grads = os.environ.get("PIPER_OVERLAP_GRADS", "0" if self.cuda else "1") == "1"
        self._setup_grad_overlap()
        self._setup_param_gates()
        self._handlers: dict[str, Callable[[Instruction], Any]] = {
            "F": self._forward, "B": self._backward, "BI": self._backward, "BW": self._backward_weight,
            "OPT": self._optimizer, "SEND": self._send, "RECV": self._recv, "ALLREDUCE": self._sync,
            "REDUCE_SCATTER": self._sync, "ALL_GATHER": self._gather, "ALL_TO_ALL": self._all_to_all}
        if self.cuda:
            self.cuda_streams = {name: torch.cuda.Stream(device) for name in self.prog.streams}
        self.completions = Completions()
        self.step_index = 0
        self.captured_grads: dict[str, torch.Tensor] = {}
        self.stepped_grads: dict[tuple[int, str], torch.Tensor] = {}  # what each optimizer stepped (capture)

    # ------------------------------------------------------------------ set-up
    def _setup_grad_overlap(self) -> None:
        """Bucket -> the parameters it covers (slices of the flat buffer; ZeRO-3's
        per-unit buckets already reduce right after their unit's backward), and a
        post-accumulate hook on each that tells the runtime a gradient is final."""
        self.bucket_members: dict[tuple[int, str, int], set[int]] = {}
        self.param_buckets: dict[int, list[tuple[tuple[int, str, int], FlatParams]]] = {}
        self.running: tuple[str, set[int]] | None = None  # (backward op id, params it writes)
        self.running_done: set[int] = set()
        self.early_streams = sorted({i.stream for i in self.instructions
                                     if i.kind in ("ALLREDUCE", "REDUCE_SCATTER") and i.dep_progress < 1.0})
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
                    p.register_post_accumulate_grad_hook(self._grad_ready)

    def _setup_param_gates(self) -> None:
        """ZeRO-1/2 with overlapped parameter gathers (plan ALL_GATHERs with ``needed_by``): the
        step starts by gathering the shards the previous step's optimizer updated, and the
        forward waits for a bucket's gather just before the first module using it (a zoo
        stage's per-layer hook; other stages wait for all of them before their first forward).
        After the last step (and before a check or checkpoint) `gather_parameters` does the
        gathers the next step would have done."""
        self.gates = [i for i in self.instructions if i.kind == "ALL_GATHER" and i.needed_by]
        self.gate_streams = sorted({i.stream for i in self.gates})
        self.gate_ids: dict[str, list[str]] = {}  # compute op id -> the gathers it waits for
        self.param_gates: dict[int, list[str]] = {}  # id(parameter) -> gathers writing it
        self.params_stale = False
        self.gates_open: set[str] = set()  # gathers waited for this step (CUDA: by the compute stream)
        for ins in self.gates:
            self.gate_ids.setdefault(ins.needed_by, []).append(ins.id)
            for p in self.flats[(ins.stage, flat_tag(ins))].params_in_bucket(ins.bucket):
                self.param_gates.setdefault(id(p), []).append(ins.id)
        self.gated_stages = {s for s, stage in self.stages.items() if hasattr(stage, "before_step")}
        if self.param_gates:
            for s in self.gated_stages:
                self.stages[s].before_step = self._await_params

    def _await_params(self, params) -> None:
        """Before a forward step: wait for the gathers of these parameters (issuing them if
        their stream has not yet)."""
        if len(self.gates_open) == len(self.gates):
            return
        self._await_gathers({g for p in params for g in self.param_gates.get(id(p), ())})

    def _await_gathers(self, ids: set[str]) -> None:
        ids = ids - self.gates_open
        if not ids:
            return
        self._issue_gathers()
        while any(g not in self.done for g in ids):
            token, t_end, err = self._wait_any(self.prog.streams, self.ptr)
            self._completed(token, t_end, err)
        if self.cuda:  # the compute stream waits for the gathers' streams
            for g in ids:
                torch.cuda.current_stream(self.device).wait_event(self.cuda_events[g][1])
        self.gates_open |= ids

    def _issue_gathers(self) -> None:
        """Issue every overlapped gather heading its stream (all in flight at once: later
        buckets arrive while the forward runs)."""
        for name in self.gate_streams:
            lst = self.prog.streams[name]
            while self.ptr[name] < len(lst) and name not in self.busy:
                head = lst[self.ptr[name]]
                if not head.needed_by or any(d not in self.done for d in head.deps):
                    break
                self.ptr[name] += 1
                self._issue(head)

    def gather_parameters(self) -> None:
        """Bring the full parameters up to date after a step whose gathers are overlapped
        with the next step's forward (no-op otherwise): every gated bucket all-gathered now,
        in plan order on every rank."""
        if not self.params_stale:
            return
        for posted in [self._gather(ins) for ins in self.gates]:
            posted.work.wait()
        self.params_stale = False

    def _grad_ready(self, p) -> None:
        """A parameter's gradient is final for the running backward op: issue the head of
        each gradient-sync stream whose bucket is complete now, in plan order."""
        if self.running is None or id(p) not in self.running[1]:
            return
        self.running_done.add(id(p))
        running_id, writes = self.running
        for name in self.early_streams:
            lst = self.prog.streams[name]
            while self.ptr[name] < len(lst) and name not in self.busy:
                ins = lst[self.ptr[name]]
                if ins.kind not in ("ALLREDUCE", "REDUCE_SCATTER") or ins.dep_progress >= 1.0 \
                        or running_id not in ins.deps or any(d not in self.done for d in ins.deps if d != running_id):
                    break
                members = self.bucket_members.get((ins.stage, flat_tag(ins), ins.bucket))
                if members is None or not (members & writes) <= self.running_done:
                    break
                self.ptr[name] += 1
                self._issue(ins)

    def _writing(self, op_id: str, params) -> "_Running":
        return _Running(self, op_id, {id(p) for p in params} if self.bucket_members else set())

    def _setup_tensor_parallel(self) -> None:
        """Each stage's units that ``shard_tensor`` selected (all by default) become this rank's
        tensor-parallel shard of them (`executor.tensor_parallel`), their collectives on the
        plan's ``tp`` group; the others run whole. Under sequence parallelism the stage's
        gradient syncs also wait for its ``TP.s{S}.norms`` all-reduce, which adds into the
        same gradient buffer (Megatron reduces them before the data-parallel sync)."""
        tp_ops = [i for lst in self.prog.streams.values() for i in lst if is_tp(i)]
        if not tp_ops:  # shard_tensor selected none of this rank's units: they all run whole
            return
        sp = bool(self.plan.meta.get("tensor_parallel", {}).get("sequence_parallel"))
        group = tp_ops[0].group
        self.tp = TPComm(self.comms.group(TP_STREAM, group), self.layout.tp, group_ranks(group).index(self.rank), sp)
        sharded = sharded_units(self.plan.meta)
        for s, stage in self.stages.items():
            self.tp_shards[s] = shard_stage(stage, self.tp, sharded)
        norms = {i.stage: i.id for i in tp_ops if not i.direction}
        if not norms:
            return
        for name, lst in self.prog.streams.items():
            self.prog.streams[name] = [
                dataclasses.replace(i, deps=[*i.deps, norms[i.stage]])
                if i.kind in ("ALLREDUCE", "REDUCE_SCATTER") and not (is_tp(i) or is_cp(i)) and i.stage in norms else i
                for i in lst]

    def _setup_context_parallel(self) -> None:
        """Every stage's attention runs over the plan's ``cp`` group (`executor.context_parallel`);
        the CP ops wait for the pieces that perform their collectives."""
        meta = self.plan.meta
        group = next(i.group for lst in self.prog.streams.values() for i in lst if is_cp(i))
        ranks = group_ranks(group)
        style = meta.get("context_parallel", {}).get("style", "allgather")
        self.cp = CPComm(self.comms.group(CP_STREAM, group), self.layout.cp, ranks.index(self.rank), False,
                         style=style, ranks=ranks, seq_len=self.seq)
        full = {int(s) for s, mode in meta.get("recompute", {}).items() if mode == "full"}
        for s, stage in self.stages.items():
            context_stage(stage, self.cp, keep=s in full)
        reorder_after_pieces(self.prog.streams, meta["stage_parts"])

    def reference_view(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of a reference parameter this rank holds (its tensor-parallel slice)."""
        for shard in self.tp_shards.values():
            if name in shard.slices:
                return shard.reference_view(name, full)
        return full

    def _setup_clipping(self) -> None:
        """Clipping by the global norm needs every gradient of the step before any update:
        each OPT also waits for all of this rank's backward and gradient-sync ops, and the
        first OPT of the step all-reduces the squared norm over every rank (its own group,
        made here on every rank alike)."""
        compute = self.prog.streams.get("compute", [])
        backward = [i.id for i in compute if i.kind in BACKWARD_KINDS]
        syncs = [i.id for lst in self.prog.streams.values() for i in lst if i.kind in ("ALLREDUCE", "REDUCE_SCATTER")]
        opts = [k for k, i in enumerate(compute) if i.kind == "OPT"]
        last_backward = max((k for k, i in enumerate(compute) if i.kind in BACKWARD_KINDS), default=-1)
        if opts and min(opts) < last_backward:
            raise PlanError("--clip-grad-norm needs every backward before the first OPT in the compute order")
        self.prog.streams["compute"] = [
            dataclasses.replace(i, deps=list(dict.fromkeys([*i.deps, *backward, *syncs]))) if i.kind == "OPT" else i
            for i in compute]
        world = tuple(range(self.plan.world_size))
        key = ("clip", world)
        if key not in self.comms.groups:
            self.comms.groups[key] = dist.new_group(list(world), timeout=timedelta(seconds=self.timeout_s))
        self.clip_group = self.comms.groups[key]

    def _build_flats(self, zero: int) -> dict[tuple[int, str], FlatParams]:
        syncs: dict[tuple[int, str], list[Instruction]] = {}
        for lst in self.prog.streams.values():
            for ins in lst:
                if ins.kind in ("ALLREDUCE", "REDUCE_SCATTER") and ins.bucket >= 0:
                    syncs.setdefault((ins.stage, flat_tag(ins)), []).append(ins)
        unit_buckets = self.plan.meta.get("zero3_buckets")
        if zero == 3 and syncs and unit_buckets is None:
            raise PlanError("this ZeRO-3 plan predates per-unit gathers (no meta.zero3_buckets); recompile it")
        flats = {}
        for s, stage in sorted(self.stages.items()):
            dense, experts = stage.named_parameters()
            for tag, named in (("", dense), (".e", experts)):
                if not named:
                    continue
                ops = syncs.get((s, tag), [])
                group = group_ranks(ops[0].group) if ops else ()
                sync = "none" if not ops else "allreduce" if ops[0].kind == "ALLREDUCE" else "shard"
                numels = None
                if zero == 3 and ops:
                    named, numels = _by_bucket(named, unit_buckets[s][tag])
                elif ops:
                    numels = _cuts(sum(p.numel() for _, p in named), ops)
                n_buckets = len({i.bucket for i in ops})  # RS: one per bucket and micro-batch
                flats[(s, tag)] = FlatParams(
                    key=f"s{s}{tag}" + (f".ep{self.ep_index}" if tag else ""), names=[n for n, _ in named],
                    params=[p for _, p in named], n_buckets=max(n_buckets, 1), group=group, sync=sync,
                    index=group.index(self.rank) if group else 0, zero=zero,
                    stream=ops[0].stream if ops else "dp", bucket_numels=numels)
        return flats

    def _bucket_parts(self) -> dict[tuple[int, str, int], list[int]]:
        """ZeRO-3: the pieces of its stage that use each bucket, in piece order."""
        out: dict[tuple[int, str, int], list[int]] = {}
        parts = self.plan.meta["stage_parts"]
        for s, by_tag in enumerate(self.plan.meta.get("zero3_buckets") or []):
            for tag, buckets in by_tag.items():
                for b, segs in enumerate(buckets):
                    out[(s, tag, b)] = [i for i, piece in enumerate(parts[s]) if set(piece) & set(segs)]
        return out

    def stage_flats(self, s: int) -> list[FlatParams]:
        return [fp for (st, _), fp in sorted(self.flats.items()) if st == s]

    # ------------------------------------------------------------------ the step
    def run_step(self, step: int, capture_grads: bool = False) -> StepResult:
        """Run every instruction of this rank once; returns the global mean loss."""
        self.step_index, self.capture = step, capture_grads
        self.envs: dict[tuple[int, int], MicroBatch] = {}
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.releases: dict[tuple[str, int, int, int], list[tuple[FlatParams, int]]] = {}
        self.inflight: dict[str, tuple[Instruction, Any]] = {}
        self.done: set[str] = set()
        self.busy: dict[str, str] = {}
        self.times: dict[str, list[float]] = {}
        self.issue_s: dict[str, float] = {}  # async op -> seconds this thread spent posting it
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.clip_coef: float | None = None
        self.grad_norm: float | None = None
        self.gates_open = set()
        if self.lr_schedule is not None:
            set_lr([fp.optimizer for fp in self.flats.values()], self.lr_schedule(step))
        for fp in self.flats.values():
            fp.zero_grad()
        if self.cuda:
            self.cuda_events: dict[str, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
            self.start_events: dict[str, torch.cuda.Event] = {}
            self.t0_event = torch.cuda.Event(enable_timing=True)
            self.t0_event.record()
        self.t0 = time.perf_counter()
        streams = self.prog.streams
        order = sorted(streams, key=lambda n: n == "compute")  # communication first
        ptr = self.ptr = dict.fromkeys(streams, 0)
        total = sum(len(lst) for lst in streams.values())
        current: Instruction | None = None
        try:
            if self.gate_ids:  # the previous step's parameter gathers go out before any compute
                self._issue_gathers()
            while len(self.done) < total:
                for token, t_end, err in self.completions.poll():
                    current = self.inflight[token[1]][0]
                    self._completed(token, t_end, err)
                issued = stop = False
                for name in order:
                    lst = streams[name]
                    # a communication stream issues every ready op before the next compute op
                    # (which blocks this thread): a gather the plan lets start when a piece
                    # ends does not wait for one more piece. Compute issues one op.
                    while not stop and ptr[name] < len(lst) and name not in self.busy \
                            and all(d in self.done for d in lst[ptr[name]].deps):
                        current = lst[ptr[name]]
                        ptr[name] += 1
                        self._issue(current)
                        issued = True
                        # a matched TP op is done at once and may free a SEND: look at every comm
                        # stream again before the next compute op (which may block in a TP collective)
                        stop = name == "compute" or ((is_tp(current) or is_cp(current)) and current.id in self.done)
                    if stop:
                        break
                if not issued and len(self.done) < total:
                    token, t_end, err = self._wait_any(streams, ptr)
                    current = self.inflight[token[1]][0]
                    self._completed(token, t_end, err)
            current = None
            self.params_stale = bool(self.gate_ids)  # this step's updates are gathered by the next
            loss = self.loss_sum.clone()
            dist.all_reduce(loss)
            loss /= self.layout.tp  # every member of a tensor-parallel group computes the loss
        except InstructionError:
            raise
        except BaseException as e:  # noqa: BLE001 - name the rank and the instruction
            if isinstance(e, KeyboardInterrupt):
                raise
            raise InstructionError(self.rank, step, current, e) from e
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.t0
        leftovers = [k for k in (self.envs, self.received, self.input_grads, self.inflight, self.releases) if k]
        for log in self.comm_logs:
            if extra := log.leftover():
                leftovers.append(f"{log.WHAT} collectives the plan does not list: {extra[:3]}")
        if leftovers:
            raise InstructionError(self.rank, step, None, f"state left over after the step: {leftovers}")
        return StepResult(step, float(loss), elapsed, self._events(), self.grad_norm)

    def _wait_any(self, streams, ptr) -> tuple[Any, float, BaseException | None]:
        import queue

        try:
            return self.completions.get(timeout=self.timeout_s)
        except queue.Empty:
            waiting = ", ".join(self.inflight) or "nothing"
            heads = ", ".join(f"{n}: {lst[ptr[n]].id}" for n, lst in streams.items() if ptr[n] < len(lst))
            raise TimeoutError(f"no progress for {self.timeout_s:.0f} s; in flight: {waiting}; "
                               f"next per stream: {heads}") from None

    # ------------------------------------------------------------------ issuing
    def _issue(self, ins: Instruction) -> None:
        if self.fault and self.fault.rank == self.rank and self.fault.step == self.step_index \
                and self.fault.op_id == ins.id:
            self._inject(ins)
        if ins.id in self.gate_ids and ins.stage not in self.gated_stages:
            self._await_gathers(set(self.gate_ids[ins.id]))  # a stage without per-module hooks
        self.times[ins.id] = [self._now()]
        with self._on_stream(ins, first=True), self._range(ins):
            out = self._tp_op(ins) if is_tp(ins) else self._cp_op(ins) if is_cp(ins) else self._handlers[ins.kind](ins)
        if isinstance(out, Logged):  # a collective a module performed: its measured times
            self.times[ins.id][0] = out.start - self.t0
            self._finish(ins, out.end)
        elif inspect.isgenerator(out):
            self.busy[ins.stream] = ins.id
            self._advance(ins, out)
        elif isinstance(out, Posted):
            self._post(ins, out.work, ("done", ins.id), out.then)
            self.issue_s[ins.id] = self._now() - self.times[ins.id][0]
        else:
            self._finish(ins, None)

    def _advance(self, ins: Instruction, gen) -> None:
        try:
            with self._on_stream(ins), self._range(ins):
                work = next(gen)
        except StopIteration as stop:
            self.busy.pop(ins.stream, None)
            if isinstance(stop.value, Posted):
                self._post(ins, stop.value.work, ("done", ins.id), stop.value.then)
            else:
                self._finish(ins, None)
            return
        self._post(ins, work, ("resume", ins.id), gen)

    def _post(self, ins: Instruction, work, token: tuple[str, str], then) -> None:
        self.inflight[ins.id] = (ins, then)
        if self.cuda:  # enqueued is done: the op's stream waits for it, dependents for the stream
            with self._on_stream(ins):
                work.wait()
            self._completed(token, None, None)
        else:
            self.completions.watch(work, token)

    def _completed(self, token: tuple[str, str], t_end: float | None, err: BaseException | None) -> None:
        ins, then = self.inflight.pop(token[1])
        if err is not None:
            raise InstructionError(self.rank, self.step_index, ins, err)
        if token[0] == "resume":
            self._advance(ins, then)
            return
        if then is not None:
            with self._on_stream(ins):
                then()
        self._finish(ins, t_end)

    def _finish(self, ins: Instruction, t_end: float | None) -> None:
        self.times[ins.id].append(self._now() if t_end is None else t_end - self.t0)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.cuda_streams[ins.stream])
            self.cuda_events[ins.id] = (self.start_events.pop(ins.id), end)
        self.done.add(ins.id)

    def _range(self, ins: Instruction):
        return torch.profiler.record_function(ins.id) if self.record_ops else _NULL

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _on_stream(self, ins: Instruction, first: bool = False):
        """CUDA: the op's stream, made to wait for the events of its dependencies."""
        if not self.cuda:
            return _NULL
        stream = self.cuda_streams[ins.stream]
        if first:
            for d in ins.deps:
                stream.wait_event(self.cuda_events[d][1])
            self.start_events[ins.id] = torch.cuda.Event(enable_timing=True)
            self.start_events[ins.id].record(stream)
        return torch.cuda.stream(stream)

    def _for_compute(self, buf: torch.Tensor) -> torch.Tensor:
        """CUDA: a buffer filled on a comm stream and read on the compute stream must not be
        reused by the caching allocator before the compute stream is done with it."""
        if self.cuda and "compute" in self.cuda_streams:
            buf.record_stream(self.cuda_streams["compute"])
        return buf

    def _inject(self, ins: Instruction) -> None:
        where = f"rank {self.rank} step {self.step_index} before {ins.id}"
        print(f"piper-sim executor: PIPER_FAULT: injecting {self.fault.mode} on {where}", file=sys.stderr,
              flush=True)
        if self.fault.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault.mode == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault (PIPER_FAULT) on {where}")

    # ------------------------------------------------------------------ compute
    def _microbatch(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and targets of micro-batch ``m`` (a context-parallel rank: its chunks of them)."""
        tokens, targets = self.data.microbatch(self.step_index, self.dp_rank, self.layout.dp, self.microbatches, m,
                                               self.device)
        if self.cp is not None:
            idx = self.cp.positions().to(tokens.device)
            tokens, targets = tokens[:, idx], targets[:, idx]
        return tokens, targets

    def _forward(self, ins: Instruction) -> None:
        s, m, part = ins.stage, ins.mb, ins.part
        stage = self.stages[s]
        if part == 0:
            env = self.envs[(s, m)] = MicroBatch()
            if stage.is_first:
                env.vals["tokens"] = self._microbatch(m)[0]
            else:
                x = self.received.pop(("F", s - 1, m), None)
                env.vals["x"] = x if x is not None else self.envs[(s - 1, m)].vals["x"]
            if stage.is_last:
                env.targets = self._microbatch(m)[1]
        env = self.envs[(s, m)]
        for log in self.comm_logs:
            log.phase = ("F", s, m)
        rec = stage.forward_piece(part, env.vals, env.meta, env.targets, self.loss_scale,
                                  checkpoint=self.recompute.get(s) == "full")
        env.records[f"p{part}"] = rec
        if "loss" in rec.outputs:
            self.loss_sum += rec.outputs["loss"].detach().float()
        self._release("F", s, m, part)

    def _backward_env(self, s: int, m: int) -> MicroBatch:
        """The micro-batch's state, seeded with the gradient of the stage output the first
        time a backward op of (s, m) runs."""
        env = self.envs[(s, m)]
        if not env.backward_started:
            env.backward_started = True
            if self.stages[s].is_last:
                env.grads["loss"] = None
            else:
                g = self.received.pop(("B", s + 1, m), None)
                env.grads["x"] = g if g is not None else self.input_grads.pop((s + 1, m))
        return env

    @staticmethod
    def _take_grads(env: MicroBatch, rec: Record) -> dict[str, torch.Tensor | None]:
        return {n: env.grads.pop(n) for n in list(rec.outputs) if n in env.grads}

    def _backward(self, ins: Instruction) -> None:
        s, m, part = ins.stage, ins.mb, ins.part
        env = self._backward_env(s, m)
        split = ins.kind == "BI"
        for log in self.comm_logs:
            log.phase = ("B", s, m)
        rec = env.records[f"p{part}"] if split else env.records.pop(f"p{part}")
        if split and self.recompute.get(s) == "full":  # run the forward again; BW uses this graph
            rec = self.stages[s].forward_piece(part, dict(rec.inputs), env.meta, env.targets, self.loss_scale)
            env.records[f"p{part}"] = rec
        if not split:
            self._grads_for(s, [part])
            with self._writing(ins.id, rec.params):
                env.grads.update(backward_full(rec, self._take_grads(env, rec)))
        else:
            env.grads.update(backward_input(rec, self._take_grads(env, rec)))
        self._release("B", s, m, part)  # BW needs no weights: a BI drops its units too
        if part == 0:
            if s > 0:
                self.input_grads[(s, m)] = env.grads.pop("x")
            if not split:
                del self.envs[(s, m)]

    def _backward_weight(self, ins: Instruction) -> None:
        env = self.envs.pop((ins.stage, ins.mb))
        self._grads_for(ins.stage, range(len(self.plan.meta["stage_parts"][ins.stage])))
        with self._writing(ins.id, [p for rec in env.records.values() for p in rec.params]):
            for rec in env.records.values():
                backward_weight(rec, self._grad_ready if self.bucket_members else None)

    def _optimizer(self, ins: Instruction):
        if self.clip_grad_norm is not None and self.clip_coef is None:
            return self._clip_then_step(ins)
        self._step_stage(ins)
        return None

    def _clip_then_step(self, ins: Instruction):
        """The step's first OPT: global gradient norm (sum of squares over every shard and
        stage, all ranks), the clip coefficient as ``torch.nn.utils.clip_grad_norm_``
        computes it, then this OPT's update."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for fp in self.flats.values():
            if fp.counts_in_norm():
                g = fp.stepped_grad()
                sq += torch.dot(g.float(), g.float()).double() if g.numel() else 0.0
        yield dist.all_reduce(sq, group=self.clip_group, async_op=True)
        norm = float(sq.sqrt())
        self.grad_norm = norm
        self.clip_coef = min(1.0, self.clip_grad_norm / (norm + 1e-6))
        self._step_stage(ins)

    def _step_stage(self, ins: Instruction) -> None:
        for key, fp in sorted(self.flats.items()):
            if key[0] != ins.stage:
                continue
            if self.capture:  # before clipping, as the reference keeps them (`reference.compare_grads`)
                self.stepped_grads[key] = fp.stepped_grad().detach().clone()
                if fp.sync != "shard":
                    self.captured_grads.update({n: p.grad.detach().clone() for n, p in zip(fp.names, fp.params)})
            if self.clip_coef is not None and self.clip_coef < 1.0:
                fp.stepped_grad().mul_(self.clip_coef)
            fp.step()

    def _grads_for(self, s: int, parts) -> None:
        """ZeRO-3: gradient storage for the buckets the backward of these pieces writes (the
        last went to a reduce-scatter)."""
        for (st, tag), fp in self.flats.items():
            if st == s and fp.per_bucket:
                for b in range(fp.n_buckets):
                    if set(self.bucket_parts[(s, tag, b)]) & set(parts):
                        fp.grad_acquire(b)

    def _release(self, letter: str, s: int, m: int, part: int) -> None:
        for fp, b in self.releases.pop((letter, s, m, part), []):
            fp.release(b)

    # ------------------------------------------------------------------ communication
    def _send(self, ins: Instruction) -> Posted:
        if ins.direction == "F":
            t = self.envs[(ins.stage, ins.mb)].vals["x"].detach()
        else:
            t = self.input_grads.pop((ins.stage, ins.mb))
        return Posted(dist.isend(t.contiguous(), ins.peer, tag=self.comms.tags[ins.match]))

    def _recv(self, ins: Instruction) -> Posted:
        key = (ins.direction, ins.stage, ins.mb)  # ("F" | "B", sender's stage, mb)
        seq = self.seq // self.layout.cp  # CP: the rank's tokens
        seq = seq // self.layout.tp if self.tp is not None and self.tp.sp else seq  # SP: their shard
        shape, dtype = (self.mbs, seq, self.cfg.hidden), self.dtype
        if self.user_model:  # the boundary tensor after the sending stage (F) or before it (B)
            b = self.plan.meta["user_model"]["boundaries"][ins.stage - (key[0] == "B")]
            shape, dtype = tuple(b["shape"]), getattr(torch, b["dtype"])
        buf = self._for_compute(torch.empty(shape, dtype=dtype, device=self.device))
        work = dist.irecv(buf, ins.peer, tag=self.comms.tags[ins.match])
        return Posted(work, lambda: self.received.__setitem__(key, buf))

    def _tp_op(self, ins: Instruction):
        """A plan TP op: ``TP.s{S}.norms`` all-reduces the stage's replicated gradients here;
        any other is the next collective the stage's modules performed in that pass, which
        must be this one (`executor.tensor_parallel`)."""
        if ins.direction:
            # a full-recompute backward re-runs the forward's collectives (``TP.R.`` ops) inside the B piece
            pas = "B" if ins.direction == "R" else ins.direction
            return self.tp.take((pas, ins.stage, ins.mb), ins.name, ins.kind)
        stage = self.stages[ins.stage]
        params = self.tp_shards[ins.stage].replicated(stage.named_parameters()[0])
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.comms.group(ins.stream, ins.group), async_op=True)

        def then():
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
        return Posted(work, then)

    def _cp_op(self, ins: Instruction) -> Logged:
        """A plan CP op: the next collective the stage's attention performed in that pass
        (``R``: a full recompute's, inside the B pass), which must be this one."""
        pas = "B" if ins.direction == "R" else ins.direction
        return self.cp.take((pas, ins.stage, ins.mb), ins.name, ins.kind)

    def _sync(self, ins: Instruction) -> Posted:
        fp = self.flats[(ins.stage, flat_tag(ins))]
        b = ins.bucket
        pg = self.comms.group(ins.stream, ins.group)
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
        if not self.cuda:
            return fp.take_grad_bucket(b, last=ins.mb < 0)
        compute, mine = self.cuda_streams["compute"], self.cuda_streams[ins.stream]
        with torch.cuda.stream(compute):
            send = fp.take_grad_bucket(b, last=ins.mb < 0)
        mine.wait_stream(compute)
        send.record_stream(mine)
        return send

    def _gather(self, ins: Instruction) -> Posted:
        s, tag, b = ins.stage, flat_tag(ins), ins.bucket
        fp = self.flats[(s, tag)]
        if ins.direction:  # ZeRO-3: gather a unit for one forward / backward, dropped after the last piece using it
            fp.acquire(b)
            users = self.bucket_parts[(s, tag, b)]
            last = users[-1] if ins.direction == "F" else users[0]
            self.releases.setdefault((ins.direction, s, ins.mb, last), []).append((fp, b))  # mb: the consumer's
        pg = self.comms.group(ins.stream, ins.group)
        return Posted(all_gather_flat(fp.bucket(b), fp.shard_piece(b), fp.index, len(fp.group), group=pg,
                                      async_op=True))

    def _all_to_all(self, ins: Instruction):
        direction, s, mb, e = ins.direction, ins.stage, ins.mb, ins.block
        # the forward op this one is (F) or is the backward of (B)
        what = ins.a2a if direction == "F" else A2A_MIRROR[ins.a2a]
        stage = self.stages[s]
        layer = stage.expert_layers[e]
        pg = self.comms.group(ins.stream, ins.group)
        env = self.envs[(s, mb)] if direction == "F" else self._backward_env(s, mb)
        meta, h = env.meta, self.cfg.hidden

        def exchange(src: torch.Tensor, out_splits: list[int], in_splits: list[int], dst: dict, name: str):
            out = self._for_compute(src.new_empty(sum(out_splits), h))
            work = dist.all_to_all_single(out, src.detach().contiguous(), out_splits, in_splits, group=pg,
                                          async_op=True)
            return Posted(work, lambda: dst.__setitem__(name, out))

        if direction == "F" and what == "dispatch":
            return self._dispatch(env, stage, layer, pg)
        sent, got = meta[f"in_splits.{layer}"], meta[f"out_splits.{layer}"]  # per rank, in dispatch
        if direction == "F":  # combine: expert outputs go home, then the weighted sum
            y = env.vals[f"y.{layer}"]
            posted = exchange(y, sent, got, env.vals, f"comb.{layer}")
            store = posted.then

            def then():
                store()
                env.records[f"post.{layer}"] = stage.combine_post(layer, env.vals, meta)
            return Posted(posted.work, then)
        if what == "combine":  # backward of the weighted sum, then its gradient to the experts
            rec = env.records.pop(f"post.{layer}")
            env.grads.update(backward_full(rec, self._take_grads(env, rec)))
            return exchange(env.grads.pop(f"comb.{layer}"), got, sent, env.grads, f"y.{layer}")
        return exchange(env.grads.pop(f"recv.{layer}"), sent, got, env.grads, f"send.{layer}")

    def _dispatch(self, env: MicroBatch, stage: Stage, layer: int, pg):
        """Exchange per-expert token counts, then the tokens themselves."""
        counts = env.meta[f"counts.{layer}"]
        ep, n = self.layout.ep, stage.local_experts
        send_counts = torch.tensor(counts, dtype=torch.int64, device=self.device)
        recv_counts = torch.empty_like(send_counts)
        yield dist.all_to_all_single(recv_counts, send_counts, group=pg, async_op=True)
        rows = recv_counts.view(ep, n).tolist()
        sent = [sum(counts[j * n:(j + 1) * n]) for j in range(ep)]
        got = [sum(r) for r in rows]
        env.meta[f"recv_counts.{layer}"] = rows
        env.meta[f"in_splits.{layer}"], env.meta[f"out_splits.{layer}"] = sent, got
        tokens = env.vals[f"send.{layer}"]
        out = self._for_compute(tokens.new_empty(sum(got), self.cfg.hidden))
        work = dist.all_to_all_single(out, tokens.detach().contiguous(), got, sent, group=pg, async_op=True)
        return Posted(work, lambda: env.vals.__setitem__(f"recv.{layer}", out))

    # ------------------------------------------------------------------ trace rows
    def _events(self) -> list[dict[str, Any]]:
        cuda_times = {}
        if self.cuda:
            cuda_times = {op: (self.t0_event.elapsed_time(a) / 1e3, self.t0_event.elapsed_time(b) / 1e3)
                          for op, (a, b) in self.cuda_events.items()}
        rows = []
        for ins in self.instructions:
            posted, end = self.times[ins.id]
            start = posted
            if ins.id in cuda_times:
                start, end = cuda_times[ins.id]
                start = min(start, end)
            rows.append({"rank": self.rank, "stream": ins.stream, "op_id": ins.id, "kind": ins.kind,
                         "stage": ins.stage, "mb": ins.mb, "start": start, "end": end, "bytes": ins.bytes,
                         "flops": ins.flops, "peer": ins.peer if ins.kind in ("SEND", "RECV") else -1,
                         "posted": posted, "issue_s": self.issue_s.get(ins.id, 0.0), "group": ins.group,
                         "match": ins.match})
        return rows


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
            unit_bucket[".".join(seg.split(".")[:2]) if seg.startswith("layers.") else seg] = b

    def bucket_of(name: str) -> int:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        if key not in unit_bucket:  # a user model's unit: the unit path the name starts with
            key = max((u for u in unit_bucket if name.startswith(u + ".")), key=len)
        return unit_bucket[key]

    ordered = sorted(named, key=lambda kv: bucket_of(kv[0]))  # stable: model order inside a bucket
    numels = [0] * len(buckets)
    for name, p in ordered:
        numels[bucket_of(name)] += p.numel()
    return ordered, numels


class _Running:
    """While a backward op runs: the parameters it writes, for `Runtime._grad_ready`."""

    def __init__(self, rt: Runtime, op_id: str, params: set[int]):
        self.rt, self.op_id, self.params = rt, op_id, params

    def __enter__(self):
        if self.params:
            self.rt.running, self.rt.running_done = (self.op_id, self.params), set()
        return self

    def __exit__(self, *exc):
        self.rt.running = None
        return False


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def align_comm_starts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A comm op starts moving data when every side has posted it: a SEND/RECV pair at the
    later of the two posts, a collective at its members' latest post."""
    latest: dict[tuple, float] = {}

    def key(r: dict[str, Any]) -> tuple:
        if r["kind"] in ("SEND", "RECV"):
            a, b = (r["rank"], r["peer"]) if r["kind"] == "SEND" else (r["peer"], r["rank"])
            return ("p2p", a, b, r["match"])
        return ("coll", r["op_id"], r["group"])

    for r in rows:
        if r["kind"] not in COMPUTE_KINDS:
            k = key(r)
            latest[k] = max(latest.get(k, r["posted"]), r["posted"])
    out = []
    for r in rows:
        r = dict(r)
        if r["kind"] not in COMPUTE_KINDS:
            r["start"] = min(max(r["start"], latest[key(r)]), r["end"])
        r.pop("group", None)
        r.pop("match", None)
        out.append(r)
    return out
