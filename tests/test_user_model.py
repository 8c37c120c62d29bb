"""Bring your own nn.Module (piper_sim.annotate): annotation checks, py: sources, per-unit
profiling with propagated shapes, compiling, simulating and running non-transformer models
(a residual MLP stack and a small CNN from tests/data/user_models.py) against the
single-process reference."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import piper_sim
from piper_sim.annotate import AnnotationError, annotate, load_user_model
from piper_sim.strategy import StrategyError
from piper_sim.user_profiling import profile_user_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "tests", "data", "user_models.py")


def src(fn: str) -> str:
    return f"py:{MODELS}:{fn}"


def strategy(model, pp: int = 2, sched: str = "1f1b", dp: int = 1, zero: int = 0, m: int = 4, mbs: int = 2,
             seq: int = 8, extra: list | None = None) -> dict:
    d: list[dict] = [{"op": "pipeline", "degree": pp}, {"op": "schedule", "name": sched}] if pp > 1 else []
    if dp > 1:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    return {"model": model, "cluster": f"cpu:{pp * dp}", "global_batch": dp * m * mbs, "seq_len": seq,
            "microbatches": m, "dtype": "fp32", "directives": d + (extra or [])}


# --------------------------------------------------------------------------- annotation


def test_units_expand_globs_in_order():
    m = load_user_model(src("small_cnn"), {"depth": 2})
    assert m.units == ["stem", "blocks.0", "blocks.1", "down", "head"]
    assert m.param_count() == sum(p.numel() for p in m.module.parameters())


def _batch(mbs, seq, device, dtype, seed):
    return torch.empty(mbs, 4, device=device, dtype=dtype), torch.zeros(mbs, dtype=torch.long, device=device)


class Two(nn.Module):
    def __init__(self, forward):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self._fwd = forward

    def forward(self, x):
        return self._fwd(self, x)


@pytest.mark.parametrize("fwd,units,needle", [
    (lambda s, x: s.b(s.a(x)), ["a", "c"], "pattern 'c' matches no submodule"),
    (lambda s, x: s.b(s.a(x)), ["a"], "parameter/buffer 'b.weight' belongs to no unit"),
    (lambda s, x: s.b(s.a(x)), ["b", "a"], "unit 'a' runs at position 0 of forward but is listed at 1"),
    (lambda s, x: s.b(torch.relu(s.a(x))), ["a", "b"], "unit 'b' does not take unit 'a''s output"),
    (lambda s, x: s.b(s.a(s.a(x))), ["a", "b"], "unit 'a' runs 2 times"),
    (lambda s, x: s.b(s.a(x)) * 2, ["a", "b"], "forward returns something other than unit 'b''s output"),
    (lambda s, x: s.b(s.a(x * 2)), ["a", "b"], "unit 'a' does not take the batch inputs"),
])
def test_bad_annotations_are_one_line_errors(fwd, units, needle):
    with pytest.raises(AnnotationError) as e:
        annotate(Two(fwd), units, F.cross_entropy, _batch)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_nested_units_and_bad_loss_refused():
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    with pytest.raises(AnnotationError, match="unit '0.0' is inside unit '0'"):
        annotate(net, ["0", "0.*", "1"], F.cross_entropy, _batch)
    with pytest.raises(AnnotationError, match="must return a scalar"):
        annotate(net, ["0", "1"], lambda out, t: out, _batch)


def test_flatten_between_units_refused_through_a_source():
    with pytest.raises(StrategyError, match="unit 'b' does not take unit 'a''s output"):
        piper_sim.compile(strategy(src("flattening"), pp=1))


@pytest.mark.parametrize("model,needle", [
    ("py:/nonexistent/m.py:f", "file /nonexistent/m.py"),
    (src("no_such_factory"), "has no function 'no_such_factory'"),
    ("py:no_such_module_xyz:f", "cannot import no_such_module_xyz"),
    ({"source": src("residual_mlp"), "kwargs": {"colour": 1}}, "unexpected keyword argument 'colour'"),
    ({"source": src("residual_mlp"), "args": {}}, "unknown key(s) args"),
    ({"source": "residual_mlp"}, "'model.source' must be a string py:"),
])
def test_bad_sources_are_one_line_errors(model, needle):
    with pytest.raises(StrategyError) as e:
        piper_sim.compile(strategy(model, pp=1))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_source_exits_2_with_one_line(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(__import__("json").dumps(strategy(src("flattening"), pp=1)))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "compile", str(path), "-o", str(tmp_path / "p.json")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "unit 'b' does not take" in r.stderr and "Traceback" not in r.stderr


HOSTILE = """
import os, sys
if os.environ.get("H30_AT_IMPORT") == "exit":
    sys.exit(0)
if os.environ.get("H30_AT_IMPORT") == "interrupt":
    raise KeyboardInterrupt
