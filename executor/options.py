"""What a ``piper-sim run`` launch and each torchrun worker share: the run options, and the
checks made before any process group starts (`preflight`, `refuse_tensor_parallel`).

The launcher itself (the ``run`` subcommand that starts torchrun) is app code in
`piper_sim.cli.run`; the worker (`executor.worker`) parses the same options. Imports no torch.
"""

from __future__ import annotations

import argparse
import glob
import os

from executor.lr import ADAMW, LRSchedule
from piper_sim.checks import arg_float, arg_int
from piper_sim.files import check_output_dir, check_output_file
from piper_sim.header import PlanHeader
from piper_sim.plan import Plan, PlanError


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by the worker and ``piper-sim run``."""
    p.add_argument("--steps", type=arg_int(1), default=1, help="training steps (default 1)")
    p.add_argument("--trace", metavar="OUT.json", help="Chrome trace of the last step, all ranks")
    p.add_argument("--timeline", metavar="OUT.png", help="timeline picture of the last step")
    p.add_argument("--kineto", metavar="DIR",
                   help="Kineto-shaped trace per rank of the last step in DIR (HolisticTraceAnalysis, Perfetto)")
    p.add_argument("--json", action="store_true", help="one JSON object per line: loss and step time per step")
    p.add_argument("--check", action="store_true",
                   help="also train a single-process reference and print max_abs/max_rel_param_diff")
    p.add_argument("--save", metavar="DIR", help="checkpoint after the last step into DIR/step-N "
                   "(torch.distributed.checkpoint, written atomically)")
    p.add_argument("--save-every", type=arg_int(0), default=0, metavar="K",
                   help="with --save: also checkpoint every K steps")
    p.add_argument("--keep", type=arg_int(1), default=2, metavar="N",
                   help="with --save: keep the newest N checkpoints (2)")
    p.add_argument("--resume", metavar="DIR", help="start from the newest complete checkpoint in DIR (any layout of the same model)")
    p.add_argument("--end-step", type=arg_int(1), metavar="T",
                   help="stop after step T-1 (set by `run --max-restarts`: a restarted worker resumes from the "
                        "newest checkpoint in --save and trains up to the same step)")
    p.add_argument("--timeout", type=arg_float(0.0), default=60.0,
                   help="seconds without progress before a rank gives up (default 60)")
    p.add_argument("--profile", metavar="DIR",
                   help="save a torch.profiler (Kineto) trace per rank in DIR: steps are ProfilerStep#N, "
                        "every plan op a record_function(op_id) range")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA for GPU clusters when available, else CPU")
    p.add_argument("--clip-grad-norm", type=arg_float(0.0), metavar="X",
                   help="clip gradients to global L2 norm X > 0 over all shards and stages (as clip_grad_norm_)")
    p.add_argument("--lr", type=arg_float(0.0), help="peak learning rate (default: the optimizer's, 1e-3)")
    p.add_argument("--warmup-steps", type=arg_int(0), default=0, metavar="N",
                   help="linear warm-up over the first N steps")
    p.add_argument("--lr-decay", choices=("constant", "linear", "cosine"), default="constant",
                   help="after warm-up: constant, or a decay to --min-lr-ratio x the peak at --decay-steps")
    p.add_argument("--decay-steps", type=arg_int(0), default=0, metavar="N", help="the step the decay ends at")
    p.add_argument("--min-lr-ratio", type=arg_float(0.0), default=0.1, help="final / peak learning rate (0.1)")
    p.add_argument("--override-lr-schedule", action="store_true",
                   help="--resume under this run's learning-rate options, not the ones the checkpoint was saved with")
    p.add_argument("--no-hash-check", action="store_true",
                   help="accept a plan whose cost estimates (flops, memory) were edited after "
                        "compiling; an edit to what runs is still refused")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --trace / --timeline file and the traces of an earlier run in "
                        "--kineto / --profile (refused by default)")


def refuse_unrunnable(plan: Plan, path: str) -> None:
    """Every refusal that depends on the plan alone, in the order ``piper-sim run`` makes them:
    tensor / context parallelism and recompute policies, a user model's factory, tied embeddings (and
    the embedding MTP modules share), MTP under a shard_tensor selection of layers."""
    refuse_tensor_parallel(plan, path)
    refuse_unbuildable_user_model(plan, path)
    refuse_tied_embeddings(plan, path)
    refuse_multi_token_prediction(plan, path)


def refuse_multi_token_prediction(plan: Plan, path: str) -> None:
    """DeepSeek-V3's multi-token-prediction modules (`ModelConfig.mtp_layers`) run with PP, DP /
    ZeRO, EP (`executor.stage`, the shared embedding across stages: `refuse_tied_embeddings`),
    tensor (+ sequence) parallelism (`executor.parallel.tensor.tp_mtp_input`) and context
    parallelism, both styles (`executor.parallel.context`: each rank reads the whole micro-batch,
    so its shifted tokens and targets need no roll over the cp group), with every schedule;
    under a ``shard_tensor`` selection of layers they are simulate-only."""
    from piper_sim.configs import config_of

    h = plan.header
    if h.user_model is not None or not config_of(h).mtp_layers:
        return
    if plan.layout.tp > 1 and h.tp.layers is not None:
        raise PlanError(f"{path}: model {h.model} has {config_of(h).mtp_layers} multi-token-prediction module(s) "
                        "(mtp_layers), which are simulate-only under a shard_tensor selection of layers in this "
                        "version; use `piper-sim simulate`")


def refuse_tensor_parallel(plan: Plan, path: str) -> None:
    """The executor runs tensor parallelism (with or without sequence parallelism) for the zoo's
    transformers (GQA or MLA; MoE with or without expert parallelism, SwiGLU or GELU experts,
    shared experts included: `executor.parallel.tensor`), and context parallelism
    (`refuse_context_parallel`): refuse what it cannot run before any process group starts."""
    refuse_context_parallel(plan, path)
    if plan.layout.tp == 1:
        return
    why = ""
    h = plan.header
    if (h.stack or {}).get("tp_overlap"):
        # the executor's TP collectives are synchronous: it would not run what the plan says
        why = "the stack's tp_overlap (collectives overlapped with the GEMMs; compile with tp_overlap false)"
    elif h.user_model is None:  # a user model's annotations were checked when it compiled
        from piper_sim.configs import config_of

        why = tp_unsupported(config_of(h), h)
    if why:
        raise PlanError(f"{path}: tensor parallel plans (tp {plan.layout.tp}) with {why} are simulate-only in this "
                        "version; use `piper-sim simulate`")


def refuse_context_parallel(plan: Plan, path: str) -> None:
    """The executor runs context parallelism (`executor.parallel.context`) for transformers
    of the zoo and model files with grouped-query or multi-head latent attention (sliding
    windows, qk_norm, MoE and dropout included); one line naming what it cannot run."""
    cp = plan.layout.cp
    if cp == 1:
        return
    h = plan.header
    if h.user_model is not None:
        raise PlanError(f"{path}: context_parallel (cp {cp}) with a user nn.Module model is simulate-only in this "
                        "version; use `piper-sim simulate`")


def tp_unsupported(cfg, header: PlanHeader) -> str:
    """What in this model and plan the executor cannot run tensor-parallel ('' when it can)."""
    tp = header.tp.degree
    checks = [
        (cfg.tie_embeddings and not (_tp_shards(header, "embed") == _tp_shards(header, "head")),
         "tied embeddings with only one of the embedding and the head sharded (shard_tensor)"),
        (cfg.vocab % tp != 0, f"vocab {cfg.vocab} not divisible by tp {tp}"),
    ]
    return next((why for bad, why in checks if bad), "")


def _tp_shards(header: PlanHeader, unit: str) -> bool:
    """Whether ``shard_tensor`` left the embedding / head tensor-parallel (the default)."""
    tp = header.tensor_parallel
    return tp is None or (tp.embedding if unit == "embed" else tp.head)


def refuse_unbuildable_user_model(plan: Plan, path: str) -> None:
    """A user model's plan must name a source every rank can rebuild it from (piper_sim.annotate)."""
    um = plan.header.user_model
    if um is None:
        return
    source = um.get("source")
    if not source:
        raise PlanError(f"{path}: user model {um.get('name')} was compiled from an object, not an importable "
                        "factory; compile with a module-level factory or a \"py:module:function\" model to run it")
    where = source[3:].rpartition(":")[0]
    if where.endswith(".py") and not os.path.isfile(where):
        raise PlanError(f"{path}: user model file {where} (source {source}) not found from {os.getcwd()}")


