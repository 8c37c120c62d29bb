"""Megatron-LM command-line arguments <-> a strategy.

An arguments file holds one ``--flag [value]`` per line (``#`` comments), as passed to
``pretrain_gpt.py``; the importer also reads a pasted command line (tokens before the first
``--flag`` are skipped). Every flag is named in a table with its source: Megatron-LM
``megatron/training/arguments.py`` (many flags there are generated from the field of the same
name, dashes for underscores, of Megatron-Core's ``ModelParallelConfig``, ``TransformerConfig``
or ``DistributedDataParallelConfig``: the field is named then).

Megatron derives the data-parallel size from the world size (``WORLD_SIZE / (TP x PP x CP)``,
arguments.py validate_args), which no flag holds: the importer needs the cluster (``--cluster``
or the ``# piper-sim:`` comment line the exporter writes).

What does not map is refused with a one-line `InteropError` naming the feature: schedules
other than 1F1B, interleaved and combined 1F1B, hybrid sharding with ZeRO-2/3, a user ``nn.Module``,
sliding-window attention, and on import FP8 and recompute of some layers only.
"""

from __future__ import annotations

import shlex
from typing import Any

from piper_sim.interop.common import (
    InteropError,
    Job,
    comment_line,
    exact_div,
    read_comment,
    strategy_from_job,
    zoo_name_of,
)

ARGS = "megatron/training/arguments.py"
MPC = "megatron/core/model_parallel_config.py ModelParallelConfig"
TC = "megatron/core/transformer/transformer_config.py TransformerConfig"
DDP = "megatron/core/distributed/distributed_data_parallel_config.py DistributedDataParallelConfig"

# fact -> (flag, source)
FLAGS: dict[str, tuple[str, str]] = {
    "tp": ("--tensor-model-parallel-size", f"{ARGS}; {MPC}.tensor_model_parallel_size"),
    "sp": ("--sequence-parallel", f"{ARGS}; {MPC}.sequence_parallel"),
    "pp": ("--pipeline-model-parallel-size", f"{ARGS}; {MPC}.pipeline_model_parallel_size"),
    "vpp_layers": ("--num-layers-per-virtual-pipeline-stage", f"{ARGS} (-> {MPC}.virtual_pipeline_model_parallel_size)"),
    "vpp": ("--num-virtual-stages-per-pipeline-rank", f"{ARGS} (-> {MPC}.virtual_pipeline_model_parallel_size)"),
    "cp": ("--context-parallel-size", f"{ARGS}; {MPC}.context_parallel_size"),
    "cp_style": ("--cp-comm-type", f"{ARGS}; {TC}.cp_comm_type"),
    "ep": ("--expert-model-parallel-size", f"{ARGS}; {MPC}.expert_model_parallel_size"),
    "etp": ("--expert-tensor-parallel-size", f"{ARGS}; {MPC}.expert_tensor_parallel_size (default: TP)"),
    "micro_batch_size": ("--micro-batch-size", f"{ARGS} (a SIZE: sequences per micro-batch per DP rank)"),
    "global_batch": ("--global-batch-size", f"{ARGS} (micro-batches = global / (micro-batch-size x DP))"),
    "seq_len": ("--seq-length", f"{ARGS}"),
    "zero1": ("--use-distributed-optimizer", f"{ARGS}; {DDP}.use_distributed_optimizer (ZeRO-1)"),
    "dp_instances": ("--num-distributed-optimizer-instances",
                     f"{ARGS}; {DDP}.num_distributed_optimizer_instances (optimizer sharded within DP / n ranks)"),
    "fsdp": ("--use-megatron-fsdp", f"{ARGS}; {DDP}.use_megatron_fsdp"),
    "fsdp_strategy": ("--data-parallel-sharding-strategy", f"{ARGS}; {DDP}.data_parallel_sharding_strategy"),
    "torch_fsdp2": ("--use-torch-fsdp2", f"{ARGS} (torch FSDP2: ZeRO-3; import only)"),
    "overlap_param_gather": ("--overlap-param-gather", f"{ARGS}; {DDP}.overlap_param_gather"),
    "dispatcher": ("--moe-token-dispatcher-type", f"{ARGS}; {TC}.moe_token_dispatcher_type (the plan's expert "
                   "all-to-all: alltoall; Megatron's default is allgather)"),
    "ep_a2a_overlap": ("--overlap-moe-expert-parallel-comm",
                       f"{ARGS}; {MPC}.overlap_moe_expert_parallel_comm (combined 1F1B)"),
    "recompute_granularity": ("--recompute-granularity", f"{ARGS}; {TC}.recompute_granularity"),
    "recompute_method": ("--recompute-method", f"{ARGS}; {TC}.recompute_method"),
    "recompute_num_layers": ("--recompute-num-layers", f"{ARGS}; {TC}.recompute_num_layers"),
    "recompute_activations": ("--recompute-activations", f"{ARGS} (= --recompute-granularity selective; import only)"),
    "bf16": ("--bf16", f"{ARGS}; {MPC}.bf16"),
    "fp16": ("--fp16", f"{ARGS}; {MPC}.fp16"),
    "fp8": ("--fp8-format", f"{ARGS}; {TC}.fp8 (import: refused)"),
    "seed": ("--seed", f"{ARGS}"),
}

