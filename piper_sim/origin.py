"""Is a plan file what its own strategy compiles to? The check every back end makes on a plan
file (`piper_sim.validate.load_valid_plan`: ``simulate``, ``run`` and each worker).

A plan records the strategy it was compiled from (``meta.strategy``) and its model
(``meta.model_spec``, or the zoo model ``meta.model`` names, or a user model's factory in
``meta.user_model``). The content hash only says the file is what some writer wrote: an edited
plan can be re-hashed, and one with an all-reduce dropped, a collective moved to another group
or a stage's optimizer step missing would train wrong with exit 0. So the plan is compiled again
from its own strategy, with this piper-sim, and compared op by op with what it says runs:

- the layout, each rank class's ranks and stages, every stream and its order;
- each instruction's fields but the cost estimates (`COST_FIELDS`; a compute op's ``bytes``,
  its HBM traffic), so each collective with its group, payload, bucket and peers, each
  send/receive pair, each pass and each optimizer step are present exactly once, in order;
- ``meta`` but the strategy itself and the costs `META_COSTS`.

Cost estimates may be edited (``--no-hash-check``) to ask the simulator "what if this op were
slower?": they are checked only to be finite and non-negative. Anything else that differs is
refused with one line naming the rank class, stream and op, or the ``meta`` key. A plan written
by another piper-sim version whose compiler differs is refused the same way: recompile it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

from piper_sim.plan import COMPUTE_KINDS, Instruction, Plan, PlanError, PlanValidationError

# Instruction fields that are the cost model's estimates, not what runs (`piper_sim.plan.Instruction`)
COST_FIELDS = frozenset({"flops", "alloc", "free", "tokens", "gemm", "kernels", "expert_flops", "needed_at"})
NUMERIC_COSTS = ("flops", "bytes", "alloc", "free", "expert_flops")
META_COSTS = frozenset({"model_flops_per_step"})
META_INPUT = "strategy"  # what is recompiled, so not compared with itself
_FIELDS = [f.name for f in dataclasses.fields(Instruction)]
_RUN_FIELDS = [n for n in _FIELDS if n not in COST_FIELDS]


def check_op_counts(plan: Plan, compiled: Plan) -> None:
    """The cheap part first: the layout, and as many rank classes, streams and ops as ``compiled``
    (so a plan with an op copied 300,000 times is refused before anything walks it)."""
    if plan.layout.to_json() != compiled.layout.to_json():
        raise PlanValidationError(f"layout {plan.layout.to_json()} is not the strategy's "
                                  f"{compiled.layout.to_json()}; {_FIX}")
    if len(plan.classes) != len(compiled.classes):
        raise PlanValidationError(f"{len(plan.classes)} rank classes where the strategy compiles to "
                                  f"{len(compiled.classes)}; {_FIX}")
    for got, want in zip(plan.classes, compiled.classes):
        where = f"rank class {got.pp_rank}"
        if set(got.streams) != set(want.streams):
            raise PlanValidationError(f"{where}: streams {sorted(got.streams)} where the strategy compiles to "
                                      f"{sorted(want.streams)}; {_FIX}")
        for stream, ops in got.streams.items():
            if len(ops) != len(want.streams[stream]):
                raise PlanValidationError(f"{where} stream {stream!r}: {len(ops):,} ops where the strategy "
                                          f"compiles to {len(want.streams[stream]):,} "
                                          f"({_count_difference(ops, want.streams[stream])}); {_FIX}")


def check_same(plan: Plan, compiled: Plan) -> None:
    """``meta``, each rank class's ranks and stages, and every op in order, field by field but
    the cost estimates, as ``compiled``; the first difference is named. After `check_op_counts`
    (the streams compared here have the same lengths)."""
    _compare_meta(plan.meta, compiled.meta)
    for got, want in zip(plan.classes, compiled.classes):
        where = f"rank class {got.pp_rank}"
        if got.ranks != want.ranks or got.stages != want.stages:
            raise PlanValidationError(f"{where}: ranks or stages differ from the strategy's; {_FIX}")
        for stream, ops in got.streams.items():
            _compare_stream(f"{where} stream {stream!r}", ops, want.streams[stream])


_FIX = "the plan was edited after compiling: recompile its strategy (`piper-sim compile`)"


def recompile(plan: Plan) -> Plan:
    """The plan its own ``meta.strategy`` compiles to, with the model the plan records."""
    from piper_sim.annotate import AnnotationError, load_user_model
    from piper_sim.compiler import compile_strategy
    from piper_sim.configs import config_of
    from piper_sim.strategy import StrategyError, parse_strategy

    header = plan.header
    if not isinstance(header.strategy, dict):
        raise PlanValidationError("meta.strategy: the plan records no strategy to check it against; "
                                  "recompile it with this piper-sim")
    try:
        strategy = parse_strategy(header.strategy)
        if header.user_model is not None:
            um = header.user_model
            if not isinstance(um, dict) or not um.get("source"):
                raise PlanValidationError("meta.user_model: the model was given as an object, not an importable "
                                          "factory, so the plan cannot be checked or run; compile with a "
                                          "\"py:module:function\" model")
            return compile_strategy(strategy, model=load_user_model(um["source"], um.get("kwargs"))).plan
        strategy = dataclasses.replace(strategy, model=config_of(header))
        return compile_strategy(strategy).plan
    except (StrategyError, AnnotationError, PlanError, ValueError, TypeError, KeyError) as e:
        if isinstance(e, PlanValidationError):
            raise
        raise PlanValidationError(f"meta: the plan's own strategy and model do not compile ({e}); "
                                  "recompile it") from None


def check_costs(plan: Plan) -> None:
    """Every numeric cost field finite and non-negative (NaN flops would simulate as nothing)."""
    for c in plan.classes:
        for stream, ops in c.streams.items():
            for ins in ops:
                for name in NUMERIC_COSTS:
                    v = getattr(ins, name)
                    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                        raise PlanValidationError(f"rank class {c.pp_rank} stream {stream!r}: op {ins.id} field "
                                                  f"{name!r} is {v!r}; expected a finite number >= 0")


def _compare_meta(got: dict[str, Any], want: dict[str, Any]) -> None:
    skip = META_COSTS | {META_INPUT}
    for key in sorted((got.keys() | want.keys()) - skip):
        if got.get(key) != want.get(key):
            raise PlanValidationError(f"meta.{key} is {_short(got.get(key))} but the plan's strategy compiles to "
                                      f"{_short(want.get(key))}; {_FIX}")


def _compare_stream(where: str, got: list[Instruction], want: list[Instruction]) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a.id != b.id:
            raise PlanValidationError(f"{where}: op #{i} is {a.id} ({a.kind}) where the strategy compiles to "
                                      f"{b.id} ({b.kind}); {_FIX}")
        for name in _RUN_FIELDS:
            if name == "bytes" and a.kind in COMPUTE_KINDS and b.kind in COMPUTE_KINDS:
                continue  # a compute op's HBM traffic: a cost estimate
            if getattr(a, name) != getattr(b, name):
                raise PlanValidationError(f"{where}: op #{i} {a.id} ({a.kind}) has {name}={_short(getattr(a, name))} "
                                          f"where the strategy compiles to {b.id} ({b.kind}) with "
                                          f"{name}={_short(getattr(b, name))}; {_FIX}")


def _count_difference(got: list[Instruction], want: list[Instruction]) -> str:
    """What a stream has too many or too few of, by op id: the first such op."""
    have = Counter(i.id for i in got)
    need = Counter(i.id for i in want)
    for ins in want:
        if have[ins.id] < need[ins.id]:
            return f"it lacks {ins.id}"
    for ins in got:
        if have[ins.id] > need[ins.id]:
            return f"{ins.id} appears {have[ins.id]:,} times" if need[ins.id] else \
                f"it has an extra {ins.id}"
    return "the same ops"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
