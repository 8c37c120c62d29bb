"""Megatron's selective recompute modules in the executor (`piper_sim.models.Block.
set_recompute_modules`): in one process, what each module's backward re-runs (counted at the
dispatcher, against the plan's re-run kernels and `piper_sim.recompute.module_recompute_flops`)
and what its forward no longer keeps (saved-tensor bytes, against the simulator's
`piper_sim.recompute.module_freed`); under torchrun (gloo), PP2 1F1B and DP2 runs of a dense,
a MoE and a DeepSeek-V3-shaped MLA model equal to the single-process reference."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor import GRAD_TOL, TOL, check_all, strategy  # noqa: E402

from executor.stage import Stage  # noqa: E402
from piper_sim.configs import unit_names  # noqa: E402
from piper_sim.models import get_config  # noqa: E402
from piper_sim.recompute import Recompute, layer_table, module_freed, module_recompute_flops  # noqa: E402
from piper_sim.sources import resolve_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

# DeepSeek-V3-shaped: MLA with a query latent, a dense first layer, then 4 routed experts
# (top-2) beside one shared expert (as tests/test_executor_tp.py's DSV3_TINY)
DSV3_TINY = {"name": "dsv3-tiny", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 256,
             "attention": "mla", "q_lora": 32, "kv_lora": 16, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 8,
             "experts": 4, "top_k": 2, "shared_experts": 1, "expert_ffn": 64, "dense_first_layers": 1}
B, S = 2, 16  # one micro-batch of the in-process checks
T = B * S
F32 = 4


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.ops[name] += 1
        if name == "mm":  # flops of x[m, k] @ w[k, n]
            self.ops["mm_flops"] += 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
        return func(*args, **(kwargs or {}))


def _run(cfg, modules: tuple[str, ...]) -> tuple[int, Counter, list[torch.Tensor]]:
    """One fp32 stage holding the whole model, one forward and backward under ``modules``:
    (bytes of the non-parameter storages autograd saved in the forward, still held when it
    ends; the ops the backward dispatched; the gradients)."""
    units = unit_names(cfg)
    stage = Stage(cfg, 0, 1, units, [units], 1, 0, torch.device("cpu"), torch.float32, seed=0)
    stage.set_recompute(Recompute("selective", modules=modules) if modules else Recompute())
    params = {p.untyped_storage().data_ptr() for p in stage.units.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab, (B, S), generator=g) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rec = stage.forward_piece(0, {"tokens": tokens}, {}, targets, 1.0)
    held = sum(s.nbytes() for s in saved.values())  # a dropped output's storage is resized to 0
    saved.clear()
    with _Count() as count:
        rec.outputs["loss"].backward()
    return held, count.ops, [p.grad for p in rec.params]


def _tables(cfg):
    kinds = [["moe_pre", "moe_experts"] if cfg.is_moe_layer(i) else ["dense"] for i in range(cfg.n_layers)]
    return [layer_table(cfg, k, B, S, F32) for ks in kinds for k in ks]


def _sim_freed(cfg, modules: tuple[str, ...]) -> float:
    """What the simulator says ``modules`` drop from every layer (fp32 layer tables)."""
    return sum(module_freed(t, modules) for t in _tables(cfg))


def _sim_rerun_flops(cfg, modules: tuple[str, ...]) -> float:
    """The forward flops the simulator says ``modules`` re-run in every layer's backward (an
    expert block's forward: its tokens through the experts' three matmuls)."""
    experts = 2.0 * T * cfg.top_k * cfg.hidden * cfg.expert_ffn * (3 if cfg.mlp != "gelu" else 2)
    return sum(module_recompute_flops(t, modules, experts if t.kind == "moe_experts" else 0.0) for t in _tables(cfg))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (config, the model as a strategy names it)."""
    path = tmp_path_factory.mktemp("models") / "dsv3-tiny.json"
    path.write_text(json.dumps(DSV3_TINY))
    return {"gpt-tiny": (get_config("gpt-tiny"), "gpt-tiny"), "moe-tiny": (get_config("moe-tiny"), "moe-tiny"),
            "dsv3-tiny": (resolve_model(DSV3_TINY), str(path))}


