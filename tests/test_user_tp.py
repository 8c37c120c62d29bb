"""Tensor (and sequence) parallelism on a user nn.Module (piper_sim.user_tp): the sharding
annotations and their one-line errors, the plan's TP ops lowered from the sharded units on
meta, and the executor against the single-process reference (torchrun, gloo, a small
Llama-shaped transformer of tests/data/user_models.py), with a negative control."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch.nn as nn
import torch.nn.functional as F

import piper_sim
from piper_sim.annotate import AnnotationError, annotate
from piper_sim.strategy import StrategyError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor import GRAD_TOL, TOL, json_lines, torchrun  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = f"py:{os.path.join(ROOT, 'tests', 'data', 'user_models.py')}:tiny_transformer"


def tp_strategy(tp: int = 2, sp: bool = False, pp: int = 1, dp: int = 1, zero: int = 1, m: int = 2,
                sched: str = "1f1b", extra: list | None = None, model=MODEL) -> dict:
    d: list[dict] = [{"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp}]
    if pp > 1:
        d += [{"op": "pipeline", "degree": pp, **({"stages_per_rank": 2} if sched == "zbv" else {})},
              {"op": "schedule", "name": sched}]
    if dp > 1:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    return {"model": model, "cluster": f"cpu:{tp * pp * dp}", "global_batch": 2 * dp * m, "seq_len": 16,
            "microbatches": m, "dtype": "fp32", "directives": d + (extra or [])}


def _batch(mbs, seq, device, dtype, seed):
    import torch

    return torch.zeros(mbs, seq, 8, device=device, dtype=dtype), torch.zeros(mbs, seq, 8, device=device, dtype=dtype)


# --------------------------------------------------------------------------- annotations


@pytest.mark.parametrize("plan,sp,needle", [
    ({"up": "sideways"}, False, "style 'sideways'; use \"colwise\" or \"rowwise\""),
    ({"nothing.*": "colwise"}, False, "pattern 'nothing.*' matches no submodule"),
    ({"pre.norm": "colwise"}, False, "module pre.norm is a LayerNorm; annotate nn.Linear"),
    ({"pre.emb": "colwise"}, False, "embedding pre.emb can only be \"rowwise\""),
    ({}, False, "non-empty dict"),
    (None, True, "sequence_parallel=True needs tensor_parallel annotations"),
])
def test_bad_sharding_annotations_are_one_line_errors(plan, sp, needle):
    class Pre(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.emb = nn.LayerNorm(8), nn.Embedding(4, 8)

        def forward(self, x):
            return self.norm(x)

    net = nn.Sequential()
    net.pre, net.up, net.down = Pre(), nn.Linear(8, 6), nn.Linear(6, 8)
    with pytest.raises(AnnotationError) as e:
        annotate(net, ["pre", "up", "down"], F.mse_loss, _batch, tensor_parallel=plan, sequence_parallel=sp)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs,strategy,needle", [
    ({}, dict(tp=3), r"degree 3 does not divide embed's num_embeddings 64 \(rowwise\)"),
    ({}, dict(tp=4), r"tp 4\) on meta failed \(RuntimeError: shape '\[2, 16, -1, 8\]' is invalid"),  # half a kv head
    ({"sequence_parallel": False}, dict(sp=True), "does not allow sequence_parallel"),
])
def test_degrees_the_annotations_do_not_allow_are_refused(kwargs, strategy, needle):
    s = tp_strategy(**strategy, model={"source": MODEL, "kwargs": kwargs})
    with pytest.raises(StrategyError, match=needle):
        piper_sim.compile(s)


def test_a_model_without_annotations_is_refused_by_name():
    s = tp_strategy(model=f"py:{os.path.join(ROOT, 'tests', 'data', 'user_models.py')}:residual_mlp")
    with pytest.raises(StrategyError, match="has no sharding annotations"):
        piper_sim.compile(s)


def test_a_forward_that_hard_codes_the_width_is_one_line_at_compile():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.a(x).view(x.shape[0], x.shape[1], 2, 4).flatten(2))

    def factory():
        return annotate(nn.Sequential(Fixed()), ["0"], F.mse_loss, _batch,
                        tensor_parallel={"0.a": "colwise", "0.b": "rowwise"})
    with pytest.raises(StrategyError) as e:
        piper_sim.compile(tp_strategy(model="mine"), model=factory)
    assert "forward on one tensor-parallel rank's shards (tp 2) on meta failed" in str(e.value)
    assert "reshape the sharded linears' outputs with -1" in str(e.value) and "\n" not in str(e.value)


def test_a_column_parallel_output_no_row_parallel_linear_reduces_is_refused():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(8, 6)

        def forward(self, x):
            return self.out(x)

    def factory():
        return annotate(nn.Sequential(nn.Linear(8, 8), Head()), ["0", "1"], lambda y, t: y.float().mean(), _batch,
                        tensor_parallel={"1.out": "colwise"})
    with pytest.raises(StrategyError) as e:
        piper_sim.compile(tp_strategy(model="mine"), model=factory)
    assert "unit 1 hands on the output of column-parallel 1.out" in str(e.value) and "\n" not in str(e.value)


def test_partial_weights_are_traced_through_functional_use():
    """A weight used inside the column-to-row region (a per-head gain, read by the parent module's
    own forward, and a transposed copy of it) gets a partial gradient per rank; one used on the
    reduced output (a layer scale) a whole one, unless sequence parallelism splits the tokens."""
    import torch

    from piper_sim.user_tp import analyse_units

    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wo = nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
            self.gain = nn.Parameter(torch.ones(4))
            self.bend = nn.Parameter(torch.ones(4, 4))
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            q = self.wq(x)
            q = q.view(*q.shape[:2], -1, 4) * self.gain @ self.bend.t()
            return x + self.scale * self.wo(q.flatten(2))

    model = annotate(nn.Sequential(nn.Linear(8, 8), Mix()), ["0", "1"], F.mse_loss, _batch,
                     tensor_parallel={"1.wq": "colwise", "1.wo": "rowwise"})
    plain = analyse_units(model, 2, 4, torch.float32, 2, sp=False)["1"]
    assert plain.partial == {"1.gain", "1.bend"} and plain.partial_params == 4 + 16
    sp = analyse_units(model, 2, 4, torch.float32, 2, sp=True)
    assert sp["1"].partial == {"1.gain", "1.bend", "1.scale", "1.wo.bias"}
    assert sp["0"].partial == {"0.weight", "0.bias"}  # a replicated unit on the rank's tokens
    assert [x[:2] for x in plain.ops["B"]] == [("1.wq.ar", "ALLREDUCE")]
    assert [x[:2] for x in sp["1"].ops["F"]] == [("1.wq.ag", "ALL_GATHER"), ("1.wo.rs", "REDUCE_SCATTER")]


# --------------------------------------------------------------------------- the plan


def _tp_ops(plan) -> list[tuple[str, str, float]]:
    return [(i.id, i.kind, i.bytes) for i in plan.classes[0].streams["tp"]]


def test_plan_lists_the_megatron_collectives_of_the_annotations():
    """TP2, one micro-batch of 2 x 16 tokens, width 32 (4 KiB of fp32 activations): q/k/v share
    one ``f`` and w1/w3 another; wo, w2 and the vocabulary-parallel embedding all-reduce
    forward; the qk norm's partial gradient is summed (TP.s0.norms). With SP: gathers and
    scatters, the token ids gathered for the embedding, every replicated weight summed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, sp = piper_sim.compile(tp_strategy(m=1)), piper_sim.compile(tp_strategy(m=1, sp=True))
    act = 2 * 16 * 32 * 4.0
    f = [(f"TP.F.s0.mb0.{n}.ar", "ALLREDUCE", act) for n in
         ("embed", "blocks.0.attn.wo", "blocks.0.ffn.w2", "blocks.1.attn.wo", "blocks.1.ffn.w2")]
    b = [(f"TP.B.s0.mb0.{n}.ar", "ALLREDUCE", act) for n in
         ("blocks.1.ffn.w1", "blocks.1.attn.wq", "blocks.0.ffn.w1", "blocks.0.attn.wq")]
    assert _tp_ops(plain) == f + b + [("TP.s0.norms", "ALLREDUCE", 2 * 2 * 8 * 4.0)]  # q_norm weight + bias
    names = [(x[0], x[1]) for x in _tp_ops(sp)]
    assert names[:4] == [("TP.F.s0.mb0.embed.tokens.ag", "ALL_GATHER"), ("TP.F.s0.mb0.embed.rs", "REDUCE_SCATTER"),
                         ("TP.F.s0.mb0.blocks.0.attn.wq.ag", "ALL_GATHER"),
                         ("TP.F.s0.mb0.blocks.0.attn.wo.rs", "REDUCE_SCATTER")]
    assert names[-3:] == [("TP.B.s0.mb0.blocks.0.attn.wq.rs", "REDUCE_SCATTER"),
                          ("TP.B.s0.mb0.embed.ag", "ALL_GATHER"), ("TP.s0.norms", "ALLREDUCE")]
    assert sp.meta["user_model"]["boundaries"][0]["shape"] == [2, 8, 64]  # the head's logits of the shard
    assert piper_sim.simulate(sp).step_time_s > 0 and piper_sim.simulate(plain).step_time_s > 0


