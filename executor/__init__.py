"""piper-sim executor: replay a compiled Plan with torch.distributed, one process per rank.

    piper-sim run PLAN.json --steps 3 --json --check          # torchrun under the hood
    torchrun --nproc-per-node 2 -m executor PLAN.json [...]   # the same workers, directly
    torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --nproc-per-node 1 \\
        -m executor PLAN.json                                 # on each node

Modules: `worker` (what a torchrun worker does: checks, steps, trace, check, checkpoint),
`runtime` (the per-rank issuing loop, compute and send/receive), `parallel` (one module per
parallelism axis: its set-up, hooks and instruction handlers), `stage` (stage modules,
flat parameter buffers / ZeRO shards, BI/BW backward split), `lr` (AdamW's hyperparameters
and the learning-rate schedule), `collectives` (process groups, p2p tags, completion
notices, gloo's faster forms of all-gather and reduce-scatter), `data` (seeded synthetic
batches), `reference` (the single-process reference for ``--check``), `checkpoint`
(torch.distributed.checkpoint), `baselines` (DDP, DDP + ZeroRedundancyOptimizer, FSDP2 and
torch.distributed.pipelining peers), `options` (the run options and pre-launch checks that
``piper-sim run`` (`piper_sim.cli.run`) and the workers share), `lifetime` (no orphans),
`heartbeat` and `failures` (naming the rank that hung or failed first). The calibration
microbenchmarks behind ``piper-sim calibrate`` are the `calibration` package.
"""