def _plan_reruns(model: str, modules: tuple[str, ...]) -> Counter:
    """Kernel calls the plan's backward lists beyond the plain backward's, per kernel name (an
    H100 stack: fused norms, flash attention; ``mm`` for every GEMM)."""
    from piper_sim.api import compile

    def calls(d: list) -> Counter:
        plan = compile({"model": model, "cluster": "h100:1x1", "global_batch": B, "seq_len": S, "microbatches": 1,
                        "directives": d})
        b = next(i for c in plan.classes for i in c.instructions() if i.kind == "B")
        out: Counter = Counter()
        for cls, name, _, _, n, _, _ in plan.kernels[b.kernels]:
            out["mm" if cls == "gemm" else name] += n
        return out

    rc = [{"op": "recompute", "mode": "selective", "modules": list(modules)}]
    return calls(rc) - calls([])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "dsv3-tiny"])
def test_each_module_reruns_and_frees_what_megatron_wraps(models, name):
    """Per module, beyond plain autograd: the backward re-runs the module's forward (its matmuls
    counted at the dispatcher, their flops the simulator's `module_recompute_flops`; the norms'
    rsqrt and the experts' silu for the dropped outputs) and
    the forward keeps what the simulator says it frees less (`module_freed`; equal for mlp,
    moe_act, shared_experts; the eager CPU kernels add named tensors to layernorm, moe and
    mla_up_proj); the plan's backward lists the same re-run GEMMs, activations and norms; the
    gradients are plain autograd's (checkpoints bit for bit; a dropped output's nested backward
    sums its input's gradient in another order: 1e-6)."""
    cfg, source = models[name]
    h, L, E, k = cfg.hidden, cfg.n_layers, cfg.n_experts, cfg.top_k
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
    dense = L - moe_layers
    shared = 1 if cfg.n_shared else 0
    base_held, base_ops, base_grads = _run(cfg, ())
    # the eager CPU rms_norm keeps x * rstd besides its output (the table prices the fused kernel)
    norm_extra = 2 * L * T * h * F32
    # the combine after the experts keeps the weighted outputs' inputs, the gathered weights and
    # three index tensors (int64), which the layer table does not list (nor the meta profile)
    combine = moe_layers * (2 * T * k * h * F32 + T * k * F32 + 3 * T * k * 8)
    cases = {"layernorm": (0, {"rsqrt": 2 * L}, norm_extra)}  # module: (matmuls, other ops re-run, extra bytes)
    if dense:
        cases["mlp"] = (3 * dense, {"silu": dense}, 0)  # w1, w3 and w2, as Megatron and the plan re-run it
    if moe_layers:
        cases["moe_act"] = (0, {"silu": E * moe_layers}, 0)
        cases["moe"] = ((1 + 3 * E + 3 * shared) * moe_layers, {"topk": moe_layers}, combine)
    if moe_layers and shared:
        cases["shared_experts"] = (3 * moe_layers, {"silu": moe_layers}, 0)
    core_held, core_ops, _ = _run(cfg, ("core_attn",))
    if cfg.attention == "mla":
        H, qk, nope, v, rope = cfg.n_heads, cfg.qk_nope_dim + cfg.qk_rope_dim, cfg.qk_nope_dim, cfg.v_head_dim, \
            cfg.qk_rope_dim
        # next to a checkpointed core (which keeps q, k, v only): q, k, the up-projected kv whose
        # view v is (flash pads v instead: the table's third q-sized tensor) and the rotary tables
        up = L * (2 * T * H * qk * F32 + T * H * (nope + v) * F32 + 2 * S * rope * F32)
        cases["mla_up_proj"] = (2 * L, {}, up - _sim_freed(cfg, ("mla_up_proj",)))
    for module, (mms, others, extra) in cases.items():
        mla = module == "mla_up_proj"
        held, ops, grads = _run(cfg, ("core_attn", module) if mla else (module,))
        rerun = ops - (core_ops if mla else base_ops)
        assert rerun["mm"] == mms, (module, rerun)
        assert rerun["mm_flops"] == _sim_rerun_flops(cfg, (module,)), (module, rerun["mm_flops"])
        for op, n in others.items():
            assert rerun[op] == n, (module, op, rerun)
        freed = (core_held if mla else base_held) - held
        assert freed > 0 and freed == _sim_freed(cfg, (module,)) + extra, (module, freed, _sim_freed(cfg, (module,)))
        # the plan's backward re-runs the same GEMMs, activations and norms (the rsqrt of each)
        planned = _plan_reruns(source, ("core_attn", module) if mla else (module,)) - \
            (_plan_reruns(source, ("core_attn",)) if mla else Counter())
        assert planned["mm"] == rerun["mm"] and planned["silu"] == rerun["silu"], (module, planned, rerun)
        assert planned["rms_norm"] == rerun["rsqrt"], (module, planned, rerun)
        exact = module in ("mlp", "moe", "shared_experts")
        assert all((a.equal(b) if exact else _rel(a, b) < 1e-6) for a, b in zip(grads, base_grads)), module
    # the modules that do not apply to this model change nothing
    for module in {"mlp", "moe_act", "moe", "shared_experts", "mla_up_proj"} - set(cases):
        held, ops, grads = _run(cfg, (module,))
        assert held == base_held and ops == base_ops and all(a.equal(b) for a, b in zip(grads, base_grads)), module
    if moe_layers:  # moe covers moe_act and shared_experts: with them it re-runs the block once
        assert _run(cfg, ("moe", "moe_act", "shared_experts"))[1] == _run(cfg, ("moe",))[1]


