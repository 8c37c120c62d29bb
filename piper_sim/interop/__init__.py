"""Export a strategy to the job files of the trainers users run, and import theirs.

- `piper_sim.interop.torchtitan`: torchtitan's TOML job config (``--job.config_file``).
- `piper_sim.interop.megatron`: Megatron-LM's command-line arguments (``pretrain_gpt.py``).
- `piper_sim.interop.common`: the `Job` both read and write, the canonical strategy form,
  the ``# piper-sim: {json}`` comment line of settings no trainer field carries.

A strategy's ``microbatches`` is a COUNT; torchtitan's ``pipeline_parallel_microbatch_size`` and
Megatron's ``--micro-batch-size`` are SIZES. Standard library only (``tomllib`` for reading TOML).
"""