# ZeRO level -> flags (Megatron's distributed optimizer shards the optimizer state = ZeRO-1;
# Megatron-FSDP's sharding strategies optim / optim_grads / optim_grads_params = ZeRO-1/2/3)
ZERO: dict[int, list[str]] = {
    0: [],
    1: [FLAGS["zero1"][0]],
    2: [FLAGS["fsdp"][0], FLAGS["fsdp_strategy"][0], "optim_grads"],
    3: [FLAGS["fsdp"][0], FLAGS["fsdp_strategy"][0], "optim_grads_params"],
}
FSDP_STRATEGIES: dict[str, int] = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}

# our schedule -> what Megatron runs: 1F1B, and interleaved 1F1B with virtual stages
# (megatron/core/pipeline_parallel/schedules.py get_forward_backward_func)
SCHEDULES: dict[str, str] = {"1f1b": "1F1B (no virtual stages)",
                             "interleaved_1f1b": "interleaved 1F1B (--num-layers-per-virtual-pipeline-stage)",
                             "combined_1f1b": "combined 1F1B (interleaved, --overlap-moe-expert-parallel-comm; "
                                              "pipeline_parallel/combined_1f1b.py)"}

# our context-parallel style -> --cp-comm-type (TransformerConfig.cp_comm_type: p2p is ring
# attention, all_gather gathers K/V as Llama 3)
CP_STYLES: dict[str, str] = {"ring": "p2p", "allgather": "allgather"}

# our recompute mode -> flags (full: every layer of every stage, "uniform" chunks of one layer)
RECOMPUTE: dict[str, list[str]] = {
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
}

# ModelConfig field -> (flag, kind); kind: int, float, "flag" (store_true) [arguments.py
# _add_network_size_args, _add_moe_args, _add_mla_args; TransformerConfig fields]
MODEL_FLAGS: dict[str, tuple[str, str]] = {
    "n_layers": ("--num-layers", "int"),
    "hidden": ("--hidden-size", "int"),
    "n_heads": ("--num-attention-heads", "int"),
    "n_kv_heads": ("--num-query-groups", "int"),
    "ffn": ("--ffn-hidden-size", "int"),
    "vocab": ("--vocab-size", "int"),
    "max_seq": ("--max-position-embeddings", "int"),
    "kv_channels": ("--kv-channels", "int"),
    "norm_eps": ("--norm-epsilon", "float"),
    "qk_norm": ("--qk-layernorm", "flag"),
    "attn_bias": ("--add-qkv-bias", "flag"),
    "n_experts": ("--num-experts", "int"),
    "top_k": ("--moe-router-topk", "int"),
    "expert_ffn": ("--moe-ffn-hidden-size", "int"),
    "q_lora_rank": ("--q-lora-rank", "int"),
    "kv_lora_rank": ("--kv-lora-rank", "int"),
    "qk_nope_dim": ("--qk-head-dim", "int"),
    "qk_rope_dim": ("--qk-pos-emb-head-dim", "int"),
    "v_head_dim": ("--v-head-dim", "int"),
    # Megatron-LM's --mtp-num-layers -> TransformerConfig.mtp_num_layers (megatron-core 0.16.1
    # transformer/transformer_config.py:48): DeepSeek-V3's multi-token-prediction modules
    "mtp_layers": ("--mtp-num-layers", "int"),
}
# flags written from several fields (see _model_args): --group-query-attention, --swiglu,
# --normalization RMSNorm|LayerNorm, --untie-embeddings-and-output-weights,
# --position-embedding-type rope|none, --rotary-base, --disable-bias-linear, --hidden-dropout,
# --attention-dropout, --moe-shared-expert-intermediate-size, --moe-layer-freq,
# --multi-latent-attention, --moe-router-pre-softmax


