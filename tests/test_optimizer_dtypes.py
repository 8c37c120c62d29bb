"""The dtypes the optimizer stores (costmodel.stack ``grad_dtype``, ``master_dtype``,
``moment_dtype``): a rank's model states and the optimizer step's bytes as closed forms, the
bad values refused in one line, and a DeepSeek-V3-like run's memory as Megatron stores it."""

import dataclasses
import itertools

import pytest

from costmodel.compute import ADAM_BYTES_PER_PARAM, adam_step_bytes
from costmodel.memory import adam_state_bytes
from costmodel.stack import DEFAULT, GRAD_DTYPES, MASTER_DTYPES, MOMENT_DTYPES, Stack, StackError, parse_stack
from piper_sim.api import compile
from piper_sim.compiler import build_dag
from piper_sim.parallel.data import static_memory
from piper_sim.simulator import simulate
from piper_sim.strategy import StrategyError, parse_strategy

COMBOS = list(itertools.product(GRAD_DTYPES, MASTER_DTYPES, MOMENT_DTYPES))
# Megatron-Bridge's DeepSeek-V3 recipe (recipes/deepseek/deepseek_v3.py:279-283 @1804c076f,
# grad_reduce_in_fp32 False): precision-aware, Megatron's own fp32 master, bf16 moments
BRIDGE_DSV3 = {"preset": "megatron-te", "reduce_dtype": "compute", "moment_dtype": "bf16"}
# Megatron-LM's --use-precision-aware-optimizer on bf16 (fp8 recipe 'delayed' by default): TE FusedAdam
# keeps the master as int16 remainders (costmodel.stack docstring)
MEGATRON_LM_PA = {**BRIDGE_DSV3, "master_dtype": "remainder"}


def _strategy(zero: int = 1, stack=None, model: str = "gpt-tiny", ep: int = 0, dtype: str = "bf16") -> dict:
    d = [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
         {"op": "data_parallel", "degree": 2, "zero": zero}]
    if ep:
        d.append({"op": "expert_parallel", "degree": ep})
    out = {"model": model, "cluster": "cpu:4", "global_batch": 4, "seq_len": 32, "microbatches": 2,
           "dtype": dtype, "directives": d}
    return {**out, "stack": stack} if stack is not None else out


def _per_param(grad: str, master: str, moment: str, zero: int, n: int, p: int = 2) -> float:
    """The closed form, bf16 parameters sharded over ``n`` ranks: parameter p, gradient buffer g,
    master copy w, two moments 2m; ZeRO-1 shards w + 2m, ZeRO-2 g too, ZeRO-3 p too."""
    g = 4 if grad == "fp32" else p
    w = {"fp32": 4, "remainder": 2, "none": 0}[master]
    m = 4 if moment == "fp32" else 2
    opt = w + 2 * m
    return {0: p + g + opt, 1: p + g + opt / n, 2: p + (g + opt) / n, 3: (p + g + opt) / n}[zero]


def test_model_state_bytes_per_parameter_are_the_closed_forms():
    """Every combination at ZeRO 0-3: the bytes a rank holds per parameter equal `_per_param`
    (e.g. Megatron precision-aware with remainders at ZeRO-1: 2 + 2 + (2 + 2 + 2)/dp)."""
    _, ctx, _ = build_dag(parse_strategy(_strategy()))
    groups = ctx.param_groups(0)
    assert len(groups) == 1 and groups[0][1] == 2  # one dense group sharded over DP 2
    params = groups[0][0]
    for (grad, master, moment), zero in itertools.product(COMBOS, (0, 1, 2, 3)):
        st = Stack(grad_dtype=grad, master_dtype=master, moment_dtype=moment)
        got = sum(static_memory(dataclasses.replace(ctx, stack=st), 0, zero).values())
        assert got == pytest.approx(params * _per_param(grad, master, moment, zero, 2)), (grad, master, moment, zero)
    # the defaults are piper-sim's historical count: 4 + 12/N at ZeRO-1 (costmodel.memory docstring)
    assert (DEFAULT.grad_dtype, DEFAULT.master_dtype, DEFAULT.moment_dtype) == ("compute", "fp32", "fp32")
    assert _per_param("compute", "fp32", "fp32", 1, 2) == 4 + 12 / 2
    assert _per_param("compute", "remainder", "bf16", 1, 64) == 2 + 2 + 6 / 64


def test_fp32_parameters_have_no_master_and_fp16_refuses_remainders():
    assert adam_state_bytes(4) == 8 and adam_state_bytes(2) == 12  # the defaults, as before
    for _, master, moment in COMBOS:  # the fp32 parameters are the master weights
        st = Stack(master_dtype=master, moment_dtype=moment)
        assert adam_state_bytes(4, st) == (8 if moment == "fp32" else 4)
    parse_strategy(_strategy(stack={"master_dtype": "remainder"}, dtype="fp32"))  # no master to split
    with pytest.raises(StrategyError, match="master_dtype 'remainder' needs bf16 parameters .*use master_dtype fp32"):
        parse_strategy(_strategy(stack={"master_dtype": "remainder"}, dtype="fp16"))