def exits():
    sys.exit()
def exits_3():
    sys.exit(3)
def interrupted():
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("at_import,fn,needle", [
    ("exit", "exits", "cannot import {file} of source 'py:{file}:exits' (sys.exit(0) called;"),
    ("interrupt", "exits", "cannot import {file} of source 'py:{file}:exits' (KeyboardInterrupt)"),
    ("", "exits", "py:{file}:exits failed (sys.exit() called; model code must return or raise, not exit)"),
    ("", "exits_3", "py:{file}:exits_3 failed (sys.exit(3) called;"),
    ("", "interrupted", "py:{file}:interrupted failed (KeyboardInterrupt)"),
])
def test_exit_or_interrupt_in_a_user_model_is_one_line_exit_2(tmp_path, monkeypatch, capsys, at_import, fn, needle):
    """sys.exit() or a KeyboardInterrupt at import or in the factory: compile says so in one
    line naming file:function and exits 2 (it used to exit 0 with no plan, or print a traceback)."""
    from piper_sim.cli.commands import main

    file = tmp_path / f"hostile_{at_import or 'none'}.py"
    file.write_text(HOSTILE)
    monkeypatch.setenv("H30_AT_IMPORT", at_import)
    (tmp_path / "s.json").write_text(__import__("json").dumps(strategy(f"py:{file}:{fn}", pp=1)))
    assert main(["compile", str(tmp_path / "s.json"), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle.format(file=file) in err and "Traceback" not in err, err
    assert not (tmp_path / "p.json").exists()


def test_exit_in_forward_or_loss_on_meta_is_one_line():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] == 2:
                sys.exit(0)
            return self.b(self.a(x))

    def batch(m, s, device, dtype, seed):
        return torch.empty(m, s, 4, device=device), torch.empty(m, s, device=device)

    def interrupted(out, targets):
        raise KeyboardInterrupt

    with pytest.raises(AnnotationError, match=r"Two: forward on meta failed \(sys.exit\(0\) called"):
        annotate(Two(), ["a", "b"], loss=F.mse_loss, example_batch=batch)
    with pytest.raises(AnnotationError, match=r"Two: loss\(output, targets\) on meta failed \(KeyboardInterrupt\)"):
        annotate(Two(), ["a", "b"], loss=interrupted, example_batch=lambda m, *a: batch(m + 1, *a))


@pytest.mark.parametrize("extra,needle", [
    ([{"op": "expert_parallel", "degree": 2}], "expert_parallel: user model"),
    ([{"op": "tensor_parallel", "degree": 2}], "tensor_parallel: user model"),
    ([{"op": "recompute", "mode": "selective"}], "recompute: mode selective"),
])
def test_ep_tp_selective_refused(extra, needle):
    s = strategy(src("residual_mlp"), pp=1, dp=2, extra=extra)
    with pytest.raises(StrategyError, match=needle):
        piper_sim.compile(s)


def test_more_stages_than_units_refused():
    with pytest.raises(StrategyError, match="4 stages but model .* has only 3 units"):
        piper_sim.compile(strategy({"source": src("residual_mlp"), "kwargs": {"depth": 1}}, pp=4))


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("fn", ["residual_mlp", "scaled_mlp"])  # reset_parameters per unit; the factory's init
def test_weights_do_not_depend_on_the_split(fn):
    m = load_user_model(src(fn))
    whole = m.build_units(m.units, seed=3)
    halves = {**m.build_units(m.units[:2], seed=3), **m.build_units(m.units[2:], seed=3)}
    single = m.build_units([m.units[1]], seed=3)
    other = m.build_units(m.units, seed=4)
    for u in m.units:
        for (n, a), (_, b) in zip(whole[u].named_parameters(), halves[u].named_parameters()):
            assert torch.equal(a, b), (u, n)
        # another seed, other weights (norm weights start at ones either way)
        assert any(not torch.equal(a, c) for a, c in zip(whole[u].parameters(), other[u].parameters())), u
    assert all(torch.equal(a, b) for a, b in zip(whole[m.units[1]].parameters(), single[m.units[1]].parameters()))
    # different units get different weights (a seed per unit, not one stream restarted)
    if fn == "residual_mlp":
        assert not torch.equal(whole["blocks.0"].fc1.weight, whole["blocks.1"].fc1.weight)


def test_factory_init_is_kept_and_reset_parameters_refuses_unknown_state():
    from piper_sim.annotate import reset_parameters

    m = load_user_model(src("small_cnn"))  # no init_unit: the factory's own init, under the seed
    head = m.build_units(["head"], seed=5)["head"][2]
    assert torch.equal(head.bias, torch.zeros_like(head.bias)) and float(head.weight.detach().std()) < 0.05
    torch.manual_seed(5)
    assert torch.equal(m.factory().module.head[2].weight, head.weight)

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(4.0))

        def forward(self, x):
            return self.fc(x) + self.table

    net = nn.Sequential(Table(), nn.Linear(4, 2))
    um = annotate(net, ["0", "1"], F.cross_entropy, _batch, init_unit=reset_parameters)
    with pytest.raises(AnnotationError, match=r"module 0 \(Table\) has state that reset_parameters\(\) does not"):
        um.build_units(["0"])


