"""piper-sim: programmable distributed training, simulator first.

The notebook API, imported lazily (``import piper_sim`` loads nothing heavy)::

    import piper_sim
    plan = piper_sim.compile(strategy)          # dict, Strategy or JSON path -> validated Plan
    plan = piper_sim.compile(strategy, model=my_factory)   # your own nn.Module (piper_sim.annotate)
    res = piper_sim.simulate(plan)              # SimResult: .per_rank, .events, .memory DataFrames
    fig = res.plot_timeline()                   # a matplotlib Figure
    print(res.explain())                        # where the step goes (piper_sim.explain.StepBreakdown)
    best = piper_sim.explore("llama3-8b", "h100:1x8", 64, 4096).table   # ranked DataFrame
    piper_sim.register_model("mine", "hf:path/to/config.json")   # then "model": "mine"

``piper_sim.explore`` is the explorer module, callable as `piper_sim.explore.explore`.

Layers (tests/test_layers.py): ``costmodel`` < this library < ``executor`` < the app
``piper_sim.cli``. This facade is the one exception to the rule that nothing imports upward: its
lazy attributes may reach any layer (they are looked up by name on first use, never at import).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "compile", "simulate", "explore", "register_model", "resolve_model"]

_LAZY = {"compile": ("piper_sim.api", "compile"), "simulate": ("piper_sim.simulator", "simulate"),
         "explore": ("piper_sim.explore", None), "register_model": ("piper_sim.sources", "register_model"),
         "resolve_model": ("piper_sim.sources", "resolve_model")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'piper_sim' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value


def __dir__() -> list[str]:
    return sorted(__all__)
