"""Expansion of high-level directives into the low-level set, and the resolved setup.

``expand(strategy)`` turns ``pipeline`` / ``data_parallel`` / ``expert_parallel`` /
``tensor_parallel`` / ``context_parallel`` / ``schedule`` into ``split``, ``place``, ``replicate``,
``shard``, ``shard_tensor``, ``shard_sequence`` and ``order`` directives. Low-level directives written by the user are kept and win over what a
helper generated (a user ``order`` for pipeline rank 2 replaces the schedule's row).
``resolve(directives)`` then reads the low-level list into a `Setup` the IR passes use.

``shard_tensor`` may select segments (``layers``, ``embedding``, ``head``; `Setup.tp_sharded`):
a selected layer is sharded with Megatron's column -> row pairing (q/k/v and the first MLP
linears by column, the attention output and last MLP linear by row), so each block needs one
all-reduce per pass; a free row/column choice per linear is not offered because any other
pairing needs a collective between the two linears (gather a column output, or split a
replicated input), which costs more and no system uses. Unselected segments are replicated.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from piper_sim.layouts import layout_layers, stages_of
from piper_sim.recompute import Recompute
from piper_sim.schedules import (SCHEDULE_TABLE, SCHEDULES, Action, ScheduleError, Slot, build_schedule, canonical_schedule,
                                 default_schedule, format_slot, guess, known_names)
from piper_sim.strategy import Strategy, StrategyError, tp_layers

_ACTION_RE = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")
DEFAULT_STREAMS = {"SEND": "send", "RECV": "recv", "ALLREDUCE": "dp", "REDUCE_SCATTER": "dp",
                   "ALL_GATHER": "dp", "ALL_TO_ALL": "ep"}


@dataclass
class Setup:
    """The low-level directives, read into the numbers the passes need."""

    pp: int
    dp: int
    ep: int
    zero: int
    bucket_mb: float | None
    microbatches: int
    num_stages: int
    # (stage) -> list of (pp_rank, first_mb, end_mb): which copy runs which micro-batches
    placement: dict[int, list[tuple[int, int, int]]]
    orders: dict[int, list[Slot]]
    recompute: dict[int, str] = field(default_factory=dict)  # stage -> "full" | "selective" | "op" | "every"
    # stage -> its whole policy (method, num_layers, every, modules: `piper_sim.recompute`)
    recompute_policy: dict[int, Recompute] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_STREAMS))
    schedule: str = "custom"
    # ZeRO-2/3: reduce-scatter each micro-batch's gradients ("per_microbatch", FSDP's and
    # DeepSpeed's default) or the accumulated ones once per step ("per_step", no_sync-style)
    reduce: str = "per_microbatch"
    # ZeRO-1/2: all-gather the updated parameters during the next step's forward, each bucket
    # waited for where it is first used (Megatron's --overlap-param-gather); off by default, as in
    # Megatron and DeepSpeed: right after the optimizer step
    overlap_param_gather: bool = False
    layers_per_stage: list[int] | str | None = None  # None: equal layer counts; "balanced": equal time
    tp: int = 1  # tensor-parallel degree (shard_tensor)
    sp: bool = False  # sequence parallelism inside the tensor-parallel group
    # shard_tensor's selection (`tp_sharded`): the layers (None: all), the embedding, the head
    tp_layers: tuple[int, ...] | None = None
    tp_embed: bool = True
    tp_head: bool = True
    cp: int = 1  # context-parallel degree (shard_sequence): each rank holds seq_len / cp tokens
    cp_style: str = "allgather"  # "allgather" (K/V all-gather, Llama 3) or "ring" (ring attention)
    # hybrid sharding (HSDP, torchtitan's data_parallel_shard_degree): ZeRO within groups of
    # dp_shard DP ranks, replicated across dp / dp_shard groups; 0: shard over all of dp
    dp_shard: int = 0

    def rank_of(self, stage: int, mb: int) -> int:
        for pp_rank, lo, hi in self.placement[stage]:
            if lo <= mb < hi:
                return pp_rank
        raise StrategyError(f"place: stage {stage} has no copy for micro-batch {mb}; "
                            "cover every micro-batch with place directives")

    @property
    def reduce_per_microbatch(self) -> bool:
        """ZeRO-2/3 reduce-scatter each micro-batch's gradients right after its backward
        (the unsharded gradients are freed, the shard accumulates); ZeRO-0/1 never do."""
        return self.zero >= 2 and self.reduce == "per_microbatch"

    @property
    def tp_partial(self) -> bool:
        """``shard_tensor`` selects only some segments (the others replicated over the TP group)."""
        return self.tp > 1 and (self.tp_layers is not None or not (self.tp_embed and self.tp_head))

    def tp_sharded(self, unit: str) -> bool:
        """Whether a unit (``embed``, ``layers.{i}``, ``head``) is Megatron-sharded over the TP
        group; an unselected one is replicated: every TP rank runs it whole on the same tokens."""
        if self.tp == 1:
            return False
        if unit == "embed":
            return self.tp_embed
        if unit == "head":
            return self.tp_head
        return self.tp_layers is None or int(unit.split(".")[1]) in self.tp_layers

    def policy(self, stage: int) -> Recompute:
        """The stage's recompute policy (``Recompute()``: none)."""
        return self.recompute_policy.get(stage) or Recompute(self.recompute.get(stage, "none"))

    def plain_full(self, stage: int) -> bool:
        """Full recompute of every unit but the embedding (the forward re-run whole in B/BI)."""
        return self.recompute.get(stage) == "full" and self.policy(stage).plain

    def stage_ranks(self) -> dict[int, list[int]]:
        return {s: sorted({r for r, _, _ in copies}) for s, copies in self.placement.items()}