def _model_file(tmp_path, spec: dict) -> str:
    path = str(tmp_path / f"{spec['name']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def _with(s: dict, modules: list[str]) -> dict:
    return {**s, "directives": [*s["directives"], {"op": "recompute", "mode": "selective", "modules": modules}]}


ALL_DSV3 = ["core_attn", "layernorm", "mlp", "moe_act", "shared_experts", "mla_up_proj"]
# per layout, plan -> (model, modules): every module that applies, in a PP2 1F1B and a DP2 plan
RUNS = {
    "pp2": {"gpt": ("gpt-tiny", ["layernorm", "mlp"]), "moe-act": ("moe-tiny", ["layernorm", "moe_act"]),
            "moe-moe": ("moe-tiny", ["moe"]), "dsv3": ("dsv3", ALL_DSV3), "dsv3-moe": ("dsv3", ["moe", "mla_up_proj"])},
    "dp2": {"gpt": ("gpt-tiny", ["core_attn", "layernorm", "mlp"]), "moe-moe": ("moe-tiny", ["layernorm", "moe"]),
            "moe-ep2-act": ("moe-tiny", ["layernorm", "moe_act"]), "dsv3": ("dsv3", ALL_DSV3),
            "dsv3-moe": ("dsv3", ["layernorm", "moe", "mla_up_proj"])},
}

# a split backward (BI/BW): the modules that drop outputs (layernorm, moe_act, mla_up_proj) differentiate
# their recomputed graphs to their inputs in BI and leave their weights' gradients to BW
# (`piper_sim.models.deferring_weight_grads`); DeepSeek-V3's own set under DualPipe
RUNS["split"] = {"gpt-zb1p": ("gpt-tiny", ["layernorm", "mlp"]), "moe-zbv": ("moe-tiny", ["layernorm", "moe_act"]),
                 "dsv3-dualpipe": ("dsv3", ["layernorm", "mla_up_proj", "moe_act"]),
                 "dsv3-zb1p": ("dsv3", ALL_DSV3)}
SPLIT_SCHEDULES = {"gpt-zb1p": "zb1p", "moe-zbv": "zbv", "dsv3-dualpipe": "dualpipe", "dsv3-zb1p": "zb1p"}


@pytest.mark.parametrize("layout", ["pp2", "dp2", "split"])
def test_runs_with_selective_modules_equal_the_reference(tmp_path, layout):
    """`run --check` (fp32, the single-process reference; gradients within 1e-5) for every
    module that applies, in PP2 1F1B plans and in DP2 (ZeRO-1) plans: gpt-tiny (dense),
    moe-tiny (moe, moe_act; under DP2 x EP2 too, where the MLP norm's output is dropped across
    the dispatch) and a DeepSeek-V3-shaped model (MLA, a shared expert, a dense first layer);
    one launch per layout."""
    dsv3 = _model_file(tmp_path, DSV3_TINY)
    configs = {}
    for name, (model, modules) in RUNS[layout].items():
        if layout == "pp2":
            s = strategy("gpt-tiny", pp=2, m=4, mbs=1)
        elif layout == "split":
            s = strategy("gpt-tiny", pp=2, sched=SPLIT_SCHEDULES[name], m=4, mbs=1)
        else:
            s = strategy("gpt-tiny", dp=2, zero=1, m=2, mbs=1, ep=2 if "ep2" in name else 0)
        configs[name] = _with({**s, "model": dsv3 if model == "dsv3" else model}, modules)
    out = check_all(tmp_path, 2, configs)
    assert set(out) == set(configs)
    for name, row in out.items():
        assert row["within_tolerance"] is True and row["max_rel_param_diff"] <= TOL, (name, row)
        assert row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)
    # one model, one batch: the plans of a model report the same losses
    for model in (("moe-tiny", "dsv3") if layout != "split" else ("dsv3",)):
        names = [n for n, (m, _) in RUNS[layout].items() if m == model]
        assert len(names) == 2 and len({round(out[n]["loss2"], 5) for n in names}) == 1, names
