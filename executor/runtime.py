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
  AG.F|B.s{s}.i{i}[.e].b{b}  ZeRO-3 gather of bucket b (a unit: the header's ``zero3_buckets``)
                          before the i-th forward / backward of the stage here (``mb`` names
                          the consumer's micro-batch); dropped after the last piece using it
                          (a BI piece too: BW reads activations and gradients, not weights)

Recomputation (the header's ``recompute``: stage -> mode): ``full`` checkpoints every layer /
expert block / head of the forward (``torch.utils.checkpoint``; a B recomputes them one at
a time; a BI runs its piece's forward again and keeps that graph for BW); ``selective``
checkpoints the attention cores only. The finer policies (``recompute_policy``:
`Stage.set_recompute`) checkpoint what they say; under a BI/BW split each of their
checkpoints re-runs once, in BI, keeping what BW reads (`executor.stage.kept_checkpoint`).
  A2A.F|B.s{s}.mb{m}.e{e}.dispatch|combine  expert-parallel token exchange
  TP.F|B|R.s{s}.mb{m}.{name}  a tensor-parallel collective: performed inside the stage's modules
                          (``executor.parallel.tensor``) during the piece before it; the op takes
                          the next one logged in that pass (R: a recompute's, in the B pass),
                          checks its name and kind and records its measured times
  TP.s{s}.norms           sequence parallel: all-reduce of the stage's replicated gradients (norms)
                          over the TP group; the stage's gradient syncs wait for it
  CP.F|B|R.s{s}.mb{m}.l{l}.kv.ag|dkv.rs  a context-parallel K/V collective (or ring): performed
                          by the layer's attention (``executor.parallel.context``) inside its piece,
                          which the op waits for (the plan issues gathers before the piece); matched
                          like a TP op

Each parallelism axis's set-up, collectives (AR/RS/AG, A2A, TP, CP) and hooks live in its module
of `executor.parallel`; this module keeps the issuing loop, compute and send/receive.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from costmodel.dtypes import torch_dtype
from executor.collectives import Comms, Completions
from executor.data import SyntheticData
from executor.lr import LRSchedule
from executor.parallel import DataParallel, apply_axes
from executor.parallel.axis import Handler, Logged, Posted
from executor.parallel.expert import expert_index
from executor.parallel.tensor import TensorParallel
from executor.stage import Record, Stage, backward_full, backward_input, backward_weight, set_lr
from executor.user_stage import UserData, UserStage, user_model_of
from piper_sim.configs import config_of
from piper_sim.models import DropoutStream, set_dropout_stream
from piper_sim.recompute import Recompute
from piper_sim.plan import COMPUTE_KINDS, Instruction, Plan, PlanError, missing_fields


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
class MicroBatch:
    """Tensors of one (stage, micro-batch) between its forward and its backward."""

    vals: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)  # an expert layer's token routing (executor.stage)
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
        h = self.header = plan.header
        self.user_model = h.user_model is not None  # a user's annotated nn.Module (executor.user_stage)
        self.cfg = user_model_of(h) if self.user_model else config_of(h)
        self.dtype = torch_dtype(h.dtype)
        self.layout = plan.layout
        self.dp_rank = self.prog.dp_rank
        self.microbatches = h.microbatches
        self.mbs, self.seq = h.micro_batch_size, h.seq_len
        # a context-parallel rank's loss is the mean of its s / cp tokens: 1 / cp of the sequence's
        # a user model under sequence parallelism: each TP rank's loss is its sequence shard's mean too
        # (piper_sim.user_tp); otherwise every member of a TP group computes the whole loss
        self.loss_shards = self.layout.tp if self.user_model and h.tp.sequence_parallel else 1
        self.loss_scale = 1.0 / (self.microbatches * self.layout.dp * self.layout.cp * self.loss_shards)
        self.ep_index = expert_index(self.dp_rank, self.layout.ep)
        if self.user_model:
            self.data = UserData(self.cfg, self.seq, h.global_batch, h.seed, self.dtype)
            self.stages = {s: UserStage(self.cfg, s, h.num_stages, h.stage_units[s], h.stage_parts[s], device,
                                        self.dtype, h.seed)
                           for s in self.prog.stages}
        else:
            self.data = SyntheticData(self.cfg.vocab, self.seq, h.global_batch, h.seed)
            self.stages = {s: Stage(self.cfg, s, h.num_stages, h.stage_units[s], h.stage_parts[s],
                                    self.layout.ep, self.ep_index, device, self.dtype, h.seed)
                           for s in self.prog.stages}
        # the plan's parallelism axes (executor.parallel): they shard the stages, rewrite the
        # program's dependencies and handle their instructions
        self.axes = apply_axes(self)
        self.dp = next(a for a in self.axes if isinstance(a, DataParallel))
        self.flats = self.dp.flats
        self.instructions = [i for lst in self.prog.streams.values() for i in lst]
        # stage -> "full" | "selective" (plans without the header field knew only full)
        self.recompute = dict(h.recompute) if h.recompute is not None else \
            {i.stage: "full" for i in self.instructions if i.recompute}
        policies = h.recompute_policy or {}
        split = {i.stage for i in self.instructions if i.kind == "BI"}
        for s, stage in self.stages.items():
            policy = Recompute.from_header(self.recompute.get(s, "none"), policies.get(s))
            # plain full: BI re-runs the whole forward (_backward); the others' checkpoints re-run once in BI
            stage.keep_recompute = s in split and not policy.plain
            stage.set_recompute(policy)
        self._handlers: dict[str, Handler] = {
            "F": self._forward, "B": self._backward, "BI": self._backward, "BW": self._backward_weight,
            "OPT": self._optimizer, "SEND": self._send, "RECV": self._recv}
        self._stream_handlers: dict[str, Handler] = {}
        for axis in self.axes:
            self._handlers.update(axis.handlers())
            self._stream_handlers.update(axis.stream_handlers())
        if self.cuda:
            self.cuda_streams = {name: torch.cuda.Stream(device) for name in self.prog.streams}
        self.completions = Completions()
        self.step_index = 0
        self.dropout_positions = self._dropout_positions()
        self.captured_grads: dict[str, torch.Tensor] = {}
        self.stepped_grads: dict[tuple[int, str], torch.Tensor] = {}  # what each optimizer stepped (capture)

    def gather_parameters(self) -> None:
        """The full parameters of the last step (`DataParallel.gather_parameters`)."""
        self.dp.gather_parameters()

    def reference_view(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of a reference parameter this rank holds (e.g. its tensor-parallel slice)."""
        for axis in self.axes:
            full = axis.reference_view(name, full)
        return full

    # ------------------------------------------------------------------ the step
    def run_step(self, step: int, capture_grads: bool = False) -> StepResult:
        """Run every instruction of this rank once; returns the global mean loss."""
        self.step_index, self.capture = step, capture_grads
        self.envs: dict[tuple[int, int], MicroBatch] = {}
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.inflight: dict[str, tuple[Instruction, Any]] = {}
        self.done: set[str] = set()
        self.busy: dict[str, str] = {}
        self.times: dict[str, list[float]] = {}
        self.issue_s: dict[str, float] = {}  # async op -> seconds this thread spent posting it
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.clip_coef: float | None = None
        self.grad_norm: float | None = None
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
            for axis in self.axes:
                axis.begin_step()
            while len(self.done) < total:
                for token, t_end, err in self.completions.poll():
                    current = self.inflight[token[1]][0]
                    self.completed(token, t_end, err)
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
                        self.issue(current)
                        issued = True
                        # a matched module collective (TP, CP) is done at once and may free a SEND: look
                        # at every comm stream again before the next compute op (which may block in one)
                        stop = name == "compute" or (name in self._stream_handlers and current.id in self.done)
                    if stop:
                        break
                if not issued and len(self.done) < total:
                    token, t_end, err = self.wait_any(streams, ptr)
                    current = self.inflight[token[1]][0]
                    self.completed(token, t_end, err)
            current = None
            set_dropout_stream(None)
            for axis in self.axes:
                axis.end_step()
            loss = self.loss_sum.clone()
            dist.all_reduce(loss)
            loss /= self.layout.tp // self.loss_shards  # the members of a TP group computing the whole loss
        except InstructionError:
            raise
        except BaseException as e:  # noqa: BLE001 - name the rank and the instruction
            if isinstance(e, KeyboardInterrupt):
                raise
            raise InstructionError(self.rank, step, current, e) from e
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.t0
        leftovers = [k for k in (self.envs, self.received, self.input_grads, self.inflight) if k]
        for axis in self.axes:
            leftovers += axis.leftovers()
        if leftovers:
            raise InstructionError(self.rank, step, None, f"state left over after the step: {leftovers}")
        return StepResult(step, float(loss), elapsed, self._events(), self.grad_norm)

    def wait_any(self, streams, ptr) -> tuple[Any, float, BaseException | None]:
        import queue

        try:
            return self.completions.get(timeout=self.timeout_s)
        except queue.Empty:
            waiting = ", ".join(self.inflight) or "nothing"
            heads = ", ".join(f"{n}: {lst[ptr[n]].id}" for n, lst in streams.items() if ptr[n] < len(lst))
            raise TimeoutError(f"no progress for {self.timeout_s:.0f} s; in flight: {waiting}; "
                               f"next per stream: {heads}") from None

    # ------------------------------------------------------------------ issuing
    def issue(self, ins: Instruction) -> None:
        if self.fault and self.fault.rank == self.rank and self.fault.step == self.step_index \
                and self.fault.op_id == ins.id:
            self._inject(ins)
        for axis in self.axes:
            axis.before_issue(ins)
        self.times[ins.id] = [self._now()]
        with self._on_stream(ins, first=True), self._range(ins):
            out = (self._stream_handlers.get(ins.stream) or self._handlers[ins.kind])(ins)
        if isinstance(out, Logged):  # a collective a module performed (TP, CP): its measured times
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
            self.completed(token, None, None)
        else:
            self.completions.watch(work, token)

    def completed(self, token: tuple[str, str], t_end: float | None, err: BaseException | None) -> None:
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

    def for_compute(self, buf: torch.Tensor) -> torch.Tensor:
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
        """Tokens and targets of micro-batch ``m`` (a context-parallel rank: its chunks of the
        tokens, the targets whole: `executor.parallel.context.ContextParallel.local_batch`)."""
        tokens, targets = self.data.microbatch(self.step_index, self.dp_rank, self.layout.dp, self.microbatches, m,
                                               self.device)
        for axis in self.axes:
            tokens, targets = axis.local_batch(tokens, targets)
        return tokens, targets

    def _dropout_positions(self) -> torch.Tensor | None:
        """The true sequence positions this rank's dropout sites see (None: the whole sequence):
        its context-parallel chunks (`local_batch`), under sequence parallelism its tensor-parallel
        rank's shard of them."""
        if self.user_model or not self.cfg.dropout:
            return None
        pos = torch.arange(self.seq)[None]
        for axis in self.axes:
            pos, _ = axis.local_batch(pos, pos)
        pos = pos[0]
        tp = next((a.comm for a in self.axes if isinstance(a, TensorParallel)), None)
        if tp is not None and tp.sp:
            n = len(pos) // tp.size
            pos = pos[tp.index * n:(tp.index + 1) * n]
        return None if torch.equal(pos, torch.arange(self.seq)) else pos

    def _dropout_stream(self, m: int) -> None:
        """Point the model's dropout at micro-batch ``m``'s rows of the step (`models.DropoutStream`):
        set before its forward and before its backward ops (a recomputed forward draws the same masks)."""
        if self.user_model or not self.cfg.dropout:
            return
        lo = self.dp_rank * (self.header.global_batch // self.layout.dp) + m * self.mbs
        set_dropout_stream(DropoutStream(self.header.seed, self.step_index, range(lo, lo + self.mbs), self.seq,
                                         self.dropout_positions))

    def _forward(self, ins: Instruction) -> None:
        s, m, part = ins.stage, ins.mb, ins.part
        self._dropout_stream(m)
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
        for axis in self.axes:
            axis.enter_pass(("F", s, m))
        rec = stage.forward_piece(part, env.vals, env.routing, env.targets, self.loss_scale)
        env.records[f"p{part}"] = rec
        for name in getattr(stage, "loss_names", ["loss"]):  # the main loss, and the MTP modules' (Stage.loss_names)
            if name in rec.outputs:
                self.loss_sum += rec.outputs[name].detach().float()
        self.dp.release("F", s, m, part)

    def backward_env(self, s: int, m: int) -> MicroBatch:
        """The micro-batch's state, seeded with the gradient of the stage output the first
        time a backward op of (s, m) runs."""
        env = self.envs[(s, m)]
        if not env.backward_started:
            env.backward_started = True
            if self.stages[s].is_last:
                env.grads.update(dict.fromkeys(getattr(self.stages[s], "loss_names", ["loss"])))
            else:
                g = self.received.pop(("B", s + 1, m), None)
                env.grads["x"] = g if g is not None else self.input_grads.pop((s + 1, m))
        return env

    @staticmethod
    def take_grads(env: MicroBatch, rec: Record) -> dict[str, torch.Tensor | None]:
        return {n: env.grads.pop(n) for n in list(rec.outputs) if n in env.grads}

    def _backward(self, ins: Instruction) -> None:
        s, m, part = ins.stage, ins.mb, ins.part
        self._dropout_stream(m)
        env = self.backward_env(s, m)
        split = ins.kind == "BI"
        for axis in self.axes:
            axis.enter_pass(("B", s, m))
        rec = env.records[f"p{part}"] if split else env.records.pop(f"p{part}")
        if split and self.recompute.get(s) == "full" and not self.stages[s].keep_recompute \
                and self.stages[s].recomputes(part):
            # plain full: run the forward again (not a piece that recomputes nothing: the
            # embedding); BW uses this graph
            rec = self.stages[s].forward_piece(part, dict(rec.inputs), env.routing, env.targets, self.loss_scale,
                                               checkpoint=False)
            env.records[f"p{part}"] = rec
        if not split:
            self.dp.grads_for(s, [part])
            with self.dp.writing(ins.id, rec.params):
                env.grads.update(backward_full(rec, self.take_grads(env, rec)))
        else:
            env.grads.update(backward_input(rec, self.take_grads(env, rec)))
        self.dp.release("B", s, m, part)  # BW needs no weights: a BI drops its units too
        if part == 0:
            if s > 0:
                self.input_grads[(s, m)] = env.grads.pop("x")
            if not split:
                del self.envs[(s, m)]

    def _backward_weight(self, ins: Instruction) -> None:
        self._dropout_stream(ins.mb)
        env = self.envs.pop((ins.stage, ins.mb))
        self.dp.grads_for(ins.stage, range(len(self.header.stage_parts[ins.stage])))
        with self.dp.writing(ins.id, [p for rec in env.records.values() for p in rec.params]):
            for rec in env.records.values():
                backward_weight(rec, self.dp.weight_hook())

    def _optimizer(self, ins: Instruction):
        if self.clip_grad_norm is not None and self.clip_coef is None:
            return self._clip_then_step(ins)
        self._step_stage(ins)
        return None

    def _clip_then_step(self, ins: Instruction):
        """The step's first OPT: the global gradient norm (`DataParallel.grad_norm`), the clip
        coefficient as ``torch.nn.utils.clip_grad_norm_`` computes it, then this OPT's update."""
        norm = yield from self.dp.grad_norm()
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

    # ------------------------------------------------------------------ communication
    def _send(self, ins: Instruction) -> Posted:
        if ins.direction == "F":
            t = self.envs[(ins.stage, ins.mb)].vals["x"].detach()
        else:
            t = self.input_grads.pop((ins.stage, ins.mb))
        return Posted(dist.isend(t.contiguous(), ins.peer, tag=self.comms.tags[ins.match]))

    def _recv(self, ins: Instruction) -> Posted:
        key = (ins.direction, ins.stage, ins.mb)  # ("F" | "B", sender's stage, mb)
        seq = self.seq
        for axis in self.axes:  # CP: the rank's tokens; SP: their shard
            seq = axis.local_seq(seq)
        shape, dtype = (self.mbs, seq, self.cfg.hidden), self.dtype
        if self.user_model:  # the boundary tensor after the sending stage (F) or before it (B)
            b = self.header.user_model["boundaries"][ins.stage - (key[0] == "B")]
            shape, dtype = tuple(b["shape"]), getattr(torch, b["dtype"])
        buf = self.for_compute(torch.empty(shape, dtype=dtype, device=self.device))
        work = dist.irecv(buf, ins.peer, tag=self.comms.tags[ins.match])
        return Posted(work, lambda: self.received.__setitem__(key, buf))

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
