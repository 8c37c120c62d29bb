"""The Python API the CLI and notebooks use."""

from __future__ import annotations

import logging
from typing import Any

from piper_sim.plan import Plan
from piper_sim.strategy import Strategy, load_strategy, parse_strategy


log = logging.getLogger(__name__)


def as_strategy(strategy: Strategy | dict[str, Any] | str) -> Strategy:
    """A Strategy from a Strategy, a dict, or a path to a strategy JSON file."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, dict):
        return parse_strategy(strategy)
    return load_strategy(strategy)


def compile(strategy: Strategy | dict[str, Any] | str, validate: bool = True, model: Any = None) -> Plan:
    """Compile a strategy into a validated Plan. ``model``: a user model
    (`piper_sim.annotate.annotate`) or a factory returning one, in place of the strategy's
    model; ``piper-sim run`` of the plan needs a module-level (importable) factory."""
    from piper_sim.compiler import compile_strategy
    from piper_sim.validate import validate_plan

    plan = compile_strategy(as_strategy(strategy), model=model).plan
    if validate:
        validate_plan(plan)
    if log.isEnabledFor(logging.DEBUG):  # the hash serialises the plan
        log.debug("compiled %s: %d ranks in %d classes, hash %s", plan.meta.get("model"), plan.world_size,
                  len(plan.classes), plan.content_hash())
    return plan