def parse_slot(text: str, where: str) -> Slot:
    """``'0F3'`` -> (Action,), ``'(0F3;1B2)'`` or torch's ``'(0F3;1B2)OVERLAP_F_B'`` ->
    overlapped pair."""
    body = text.strip()
    if body.startswith("(") and body.endswith(")OVERLAP_F_B"):
        body = body[: -len("OVERLAP_F_B")]
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    actions = []
    for part in body.split(";"):
        m = _ACTION_RE.match(part.strip())
        if not m:
            raise StrategyError(f"{where}: bad action {part!r}; write '{{stage}}{{F|B|I|W}}{{mb}}' "
                                "like '0F3', pairs as '(0F3;1B2)'")
        actions.append(Action(int(m.group(1)), m.group(2), int(m.group(3))))
    if len(actions) > 2:
        raise StrategyError(f"{where}: slot {text!r} has {len(actions)} actions; at most 2 can overlap")
    return tuple(actions)



def _check_needs_ep(name: str, by_op: dict) -> None:
    """combined_1f1b overlaps expert all-to-alls: Megatron-Core asserts expert parallelism and
    no full recompute with it (transformer/transformer_config.py, overlap_moe_expert_parallel_comm)."""
    if not SCHEDULE_TABLE[name].needs_ep:
        return
    if by_op.get("expert_parallel", {}).get("degree", 1) <= 1:
        raise StrategyError(f"schedule {name}: overlaps the expert-parallel all-to-alls of two micro-batches, "
                            "so it needs expert_parallel degree > 1; use interleaved_1f1b")
    rc = [d for d in by_op.values() if d["op"] == "recompute"]
    if any(d.get("mode", "full") in ("full", "every") or "method" in d or "num_layers" in d for d in rc):
        raise StrategyError(f"schedule {name}: full recompute is refused with it, as Megatron-Core refuses "
                            "full recomputation with overlap_moe_expert_parallel_comm; use recompute mode selective, "
                            "or schedule interleaved_1f1b")

