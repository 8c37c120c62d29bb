"""torchtitan's TOML job config <-> a strategy.

The format is torchtitan 0.1/0.2's ``--job.config_file`` TOML, read by
``torchtitan.config.ConfigManager`` into ``torchtitan.config.job_config.JobConfig``
(torchtitan 0.3 dropped TOML for Python config registries; its ``ParallelismConfig`` keeps
the field names below). Every field written here is named in `FIELDS` with the JobConfig
field it sets; every value table names its source.

What does not map is refused with a one-line `InteropError` naming the feature: ZeRO-1
(FSDP2 always shards gradients too), DDP (zero 0) with any other parallelism and zero 0 with
context parallelism (torchtitan applies DDP only alone and FSDP over the CP ranks always),
tensor parallelism without sequence parallelism (torchtitan's TP plans always shard the norms
over the sequence), DualPipe (a stage on two ranks: torch has no such schedule), fp16, and on
import float8 and selective activation checkpointing of every n-th layer.
"""

from __future__ import annotations

from typing import Any

from piper_sim.interop.common import (
    InteropError,
    Job,
    comment_line,
    exact_div,
    read_comment,
    strategy_from_job,
)
from piper_sim.schedules import TORCH_NAMES, canonical_schedule

JC = "torchtitan/config/job_config.py"  # torchtitan 0.2.2; 0.3.0: torchtitan/config/configs.py

# fact -> (TOML section.key, source: the JobConfig field)
FIELDS: dict[str, tuple[str, str]] = {
    "pp": ("parallelism.pipeline_parallel_degree", f"{JC} Parallelism.pipeline_parallel_degree"),
    "schedule": ("parallelism.pipeline_parallel_schedule", (f"{JC} Parallelism.pipeline_parallel_schedule "
                 "(torch.distributed.pipelining get_schedule_class names)")),
    "layers_per_stage": ("parallelism.pipeline_parallel_layers_per_stage",
                         f"{JC} Parallelism.pipeline_parallel_layers_per_stage (sets the virtual stages per rank)"),
    "first_less": ("parallelism.pipeline_parallel_first_stage_less_layers",
                   f"{JC} Parallelism.pipeline_parallel_first_stage_less_layers (0: equal layer counts, as ours)"),
    "last_less": ("parallelism.pipeline_parallel_last_stage_less_layers",
                  f"{JC} Parallelism.pipeline_parallel_last_stage_less_layers"),
    "micro_batch_size": ("parallelism.pipeline_parallel_microbatch_size",
                         f"{JC} Parallelism.pipeline_parallel_microbatch_size (a SIZE, sequences)"),
    "dp_replicate": ("parallelism.data_parallel_replicate_degree", f"{JC} Parallelism.data_parallel_replicate_degree"),
    "dp_shard": ("parallelism.data_parallel_shard_degree", f"{JC} Parallelism.data_parallel_shard_degree"),
    "reshard": ("parallelism.fsdp_reshard_after_forward", f"{JC} Parallelism.fsdp_reshard_after_forward"),
    "tp": ("parallelism.tensor_parallel_degree", f"{JC} Parallelism.tensor_parallel_degree"),
    "cp": ("parallelism.context_parallel_degree", f"{JC} Parallelism.context_parallel_degree"),
    "cp_style": ("parallelism.context_parallel_rotate_method", f"{JC} Parallelism.context_parallel_rotate_method"),
    "ep": ("parallelism.expert_parallel_degree", f"{JC} Parallelism.expert_parallel_degree"),
    "etp": ("parallelism.expert_tensor_parallel_degree", f"{JC} Parallelism.expert_tensor_parallel_degree"),
    "local_batch": ("training.local_batch_size", f"{JC} Training.local_batch_size (sequences per DP rank)"),
    "global_batch": ("training.global_batch_size", f"{JC} Training.global_batch_size (-1: local x DP)"),
    "seq_len": ("training.seq_len", f"{JC} Training.seq_len"),
    "dtype": ("training.mixed_precision_param", f"{JC} Training.mixed_precision_param"),
    "recompute": ("activation_checkpoint.mode", f"{JC} ActivationCheckpoint.mode"),
    "selective_option": ("activation_checkpoint.selective_ac_option", f"{JC} ActivationCheckpoint.selective_ac_option"),
    "compile": ("compile.enable", f"{JC} Compile.enable"),
    "optimizer": ("optimizer.implementation", f"{JC} Optimizer.implementation"),
    "model_name": ("model.name", f"{JC} Model.name"),
    "flavor": ("model.flavor", f"{JC} Model.flavor"),
    "converters": ("model.converters", f"{JC} Model.converters ('quantize.linear.float8': float8 training)"),
    "seed": ("debug.seed", f"{JC} Debug.seed"),
    "description": ("job.description", f"{JC} Job.description"),
}