def refuse_tied_embeddings(plan: Plan, path: str) -> None:
    """A model with tied embeddings runs with its embedding and head on one stage (full
    backward passes, no BI/BW split, no ZeRO-3: the head's piece reuses the embedding's
    weight), or on the first and the last stage, the last holding its own copy whose gradient
    the plan's ``AR.embed`` sums with the first's once per step
    (`executor.parallel.tied`; Megatron-Core's embedding group). Refused before any process
    group starts."""
    from piper_sim.configs import config_of

    h = plan.header
    if h.user_model is not None or not (config_of(h).tie_embeddings or config_of(h).mtp_layers):
        return
    # an untied model's MTP modules read the embedding as a tied head does (the last stage's copy)
    what = "ties its embeddings (tie_embeddings)" if config_of(h).tie_embeddings else \
        "shares its embedding with its multi-token-prediction modules (mtp_layers)"
    units = h.stage_units
    stages = {u: s for s, names in enumerate(units) for u in names if u in ("embed", "head")}
    first, last = stages.get("embed"), stages.get("head")
    why = ""
    if first != last:
        if not any(i.tied for c in plan.classes for i in c.instructions()):
            why = (f"its embedding (stage {first}) and head (stage {last}) are on two stages but the plan has no "
                   "tied-embedding gradient all-reduce (AR.embed): recompile it")
        elif any(i.tied and (i.mb >= 0 or i.round >= 0) for c in plan.classes for i in c.instructions()):
            # a later micro-batch's backward may add to the gradient between the sum and the
            # reduce-scatter that takes it (executor.parallel.data): that share would miss the other copy
            why = (f"its embedding (stage {first}) and head (stage {last}) are on two stages and ZeRO-{h.zero} "
                   "reduce-scatters every micro-batch (use data_parallel reduce \"per_step\")")
    elif h.zero == 3:
        why = "ZeRO-3 gathers the head's unit without the embedding it reuses"
    elif any(i.kind == "BW" for c in plan.classes for i in c.instructions()):
        why = f"schedule {h.schedule} splits the backward (BI/BW) of the head's piece"
    if why:
        raise PlanError(f"{path}: model {h.model} {what} and {why}; "
                        "the executor cannot share that weight: simulate it" +
                        (", or untie the model" if config_of(h).tie_embeddings else ""))


