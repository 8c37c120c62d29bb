"""Recompute policies as real runs write them, and the saved tensors of one layer they act on.

A policy (`Recompute`, the ``recompute`` directive of one stage) says, per transformer layer of
the stage, which of its saved activations stay from forward to backward and which forward work
its backward runs again:

``full``            every layer is a checkpoint (keeps its input); the head too (piper-sim's
                    historical rule). With ``method`` it is Megatron's ``--recompute-granularity
                    full`` [Megatron-LM megatron/training/arguments.py ``--recompute-method``,
                    ``--recompute-num-layers``; megatron/core/transformer/transformer_block.py
                    ``TransformerBlock._checkpointed_forward``]: ``uniform`` checkpoints chunks of
                    ``num_layers`` consecutive layers (one input kept per chunk, a chunk recomputed
                    at once), ``block`` checkpoints the first ``num_layers`` layers of each stage
                    and keeps all activations of the others; neither recomputes the output layer.
``every``           torchtitan ``activation_checkpoint.mode = "selective"`` with
                    ``selective_ac_option = "N"`` (``every: N``): full AC of every N-th block
                    [torchtitan distributed/activation_checkpoint.py ``_apply_layer_sac``: a global
                    block counter from 1, checkpointed when ``count % ac_freq == 0``]; counted here
                    over the model's layer indices (layer ``i`` when ``(i + 1) % N == 0``), which is
                    torchtitan's count whenever a rank's layers per stage are a multiple of N.
``op``              torchtitan ``selective_ac_option = "op"`` [distributed/activation_checkpoint.py
                    ``_apply_op_sac`` / ``_get_custom_policy`` and the ``_save_list`` of ops
                    (``aten.mm``, the SDPA flash/efficient/cudnn ops, ``aten.max``, ...)]: each block
                    is a checkpoint whose selective-checkpoint policy keeps the outputs of the
                    save-list ops, except every second ``mm`` (the ``mm_count % 2 == 0`` rule, the
                    count restarting per block); everything else is recomputed in backward. For a
                    Llama block the mm order is wq, wk, wv, wo, w1, w3, w2, so wq, wv, w1 and w2
                    outputs are kept, and the attention op's outputs (out, log-sum-exp). MoE:
                    the router gate mm is forced to recompute and not counted
                    (``per_op_sac_force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``), the
                    routed experts run ``_grouped_mm``, not on the save list: recomputed.
                    torchao float8 linears are counted and kept alike (their ``aten.mm``); under
                    torch.compile the w2 (and wo) output is not saved: no backward reads it
                    (`LayerTable.op_sac_saved`).
``selective``       Megatron ``--recompute-granularity selective`` with ``modules`` (its
                    ``--recompute-modules``, default ``[core_attn]`` = Korthikanti et al.'s attention
                    core, the measured mode of `piper_sim.memory`) [megatron/core/transformer/
                    transformer_layer.py, ``recompute_modules``]: ``core_attn``; ``layernorm`` (the two
                    norms' outputs and statistics dropped, ``CheckpointWithoutOutput``); ``mlp`` (the
                    dense MLP a checkpoint: its internals); ``moe_act`` (the experts' activation
                    output); ``moe`` (the whole MoE block, not with expert parallelism);
                    ``shared_experts``; ``mla_up_proj`` (MLA's up-projections and rope: q, k and v;
                    the two latent norm outputs are the checkpoint's inputs and stay
                    [multi_latent_attention.py ``qkv_up_checkpoint.checkpoint(
                    qkv_up_proj_and_rope_apply, q_compressed, kv_compressed, ...)``]).

Activation bytes of a policy are closed forms over one layer's saved-tensor table
(`layer_table`, fused norms and flash attention: what autograd keeps for a piper-sim block;
`piper_sim.memory` measures the ``none`` and ``core_attn`` totals on meta instead). A policy's
extra backward work is priced from the forward's own kernel rows (`piper_sim.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

MODES = ("full", "selective", "op", "every")
METHODS = ("uniform", "block")
MODULES = ("core_attn", "layernorm", "mlp", "moe_act", "moe", "shared_experts", "mla_up_proj")
# modules whose recompute re-runs a tensor-parallel collective (Megatron's checkpoint holds the
# row-parallel output's all-reduce / reduce-scatter): module -> the block label of its collectives
TP_COLLECTIVE_MODULES = {"mlp": "mlp", "moe": "moe", "shared_experts": "shared"}
# linears whose output only joins the residual stream (a Llama block's ``h = x + wo(...)`` and
# ``out = h + w2(...)``, torchtitan models/llama3/model.py:263, 302, 365-366 @e7c0cae): no backward
# reads it, so torch.compile's partitioner does not save it even when op-SAC marks it MUST_SAVE
# (measured on CPU, torch 2.13: benchmarks/probe_saved_tensors.py)
RESIDUAL_ONLY = ("wo", "mlp.w2", "mlp.fc2", "shared.w2", "shared.fc2")


def reruns_forward_collective(unit_mode: str, modules: tuple[str, ...], block: str) -> bool:
    """Whether a unit recomputed as ``unit_mode`` (`Recompute.unit_modes`) re-runs, inside its
    backward, the forward collective of its ``block`` (``attn``, ``mlp``, ``moe``, ``shared``,
    ``kv``, or '' for the embedding's / head's): a ``full`` or op-SAC checkpoint re-runs its
    whole forward (no early stop: every collective recurs), a ``selective`` one only the
    collectives inside its modules' checkpoints (`TP_COLLECTIVE_MODULES`)."""
    if unit_mode in ("full", "op"):
        return True
    return unit_mode == "selective" and any(TP_COLLECTIVE_MODULES.get(m) == block for m in modules)