def test_sharded_units_cost_a_share_of_the_flops():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = piper_sim.compile({**tp_strategy(tp=1), "directives": []})
        two = piper_sim.compile(tp_strategy())
    f1 = sum(i.flops for i in one.classes[0].streams["compute"] if i.kind == "F")
    f2 = sum(i.flops for i in two.classes[0].streams["compute"] if i.kind == "F")
    assert 0.5 * f1 < f2 < 0.8 * f1  # the linears and attention halve, the head is replicated
    assert two.meta["model_flops_per_step"] == one.meta["model_flops_per_step"]


# --------------------------------------------------------------------------- the executor


def run_checks(tmp_path, nproc: int, configs: dict[str, dict], launcher: list[str] | None = None,
               ok: bool = True) -> dict[str, dict]:
    """``--check`` of every plan in one torchrun (``launcher``: a script in place of ``-m executor``)."""
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, s in configs.items():
            paths[str(tmp_path / f"{name}.json")] = name
            piper_sim.compile(s).save(str(tmp_path / f"{name}.json"))
    args = [*paths, "--steps", "2", "--check", "--json"]
    r = torchrun(nproc, [*launcher, *args] if launcher else args, module="" if launcher else "executor")
    assert (r.returncode == 0) == ok, r.stderr[-3000:]
    out: dict[str, dict] = {}
    for row in json_lines(r.stdout):
        out.setdefault(paths[row["plan"]], {}).update({f"loss{row['step']}": row["loss"]} if "loss" in row else row)
    assert {k for k, row in out.items() if "max_rel_grad_diff" in row} == set(configs), r.stderr[-3000:]
    return out


