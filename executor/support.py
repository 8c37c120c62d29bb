"""What the executor runs, feature by feature: `unrunnable` (every refusal that depends on the
plan alone, the ones ``piper-sim run`` makes before launching) and `FEATURES`, the README's
feature x back-end table, each row a small strategy the test compiles and checks against
`unrunnable` (tests/test_support.py), so the table cannot drift from the code.

The simulator runs every row. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from executor.options import refuse_unrunnable
from piper_sim.plan import Plan, PlanError


def unrunnable(plan: Plan, path: str = "plan") -> str:
    """Why the executor would refuse ``plan`` before any process group starts ('' when it runs
    it: `executor.options.refuse_unrunnable`, as ``piper-sim run`` refuses it). Run options such
    as ``--save`` are checked by `executor.options.preflight`."""
    try:
        refuse_unrunnable(plan, path)
    except PlanError as e:
        return str(e)
    return ""


def _s(*directives: dict, model: str = "gpt-tiny", world: int = 2, m: int = 2, dp: int = 1) -> dict[str, Any]:
    return {"model": model, "cluster": f"cpu:{world}", "global_batch": dp * m, "seq_len": 32, "microbatches": m,
            "dtype": "fp32", "directives": list(directives)}


TINY = {"name": "tiny", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 128, "vocab": 512,
        "max_seq": 128}
MOE = {**TINY, "name": "moe", "experts": 4, "top_k": 2, "expert_ffn": 64}
MLA = {**TINY, "name": "mla", "attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_dim": 16,
       "qk_rope_dim": 8, "v_head_dim": 16}
PP2 = {"op": "pipeline", "degree": 2}
DP2 = {"op": "data_parallel", "degree": 2, "zero": 1}
TP2 = {"op": "tensor_parallel", "degree": 2}
TP2_SP = {"op": "tensor_parallel", "degree": 2, "sequence_parallel": True}
CP2 = {"op": "context_parallel", "degree": 2}
EP2 = {"op": "expert_parallel", "degree": 2}


def _sched(name: str, v: int = 1) -> list[dict]:
    return [{"op": "pipeline", "degree": 2, **({"stages_per_rank": v} if v > 1 else {})},
            {"op": "schedule", "name": name}]


@dataclass(frozen=True)
class Feature:
    """One row: a plan feature, a strategy that has it, and whether the executor runs it
    (``why``: the reason it does not, as the refusal says it)."""

    name: str
    strategy: dict[str, Any] = field(repr=False)
    runs: bool = True
    why: str = ""
    model_file: dict[str, Any] | None = field(default=None, repr=False)  # a model file in place of gpt-tiny
    user_model: str = ""  # a user nn.Module in place of gpt-tiny: "file.py:factory", the file from the repository root
    match: str = ""  # the words of the refusal that say why (default: ``why``)


FEATURES: tuple[Feature, ...] = (
    Feature("pipeline 1F1B / GPipe / interleaved", _s(*_sched("interleaved_1f1b", 2), m=4)),
    Feature("zero-bubble ZB1P / ZBV", _s(*_sched("zbv", 2), m=4)),
    Feature("DualPipe / DualPipeV", _s(*_sched("dualpipev", 2), m=4)),
    Feature("combined 1F1B (Megatron-Core's expert all-to-all overlap)",
            _s(*_sched("combined_1f1b", 2), DP2, EP2, model="moe-tiny", world=4, m=4, dp=2)),
    Feature("data parallel, ZeRO 0-3", _s({"op": "data_parallel", "degree": 2, "zero": 3}, dp=2)),
    Feature("hybrid sharding (HSDP)",
            _s({"op": "data_parallel", "degree": 4, "zero": 1, "shard_degree": 2}, world=4, dp=4)),
    Feature("full and selective recompute", _s(PP2, {"op": "recompute", "mode": "selective"}, m=4)),
    Feature("op-level selective AC (torchtitan), every-N, Megatron method/num_layers",
            _s(DP2, {"op": "recompute", "mode": "op"}, dp=2)),
    Feature("Megatron selective modules beyond the attention core (layernorm, mlp, moe, moe_act, shared_experts, "
            "mla_up_proj)", _s(PP2, {"op": "recompute", "mode": "selective", "modules": ["layernorm", "mlp"]}, m=4)),
    Feature("Megatron selective modules under tensor parallel",
            _s(TP2, {"op": "recompute", "mode": "selective", "modules": ["layernorm", "mlp"]})),
    Feature("finer recompute (op-SAC, every-N, method, modules mlp / moe / shared_experts) with a split backward",
            _s(*_sched("zb1p"), {"op": "recompute", "mode": "op"}, m=4)),
    Feature("Megatron selective modules layernorm / moe_act / mla_up_proj with a split backward",
            _s(*_sched("zb1p"), {"op": "recompute", "mode": "selective", "modules": ["layernorm"]}, m=4)),
    Feature("expert parallel (MoE)", _s(DP2, EP2, model="moe-tiny", dp=2)),
    Feature("tensor parallel (+ sequence parallel)", _s(TP2_SP)),
    Feature("tensor parallel with qk_norm (Qwen3)", _s(TP2_SP), model_file={**TINY, "qk_norm": True}),
    Feature("tensor parallel (+ sequence parallel) on a user nn.Module (sharding annotations)", _s(TP2_SP),
            user_model="tests/data/user_models.py:tiny_transformer"),
    Feature("tensor parallel with tied embeddings", _s(TP2), model_file={**TINY, "tie_embeddings": True}),
    Feature("tensor parallel with ZeRO-3 and qk_norm", _s({"op": "data_parallel", "degree": 2, "zero": 3}, TP2,
                                                        world=4, dp=2),
            model_file={**TINY, "qk_norm": True}),
    Feature("tensor parallel x pipeline x ZeRO-1", _s(TP2, PP2, DP2, world=8, m=4, dp=2)),
    Feature("tensor parallel with MoE and sequence parallel", _s(DP2, EP2, TP2_SP, model="moe-tiny", world=4, dp=2)),
    Feature("tensor parallel with ZeRO-3 and sequence parallel",
            _s({"op": "data_parallel", "degree": 2, "zero": 3}, TP2_SP, world=4, dp=2)),
    Feature("tensor parallel with a split backward, SP and full recompute",
            _s(*_sched("zb1p"), TP2_SP, {"op": "recompute"}, world=4, m=4)),
    Feature("context parallel (all-gather, ring)", _s({"op": "context_parallel", "degree": 2, "style": "ring"})),
    Feature("context parallel x tensor parallel", _s(CP2, TP2_SP, world=4)),
    Feature("MoE on tensor parallel without expert parallel", _s(TP2, model="moe-tiny")),
    Feature("GELU experts under tensor parallel", _s(TP2_SP), model_file={**MOE, "mlp": "gelu", "shared_experts": 1}),
    Feature("MoE with shared experts under tensor parallel", _s(DP2, EP2, TP2, world=4, dp=2),
            model_file={**MOE, "shared_experts": 1}),
    Feature("multi-head latent attention (DeepSeek-V3) under tensor parallel", _s(TP2), model_file=MLA),
    Feature("multi-head latent attention under tensor and sequence parallel", _s(TP2_SP), model_file=MLA),
    Feature("multi-head latent attention under context parallel", _s(CP2), model_file=MLA),
    Feature("dropout under tensor, sequence and context parallel", _s(CP2, TP2_SP, world=4),
            model_file={**TINY, "dropout": 0.1}),
    Feature("tied embeddings with the embedding and head on two stages (Megatron's embedding group)",
            _s(PP2, DP2, world=4, m=4, dp=2), model_file={**TINY, "tie_embeddings": True}),
    Feature("tied embeddings on two stages of one pipeline rank (placement v, DualPipe)",
            _s(*_sched("zbv", 2), m=4), model_file={**TINY, "tie_embeddings": True}),
    Feature("tied embeddings on two stages with ZeRO-2/3 reducing every micro-batch",
            _s(PP2, {"op": "data_parallel", "degree": 2, "zero": 2}, world=4, m=4, dp=2),
            model_file={**TINY, "tie_embeddings": True}, runs=False,
            why="per-micro-batch reduce-scatters (reduce per_step runs)", match="reduce-scatters every micro-batch"),
    Feature("multi-head latent attention, shared experts (no TP/CP)", _s(DP2, EP2, dp=2),
            model_file={**MOE, "shared_experts": 1, **{k: v for k, v in MLA.items() if k not in TINY}}),
    Feature("multi-token prediction (DeepSeek-V3 MTP modules)", _s(PP2, m=4), model_file={**TINY, "mtp_layers": 1}),
    Feature("multi-token prediction under context parallel (all-gather, ring)", _s(CP2),
            model_file={**TINY, "mtp_layers": 1}),
    Feature("multi-token prediction under tensor (+ sequence) parallel", _s(TP2_SP), model_file={**TINY, "mtp_layers": 1}),
    Feature("multi-token prediction under tensor parallel with a split backward", _s(*_sched("zb1p"), TP2_SP, world=4, m=4),
            model_file={**TINY, "mtp_layers": 1}),
)


def feature_table() -> str:
    """`FEATURES` as the README's markdown table."""
    rows = ["| plan feature | simulator | executor |", "|---|---|---|"]
    for f in FEATURES:
        rows.append(f"| {f.name} | ✅ | {'✅' if f.runs else 'simulate-only: ' + f.why} |")
    return "\n".join(rows)