@dataclass(frozen=True)
class Recompute:
    """One stage's recompute policy (see the module docstring)."""

    mode: str = "none"
    method: str = ""          # full: "" (every layer and the head) | "uniform" | "block"
    num_layers: int = 1       # full + method: Megatron --recompute-num-layers
    every: int = 1            # every: torchtitan selective_ac_option = "N"
    modules: tuple[str, ...] = ()  # selective: Megatron --recompute-modules ((): core_attn)

    @classmethod
    def from_directive(cls, d: dict[str, Any]) -> Recompute:
        return cls(mode=d.get("mode", "full"), method=d.get("method", "uniform" if "num_layers" in d else ""),
                   num_layers=d.get("num_layers", 1), every=d.get("every", 1),
                   modules=tuple(d.get("modules", ())))

    @property
    def options(self) -> dict[str, Any]:
        """The fields beyond ``mode`` that are set (what the plan header records)."""
        out: dict[str, Any] = {}
        if self.method:
            out.update(method=self.method, num_layers=self.num_layers)
        if self.mode == "every":
            out["every"] = self.every
        if self.modules:
            out["modules"] = list(self.modules)
        return out

    @classmethod
    def from_header(cls, mode: str, options: dict[str, Any] | None) -> Recompute:
        o = options or {}
        return cls(mode=mode, method=o.get("method", ""), num_layers=o.get("num_layers", 1),
                   every=o.get("every", 1), modules=tuple(o.get("modules", ())))

    @property
    def plain(self) -> bool:
        """Today's modes: plain ``full`` (every layer and the head) or ``selective`` (core_attn)."""
        return not self.options and self.mode in ("none", "full", "selective")

    @property
    def module_set(self) -> tuple[str, ...]:
        return self.modules or ("core_attn",)

    def unit_modes(self, units: list[str]) -> dict[str, tuple[str, int]]:
        """unit -> (per-unit mode, checkpoint chunk) for the units of one stage, in order:
        ``none`` | ``full`` | ``op`` | ``selective``; a chunk groups the units one checkpoint
        holds (Megatron uniform with ``num_layers`` > 1; otherwise one unit per chunk)."""
        out: dict[str, tuple[str, int]] = {}
        pos = 0
        for i, u in enumerate(units):
            layer = u.startswith("layers.")
            if self.mode == "none":
                mode = "none"
            elif self.mode == "full" and not self.method:
                mode = "full" if u != "embed" else "none"
            elif not layer:
                mode = "none"  # torchtitan and Megatron wrap transformer blocks only
            elif self.mode == "full" and self.method == "block":
                mode = "full" if pos < self.num_layers else "none"
            elif self.mode == "full":
                mode = "full"
            elif self.mode == "every":
                mode = "full" if (int(u.split(".")[1]) + 1) % self.every == 0 else "none"
            else:
                mode = self.mode
            chunk = pos // self.num_layers if (layer and self.mode == "full" and self.method == "uniform") else -1 - i
            out[u] = (mode, chunk)
            pos += layer
        return out


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a layer keeps from forward to backward without recompute."""

    name: str
    nbytes: float
    module: str          # layernorm | attn_proj | core_attn | mla_up_proj | mlp | router | experts | shared_experts
    mm: tuple[int, int, int] | None = None  # produced by an ``mm`` of shape (m, n, k): its output
    sdpa: bool = False   # an output of the attention op (on torchtitan's save list)


@dataclass(frozen=True)
class LayerTable:
    """The saved tensors of one layer segment (``dense``, ``moe_pre`` or ``moe_experts``) and the
    mm calls of its forward in execution order (shape ``(m, n, k)``: ``x[m, k] @ W.T[k, n]``)."""

    kind: str
    input_bytes: float
    rows: tuple[SavedTensor, ...]
    mms: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    nbytes: int = 2
    module_flops: dict[str, float] = field(default_factory=dict)  # forward flops of named modules

    @property
    def saved(self) -> float:
        """Every row: what autograd keeps without recompute (a GQA layer with fused norms and
        flash attention, no dropout or qk_norm: equal to the meta-measured profile)."""
        return sum(r.nbytes for r in self.rows)

    def module_bytes(self, *modules: str) -> float:
        return sum(r.nbytes for r in self.rows if r.module in modules)

    def op_sac_saved(self, compiled: bool = False) -> tuple[list[tuple[str, tuple[int, int, int]]], float]:
        """torchtitan op-SAC on this segment: (the mm calls whose outputs are kept, bytes kept
        besides the checkpoint input: those outputs and the attention op's). torchao float8
        linears count as bf16 ones: the policy runs in a TorchDispatchMode, which sees an op before
        a tensor subclass lowers it, and torchao's Float8 tensor implements ``aten.mm`` (pytorch/ao
        torchao/float8/float8_ops.py:351 @0afa4c1, ``float8_mm`` -> ``torch._scaled_mm``), so the
        policy counts and saves its ``aten.mm`` output in bf16 (measured on CPU: benchmarks/probe_saved_tensors.py).
        ``compiled`` (the block under ``torch.compile``, torchtitan's per-block compile): the
        partitioner saves only what the backward reads, so a kept output the backward never
        reads (`RESIDUAL_ONLY`: the attention and MLP output projections, added to the residual
        stream) costs no bytes; its mm still does not run again."""
        kept_mms, count = [], 0
        for name, shape in self.mms:
            if name in ("router", "experts"):  # forced recompute / _grouped_mm: not counted, not saved
                continue
            count += 1
            if count % 2 == 1:
                kept_mms.append((name, shape))
        outs = sum(shape[0] * shape[1] * self.nbytes for name, shape in kept_mms
                   if not (compiled and name in RESIDUAL_ONLY))
        return kept_mms, outs + sum(r.nbytes for r in self.rows if r.sdpa)


def layer_table(cfg, kind: str, micro_batch: int, seq: int, nbytes: int, a2a_bytes: float = 0.0) -> LayerTable:
    """The closed-form table of what one layer segment keeps (see `SavedTensor`), one rank's
    share under tensor parallelism (``cfg`` a shard config). ``seq``: the tokens of a sequence
    the rank's attention sees; the residual stream holds ``cfg.local_seq(seq)`` of them (sequence
    parallelism). ``a2a_bytes``: the expert block's dispatched tokens (``moe_experts``)."""
    B, h, nb = micro_batch, cfg.hidden, nbytes
    t_res = B * cfg.local_seq(seq)  # residual-stream tokens (the norms)
    t = B * seq                     # tokens inside the tensor-parallel region
    rows: list[SavedTensor] = []
    mms: list[tuple[str, tuple[int, int, int]]] = []
    flops: dict[str, float] = {}

    def mm(name: str, n: int, k: int, m: int = t) -> tuple[int, int, int]:
        mms.append((name, (m, n, k)))
        return (m, n, k)

    def mlp(module: str, tokens: int, ffn: int, prefix: str) -> None:
        if cfg.mlp == "gelu":
            mm(prefix + "fc1", ffn, h, tokens)
            mm(prefix + "fc2", h, ffn, tokens)
            rows.extend([SavedTensor(prefix + "fc1.out", tokens * ffn * nb, module, mm=(tokens, ffn, h)),
                         SavedTensor(prefix + "act.out", tokens * ffn * nb, module + ".act")])
            flops[module] = flops.get(module, 0.0) + 4.0 * tokens * h * ffn
            return
        mm(prefix + "w1", ffn, h, tokens)
        mm(prefix + "w3", ffn, h, tokens)
        mm(prefix + "w2", h, ffn, tokens)
        rows.extend([SavedTensor(prefix + "w1.out", tokens * ffn * nb, module, mm=(tokens, ffn, h)),
                     SavedTensor(prefix + "w3.out", tokens * ffn * nb, module, mm=(tokens, ffn, h)),
                     SavedTensor(prefix + "silu.out", tokens * ffn * nb, module + ".act"),
                     SavedTensor(prefix + "act.out", tokens * ffn * nb, module + ".act")])
        flops[module] = flops.get(module, 0.0) + 6.0 * tokens * h * ffn

    if kind == "moe_experts":
        copies = round(a2a_bytes / (h * nb)) if a2a_bytes else t_res * cfg.top_k
        rows.append(SavedTensor("dispatched", copies * h * nb, "experts"))
        mlp("experts", copies, cfg.local_expert_ffn, "experts.")
        mms[:] = [("experts", s) for _, s in mms]  # routed experts: torchtitan's _grouped_mm
        return LayerTable(kind, float(a2a_bytes), tuple(rows), tuple(mms), nb, flops)

    def norm(name: str) -> None:
        rows.extend([SavedTensor(name + ".out", t_res * h * nb, "layernorm"),
                     SavedTensor(name + ".rstd", t_res * 4.0, "layernorm")])

    H, KV = cfg.local_heads, cfg.local_kv_heads
    rows.append(SavedTensor("input", t_res * h * nb, "residual"))  # the attention norm's input
    norm("attn_norm")
    if cfg.attention == "mla":
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        if cfg.q_lora_rank:
            mm("wq_a", cfg.q_lora_rank, h)
            rows.append(SavedTensor("q_norm.out", t * cfg.q_lora_rank * nb, "attn_proj"))  # mla_up_proj's input
            mm("wq_b", H * qk, cfg.q_lora_rank)
        else:
            mm("wq", H * qk, h)
        mm("wkv_a", cfg.kv_lora_rank + cfg.qk_rope_dim, h)
        rows.append(SavedTensor("kv_norm.out", t * cfg.kv_lora_rank * nb, "attn_proj"))  # mla_up_proj's input
        mm("wkv_b", H * (cfg.qk_nope_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        rows.extend([SavedTensor("q", t * H * qk * nb, "mla_up_proj"), SavedTensor("k", t * H * qk * nb, "mla_up_proj"),
                     SavedTensor("v", t * H * qk * nb, "mla_up_proj")])  # v padded to the qk head dim (flash)
        flops["mla_up_proj"] = 2.0 * t * (cfg.q_lora_rank * H * qk if cfg.q_lora_rank else 0) \
            + 2.0 * t * cfg.kv_lora_rank * H * (cfg.qk_nope_dim + cfg.v_head_dim)
        out_dim, o_in = H * qk, H * cfg.v_head_dim
    else:
        hd = cfg.head_dim
        if cfg.rope:  # the rotary tables the rotations keep (one per layer)
            rows.append(SavedTensor("rope.cos_sin", 2 * seq * hd * nb, "attn_proj"))
        mm("wq", H * hd, h)
        mm("wk", KV * hd, h)
        mm("wv", KV * hd, h)
        rows.extend([SavedTensor("q", t * H * hd * nb, "attn_proj"), SavedTensor("k", t * KV * hd * nb, "attn_proj"),
                     SavedTensor("v", t * KV * hd * nb, "attn_proj")])
        out_dim = o_in = H * hd
    rows.extend([SavedTensor("attn.out", t * out_dim * nb, "attn_proj", sdpa=True),
                 SavedTensor("attn.lse", t * H * 4.0, "core_attn", sdpa=True),
                 SavedTensor("attn.rng", 24.0, "core_attn", sdpa=True)])  # philox seed and offset
    mm("wo", h, o_in)
    rows.append(SavedTensor("residual", t_res * h * nb, "residual"))  # the MLP norm's input
    norm("mlp_norm")
    if kind == "dense":
        mlp("mlp", t, cfg.local_ffn, "mlp.")
    else:
        mm("router", cfg.n_experts, h)
        flops["router"] = 2.0 * t * h * cfg.n_experts
        k = cfg.top_k  # fp32 softmax, top-k weights and int64 ids, the renormalising sum
        rows.extend([SavedTensor("router.probs", t * cfg.n_experts * 4.0, "router"),
                     SavedTensor("router.topk", t * k * 4.0, "router"), SavedTensor("router.ids", t * k * 8.0, "router")])
        if cfg.norm_topk:
            rows.append(SavedTensor("router.sum", t * 4.0, "router"))
        if cfg.n_shared:
            mlp("shared_experts", t, cfg.n_shared * cfg.local_expert_ffn, "shared.")
    return LayerTable(kind, float(t_res * h * nb), tuple(rows), tuple(mms), nb, flops)


def with_fused_swiglu(table: LayerTable) -> LayerTable:
    """``table`` as a fused SwiGLU kernel saves it: its two inputs only, not ``silu(gate)``
    (Megatron-Core ``bias_swiglu_impl``; `piper_sim.models._MetaFusedSwiGLU`, what the profile
    measures with the stack's ``swiglu: fused``)."""
    return replace(table, rows=tuple(r for r in table.rows if not r.name.endswith("silu.out")))


def op_sac_kept(table: LayerTable, compiled: bool = False) -> float:
    """Bytes a layer segment keeps under torchtitan op-SAC: its checkpoint input (the layer's
    input; nothing for a routed-expert block inside it) and the save-list outputs (``compiled``:
    `LayerTable.op_sac_saved`)."""
    return (table.input_bytes if table.kind != "moe_experts" else 0.0) + table.op_sac_saved(compiled)[1]


def module_freed(table: LayerTable, modules: tuple[str, ...]) -> float:
    """Bytes Megatron's selective ``modules`` drop from a layer segment's saved tensors, besides
    ``core_attn`` (measured): the named modules' internal tensors (their input stays)."""
    tags: set[str] = set()
    for m in modules:
        tags |= {"layernorm": {"layernorm"}, "mlp": {"mlp", "mlp.act"}, "moe_act": {"experts.act"},
                 "moe": {"experts", "experts.act", "shared_experts", "shared_experts.act", "router"},
                 "shared_experts": {"shared_experts", "shared_experts.act"},
                 "mla_up_proj": {"mla_up_proj"}}.get(m, set())
    return table.module_bytes(*tags)


def module_recompute_flops(table: LayerTable, modules: tuple[str, ...], fwd_flops: float) -> float:
    """Forward flops the backward re-runs for Megatron's selective ``modules`` of one segment
    (``core_attn`` apart: `piper_sim.memory` measures it). ``fwd_flops``: the segment's."""
    out = 0.0
    for m in modules:
        if m == "moe":
            out += fwd_flops if table.kind == "moe_experts" else \
                table.module_flops.get("router", 0.0) + table.module_flops.get("shared_experts", 0.0)
        elif m == "shared_experts" or (m == "mlp" and table.kind == "dense") or m == "mla_up_proj":
            out += table.module_flops.get(m, 0.0)
    return out