def reference_losses(tmp_path, s: dict) -> list[float]:
    from executor.reference import reference_training
    from piper_sim.plan import Plan

    path = str(tmp_path / "reference.json")
    piper_sim.compile(s).save(path)
    return reference_training(Plan.load(path), 2)[1]


def assert_matches(rows: dict[str, dict]) -> None:
    for name, row in rows.items():
        assert row["within_tolerance"] is True and row["max_rel_param_diff"] <= TOL, (name, row)
        assert row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)


# a negative control: the plan named *skip* runs with its row-parallel all-reduces logged (so the
# plan's ops match) but not performed; --check must fail it (the last plan: the worker stops there)
SKIP_ROW_REDUCE = """
import os, runpy, sys, time
sys.path.insert(0, os.getcwd())  # the repository's executor (torchrun runs in it), as -m executor imports it
import executor.parallel.tensor as t
import executor.worker as w

skipping, run_plan, reduce = [False], w.run_plan, t._ReduceFromTP.forward

def skip(ctx, x, tp, name):
    if not skipping[0]:
        return reduce(ctx, x, tp, name)
    now = time.perf_counter()
    tp.record(name, "ALLREDUCE", now, now)
    return x.clone()

def run(path, *args, **kwargs):
    skipping[0] = "skip" in os.path.basename(path)
    return run_plan(path, *args, **kwargs)

t._ReduceFromTP.forward, w.run_plan = staticmethod(skip), run
sys.argv = ["executor", *sys.argv[1:]]
runpy.run_module("executor", run_name="__main__", alter_sys=True)
"""


def test_tp2_x_dp2_and_pp2_x_tp2_sp_match_the_reference_and_skipping_the_row_reduce_fails(tmp_path):
    """One torchrun of 4 ranks (the fast set's budget): TP2 x DP2 ZeRO-1, PP2 x TP2 with SP, and the
    negative control last."""
    script = tmp_path / "skip_row_reduce.py"
    script.write_text(SKIP_ROW_REDUCE)
    rows = run_checks(tmp_path, 4, {"tp2-dp2": tp_strategy(dp=2), "pp2-tp2-sp": tp_strategy(sp=True, pp=2, m=4),
                                    "tp2-dp2-skip": tp_strategy(dp=2)}, launcher=[str(script)], ok=False)
    skipped = rows.pop("tp2-dp2-skip")
    assert skipped["within_tolerance"] is False and skipped["max_rel_grad_diff"] > 1e-2, skipped
    assert_matches(rows)
    ref = reference_losses(tmp_path, tp_strategy(dp=2))  # one global batch of 8 sequences in both layouts
    for name, row in rows.items():  # the loss counted once per TP group, the shards' means summed under SP
        assert [row["loss0"], row["loss1"]] == pytest.approx(ref, rel=1e-5), (name, row, ref)


@pytest.mark.slow
def test_tp2_and_sequence_parallel_match_the_reference(tmp_path):
    assert_matches(run_checks(tmp_path, 2, {"tp2": tp_strategy(), "tp2-sp": tp_strategy(sp=True),
                                            "tp2-sp-full": tp_strategy(sp=True, extra=[{"op": "recompute"}])}))


@pytest.mark.slow
def test_tp2_with_zero3_recompute_and_split_backward_match_the_reference(tmp_path):
    """ZeRO-3 with SP, full recompute (TP.R ops), zero-bubble BI/BW (a first piece's collectives
    in BW), ZB-V, with and without SP."""
    configs = {"tp2-sp-dp2-zero3": tp_strategy(sp=True, dp=2, zero=3), "pp2-tp2": tp_strategy(pp=2, m=4),
               "pp2-tp2-sp-full": tp_strategy(sp=True, pp=2, m=4, extra=[{"op": "recompute"}]),
               "pp2-tp2-zb1p": tp_strategy(pp=2, m=4, sched="zb1p"),
               "pp2-tp2-sp-zb1p-full": tp_strategy(sp=True, pp=2, m=4, sched="zb1p", extra=[{"op": "recompute"}]),
               "pp2-tp2-zbv": tp_strategy(pp=2, m=4, sched="zbv")}
    assert_matches(run_checks(tmp_path, 4, configs))
