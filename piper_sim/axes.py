"""The registry of parallelism techniques: one `Axis` entry per technique, in the order its
passes run (torchtitan's one ``apply_*`` per technique, as a table).

An entry owns its IR passes (each tagged with a phase of `piper_sim.ir.PHASES`) and its
checks of a resolved setup against the model and cluster. The compiler runs the passes and
the checks through this table only; generic code (the IR driver, the compiler, the
simulator and the runtime loop) never branches on an axis name. A new technique is its
module in `piper_sim.parallel` plus one line in `AXES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from piper_sim.ir import Pass
from piper_sim.parallel import context, data, expert, hybrid, memory, pipeline, tensor, tied

# what the compiler and the explorer share with the techniques (they reach them only here)
BW_KEEP_FRACTION, held_after = memory.BW_KEEP_FRACTION, memory.held_after
cp_error, cp_memory, cp_segments, gathered_kv_bytes = (context.cp_error, context.cp_memory, context.cp_segments,
                                                        context.gathered_kv_bytes)
static_memory, unit_buckets = data.static_memory, data.unit_buckets
attn_grad_width = tensor.attn_grad_width
# the techniques' own comm streams in words (`piper_sim.explain` names exposed communication by stream)
STREAM_WORDS = {**tensor.STREAM_WORDS, **context.STREAM_WORDS, **tied.STREAM_WORDS}

Check = Callable[..., None]  # (model config, setup, strategy, cluster) -> None; raises StrategyError
# (an explorer candidate, GPUs per node) -> the variants the technique adds to it, each a tuple of
# (directive op, field, value) settings (`explore.Candidate.options`)
Explore = Callable[..., list[tuple[tuple[str, str, object], ...]]]


@dataclass(frozen=True)
class Axis:
    """A parallelism technique: its name (the mesh axis or directive it owns), its passes as
    ``(phase, pass)``, its checks and its explorer dimension (variants of a candidate)."""

    name: str
    passes: tuple[tuple[str, Pass], ...] = ()
    check: Check | None = None
    explore: Explore | None = None


AXES: tuple[Axis, ...] = (
    Axis("pp", passes=(("build", pipeline.build_pass), ("order", pipeline.sequence_pass))),
    Axis("ep", passes=(("pieces", expert.piece_pass),), check=expert.check),
    Axis("tp", passes=(("layer", tensor.tensor_pass), ("edges", tensor.norms_after_zero3_pass),
                       ("edges", tensor.compute_waits_edges)),
         check=tensor.check),
    Axis("recompute", passes=(("layer", memory.recompute_pass), ("layer", memory.activation_memory_pass))),
    Axis("cp", passes=(("layer", context.context_pass), ("edges", context.context_edges)), check=context.check),
    Axis("dp", passes=(("sync", data.replicate_pass), ("sync", data.optimizer_pass), ("edges", data.prefetch_edges),
                       ("memory", data.grad_bucket_memory))),
    Axis("tied", passes=(("sync", tied.tied_embedding_pass),)),  # before hsdp: its syncs are the DP ones
    Axis("hsdp", passes=(("sync", hybrid.replica_allreduce_pass),), check=hybrid.check, explore=hybrid.explore),
)


def passes() -> list[tuple[str, Pass]]:
    """Every registered pass, in registry order (`piper_sim.ir.run_passes` orders them by phase)."""
    return [p for axis in AXES for p in axis.passes]


def check_setup(cfg, setup, strategy, cluster) -> None:
    """Run every axis's checks (each raises `StrategyError` naming its directive)."""
    for axis in AXES:
        if axis.check is not None:
            axis.check(cfg, setup, strategy, cluster)


def explore_options(candidate, gpus_per_node: int) -> list[tuple[tuple[str, str, object], ...]]:
    """Every registered technique's variants of an explorer candidate (`Axis.explore`)."""
    return [o for axis in AXES if axis.explore is not None for o in axis.explore(candidate, gpus_per_node)]