def expand(strategy: Strategy) -> list[dict[str, Any]]:
    """High-level directives -> low-level list (split, place, replicate, shard, order, ...)."""
    by_op = {d["op"]: d for d in strategy.directives}
    m = strategy.microbatches
    out: list[dict[str, Any]] = []
    if "split" not in by_op:
        out.append({"op": "split", "microbatches": m})
    pipe = by_op.get("pipeline", {"op": "pipeline", "degree": 1})
    pp = pipe["degree"]
    v = pipe.get("stages_per_rank")  # None: what the schedule needs (2 for zbv, dualpipev)
    if "layout" in pipe:  # Megatron's layout string: its stage count gives the stages per rank
        lps = layout_layers(pipe["layout"], "directive pipeline")
        v = stages_of(lps, pp, v, "directive pipeline")
    sched = by_op.get("schedule")
    has_low_level = any(d["op"] in ("place", "order") for d in strategy.directives)
    if sched or not has_low_level:
        name = canonical_schedule(sched["name"]) if sched else default_schedule(v)
        if name not in SCHEDULES:
            raise StrategyError(f"schedule: unknown name {sched['name']!r}{guess(sched['name'])}; "
                                f"choose one of {known_names()}")
        _check_needs_ep(name, by_op)
        placement = pipe.get("placement")
        try:
            spec = build_schedule(name, pp, m, stages_per_rank=v, placement=placement)
        except ScheduleError as e:
            raise StrategyError(f"directive schedule: {e}") from None
        for stage, ranks in sorted(spec.stage_ranks.items()):
            if len(ranks) == 1:
                out.append({"op": "place", "stage": stage, "pp_rank": ranks[0], "from": name})
            else:  # dualpipe: one copy per direction, each taking half of the micro-batches
                for r in ranks:
                    mbs = [mb for mb in range(m) if spec.rank_of(stage, mb) == r]
                    out.append({"op": "place", "stage": stage, "pp_rank": r,
                                "microbatches": [min(mbs), max(mbs) + 1], "from": name})
        for r, slots in enumerate(spec.orders):
            out.append({"op": "order", "pp_rank": r, "slots": [format_slot(s) for s in slots],
                        "from": name})
    if "layers_per_stage" in pipe:
        out.append({"op": "segment", "layers_per_stage": pipe["layers_per_stage"]})
    elif "layout" in pipe:
        out.append({"op": "segment", "layers_per_stage": lps})
    if "data_parallel" in by_op:
        d = by_op["data_parallel"]
        out.append({"op": "replicate", "degree": d["degree"], "zero": d.get("zero", 0),
                    **{k: d[k] for k in ("bucket_mb", "reduce", "overlap_param_gather", "shard_degree") if k in d}})
    user_tp = by_op.get("shard_tensor")
    if "tensor_parallel" in by_op:
        d = by_op["tensor_parallel"]
        if user_tp is not None and user_tp["degree"] != d["degree"]:
            raise StrategyError(f"shard_tensor: field 'degree' {user_tp['degree']} differs from tensor_parallel's "
                                f"degree {d['degree']}; give both the same degree or drop one")
        if user_tp is None:
            out.append({"op": "shard_tensor", "degree": d["degree"],
                        "sequence_parallel": bool(d.get("sequence_parallel", False))})
        else:  # the user's selection wins; sequence_parallel comes from tensor_parallel unless it says
            user_tp = {"sequence_parallel": bool(d.get("sequence_parallel", False)), **user_tp}
    if "context_parallel" in by_op:
        d = by_op["context_parallel"]
        out.append({"op": "shard_sequence", "degree": d["degree"], "style": d.get("style", "allgather")})
    if "expert_parallel" in by_op:
        out.append({"op": "shard", "degree": by_op["expert_parallel"]["degree"]})
        if "data_parallel" not in by_op and not any(d["op"] == "replicate" for d in strategy.directives):
            # EP ranks are data parallel for the non-expert parts: no DP given means DP = EP.
            out.append({"op": "replicate", "degree": by_op["expert_parallel"]["degree"], "zero": 0})
    for d in strategy.directives:
        if d["op"] not in ("pipeline", "data_parallel", "expert_parallel", "tensor_parallel", "context_parallel",
                           "schedule"):
            out.append(dict(user_tp) if d is by_op.get("shard_tensor") and user_tp is not None else dict(d))
    return out