def _model_args(cfg) -> list[list[str]]:
    from piper_sim.configs import ModelConfig

    if not isinstance(cfg, ModelConfig):
        raise InteropError("model: a user nn.Module (py:...) has no Megatron model arguments; "
                           "describe it as a model file (piper-sim models --json) to export it")
    if cfg.sliding_window:
        raise InteropError("model: sliding-window attention does not map to Megatron arguments here")
    if cfg.o_bias != cfg.mlp_bias:
        raise InteropError("model: o_bias and mlp_bias differ; Megatron's --disable-bias-linear sets both")
    if cfg.router_bias:
        raise InteropError("model: router_bias does not map to a Megatron argument")
    out: list[list[str]] = []
    for f, (flag, kind) in MODEL_FLAGS.items():
        v = getattr(cfg, f)
        if kind == "flag":
            if v:
                out.append([flag])
        elif f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "max_seq", "norm_eps") or v:
            if cfg.attention == "mla" and f == "n_kv_heads":
                continue
            out.append([flag, repr(v) if kind == "float" else str(v)])
    if cfg.n_kv_heads != cfg.n_heads and cfg.attention == "gqa":
        out.append(["--group-query-attention"])
    if cfg.mlp == "swiglu":
        out.append(["--swiglu"])
    out.append(["--normalization", "RMSNorm" if cfg.norm == "rms" else "LayerNorm"])
    if not cfg.tie_embeddings:
        out.append(["--untie-embeddings-and-output-weights"])
    out.append(["--position-embedding-type", "rope" if cfg.rope else "none"])
    if cfg.rope:
        out.append(["--rotary-base", str(int(cfg.rope_theta))])
    if not cfg.mlp_bias:
        out.append(["--disable-bias-linear"])
    out += [["--hidden-dropout", repr(cfg.dropout)], ["--attention-dropout", repr(cfg.dropout)]]
    if cfg.attention == "mla":
        out.append(["--multi-latent-attention"])
    if cfg.is_moe:
        if cfg.n_shared:
            out.append(["--moe-shared-expert-intermediate-size", str(cfg.n_shared * cfg.expert_ffn)])
        if cfg.first_dense:
            out.append(["--moe-layer-freq", f"([0]*{cfg.first_dense}+[1]*{cfg.n_layers - cfg.first_dense})"])
        if not cfg.norm_topk:
            out.append(["--moe-router-pre-softmax"])
    return out