# output folders -> the files of an earlier run they may hold, which this run would replace
OUTPUT_DIRS = {"kineto": "rank*.pt.trace.json", "profile": "rank*.json", "save": ""}


def check_outputs(args) -> None:
    """The output paths, before anything runs: a file option (``--trace``, ``--timeline``)
    is not a folder and its folder exists and is writable; a folder option (``--kineto``,
    ``--profile``, ``--save``) is not a file and can be created. Existing outputs are refused
    unless ``--force`` (``--save`` keeps and rotates its checkpoints); a worker restarted by
    torchrun may find its own. Creates nothing."""
    force = args.force or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    for name in ("trace", "timeline"):
        if getattr(args, name):
            check_output_file(getattr(args, name), f"--{name}", force)
    for name, earlier in OUTPUT_DIRS.items():
        path = getattr(args, name)
        if not path:
            continue
        check_output_dir(path, f"--{name}")
        if earlier and not force and glob.glob(os.path.join(glob.escape(path), earlier)):
            raise ValueError(f"--{name} {path}: holds the traces of an earlier run ({earlier}); pass --force to "
                             "replace them, or choose another folder")


def lr_schedule(args) -> LRSchedule | None:
    """The ``--lr`` options as a schedule (None: every step at the optimizer's own rate)."""
    if args.lr is None and args.warmup_steps == 0 and args.lr_decay == "constant":
        return None
    return LRSchedule(ADAMW["lr"] if args.lr is None else args.lr, args.warmup_steps, args.lr_decay,
                      args.decay_steps, args.min_lr_ratio)


