"""What a torchtitan job config and Megatron-LM arguments share with a strategy: `Job`.

`job_from_strategy` reads a strategy into a `Job` (the degrees, the schedule, ZeRO, recompute,
batch sizes as counts *and* sizes) and refuses what no trainer's job file can say (hand-written
``place``/``order``/``segment``/``stream`` directives, a ``shard_tensor`` selection, recompute of
some stages only); `strategy_from_job` writes the canonical strategy back, the one form the
importers produce, so ``import(export(s))`` compiles to the plan hash of ``s`` when ``s`` is
written in that form (`canonical`).

Counts and sizes: a strategy's ``microbatches`` is a COUNT per step (per data-parallel rank);
torchtitan's ``pipeline_parallel_microbatch_size`` and Megatron's ``--micro-batch-size`` are
SIZES (sequences per micro-batch per data-parallel rank):
``micro_batch_size = global_batch / (dp * microbatches)``.

Settings no trainer field carries (the cluster, the strategy's name and seed, the training
stack's kernel choices, DP bucket sizes and reduce timing) travel in one comment line,
``# piper-sim: {json}`` (`COMMENT`), which the importers read back when it is there.

Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from costmodel.stack import DEFAULT as DEFAULT_STACK
from piper_sim.strategy import Strategy, StrategyError, parse_strategy

COMMENT = "# piper-sim: "  # the one comment line of piper-sim-only settings (JSON)


class InteropError(ValueError):
    """A feature that does not map to (or from) a trainer's job file; one line naming it."""