def export(job: Job, source: str = "") -> str:
    """The arguments text of a job; `InteropError` for what Megatron cannot run."""
    from piper_sim.sources import resolve_model

    if job.pp > 1 and job.schedule not in SCHEDULES:
        raise InteropError(f"schedule {job.schedule}: Megatron runs 1F1B, interleaved and combined 1F1B only "
                           "(megatron/core/pipeline_parallel/schedules.py); choose 1f1b, interleaved_1f1b or "
                           "combined_1f1b")
    if job.dp_shard and job.zero >= 2:
        raise InteropError(f"data_parallel shard_degree {job.dp_shard} with zero {job.zero}: hybrid sharding maps "
                           "to Megatron only with the distributed optimizer (zero 1, "
                           "--num-distributed-optimizer-instances)")
    cfg = resolve_model(job.model)
    rows: list[list[str]] = [[FLAGS["tp"][0], str(job.tp)], [FLAGS["pp"][0], str(job.pp)]]
    if job.stages_per_rank > 1:
        if cfg.n_layers % (job.pp * job.stages_per_rank) == 0:
            rows.append([FLAGS["vpp_layers"][0], str(cfg.n_layers // (job.pp * job.stages_per_rank))])
        else:
            rows.append([FLAGS["vpp"][0], str(job.stages_per_rank)])
    if job.sp:
        rows.append([FLAGS["sp"][0]])
    rows.append([FLAGS["cp"][0], str(job.cp)])
    if job.cp > 1:
        rows.append([FLAGS["cp_style"][0], CP_STYLES[job.cp_style]])
    rows.append([FLAGS["ep"][0], str(job.ep)])
    if job.ep > 1:
        rows += [[FLAGS["etp"][0], str(job.tp)], [FLAGS["dispatcher"][0], "alltoall"]]
    rows += [[FLAGS["micro_batch_size"][0], str(job.micro_batch_size)],
             [FLAGS["global_batch"][0], str(job.global_batch)], [FLAGS["seq_len"][0], str(job.seq_len)]]
    zero = ZERO[job.zero]
    if zero:
        rows.append(zero[:1]) if len(zero) == 1 else rows.extend([zero[:1], zero[1:]])
    if job.dp_shard:
        rows.append([FLAGS["dp_instances"][0], str(job.dp // job.dp_shard)])
    if job.overlap_param_gather:
        rows.append([FLAGS["overlap_param_gather"][0]])
    if job.schedule == "combined_1f1b":
        rows.append([FLAGS["ep_a2a_overlap"][0]])
    if job.recompute:
        flags = RECOMPUTE[job.recompute]
        rows += [flags[i:i + 2] for i in range(0, len(flags), 2)]
    if job.dtype in ("bf16", "fp16"):
        rows.append([FLAGS[job.dtype][0]])
    rows.append([FLAGS["seed"][0], str(job.extra.get("seed", 0))])
    model_rows = _model_args(cfg)
    extra = {"model": job.model}
    dp = job.dp
    lines = [f"# Megatron-LM arguments (pretrain_gpt.py) written by piper-sim {source}".rstrip(),
             (f"# launch on {job.world} GPUs: data-parallel size {dp} = {job.world} / (TP {job.tp} x PP {job.pp} x "
             f"CP {job.cp}); {job.microbatches} micro-batch(es) (a count) of {job.micro_batch_size} sequence(s) "
             "(a size) per DP rank and step"),
             comment_line(job, extra),
             "# parallelism and batch"] + [" ".join(r) for r in rows] + \
        ["# model shape"] + [" ".join(r) for r in model_rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- import


def tokens(text: str) -> dict[str, list[str]]:
    """``--flag value...`` -> {flag: [values]} (a flag given twice: the last wins)."""
    out: dict[str, list[str]] = {}
    words: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        words += shlex.split(line.rstrip("\\"), comments=True)
    flag = None
    for w in words:
        if w.startswith("--"):
            flag, _, value = w.partition("=")
            out[flag] = [value] if value else []
        elif flag is not None:
            out[flag].append(w)
    return out


def _value(args: dict, flag: str, kind, default: Any, where: str) -> Any:
    if flag not in args:
        return default
    vals = args[flag]
    if kind == "flag":
        return True
    if len(vals) != 1:
        raise InteropError(f"{where}: {flag} needs one value (got {' '.join(vals) or 'none'})")
    try:
        return kind(vals[0])
    except ValueError:
        raise InteropError(f"{where}: {flag} {vals[0]!r} is not {'an integer' if kind is int else 'a number'}") \
            from None


def _model_of(args: dict, where: str) -> dict[str, Any]:
    """The ModelConfig fields of the model-shape flags."""
    fields: dict[str, Any] = {}
    for f, (flag, kind) in MODEL_FLAGS.items():
        v = _value(args, flag, {"int": int, "float": float, "flag": "flag"}[kind], None, where)
        if v is not None:
            fields[f] = v
    for need in ("n_layers", "hidden", "n_heads"):
        if need not in fields:
            raise InteropError(f"{where}: {MODEL_FLAGS[need][0]} is missing (the model's shape); pass --model instead")
    mla = "--multi-latent-attention" in args
    if mla:
        fields["attention"] = "mla"
    if mla or "--group-query-attention" not in args:  # Megatron reads --num-query-groups only with GQA
        fields["n_kv_heads"] = fields["n_heads"]
    fields.setdefault("ffn", 4 * fields["hidden"])
    fields.setdefault("vocab", 32000)
    fields["mlp"] = "swiglu" if "--swiglu" in args else "gelu"
    fields["norm"] = {"RMSNorm": "rms", "LayerNorm": "layer"}.get(_value(args, "--normalization", str, "LayerNorm",
                                                                         where), "layer")
    fields["tie_embeddings"] = "--untie-embeddings-and-output-weights" not in args
    fields["rope"] = _value(args, "--position-embedding-type", str, "learned_absolute", where) == "rope"
    fields["rope_theta"] = float(_value(args, "--rotary-base", int, 10000, where))
    bias = "--disable-bias-linear" not in args
    fields["o_bias"] = fields["mlp_bias"] = bias
    fields["dropout"] = _value(args, "--hidden-dropout", float, 0.1, where)
    if fields.get("n_experts"):
        shared = _value(args, "--moe-shared-expert-intermediate-size", int, 0, where)
        fields.setdefault("expert_ffn", fields["ffn"])
        fields["n_shared"] = shared // fields["expert_ffn"] if shared else 0
        freq = _value(args, "--moe-layer-freq", str, "1", where)
        if freq != "1":
            import re

            m = re.fullmatch(r"\(\[0\]\*(\d+)\+\[1\]\*(\d+)\)", freq.replace(" ", ""))
            if not m:
                raise InteropError(f"{where}: --moe-layer-freq {freq!r} does not map; piper-sim's MoE models have "
                                   "dense first layers then MoE layers, written ([0]*k+[1]*n)")
            fields["first_dense"] = int(m.group(1))
        fields["norm_topk"] = "--moe-router-pre-softmax" not in args
    if "max_seq" not in fields:
        fields["max_seq"] = _value(args, FLAGS["seq_len"][0], int, 4096, where)
    return fields


def parse(text: str, where: str, cluster: str | None = None, model: Any = None,
          model_file: str | None = None) -> tuple[dict, list[str], dict[str, str]]:
    """Megatron arguments -> (canonical strategy dict, warnings, {path: text} of a model file to write)."""
    import json

    args = tokens(text)
    ours = read_comment(text.splitlines(), where)
    notes: list[str] = []
    files: dict[str, str] = {}
    if FLAGS["fp8"][0] in args or "--fp8-recipe" in args:
        raise InteropError(f"{where}: --fp8-format does not import; remove it and set the strategy's stack fp8 "
                           "(--fp8-recipe tensorwise, blockwise or mxfp8) to simulate the FP8 job")
    cluster = cluster or ours.get("cluster")
    if not cluster:
        raise InteropError(f"{where}: Megatron arguments do not hold the world size (WORLD_SIZE); pass --cluster "
                           "(e.g. h100:2x8)")
    from costmodel.hardware import parse_cluster

    world = parse_cluster(cluster).world_size
    ints = {k: _value(args, FLAGS[k][0], int, 1, where) for k in ("tp", "pp", "cp", "ep")}
    tp, pp, cp, ep = ints["tp"], ints["pp"], ints["cp"], ints["ep"]
    dp = exact_div(world, tp * pp * cp, f"{where}: the cluster's {world} ranks over TP x PP x CP")
    etp = _value(args, FLAGS["etp"][0], int, tp, where)
    if ep > 1 and etp != tp:
        raise InteropError(f"{where}: --expert-tensor-parallel-size {etp} differs from TP {tp}; piper-sim shards "
                           "the experts over the TP ranks (etp = tp)")
    mbs = _value(args, FLAGS["micro_batch_size"][0], int, None, where)
    if mbs is None:
        raise InteropError(f"{where}: {FLAGS['micro_batch_size'][0]} is missing")
    global_batch = _value(args, FLAGS["global_batch"][0], int, mbs * dp, where)
    microbatches = exact_div(global_batch, mbs * dp, f"{where}: --global-batch-size over micro-batch-size x DP")
    seq_len = _value(args, FLAGS["seq_len"][0], int, None, where)
    if seq_len is None:
        raise InteropError(f"{where}: {FLAGS['seq_len'][0]} is missing")
    # model
    if model is None:
        model = ours.get("model")
    if model is None:
        from piper_sim.configs import config_from_dict

        fields = _model_of(args, where)
        cfg = config_from_dict({"name": "megatron-model", **fields}, where=where)
        model = zoo_name_of(cfg)
        if model is None:
            model = model_file or "megatron-model.json"
            files[model] = json.dumps({k: v for k, v in fields.items()}, indent=1) + "\n"
            notes.append(f"model: no zoo model has these shapes; wrote them to {model}")
    n_layers = _layers(model, args)
    # pipeline
    spr = 1
    if pp > 1:
        if FLAGS["vpp"][0] in args:
            spr = _value(args, FLAGS["vpp"][0], int, 1, where)
        elif FLAGS["vpp_layers"][0] in args:
            per = _value(args, FLAGS["vpp_layers"][0], int, 1, where)
            spr = exact_div(exact_div(n_layers, pp, f"{where}: --num-layers over PP"), per,
                            f"{where}: layers per pipeline rank over --num-layers-per-virtual-pipeline-stage")
    schedule = ("interleaved_1f1b" if spr > 1 else "1f1b") if pp > 1 else None
    if schedule == "interleaved_1f1b" and FLAGS["ep_a2a_overlap"][0] in args:
        schedule = "combined_1f1b"
    # data parallel
    zero = 1 if FLAGS["zero1"][0] in args else 0
    if FLAGS["fsdp"][0] in args:
        strat = _value(args, FLAGS["fsdp_strategy"][0], str, "optim_grads_params", where)
        if strat not in FSDP_STRATEGIES:
            raise InteropError(f"{where}: --data-parallel-sharding-strategy {strat!r}; expected "
                               + ", ".join(FSDP_STRATEGIES))
        zero = FSDP_STRATEGIES[strat]
    if FLAGS["torch_fsdp2"][0] in args:
        zero = 3
    instances = _value(args, FLAGS["dp_instances"][0], int, 1, where)
    dp_shard = exact_div(dp, instances, f"{where}: DP over --num-distributed-optimizer-instances") \
        if instances > 1 else 0
    # recompute
    recompute = None
    gran = _value(args, FLAGS["recompute_granularity"][0], str, None, where)
    if FLAGS["recompute_activations"][0] in args:
        gran = gran or "selective"
    if gran == "selective":
        recompute = "selective"
    elif gran == "full":
        method = _value(args, FLAGS["recompute_method"][0], str, None, where)
        k = _value(args, FLAGS["recompute_num_layers"][0], int, 1, where)
        per_chunk = n_layers // (pp * spr)
        if not (method == "uniform" or method == "block" and k >= per_chunk):
            raise InteropError(f"{where}: --recompute-method {method} --recompute-num-layers {k}: recompute of some "
                               "layers only does not map; piper-sim recomputes every layer (use uniform)")
        recompute = "full"
    elif gran is not None:
        raise InteropError(f"{where}: --recompute-granularity {gran!r}; expected full or selective")
    dtype = "bf16" if FLAGS["bf16"][0] in args else "fp16" if FLAGS["fp16"][0] in args else "fp32"
    cp_type = _value(args, FLAGS["cp_style"][0], str, "p2p", where) if cp > 1 else "allgather"
    style = {v: k for k, v in CP_STYLES.items()}.get(cp_type, "?")
    if cp_type == "all_gather":
        style = "allgather"
    if style == "?":
        raise InteropError(f"{where}: --cp-comm-type {cp_type}: piper-sim has ring (p2p) and all-gather CP only")
    extra = {k: ours[k] for k in ("name", "seed", "stack", "data_parallel") if k in ours}
    if not ours:
        extra["stack"] = {"preset": "megatron-te"}
        if "--seed" in args:
            extra["seed"] = _value(args, "--seed", int, 0, where)
    job = Job(model=model, cluster=cluster, global_batch=global_batch, seq_len=seq_len, microbatches=microbatches,
              dtype=dtype, pp=pp, stages_per_rank=spr, schedule=schedule, dp=dp, zero=zero, dp_shard=dp_shard, tp=tp,
              sp=tp > 1 and FLAGS["sp"][0] in args, cp=cp, cp_style=style, ep=ep, recompute=recompute,
              overlap_param_gather=FLAGS["overlap_param_gather"][0] in args, extra=extra)
    if extra.get("seed") == 0:
        extra.pop("seed")
    return strategy_from_job(job), notes, files


def _layers(model: Any, args: dict) -> int:
    if args.get("--num-layers"):
        try:
            return int(args["--num-layers"][0])
        except ValueError:
            pass
    from piper_sim.sources import resolve_model

    return resolve_model(model).n_layers
