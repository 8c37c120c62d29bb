"""``piper-sim export`` and ``piper-sim import``: a plan or strategy to a torchtitan TOML job
config or Megatron-LM arguments, and back to a strategy (`piper_sim.interop`). Torch-free."""

from __future__ import annotations

import argparse
import json
import logging
import os

log = logging.getLogger("piper_sim.cli")


def cmd_export(args: argparse.Namespace) -> None:
    from piper_sim.files import write_text
    from piper_sim.interop import megatron, torchtitan
    from piper_sim.interop.common import job_from_strategy, load_source

    if not (args.torchtitan or args.megatron):
        raise ValueError("export: give --torchtitan JOB.toml and/or --megatron ARGS.txt")
    strategy = load_source(args.source)
    job = job_from_strategy(strategy)
    source = f"from {os.path.basename(args.source)}"
    texts = [(path, mod.export(job, source)) for path, mod in ((args.torchtitan, torchtitan),
                                                              (args.megatron, megatron)) if path]
    for path, text in texts:  # every target checked before any file is written
        write_text(path, text)
        print(f"wrote {path}: {strategy.short()} on {job.world} ranks, {job.microbatches} micro-batch(es) of "
              f"{job.micro_batch_size} sequence(s) per data-parallel rank")


def cmd_import(args: argparse.Namespace) -> None:
    from piper_sim.files import write_text
    from piper_sim.interop import megatron, torchtitan
    from piper_sim.strategy import parse_strategy

    with open(args.job) as f:
        text = f.read()
    out = args.out or os.path.splitext(args.job)[0] + ".strategy.json"
    fmt = args.format or ("torchtitan" if args.job.lower().endswith(".toml") else "megatron")
    files: dict[str, str] = {}
    if fmt == "torchtitan":
        strategy, notes = torchtitan.parse(text, args.job, cluster=args.cluster, model=args.model)
    else:
        model_file = os.path.splitext(out)[0] + ".model.json"
        strategy, notes, files = megatron.parse(text, args.job, cluster=args.cluster, model=args.model,
                                                model_file=model_file)
    for note in notes:
        log.warning(note)
    for path, body in files.items():
        write_text(path, body)
    write_text(out, json.dumps(strategy, indent=1) + "\n")
    s = parse_strategy(strategy)
    print(f"wrote {out}: {s.model if isinstance(s.model, str) else s.model['source']} on {s.cluster}, "
          f"{s.short()}; simulate it with `piper-sim simulate {out}`")


def add_interop_parsers(sub) -> None:
    e = sub.add_parser("export", help="write a plan's strategy as a torchtitan TOML job config or Megatron-LM "
                                      "arguments", description="""Write a plan's (or a strategy's) parallelism as a torchtitan TOML job config or
Megatron-LM command-line arguments, to run the same strategy there.

examples:
  piper-sim export plan.json --torchtitan job.toml
  piper-sim export plan.json --megatron args.txt""")
    e.add_argument("source", metavar="PLAN.json", help="a plan from `piper-sim compile` (or a strategy file)")
    e.add_argument("--torchtitan", metavar="JOB.toml", help="torchtitan job config to write (--job.config_file)")
    e.add_argument("--megatron", metavar="ARGS.txt", help="Megatron-LM arguments to write, one flag per line")
    e.set_defaults(func=cmd_export)
    i = sub.add_parser("import", help="read a torchtitan TOML job config or Megatron-LM arguments into a strategy",
                       description="""Read a torchtitan TOML job config or Megatron-LM arguments into a piper-sim strategy
file, to simulate or explore around a job you already run.

examples:
  piper-sim import job.toml -o strategy.json
  piper-sim import args.txt --cluster h100:4x8 --model llama3-8b""")
    i.add_argument("job", metavar="JOB.toml|ARGS.txt", help="torchtitan TOML (.toml) or Megatron arguments (else)")
    i.add_argument("--out", "-o", metavar="STRATEGY.json", help="strategy file to write (default: JOB.strategy.json)")
    i.add_argument("--format", choices=("torchtitan", "megatron"), help="default: by the file's suffix")
    i.add_argument("--cluster", help="the cluster the job runs on, e.g. h100:4x8 (Megatron: required unless the "
                                     "file has piper-sim's comment line)")
    i.add_argument("--model", help="the model (zoo name or model file) instead of the one the file names")
    i.set_defaults(func=cmd_import)