# --------------------------------------------------------------------------- profiling


def test_profile_propagates_shapes_and_counts_flops():
    m = load_user_model(src("small_cnn"), {"channels": 8, "depth": 2})
    segs = profile_user_model(m, 2, 16, torch.float32)
    shapes = {s.name: s.out_shape for s in segs}
    assert shapes["stem"] == shapes["blocks.1"] == (2, 8, 16, 16)
    assert shapes["down"] == (2, 16, 8, 8)  # stride 2 doubles channels, halves the image
    assert segs[1].out_bytes == 2 * 8 * 16 * 16 * 4 and segs[-1].out_bytes == 4
    # a 3x3 conv of 8 -> 8 channels on 16x16, 2 images, priced as its implicit GEMM; its
    # backward is one GEMM of the same size per gradient (input, weight)
    conv = 2 * (2 * 256) * 8 * (8 * 9)
    assert segs[1].fwd_flops == segs[1].bwd_input_flops == segs[1].bwd_weight_flops == conv
    assert ("gemm", "conv", (512, 8, 72, 1)) in {r[:3] for r in segs[1].kernels_f}
    assert {r[1] for r in segs[1].kernels_bw if r[0] == "gemm"} == {"conv_bwd_weight"}
    assert segs[0].bwd_input_flops == 0 and segs[1].bwd_input_flops > 0  # nothing before the stem
    assert segs[1].param_count == m.unit_param_count("blocks.1")


def test_identical_units_profiled_once_and_fast():
    m = load_user_model(src("residual_mlp"), {"depth": 100, "width": 32})
    t0 = time.perf_counter()
    segs = profile_user_model(m, 4, 16, torch.bfloat16)
    elapsed = time.perf_counter() - t0
    assert len(segs) == 102
    assert len({id(s.kernels_f) for s in segs}) == 3  # stem, one block, head
    assert elapsed < 10.0
    w, T = 32, 4 * 16
    assert segs[5].fwd_flops == 2 * T * w * 2 * w * 2  # two linears w -> 2w -> w (bias adds are memory ops)


# --------------------------------------------------------------------------- compile and simulate


@pytest.mark.parametrize("fn", ["residual_mlp", "small_cnn"])
def test_compile_and_simulate(fn):
    plan = piper_sim.compile(strategy(src(fn), pp=2, sched="zb1p"))
    um = plan.meta["user_model"]
    assert um["source"] == src(fn) and plan.meta["stage_units"][0][0] == "stem"
    assert sum(len(u) for u in plan.meta["stage_units"]) == len(um["units"])
    x, _ = load_user_model(src(fn)).example_batch(2, 8, "cpu", torch.float32, 0)
    assert um["boundaries"][0]["shape"][0] == 2 and len(um["boundaries"][0]["shape"]) == x.dim()
    sends = [i for c in plan.classes for lst in c.streams.values() for i in lst if i.kind == "SEND"]
    assert {i.bytes for i in sends if i.id.startswith("SEND.F")} == {4 * math.prod(um["boundaries"][0]["shape"])}
    res = piper_sim.simulate(plan, costmodel=os.path.join(ROOT, "traces", "calibration", "cpu-2core.json"))
    assert res.step_time_s > 0


def test_balanced_and_explicit_stages():
    model = {"source": src("residual_mlp"), "kwargs": {"depth": 6}}
    plan = piper_sim.compile(strategy(model, pp=2, extra=[{"op": "segment", "layers_per_stage": [2, 6]}]))
    assert plan.meta["stage_units"] == [["stem", "blocks.0"], [f"blocks.{i}" for i in range(1, 6)] + ["head"]]
    bal = piper_sim.compile(strategy(model, pp=2, extra=[{"op": "segment", "layers_per_stage": "balanced"}]))
    assert [len(u) for u in bal.meta["stage_units"]] == [4, 4]
    with pytest.raises(StrategyError, match="summing to the 8 units"):
        piper_sim.compile(strategy(model, pp=2, extra=[{"op": "segment", "layers_per_stage": [2, 2]}]))


def test_kwargs_are_in_the_plan_hash():
    a = piper_sim.compile(strategy({"source": src("residual_mlp"), "kwargs": {"width": 16}}))
    b = piper_sim.compile(strategy({"source": src("residual_mlp"), "kwargs": {"width": 24}}))
    assert a.meta["user_model"]["kwargs"] == {"width": 16}
    assert a.content_hash() != b.content_hash()