# our schedule -> torchtitan's name: torch.distributed.pipelining's class without "Schedule"
# (piper_sim.schedules.SCHEDULE_TABLE torch_name; torch schedules.py get_schedule_class)
SCHEDULES: dict[str, str] = dict(TORCH_NAMES)

# ZeRO level -> fsdp_reshard_after_forward (FSDP2 fully_shard(reshard_after_forward=...):
# "always" frees the gathered parameters after forward = ZeRO-3, "never" keeps them to the
# backward = ZeRO-2 (SHARD_GRAD_OP); torchtitan models/llama3/infra/parallelize.py apply_fsdp)
RESHARD: dict[int, str] = {2: "never", 3: "always"}

# our context-parallel style -> context_parallel_rotate_method (torch
# distributed/tensor/experimental/_attention.py: "allgather" gathers every K/V shard, as
# Llama 3; "alltoall" passes shards round the ring)
CP_STYLES: dict[str, str] = {"allgather": "allgather", "ring": "alltoall"}

# our recompute mode -> activation_checkpoint (mode, selective_ac_option); "selective" is
# Korthikanti's attention-core recompute, torchtitan's nearest is per-op SAC ("op": matmul
# outputs saved, the rest recomputed) [torchtitan distributed/activation_checkpoint.py]
RECOMPUTE: dict[str | None, tuple[str, str | None]] = {None: ("none", None), "full": ("full", None),
                                                      "selective": ("selective", "op")}

# our dtype -> mixed_precision_param (fp16 has no torchtitan setting)
DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}

# zoo model -> (model.name, model.flavor) [torchtitan models/llama3/__init__.py llama3_args,
# models/deepseek_v3/__init__.py deepseekv3_args]
MODELS: dict[str, tuple[str, str]] = {
    "llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B"),
    "deepseek-v3": ("deepseek_v3", "671B"),
}

FLOAT8 = "quantize.linear.float8"  # model.converters entry of float8 linears (0.1: "float8")