def preflight(args, plans: list[Plan]) -> int:
    """What a launch needs beyond valid plans, checked by ``piper-sim run`` before torchrun
    and by every worker before its process group: the output paths (`check_outputs`), the
    checkpoint to resume, and that the
    test hooks PIPER_FAULT / PIPER_CKPT_KILL name a rank, step and op of this run.
    Returns the step the run starts from."""
    from executor import checkpoint

    checkpoint.check_kill_spec()
    check_outputs(args)
    if args.lr_decay != "constant" and args.decay_steps <= args.warmup_steps:
        raise PlanError(f"--lr-decay {args.lr_decay} needs --decay-steps after --warmup-steps ({args.warmup_steps}); "
                        f"got --decay-steps {args.decay_steps}")
    start = checkpoint.find(args.resume, plans[0].content_hash(), plans[0].world_size,
                            checkpoint.schedule_dict(lr_schedule(args)), args.override_lr_schedule,
                            plans[0].header.model)[1] \
        if args.resume else 0
    if args.end_step is not None and args.end_step <= start:
        raise PlanError(f"--end-step {args.end_step} is not after the resumed step {start}")
    if not os.environ.get("PIPER_FAULT"):
        return start
    from executor.runtime import Fault  # imports torch: only when a fault is injected

    try:
        fault = Fault.from_env()
        if fault.rank < 0 or fault.step < 0:
            raise ValueError("negative rank or step")
    except ValueError as e:
        msg = str(e) if str(e).startswith("PIPER_FAULT") else f"PIPER_FAULT={os.environ['PIPER_FAULT']!r}: {e}"
        if "expected" not in msg:
            msg += "; expected rank:step:op_id[:raise|kill|hang]"
        raise PlanError(msg) from None
    world = plans[0].world_size
    if fault.rank >= world:
        raise PlanError(f"PIPER_FAULT names rank {fault.rank}; the plan has ranks 0..{world - 1}")
    if not start <= fault.step < start + args.steps:
        raise PlanError(f"PIPER_FAULT names step {fault.step}; this run does steps {start}..{start + args.steps - 1}")
    if not any(fault.op_id == i.id for p in plans for i in p.class_of(fault.rank).instructions()):
        raise PlanError(f"PIPER_FAULT names op {fault.op_id}, which rank {fault.rank} does not run")
    return start


def stack_settings(plan: Plan) -> tuple[dict[str, str], str]:
    """What the executor does with the plan's training stack (the header's ``stack``, costmodel.stack):
    the environment its workers get (AdamW's implementation, ``PIPER_ADAMW``, as the stack
    says unless already set) and a one-line notice of the stack fields it runs and ignores
    ("" for a plan without a stack)."""
    from costmodel.stack import DEFAULT, parse_stack

    h = plan.header
    if not h.stack:
        return {}, ""
    stack = parse_stack(h.stack, f"{h.model or 'plan'} meta.stack")
    env = {} if os.environ.get("PIPER_ADAMW") else {"PIPER_ADAMW": stack.optimizer}
    if stack.expandable_segments and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:  # CUDA only; harmless on CPU
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    ignored = []
    if stack.attention != DEFAULT.attention:
        ignored.append(f"attention {stack.attention} (torch SDPA runs)")
    if stack.unpad:
        ignored.append("unpad (torch SDPA runs on the padded q, k, v)")
    # torch's F.rms_norm runs, uncompiled: its decomposition, or a fused kernel where the device's torch has one
    ignored.append(f"norms {stack.norms}, compile {'on' if stack.compile else 'off'} (torch's F.rms_norm runs, uncompiled)")
    if stack.dropout is not None:
        ignored.append(f"dropout {stack.dropout:g} (the model's dropout runs)")
    if stack.reduce_dtype != DEFAULT.reduce_dtype:
        ignored.append(f"reduce_dtype {stack.reduce_dtype} (gradients are reduced in the plan's dtype)")
    stored = [f"{k} {getattr(stack, k)}" for k in ("grad_dtype", "master_dtype", "moment_dtype")
              if getattr(stack, k) != getattr(DEFAULT, k)]
    if stored:  # the units are built in the plan's dtype; torch's AdamW state follows the parameters
        ignored.append(", ".join(stored) + " (simulate-only: gradients and AdamW's moments are kept in the plan's "
                       "dtype, with no master copy)")
    if stack.fp8 != DEFAULT.fp8:
        ignored.append(f"fp8 {stack.fp8} (simulate-only: the linears run in the plan's dtype)")
    if stack.tp_backward_overlap and plan.layout.tp > 1:
        ignored.append("tp_backward_overlap (the TP collectives run synchronously: same numbers, no overlap)")
    runs = f"AdamW {os.environ.get('PIPER_ADAMW') or stack.optimizer}" + \
        (", expandable segments (CUDA)" if stack.expandable_segments else "")
    name = f" {stack.preset!r}" if stack.preset else ""
    return env, f"the plan's stack{name}: runs {runs}; ignores " + "; ".join(ignored)