def test_full_recompute_keeps_unit_inputs():
    def acts(plan) -> float:
        return float(piper_sim.simulate(plan).per_rank["activations_bytes"].max())

    model = {"source": src("residual_mlp"), "kwargs": {"depth": 6, "width": 64}}
    plain = piper_sim.compile(strategy(model, pp=2))
    rc = piper_sim.compile(strategy(model, pp=2, extra=[{"op": "recompute", "mode": "full"}]))
    assert 0 < acts(rc) < acts(plain)


def test_python_api_objects(tmp_path, monkeypatch):
    from executor.user_stage import user_model_of
    from piper_sim.plan import PlanError

    (tmp_path / "my_models_xyz.py").write_text(
        f"import importlib.util\nspec = importlib.util.spec_from_file_location('um', {MODELS!r})\n"
        "um = importlib.util.module_from_spec(spec); spec.loader.exec_module(um)\n"
        "def factory():\n    return um.residual_mlp(depth=2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_models_xyz

    plan = piper_sim.compile(strategy("mine", pp=2), model=my_models_xyz.factory)
    assert plan.meta["user_model"]["source"] == "py:my_models_xyz:factory"
    assert user_model_of(plan.header).units == ["stem", "blocks.0", "blocks.1", "head"]

    def local():  # not importable: compile and simulate work, run says why not
        return my_models_xyz.um.small_cnn(depth=1)

    from piper_sim.annotate import _import_factory

    file_factory = _import_factory(src("small_cnn"))  # a module-level function of a py:file.py source
    assert piper_sim.compile(strategy("mine"), model=file_factory).meta["user_model"]["source"] == src("small_cnn")

    for obj in (local, local()):
        plan = piper_sim.compile(strategy("mine", pp=2), model=obj)
        assert plan.meta["user_model"]["source"] is None and plan.meta["model"] == "small-cnn-1x8"
        piper_sim.simulate(plan)
        with pytest.raises(PlanError, match="not an importable factory"):
            user_model_of(plan.header)


# --------------------------------------------------------------------------- executor


def _torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_executor import torchrun

    return torchrun(nproc, args, timeout=300)


def _check_rows(r: subprocess.CompletedProcess, n: int) -> list[dict]:
    from test_executor import GRAD_TOL, TOL, json_lines

    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for x in json_lines(r.stdout) if "max_rel_param_diff" in x]
    assert len(rows) == n
    for x in rows:
        assert x["within_tolerance"] and x["max_rel_param_diff"] < TOL and x["max_rel_grad_diff"] <= GRAD_TOL, x
    return rows


def test_run_pp2_matches_reference(tmp_path):
    """1F1B, zero bubble, and interleaved stages under full recompute (token-id inputs)."""
    paths = []
    for fn, sched, extra in (("residual_mlp", "1f1b", []), ("small_cnn", "zb1p", []),
                             ("bag_of_tokens", "zb1p", [{"op": "recompute", "mode": "full"}])):
        plan = piper_sim.compile(strategy(src(fn), pp=2, sched=sched, extra=extra))
        paths.append(str(tmp_path / f"{fn}.json"))
        plan.save(paths[-1])
    _check_rows(_torchrun(2, [*paths, "--steps", "2", "--check", "--json"]), 3)


def test_run_pp2_dp2_zero1_and_zero3_match_reference(tmp_path):
    paths = [str(tmp_path / "z1.json"), str(tmp_path / "z3.json")]
    piper_sim.compile(strategy(src("residual_mlp"), pp=2, dp=2, zero=1, m=2)).save(paths[0])
    piper_sim.compile(strategy(src("small_cnn"), pp=2, dp=2, zero=3, m=2)).save(paths[1])
    _check_rows(_torchrun(4, [*paths, "--steps", "2", "--check", "--json"]), 2)


def test_example_compiles_and_simulates_from_the_repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's source path is relative to where piper-sim runs
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_user_model", os.path.join(ROOT, "examples", "user_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = piper_sim.compile(mod.STRATEGY), piper_sim.compile(mod.STRATEGY)
    assert a.content_hash() == b.content_hash()  # profiling and the split are deterministic
    assert [len(u) for u in a.meta["stage_units"]] == [4, 4]  # balanced: the head is cheap
    assert piper_sim.simulate(a).step_time_s > 0


def test_run_refuses_a_plan_of_an_object_before_launching(tmp_path):
    def local():
        return annotate(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), ["0", "1"], F.cross_entropy, _batch)

    path = tmp_path / "p.json"
    piper_sim.compile(strategy("mine", pp=2), model=local).save(str(path))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "run", str(path), "--steps", "1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "not an importable factory" in r.stderr and r.stderr.count("\n") == 1