def resolve(directives: list[dict[str, Any]]) -> Setup:
    """Read a low-level directive list into a `Setup` (later directives win)."""
    m = next(d["microbatches"] for d in directives if d["op"] == "split")
    placement: dict[int, list[tuple[int, int, int]]] = {}
    orders: dict[int, list[Slot]] = {}
    dp, zero, bucket_mb, ep, reduce, tp, sp = 1, 0, None, 1, "per_microbatch", 1, False
    overlap_gather = False
    dp_shard = 0
    cp, cp_style = 1, "allgather"
    tp_sel: tuple[tuple[int, ...] | None, bool, bool] = (None, True, True)
    recompute: dict[int, Recompute] = {}
    recompute_all: Recompute | None = None
    streams = dict(DEFAULT_STREAMS)
    schedule = "custom"
    user_placed: set[int] = set()
    layers_per_stage = None
    for i, d in enumerate(directives):
        op = d["op"]
        where = f"directive {op}"
        if op == "place":
            stage, r = d["stage"], d["pp_rank"]  # types checked by strategy.check_directive
            lo, hi = d.get("microbatches", [0, m])
            if "from" not in d and stage not in user_placed:
                placement[stage] = []  # a user's place replaces the generated one
                user_placed.add(stage)
            placement.setdefault(stage, []).append((r, lo, hi))
        elif op == "order":
            where = f"directive order (pp_rank {d['pp_rank']})"
            orders[d["pp_rank"]] = [parse_slot(s, where) for s in d["slots"]]
            schedule = d.get("from", "custom")
        elif op == "replicate":
            dp, zero, bucket_mb = d["degree"], d.get("zero", 0), d.get("bucket_mb")
            reduce = d.get("reduce", "per_microbatch")
            overlap_gather = d.get("overlap_param_gather", False)
            dp_shard = d.get("shard_degree", 0)
            dp_shard = 0 if dp_shard == dp else dp_shard  # one shard group: plain ZeRO
        elif op == "shard":
            ep = d["degree"]
        elif op == "shard_tensor":
            tp, sp = d["degree"], bool(d.get("sequence_parallel", False))
            tp_sel = (tp_layers(d["layers"], where) if "layers" in d else None, d.get("embedding", True),
                      d.get("head", True))
        elif op == "shard_sequence":
            cp, cp_style = d["degree"], d.get("style", "allgather")
        elif op == "recompute":  # a later directive wins for the stages it names
            stages, mode = d.get("stages", "all"), Recompute.from_directive(d)
            if stages == "all":
                recompute_all, recompute = mode, {}
            else:
                recompute.update(dict.fromkeys(stages, mode))
        elif op == "stream":
            streams[d["kind"]] = d["name"]
        elif op == "segment":
            lps = d["layers_per_stage"]
            layers_per_stage = lps if lps == "balanced" else list(lps)
    if not placement:
        raise StrategyError("no place directive: add {\"op\": \"pipeline\", \"degree\": P} or place directives")
    num_stages = max(placement) + 1
    missing = sorted(set(range(num_stages)) - placement.keys())
    if missing:
        raise StrategyError(f"place: stage(s) {missing} are not placed on any pipeline rank")
    pp = max(r for copies in placement.values() for r, _, _ in copies) + 1
    for r in orders:
        if r >= pp:
            raise StrategyError(f"directive order: pp_rank {r} is outside the pipeline ranks 0..{pp - 1}")
    for stage, copies in placement.items():
        covered = sorted((lo, hi) for _, lo, hi in copies)
        pos = 0
        for lo, hi in covered:
            if lo != pos:
                raise StrategyError(f"place: stage {stage} copies must cover micro-batches 0..{m - 1} "
                                    f"exactly once (gap or overlap at {pos})")
            pos = hi
        if pos != m:
            raise StrategyError(f"place: stage {stage} copies cover micro-batches up to {pos}, not {m}")
    bad = sorted(s for s in recompute if s >= num_stages)
    if bad:
        raise StrategyError(f"directive recompute: field 'stages' names stage(s) {bad}, but there are "
                            f"{num_stages} stages (0..{num_stages - 1})")
    if recompute_all:
        recompute = {**dict.fromkeys(range(num_stages), recompute_all), **recompute}
    if zero and dp * cp == 1 and max(len({r for r, _, _ in c}) for c in placement.values()) == 1:
        warnings.warn(f"replicate: zero={zero} on data-parallel degree 1 has nothing to shard; "
                      "it is ignored", stacklevel=2)
    return Setup(pp=pp, dp=dp, ep=ep, zero=zero, bucket_mb=bucket_mb, microbatches=m,
                 num_stages=num_stages, placement=placement, orders=orders,
                 recompute={s: p.mode for s, p in recompute.items()}, recompute_policy=recompute,
                 streams=streams, schedule=schedule, reduce=reduce, overlap_param_gather=overlap_gather,
                 layers_per_stage=layers_per_stage, tp=tp,
                 sp=sp and tp > 1, cp=cp, cp_style=cp_style, tp_layers=tp_sel[0], tp_embed=tp_sel[1],
                 tp_head=tp_sel[2], dp_shard=dp_shard)