@dataclass
class Job:
    """A strategy as the facts a trainer's job file states (see the module docstring)."""

    model: Any  # the strategy's model (a zoo name, a model file path, a py: source...)
    cluster: str | None
    global_batch: int
    seq_len: int
    microbatches: int  # a COUNT per step and data-parallel rank
    dtype: str = "bf16"
    pp: int = 1
    stages_per_rank: int = 1  # virtual pipeline stages per rank (interleaved, V schedules: 2)
    schedule: str | None = None  # our name (piper_sim.schedules); None: no pipeline directive
    dp: int = 1
    zero: int = 0
    dp_shard: int = 0  # HSDP shard group (0: all of dp)
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_style: str = "allgather"
    ep: int = 1
    recompute: str | None = None  # "full" | "selective" on every stage
    overlap_param_gather: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # piper-sim-only: name, seed, stack, dp options

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one data-parallel rank (a SIZE)."""
        return self.global_batch // (self.dp * self.microbatches)

    @property
    def local_batch(self) -> int:
        """Sequences per step on one data-parallel rank (torchtitan's local_batch_size with PP)."""
        return self.global_batch // self.dp


# directive ops a job file can state, and the low-level ones it cannot
_MAPPED = ("pipeline", "schedule", "data_parallel", "tensor_parallel", "context_parallel", "expert_parallel",
           "recompute")
_DP_PIPER_ONLY = ("bucket_mb", "reduce")  # data_parallel options no trainer field carries exactly


def load_source(path: str) -> Strategy:
    """The strategy of a plan file (``piper-sim compile``'s output: its header's strategy) or a
    strategy file."""
    from piper_sim.plan import Plan
    from piper_sim.strategy import load_strategy

    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise InteropError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if isinstance(data, dict) and "layout" in data:  # a plan file
        plan = Plan.from_json(data)
        if plan.header.strategy is None:
            raise InteropError(f"{path}: the plan has no strategy in its header (compiled by an old piper-sim); "
                               "export the strategy file instead")
        return parse_strategy(plan.header.strategy)
    return load_strategy(path)


def job_from_strategy(strategy: Strategy | dict) -> Job:
    """Read a strategy into a `Job`; one-line `InteropError` for what no job file can say."""
    from piper_sim.directives import expand, resolve

    if isinstance(strategy, dict):
        strategy = parse_strategy(strategy)
    by_op: dict[str, dict] = {}
    for d in strategy.directives:
        if d["op"] not in _MAPPED:
            raise InteropError(f"directive {d['op']}: hand-written low-level directives do not map to a trainer's "
                               "job file; write the strategy with the high-level directives (pipeline, schedule, "
                               "data_parallel, tensor_parallel, context_parallel, expert_parallel, recompute)")
        if d["op"] == "recompute":
            if d.get("stages", "all") != "all":
                raise InteropError("directive recompute: field 'stages' (recompute on some pipeline stages only) "
                                   "does not map; torchtitan and Megatron recompute every stage alike")
            if "recompute" in by_op:
                raise InteropError("directive recompute: given twice; keep one")
            extra = sorted({"method", "num_layers", "every", "modules"} & d.keys())
            if d.get("mode", "full") not in ("full", "selective") or extra:
                what = f"field(s) {', '.join(extra)}" if extra else f"mode {d['mode']!r}"
                raise InteropError(f"directive recompute: {what} (piper_sim.recompute policies) not exported to "
                                   "job files in this version; use mode full or selective")
        by_op[d["op"]] = d
    if "layers_per_stage" in by_op.get("pipeline", {}):
        raise InteropError("directive pipeline: field 'layers_per_stage' does not map (torchtitan and Megatron "
                           "split layers evenly, or by module names / layouts piper-sim does not write)")
    if "layout" in by_op.get("pipeline", {}):
        raise InteropError("directive pipeline: field 'layout' is not exported in this version (Megatron's "
                           "--pipeline-model-parallel-layout takes it as written); drop it to export")
    if "placement" in by_op.get("pipeline", {}):
        raise InteropError("directive pipeline: field 'placement' does not map; the schedule's name sets it")
    setup = resolve(expand(strategy))  # checks the strategy as the compiler does
    extra: dict[str, Any] = {}
    if strategy.name:
        extra["name"] = strategy.name
    if strategy.seed:
        extra["seed"] = strategy.seed
    if strategy.stack != DEFAULT_STACK:
        extra["stack"] = strategy.to_json()["stack"]
    dp_opts = {k: by_op["data_parallel"][k] for k in _DP_PIPER_ONLY if k in by_op.get("data_parallel", {})}
    if dp_opts:
        extra["data_parallel"] = dp_opts
    pipe = by_op.get("pipeline")
    return Job(model=strategy.model, cluster=strategy.cluster, global_batch=strategy.global_batch,
               seq_len=strategy.seq_len, microbatches=strategy.microbatches, dtype=strategy.dtype,
               pp=setup.pp, stages_per_rank=setup.num_stages // setup.pp,
               schedule=setup.schedule if pipe is not None or "schedule" in by_op else None,
               dp=setup.dp, zero=setup.zero, dp_shard=setup.dp_shard, tp=setup.tp, sp=setup.sp, cp=setup.cp,
               cp_style=setup.cp_style, ep=setup.ep,
               recompute=by_op["recompute"].get("mode", "full") if "recompute" in by_op else None,
               overlap_param_gather=setup.overlap_param_gather, extra=extra)


def strategy_from_job(job: Job) -> dict[str, Any]:
    """The canonical strategy (JSON) of a job: directives in the order pipeline, schedule,
    data_parallel, tensor_parallel, context_parallel, expert_parallel, recompute; each only when
    it does something, with its mapped fields spelled out."""
    d: list[dict[str, Any]] = []
    if job.pp > 1 or job.schedule is not None:
        d.append({"op": "pipeline", "degree": job.pp,
                  **({"stages_per_rank": job.stages_per_rank} if job.stages_per_rank > 1 else {})})
        d.append({"op": "schedule", "name": job.schedule or ("interleaved_1f1b" if job.stages_per_rank > 1
                                                             else "1f1b")})
    if job.dp > 1 or job.zero:
        dp = {"op": "data_parallel", "degree": job.dp, "zero": job.zero}
        if job.dp_shard and job.dp_shard != job.dp:
            dp["shard_degree"] = job.dp_shard
        if job.overlap_param_gather:
            dp["overlap_param_gather"] = True
        dp.update(job.extra.get("data_parallel", {}))
        d.append(dp)
    if job.tp > 1:
        d.append({"op": "tensor_parallel", "degree": job.tp, "sequence_parallel": job.sp})
    if job.cp > 1:
        d.append({"op": "context_parallel", "degree": job.cp, "style": job.cp_style})
    if job.ep > 1:
        d.append({"op": "expert_parallel", "degree": job.ep})
    if job.recompute:
        d.append({"op": "recompute", "mode": job.recompute})
    out: dict[str, Any] = {"model": job.model, "cluster": job.cluster, "global_batch": job.global_batch,
                           "seq_len": job.seq_len, "microbatches": job.microbatches, "dtype": job.dtype,
                           "directives": d}
    for key in ("name", "seed", "stack"):
        if key in job.extra:
            out[key] = job.extra[key]
    parse_strategy(out)  # a one-line StrategyError if the job file said something impossible
    return out


def canonical(strategy: Strategy | dict) -> dict[str, Any]:
    """The strategy in the importers' form (`strategy_from_job`)."""
    return strategy_from_job(job_from_strategy(strategy))


def comment_line(job: Job, extra: dict[str, Any]) -> str:
    """The ``# piper-sim: {json}`` line: the cluster, the model when the file cannot name it, and
    ``job.extra``."""
    data = {"cluster": job.cluster, **extra, **job.extra}
    return COMMENT + json.dumps(data, sort_keys=True, separators=(", ", ": "))


def read_comment(lines: list[str], where: str) -> dict[str, Any]:
    """The piper-sim settings of a job file's ``# piper-sim: {json}`` line ({} when absent)."""
    for line in lines:
        if line.startswith(COMMENT):
            try:
                data = json.loads(line[len(COMMENT):])
            except json.JSONDecodeError as e:
                raise InteropError(f"{where}: the '{COMMENT.strip()}' line is not JSON ({e.msg}); "
                                   "fix or delete it") from None
            if not isinstance(data, dict):
                raise InteropError(f"{where}: the '{COMMENT.strip()}' line must hold a JSON object")
            return data
    return {}


def exact_div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise InteropError(f"{what}: {a} is not a multiple of {b}")
    return a // b


def zoo_name_of(cfg) -> str | None:
    """The built-in zoo model whose shapes equal ``cfg``'s (name aside), if any."""
    import dataclasses

    from piper_sim.configs import BUILTIN_ZOO

    for name, z in BUILTIN_ZOO.items():
        if dataclasses.replace(z, name=cfg.name) == cfg:
            return name
    return None


__all__ = ["COMMENT", "InteropError", "Job", "StrategyError", "canonical", "comment_line", "exact_div",
           "job_from_strategy", "load_source", "read_comment", "strategy_from_job", "zoo_name_of"]
