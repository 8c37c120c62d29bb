"""FP8 linears: which GEMM rows of a segment's profile run in FP8 under the stack's ``fp8``
recipe, and the quantisation kernels the recipe adds (their bytes: `costmodel.fp8`).

Real recipes compute only the linear layers inside the transformer blocks in FP8:

- Megatron-Core with Transformer Engine: the TE layer spec's linears (``linear_qkv``,
  ``linear_proj``, ``linear_fc1``, ``linear_fc2``, MLA's projections, the grouped expert GEMMs);
  the output layer is megatron's own ``ColumnParallelLinear`` [megatron-core 0.16.1
  models/gpt/gpt_model.py:241], the router a ``router_gating_linear`` in the router dtype
  [transformer/moe/router.py:95-100], the attention core TE's fused attention;
- torchtitan: every ``nn.Linear`` but the filtered fqns, ``filter_fqns = ["output"]`` in the
  Llama 3 configs [torchtitan e7c0cae torchtitan/models/llama3/train_configs/llama3_8b.toml:59-62];
- DeepSeek-V3: "the embedding module, the output head, MoE gating modules, normalization
  operators, and attention operators" keep BF16/FP32 [arXiv 2412.19437 §3.3].

So in the segments ``dense``, ``moe_pre`` and ``moe_experts`` the GEMMs of the block's linears
get dtype ``fp8`` (priced at the FP8 peak, their operands at one byte), except the router's;
the attention core (flash rows, or the unfused bmms) and the ``embed`` and ``head`` segments
keep the model dtype. The linears are the closed-form list of one layer's mm calls
(`piper_sim.recompute.layer_table`, the routed experts' from the expert MLP), matched to the
profile's rows by shape: forward ``(m, n, k)``, input gradient ``(m, k, n)``, weight gradient
``(n, k, m)``; a row holding more calls of a shape than the block has FP8 linears of it (the
router's shape colliding with a linear's) keeps the rest in the model dtype.

Quantisation kernels (memory-bound rows ``fp8_quantize_*``, `costmodel.fp8.Cast`): each
distinct input tensor once in the forward (rowwise and columnwise copies; q/k/v, gate/up and
MLA's two down-projections read one tensor, which Megatron-Core's fused ``linear_qkv`` /
``linear_fc1`` quantise once), each linear's output gradient in the input-gradient pass, and
the weights once per step, priced in the optimizer step
(`piper_sim.parallel.data.fp8_weight_cast_bytes`).

FP8 activation caching (the stack's ``fp8_activations: fp8``, Transformer Engine's linears and
DeepSeek-V3 §3.3.3): a linear keeps its input for the weight gradient as the FP8 columnwise copy
(`costmodel.fp8.cached_element_bytes`) instead of the high-precision tensor. In the layer's
closed-form saved-tensor table (`piper_sim.recompute.layer_table`) the tensors only FP8 linears
read become FP8 (`CACHED`: the norm outputs, MLA's compressed latents, the MLP activation, the
dispatched tokens); a tensor another op still needs in high precision keeps its copy and gains
an FP8 one (`COPIED`: the attention output flash attention's backward reads, the MLP norm's
output the BF16 router reads beside the shared experts). `cache_inputs` rewrites the table;
`apply` moves the profile's saved bytes by the same difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TypeVar

from costmodel.dtypes import dtype_bytes
from costmodel.fp8 import E5M6_BYTES, cached_element_bytes, cast_of
from piper_sim import kernels
from piper_sim.configs import ModelConfig
from piper_sim.recompute import LayerTable, SavedTensor, layer_table

Segment = TypeVar("Segment")  # a piper_sim.profiling.SegmentCost (not imported: profiling imports this module)

FP8_KINDS = ("dense", "moe_pre", "moe_experts")
NOT_FP8 = ("router",)  # MoE gating stays in the model (or router) dtype [DSV3 §3.3][MCore router.py]
# linears that read the tensor an earlier linear of the layer reads (one cast serves both)
SHARES_INPUT = ("wk", "wv", "wkv_a", "mlp.w3", "shared.w3", "experts.w3")
QUANT_INPUT, QUANT_GRAD = "fp8_quantize_input", "fp8_quantize_grad_output"
LINEAR_GEMMS = ("mm", "addmm")  # a linear's GEMM on meta (F.linear: mm, addmm with a bias)
# saved tensors (`layer_table` rows) that only FP8 linears read: kept in FP8 under activation caching
CACHED = ("attn_norm.out", "q_norm.out", "kv_norm.out", "mlp.act.out", "shared.act.out", "experts.act.out",
          "dispatched")
# saved tensor -> (its FP8 copy, the module it belongs to): read by an FP8 linear and, in high
# precision, by another op (flash attention's backward; the router, when shared experts read it too)
COPIED = {"attn.out": ("wo.input_fp8", "attn_proj"), "mlp_norm.out": ("shared.input_fp8", "shared_experts")}
# DeepSeek-V3 (``fp8_activations: deepseek``, arXiv 2412.19437 §3.3.3 (2)): "we cache the inputs of
# the SwiGLU operator [in MoE] and recompute its output in the backward pass. These activations
# are also stored in FP8 with our fine-grained quantization method"
SWIGLU_INPUTS = ("experts.w1.out", "experts.w3.out", "shared.w1.out", "shared.w3.out")


@dataclass(frozen=True)
class Linear:
    """One FP8 linear of a segment: ``x[m, k] @ W.T[k, n]``, run ``calls`` times per micro-batch
    (the routed experts: once per expert)."""

    name: str
    m: int
    n: int
    k: int
    calls: int = 1

    @property
    def new_input(self) -> bool:
        return self.name not in SHARES_INPUT


def block_linears(cfg: ModelConfig, kind: str, micro_batch: int, seq: int) -> list[Linear]:
    """The FP8 linears of one ``dense``, ``moe_pre`` or ``moe_experts`` segment (``cfg`` the
    rank's shard under tensor parallelism; ``seq`` the tokens of a sequence it profiles)."""
    if kind == "moe_experts":  # one expert's MLP on its uniform share of the routed tokens (profiling)
        routed = micro_batch * seq * cfg.top_k
        tokens = math.ceil(routed / cfg.n_experts)
        calls = max(1, round(routed / tokens))  # kernels.scale's count: n_experts when it divides
        h, ffn = cfg.hidden, cfg.local_expert_ffn
        names = (("experts.fc1", ffn, h), ("experts.fc2", h, ffn)) if cfg.mlp == "gelu" else \
            (("experts.w1", ffn, h), ("experts.w3", ffn, h), ("experts.w2", h, ffn))
        return [Linear(name, tokens, n, k, calls) for name, n, k in names]
    table = layer_table(cfg, kind, micro_batch, seq, 2)
    return [Linear(name, m, n, k) for name, (m, n, k) in table.mms if name not in NOT_FP8]


def quantize_rows(linears: list[Linear], recipe: str, family: str, dtype: str) -> tuple[tuple, tuple]:
    """(forward rows, input-gradient rows) of the casts ``recipe`` adds for ``linears``: each
    distinct input in the forward, each output gradient in the backward."""
    src = dtype_bytes(dtype)
    x, g = cast_of(recipe, family, "input"), cast_of(recipe, family, "grad_output")
    f = [_mem(QUANT_INPUT, x.nbytes(lin.m * lin.k, src), dtype, lin.calls) for lin in linears if lin.new_input]
    bi = [_mem(QUANT_GRAD, g.nbytes(lin.m * lin.n, src), dtype, lin.calls) for lin in linears]
    return kernels.merge(f), kernels.merge(bi)


def _mem(name: str, per_call: float, dtype: str, calls: int) -> tuple:
    return ("mem", name, (round(per_call),), dtype, calls, 0.0, float(round(per_call) * calls))


def to_fp8(rows: tuple, shapes: dict[tuple[int, int, int], int] | None, dtype: str) -> tuple:
    """``rows`` with up to ``shapes[(m, n, k)]`` calls of each linear GEMM shape in FP8 (``None``:
    every linear GEMM, the routed experts'): one byte per operand element, the output in the
    model dtype."""
    out = []
    left = dict(shapes or {})
    for cls, name, shape, dt, count, flops, nbytes in rows:
        linear = cls == "gemm" and name in LINEAR_GEMMS and shape[3] == 1
        take = 0 if not linear else count if shapes is None else min(count, left.get(tuple(shape[:3]), 0))
        if take:
            left[tuple(shape[:3])] = left.get(tuple(shape[:3]), 0) - take
            m, n, k, b = shape
            out.append((cls, name, shape, "fp8", take, flops * take / count,
                        float(take * b * (m * k + k * n + m * n * dtype_bytes(dtype)))))
        if count > take:
            out.append((cls, name, shape, dt, count - take, flops * (count - take) / count,
                        nbytes * (count - take) / count))
    return kernels.merge(out)


def _shapes(linears: list[Linear], order: tuple[int, int, int]) -> dict[tuple[int, int, int], int]:
    """GEMM shapes (and calls) of the linears in one pass: ``order`` picks (m, n, k) from (m, n, k)."""
    acc: dict[tuple[int, int, int], int] = {}
    for lin in linears:
        dims = (lin.m, lin.n, lin.k)
        key = tuple(dims[i] for i in order)
        acc[key] = acc.get(key, 0) + lin.calls
    return acc


def apply(cost: Segment, cfg: ModelConfig, kind: str, micro_batch: int, seq: int, recipe: str, family: str,
          dtype: str, cached: bool = False, mode: str = "fp8") -> Segment:
    """``cost`` with its block linears in FP8 and the recipe's casts added (other kinds unchanged);
    ``cached``: their inputs saved in FP8 (`cache_inputs`, ``mode`` the stack's ``fp8_activations``)."""
    if recipe == "none" or kind not in FP8_KINDS:
        return cost
    linears = block_linears(cfg, kind, micro_batch, seq)
    q_f, q_bi = quantize_rows(linears, recipe, family, dtype)
    experts = kind == "moe_experts"  # the expert MLP's GEMMs only: all of them (counts as profiling scaled them)

    def shapes(order: tuple[int, int, int]) -> dict | None:
        return None if experts else _shapes(linears, order)

    saved = cost.saved_act_bytes
    if cached:
        saved = max(0, round(saved + cached_delta(cfg, kind, micro_batch, seq, recipe, dtype, cost.a2a_bytes, mode)))
    return replace(cost, saved_act_bytes=saved,
                   kernels_f=kernels.merge(to_fp8(cost.kernels_f, shapes((0, 1, 2)), dtype), q_f),
                   kernels_bi=kernels.merge(to_fp8(cost.kernels_bi, shapes((0, 2, 1)), dtype), q_bi),
                   kernels_bw=to_fp8(cost.kernels_bw, shapes((1, 2, 0)), dtype))


def cache_inputs(table: LayerTable, recipe: str, mode: str = "fp8") -> LayerTable:
    """``table`` with its FP8 linears' inputs saved in FP8 (see the module docstring); ``mode``
    ``deepseek``: also the MoE SwiGLU's inputs (`SWIGLU_INPUTS`), and the attention output kept
    once, in E5M6 (`costmodel.fp8.E5M6_BYTES`), for the output linear and the attention backward."""
    element = cached_element_bytes(recipe)
    shared_experts = any(n.startswith("shared.") for n, _ in table.mms)
    rows: list[SavedTensor] = []
    for r in table.rows:
        if r.name in CACHED or (r.name == "mlp_norm.out" and table.kind == "dense") or \
                (mode == "deepseek" and r.name in SWIGLU_INPUTS):
            rows.append(replace(r, nbytes=r.nbytes * element / table.nbytes))
            continue
        if mode == "deepseek" and r.name == "attn.out":
            rows.append(replace(r, nbytes=r.nbytes * E5M6_BYTES / table.nbytes))
            continue
        rows.append(r)
        copy = 0.0
        if r.name == "attn.out":  # wo's input: the heads' values (MLA's flash output pads them to the qk dim)
            m, _, k = dict(table.mms)["wo"]
            copy = m * k * element
        elif r.name == "mlp_norm.out" and shared_experts:
            copy = r.nbytes * element / table.nbytes
        if copy:
            name, module = COPIED[r.name]
            rows.append(SavedTensor(name, copy, module))
    return replace(table, rows=tuple(rows))


def cached_delta(cfg: ModelConfig, kind: str, micro_batch: int, seq: int, recipe: str, dtype: str,
                 a2a_bytes: float = 0.0, mode: str = "fp8") -> float:
    """Bytes FP8 activation caching adds to one segment's saved activations (negative: frees)."""
    table = layer_table(cfg, kind, micro_batch, seq, dtype_bytes(dtype), a2a_bytes)
    return cache_inputs(table, recipe, mode).saved - table.saved


def fp8_weight_tensors(rows: tuple) -> list[tuple[int, int]]:
    """(elements of one weight, weights) of each FP8 GEMM row of a forward table (a linear's
    forward call reads one weight ``[n, k]``)."""
    return [(r[2][1] * r[2][2] * r[2][3], r[4]) for r in rows if r[0] == "gemm" and r[3] == "fp8"]
