"""The typed plan header (`piper_sim.header`): it reads back the very meta it was read from, and
the back ends read the run's settings through it, never as free ``meta`` keys."""

from __future__ import annotations

import json
import os
import re

import pytest

from piper_sim.header import ContextParallelHeader, MoEHeader, PlanHeader, TensorParallelHeader
from test_plan_hashes import MATRIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CP = {"model": "gpt-tiny", "cluster": "cpu:4", "global_batch": 4, "seq_len": 32, "microbatches": 2,
      "directives": [{"op": "pipeline", "degree": 1}, {"op": "data_parallel", "degree": 2},
                     {"op": "context_parallel", "degree": 2, "style": "ring"}, {"op": "recompute", "mode": "full"}]}
SHARD = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 2, "seq_len": 32, "microbatches": 2,
         "directives": [{"op": "pipeline", "degree": 1},
                        {"op": "shard_tensor", "degree": 2, "layers": [0], "embedding": False}]}
STRATEGIES = {**MATRIX, "gpt-cp2-ring-dp2": CP, "gpt-shard-tensor-layer0": SHARD}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_header_gives_back_the_meta_it_read(name):
    from piper_sim.compiler import compile_strategy

    plan = compile_strategy(STRATEGIES[name]).plan
    h = plan.header
    assert h.to_meta() == plan.meta
    assert json.dumps(h.to_meta()) == json.dumps(plan.meta)  # the same keys in the same order
    assert (h.model, h.dtype, h.seq_len, h.microbatches) == (plan.meta["model"], plan.meta["dtype"],
                                                             plan.meta["seq_len"], plan.meta["microbatches"])
    assert h.tp.degree == plan.layout.tp and h.cp.degree == plan.layout.cp


def test_typed_sections():
    from piper_sim.compiler import compile_strategy

    cp = compile_strategy(CP).plan.header
    assert cp.context_parallel == ContextParallelHeader(degree=2, style="ring")
    assert cp.recompute == {0: "full"} and cp.tensor_parallel is None
    shard = compile_strategy(SHARD).plan.header.tensor_parallel
    assert (shard.layers, shard.embedding, shard.head) == ([0], False, True)
    moe = compile_strategy(MATRIX["moe-ep2-pp1-dp2"]).plan.header
    assert moe.moe == MoEHeader(top_k=2, n_experts=4) and moe.zero == 0


def test_old_plans_read_with_the_defaults():
    """A meta without the optional keys reads as today's ``.get(key, default)`` did, and writes
    back without them; keys this version does not know survive."""
    h = PlanHeader.from_meta({"model": "gpt-tiny", "future_key": [1]})
    assert (h.zero, h.model_flops_per_step, h.recompute, h.moe, h.stack) == (0, 0.0, None, None, None)
    assert h.tp == TensorParallelHeader() and h.cp.style == "allgather"
    assert h.to_meta() == {"model": "gpt-tiny", "future_key": [1]}
    assert PlanHeader.from_meta({}).to_meta() == {}
    assert PlanHeader(model="m", zero=1).to_meta() == {"model": "m", "zero": 1, "model_flops_per_step": 0.0}


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.readlines()


@pytest.mark.parametrize("path", ["executor", "piper_sim/simulator.py"])
def test_back_ends_read_no_free_meta_keys(path):
    full = os.path.join(ROOT, path)
    files = [full] if full.endswith(".py") else \
        [os.path.join(d, f) for d, _, fs in os.walk(full) for f in fs if f.endswith(".py")]
    hits = [f"{os.path.relpath(f, ROOT)}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(_lines(f), 1) if re.search(r"meta\[|meta\.get\(", line)]
    assert not hits, "read the plan header (Plan.header), not meta:\n" + "\n".join(hits)