def _toml_value(v: Any) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def export(job: Job, source: str = "") -> str:
    """The TOML text of a job; `InteropError` for what torchtitan cannot run."""
    fsdp = _check_export(job)
    values: dict[str, Any] = {}

    def put(fact: str, value: Any) -> None:
        values[FIELDS[fact][0]] = value

    put("description", f"piper-sim {source}".strip())
    extra: dict[str, Any] = {}
    if isinstance(job.model, str) and job.model in MODELS:
        put("model_name", MODELS[job.model][0])
        put("flavor", MODELS[job.model][1])
    else:
        extra["model"] = job.model  # no torchtitan flavor: set [model] to yours
    put("converters", [])
    put("local_batch", job.local_batch if job.pp > 1 else job.micro_batch_size)
    put("global_batch", job.global_batch)
    put("seq_len", job.seq_len)
    put("dtype", DTYPES[job.dtype])
    dp_shard = job.dp_shard or job.dp
    put("dp_replicate", job.dp // dp_shard if job.zero else job.dp)
    put("dp_shard", dp_shard if job.zero else 1)
    if fsdp:
        put("reshard", RESHARD[job.zero])
    put("tp", job.tp)
    put("pp", job.pp)
    if job.pp > 1:
        put("schedule", SCHEDULES[job.schedule])
        put("micro_batch_size", job.micro_batch_size)
        n_layers = _n_layers(job.model)
        put("layers_per_stage", exact_div(n_layers, job.pp * job.stages_per_rank,
                                          f"layers of {job.model} over the {job.pp * job.stages_per_rank} stages"))
        put("first_less", 0)
        put("last_less", 0)
    put("cp", job.cp)
    if job.cp > 1:
        put("cp_style", CP_STYLES[job.cp_style])
    put("ep", job.ep)
    if job.ep > 1:
        put("etp", job.tp)
    mode, option = RECOMPUTE[job.recompute]
    put("recompute", mode)
    if option:
        put("selective_option", option)
    stack = job.extra.get("stack") or {}
    from costmodel.stack import parse_stack

    st = parse_stack(stack or None)
    put("compile", st.compile)
    put("optimizer", st.optimizer)
    if "seed" in job.extra:
        put("seed", job.extra["seed"])
    sections: dict[str, list[str]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {_toml_value(value)}")
    mb = job.micro_batch_size
    lines = [f"# torchtitan job config (torchtitan 0.1/0.2 --job.config_file) written by piper-sim {source}".rstrip(),
             (f"# {job.world} ranks; per data-parallel rank {job.microbatches} micro-batch(es) (a count) of {mb} "
             f"sequence(s) (a size) = {job.local_batch} sequences per step"),
             comment_line(job, extra), ""]
    for section, rows in sections.items():
        lines += [f"[{section}]", *rows, ""]
    return "\n".join(lines)


def _check_export(job: Job) -> bool:
    """Refuse what torchtitan cannot run; return whether it applies FSDP."""
    if job.dtype not in DTYPES:
        raise InteropError(f"dtype {job.dtype}: torchtitan trains in bfloat16 or float32 "
                           f"({FIELDS['dtype'][1]}); use bf16 or fp32")
    if job.zero == 1:
        raise InteropError("zero 1: torchtitan has no ZeRO-1 (FSDP2 shards gradients too); use zero 2 "
                           "(fsdp_reshard_after_forward = \"never\") or zero 3, or export --megatron "
                           "(--use-distributed-optimizer)")
    others = job.pp > 1 or job.tp > 1 or job.cp > 1 or job.ep > 1
    if job.zero == 0 and job.cp > 1:
        raise InteropError("zero 0 with context_parallel: torchtitan always applies FSDP over the "
                           "context-parallel ranks (parallel_dims.py fsdp mesh = dp_shard x cp); use zero 2 or 3")
    if job.zero == 0 and job.dp > 1 and others:
        raise InteropError("zero 0 (DDP) with other parallelism: torchtitan runs DDP only as the sole parallelism "
                           "(models/llama3/infra/parallelize.py: 'DDP has not supported > 1D parallelism'); "
                           "use zero 2 or 3")
    if job.tp > 1 and not job.sp:
        raise InteropError("tensor_parallel without sequence_parallel: torchtitan's TP plans always shard the "
                           "norms over the sequence (SequenceParallel); set sequence_parallel true")
    if job.pp > 1 and job.schedule not in SCHEDULES:
        raise InteropError(f"schedule {job.schedule}: torch.distributed.pipelining has no schedule with this "
                           f"order (it places a stage on two ranks); choose one of "
                           f"{', '.join(SCHEDULES)} ({', '.join(SCHEDULES.values())})")
    fsdp = job.zero >= 2 and job.dp * job.cp > 1
    if job.ep > 1:
        shard = (job.dp_shard or job.dp) if fsdp else 1
        if (shard * job.cp) % job.ep:
            raise InteropError(f"expert_parallel {job.ep}: torchtitan takes the expert-parallel ranks from the FSDP "
                               f"ranks (data_parallel_shard_degree {shard} x context_parallel_degree {job.cp}); "
                               "use zero 2 or 3 over a multiple of the EP degree")
    return fsdp


# ----------------------------------------------------------------------------- import


def _get(data: dict, fact: str, default: Any) -> Any:
    section, name = FIELDS[fact][0].split(".")
    value = data.get(section, {}).get(name, default)
    return default if value is None else value


def _int(data: dict, fact: str, default: int, where: str) -> int:
    v = _get(data, fact, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InteropError(f"{where}: {FIELDS[fact][0]} must be an integer (got {v!r})")
    return v


def parse(text: str, where: str, cluster: str | None = None, model: Any = None) -> tuple[dict, list[str]]:
    """A torchtitan TOML job config -> (canonical strategy dict, warnings)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InteropError(f"{where}: not valid TOML ({' '.join(str(e).split())})") from None
    notes: list[str] = []
    ours = read_comment(text.splitlines(), where)
    if FLOAT8 in _get(data, "converters", []) or "float8" in _get(data, "converters", []):
        raise InteropError(f"{where}: model.converters float8 does not import; remove the converter and set the "
                           "strategy's stack fp8 (torchao's default float8 is tensorwise) to simulate the FP8 job")
    pp, tp, cp = (_int(data, k, 1, where) for k in ("pp", "tp", "cp"))
    ep, etp = _int(data, "ep", 1, where), _int(data, "etp", 1, where)
    rep, shard = _int(data, "dp_replicate", 1, where), _int(data, "dp_shard", -1, where)
    cluster = cluster or ours.get("cluster")
    if shard == -1:
        if not cluster:
            raise InteropError(f"{where}: parallelism.data_parallel_shard_degree = -1 (the remaining ranks) needs "
                               "the world size; pass --cluster (e.g. h100:4x8)")
        from costmodel.hardware import parse_cluster

        shard = exact_div(parse_cluster(cluster).world_size, rep * cp * tp * pp,
                          f"{where}: the cluster's ranks over replicate x cp x tp x pp")
    dp = rep * shard
    world = dp * cp * tp * pp
    if not cluster:
        cluster = f"h100:1x{world}" if world <= 8 else f"h100:{exact_div(world, 8, 'ranks in nodes of 8')}x8"
        notes.append(f"no cluster given: assuming {cluster} (pass --cluster)")
    fsdp = shard * cp > 1
    policy = _get(data, "reshard", "default")
    if fsdp:
        zero = {"always": 3, "never": 2, "default": 2 if pp > 1 else 3}.get(policy)
        if zero is None:
            raise InteropError(f"{where}: {FIELDS['reshard'][0]} = {policy!r}; expected default, always or never")
    else:
        zero = 0
    if ep > 1 and tp > 1 and etp != tp:
        raise InteropError(f"{where}: expert_tensor_parallel_degree {etp} with tensor_parallel_degree {tp} does not "
                           "map; piper-sim shards the experts over the TP ranks too (etp = tp)")
    local = _int(data, "local_batch", 8, where)
    global_batch = _int(data, "global_batch", -1, where)
    global_batch = local * dp if global_batch <= 0 else global_batch
    accum = exact_div(global_batch, local * dp, f"{where}: training.global_batch_size over local_batch_size x DP")
    if pp > 1:
        per_schedule = exact_div(local, _int(data, "micro_batch_size", 1, where),
                                 f"{where}: local_batch_size over pipeline_parallel_microbatch_size")
        microbatches = per_schedule * accum
        if accum > 1:
            notes.append(f"gradient accumulation of {accum} pipeline rounds is simulated as one schedule of "
                         f"{microbatches} micro-batches")
        name = canonical_schedule(str(_get(data, "schedule", "1F1B")))
        if name not in SCHEDULES:
            raise InteropError(f"{where}: {FIELDS['schedule'][0]} {_get(data, 'schedule', '')!r} has no piper-sim "
                               f"schedule; known: {', '.join(SCHEDULES.values())}")
    else:
        microbatches, name = accum, None
    model = model or ours.get("model") or _model_of(data, where)
    spr = 1
    if pp > 1:
        lps = _get(data, "layers_per_stage", None)
        if lps is None:  # torchtitan: one stage per rank for single-stage schedules, else two
            spr = 1 if name in ("gpipe", "1f1b") else 2
        else:
            spr = exact_div(_n_layers(model), pp * lps, f"{where}: the model's layers over PP x "
                            "pipeline_parallel_layers_per_stage")
    mode = _get(data, "recompute", "selective")
    option = str(_get(data, "selective_option", "2"))
    recompute = {"none": None, "full": "full"}.get(mode, "?")
    if mode == "selective":
        if option != "op":
            raise InteropError(f"{where}: activation_checkpoint selective_ac_option = {option!r} (full recompute of "
                               "every n-th layer; torchtitan's default when the section is absent) does not map: "
                               "piper-sim recomputes every layer alike; set mode \"full\", \"none\" or "
                               "selective_ac_option \"op\"")
        recompute = "selective"
    if recompute == "?":
        raise InteropError(f"{where}: activation_checkpoint.mode {mode!r} does not map; use none, full or selective")
    dtype = {v: k for k, v in DTYPES.items()}.get(_get(data, "dtype", "bfloat16"))
    style = {v: k for k, v in CP_STYLES.items()}.get(_get(data, "cp_style", "allgather"), "allgather")
    extra = {k: ours[k] for k in ("name", "seed", "stack", "data_parallel") if k in ours}
    if not ours:  # a torchtitan job of the user's: its stack (with the comment, the comment's stack)
        compile_on = bool(_get(data, "compile", False))
        extra["stack"] = {"preset": "torchtitan-compile" if compile_on else "torchtitan"}
        impl = _get(data, "optimizer", "fused")
        if impl != "foreach":
            extra["stack"]["optimizer"] = "fused" if impl == "fused" else "foreach"
    seed = _get(data, "seed", None)
    if seed is not None and "seed" not in extra:
        extra["seed"] = seed
    job = Job(model=model, cluster=cluster, global_batch=global_batch, seq_len=_int(data, "seq_len", 2048, where),
              microbatches=microbatches, dtype=dtype or "bf16", pp=pp, stages_per_rank=spr, schedule=name, dp=dp,
              zero=zero, dp_shard=shard if rep > 1 and fsdp else 0, tp=tp, sp=tp > 1, cp=cp, cp_style=style, ep=ep,
              recompute=recompute, extra=extra)
    return strategy_from_job(job), notes


def _n_layers(model: Any) -> int:
    from piper_sim.sources import resolve_model

    return resolve_model(model).n_layers


def _model_of(data: dict, where: str) -> str:
    name, flavor = _get(data, "model_name", "llama3"), _get(data, "flavor", "debugmodel")
    for ours, theirs in MODELS.items():
        if theirs == (name, flavor):
            return ours
    raise InteropError(f"{where}: model {name} flavor {flavor} has no piper-sim zoo model "
                       f"(known: {', '.join(f'{a}/{b}' for a, b in MODELS.values())}); pass --model")