def test_optimizer_step_bytes_are_the_closed_forms_and_reach_the_plan():
    """Fused AdamW per parameter: read g, read+write w and both moments, write p (read it too
    when no separate fp32 master exists). The default is the 28 B the optimizer time always used."""
    assert adam_step_bytes(DEFAULT, 2) == ADAM_BYTES_PER_PARAM == 28
    assert adam_step_bytes(DEFAULT, 4) == 28  # fp32: read+write p, no master
    for grad, master, moment in COMBOS:
        st = Stack(grad_dtype=grad, master_dtype=master, moment_dtype=moment)
        g, w, m = (4 if grad == "fp32" else 2), {"fp32": 4, "remainder": 2, "none": 0}[master], (4 if moment == "fp32" else 2)
        p_traffic = 2 if master == "fp32" else 4
        assert adam_step_bytes(st, 2) == g + p_traffic + 2 * w + 4 * m, (grad, master, moment)
    assert adam_step_bytes(parse_stack(MEGATRON_LM_PA), 2) == 2 + 4 + 4 + 8  # TE's remainder kernel: 18 B
    assert adam_step_bytes(parse_stack(BRIDGE_DSV3), 2) == 2 + 2 + 8 + 8
    # the plan's OPT ops move those bytes (fused: ratio 1), for the rank's shard
    base, bridge = (compile(_strategy(stack=s)) for s in (None, MEGATRON_LM_PA))
    opt = [[i.bytes for i in p.classes[0].instructions() if i.kind == "OPT"] for p in (base, bridge)]
    assert opt[0] and [b / a for a, b in zip(*opt)] == pytest.approx([18 / 28] * len(opt[0]))


def test_bad_values_are_one_line_errors_and_describe_shows_what_differs():
    for field, bad in (("grad_dtype", "bf16"), ("master_dtype", "fp16"), ("moment_dtype", "fp8")):
        with pytest.raises(StackError, match=f"^strategy field 'stack': {field} must be one of .* \\(got '{bad}'\\)$"):
            parse_stack({field: bad})
    with pytest.raises(StrategyError, match="moment_dtype must be one of fp32, bf16"):
        parse_strategy(_strategy(stack={"moment_dtype": "int8"}))
    assert "master" not in DEFAULT.describe() and "grad buffer" not in DEFAULT.describe()
    text = parse_stack({**MEGATRON_LM_PA, "grad_dtype": "fp32"}).describe()
    assert "grad reduce compute, grad buffer fp32, master remainder, Adam moments bf16," in text, text
    assert parse_strategy(parse_strategy(_strategy(stack=MEGATRON_LM_PA)).to_json()).stack == parse_stack(MEGATRON_LM_PA)


def test_deepseek_v3_like_run_holds_less_as_megatron_stores_it():
    """A MoE run with PP, EP and ZeRO-1 DP: Megatron-Bridge's recipe (fp32 master, bf16 moments)
    drops each rank's optimizer state by (12 - 8) B per parameter of its shards, Megatron-LM's
    precision-aware optimizer with remainders by (12 - 6) B, and nothing else changes: the
    simulated peak drops by exactly that. The DeepSeek-V3 report's (fp32 master and gradients,
    bf16 moments, §3.3.3) trades 4 B of moments on the shard for 2 B more gradient on every parameter."""
    strat = _strategy(model="moe-tiny", ep=2)
    _, ctx, _ = build_dag(parse_strategy(strat))
    groups = {s: ctx.param_groups(s) for s in ctx.layout.stage_ranks}
    assert any(n != groups[0][0][1] for _, n in groups[0])  # experts shard over fewer ranks than the dense part
    sims = {k: simulate(compile({**strat, "stack": st})) for k, st in
            (("base", "megatron-te"), ("bridge", BRIDGE_DSV3), ("megatron-lm", MEGATRON_LM_PA),
             ("report", {"preset": "megatron-te", "grad_dtype": "fp32", "moment_dtype": "bf16"}))}
    for pp_rank, stage in ((0, 0), (1, 1)):
        base, bridge, mlm, report = (next(r for r in sims[k].rank_stats if r.pp_rank == pp_rank) for k in sims)
        shard = sum(c / n for c, n in groups[stage])
        whole = sum(c for c, _ in groups[stage])
        for run, drop in ((bridge, 4), (mlm, 6)):
            assert base.optimizer_bytes - run.optimizer_bytes == pytest.approx(drop * shard)
            assert (run.params_bytes, run.grads_bytes) == (base.params_bytes, base.grads_bytes)
            assert base.peak_memory_bytes - run.peak_memory_bytes == pytest.approx(drop * shard)
        assert report.optimizer_bytes == pytest.approx(bridge.optimizer_bytes)
        assert report.grads_bytes == pytest.approx(2 * base.grads_bytes) == pytest.approx(4 * whole)


def test_executor_says_the_stored_dtypes_are_simulate_only():
    """torch's AdamW keeps its state in the parameters' dtype: `piper-sim run` names the fields it ignores."""
    from executor.options import stack_settings

    _, notice = stack_settings(compile(_strategy(stack=MEGATRON_LM_PA)))
    assert "master_dtype remainder, moment_dtype bf16 (simulate-only" in notice, notice
    assert "simulate-only" not in stack_settings(compile(_strategy(stack="megatron-te")))[1]
