"""FP8 training recipes: the GPUs each runs on and the bytes each quantisation kernel moves.

An FP8 run computes the linear layers of the transformer blocks in FP8 (the stack's ``fp8``
field, `costmodel.stack`; which GEMMs: `piper_sim.fp8`). Each FP8 GEMM needs its operands
quantised first: memory-bound kernels that read the high-precision tensor and write the FP8
data and its scales. Transformer Engine's table of which tensor each GEMM of a linear reads
[TE-perf, Table 2]:

    forward  output = input · weightᵀ        input rowwise,        weight rowwise
    wgrad    wgrad  = output_gradᵀ · input   output_grad columnwise, input columnwise
    dgrad    dgrad  = output_grad · weight   output_grad rowwise,  weight columnwise

so every tensor is quantised in both usages: the input in the forward (TE saves the
columnwise input for the wgrad [TE-perf, "Activations saved for backward"]), the output
gradient in the backward ("both rowwise and columnwise usages are produced on the fly"
[TE-perf]), the weight once per step (Megatron-Core passes ``is_first_microbatch`` so TE
casts the weight on a step's first micro-batch and reuses it [MCore-TE]; with
``fp8_param_gather``, the Megatron-Bridge FP8 recipes' setting [MB-prec], the weights are kept
in FP8 and the distributed optimizer quantises its updated shard after each step [MCore-opt]).

A cast moves ``reads · elements · source_bytes + copies · (elements + scales · scale_bytes)``
bytes (`Cast.nbytes`), with the recipe's numbers (`CASTS`, one source per row):

``tensorwise``  FP8 current scaling (TE ``Float8CurrentScaling``; Megatron-Bridge FP8-CS;
                torchao's default ``Float8LinearConfig``, torchtitan's float8 converter): one
                fp32 scale per tensor, computed from the tensor's amax, so the source is read
                twice ("reading the tensor twice: first read amax, second read scale and cast"
                [TE-cs]); on Hopper the columnwise usage is a physical transpose, a second copy;
                on Blackwell one copy serves both usages [TE-cs, "Transpose handling"].
``blockwise``   FP8 block scaling (TE ``Float8BlockScaling``, DeepSeek-V3 §3.3.1 [DSV3]):
                activations and gradients in 1x128 blocks, weights in 128x128 blocks, fp32
                scales [TE-bs]; a 1D-blocked tensor's columnwise copy is quantised separately
                from the source (its blocks differ), the rowwise and columnwise copies in one
                kernel (one read, TE-perf fusion 1). Hopper only [MB-prec]: on Blackwell TE
                emulates it with MXFP8 [TE-bs, "Supported devices"].
``mxfp8``       MXFP8 (TE ``MXFP8BlockScaling``, Megatron-Bridge FP8-MX): one E8M0 (1-byte)
                scale per 32 consecutive elements, rowwise (1x32) and columnwise (32x1) copies
                each quantised from the source [TE-mx]; Blackwell only (SM 10.0+) [TE-mx].

Sources: [TE-perf] NVIDIA/TransformerEngine
``docs/features/low_precision_training/performance_considerations/performance_considerations.rst``
(Table 2, "Quantization fusions", "Memory usage"); [TE-cs] ``.../fp8_current_scaling/
fp8_current_scaling.rst``; [TE-bs] ``.../fp8_blockwise_scaling/fp8_blockwise_scaling.rst``;
[TE-mx] ``.../mxfp8/mxfp8.rst`` (all @d0067d0); [MCore-TE] megatron-core 0.16.1
``megatron/core/extensions/transformer_engine.py`` TELinear.forward (``is_first_microbatch``,
``disable_parameter_transpose_cache`` default False) and ``pipeline_parallel/schedules.py``
forward_step (``set_is_first_microbatch`` on a step's first micro-batch); [MCore-opt] the same
package's ``optimizer/distrib_optimizer.py`` ``_copy_main_params_to_model_params`` ->
``fp8_utils.quantize_param_shard``; [MB-prec] NVIDIA-NeMo/Megatron-Bridge
``src/megatron/bridge/training/mixed_precision.py`` @1804c076f (line 46: ``fp8_recipe``
"tensorwise", "delayed", "mxfp8" (for Blackwell only), "blockwise" (for Hopper only); lines
242-253 bf16_with_mxfp8_mixed and 272-291 bf16_with_fp8_current_scaling_mixed: ``fp8_param_gather = True``);
[DSV3] arXiv 2412.19437 §3.3.1 (fine-grained quantisation: 1x128 tiles, 128x128 blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

RECIPES = ("none", "tensorwise", "blockwise", "mxfp8")
# GPU families (costmodel.hardware GPU.family) each recipe runs on [MB-prec][TE-mx][TE-bs]
RECIPE_FAMILIES: dict[str, tuple[str, ...]] = {
    "tensorwise": ("hopper", "blackwell"), "blockwise": ("hopper",), "mxfp8": ("blackwell",),
}
ROLES = ("input", "grad_output", "weight")


@dataclass(frozen=True)
class Cast:
    """One quantisation of a high-precision tensor into the FP8 copies a linear's GEMMs read."""

    reads: int        # passes over the high-precision source
    copies: int       # FP8 copies written (rowwise, columnwise)
    block: int        # elements sharing one scale; 0: one scale for the whole tensor
    scale_bytes: int  # bytes of one scale (fp32 4, E8M0 1)
    source: str

    def nbytes(self, elements: float, source_bytes: int) -> float:
        """Bytes the cast of a tensor of ``elements`` (in ``source_bytes`` each) moves."""
        scales = 1.0 if self.block == 0 else elements / self.block
        return self.reads * elements * source_bytes + self.copies * (elements + scales * self.scale_bytes)


_CS = "TE fp8_current_scaling.rst: amax read + cast read, one fp32 scale per tensor"
_TENSORWISE_HOPPER = Cast(2, 2, 0, 4, _CS + "; Hopper: columnwise = a transposed copy")
_TENSORWISE_BLACKWELL = Cast(2, 1, 0, 4, _CS + "; Blackwell: rowwise and columnwise share one layout")
_BLOCK_1D = Cast(1, 2, 128, 4, "TE fp8_blockwise_scaling.rst / DSV3 §3.3.1: 1x128 blocks, fp32 scales, "
                               "rowwise and columnwise quantised from the source in one kernel")
_BLOCK_2D = Cast(1, 2, 128 * 128, 4, "TE fp8_blockwise_scaling.rst / DSV3 §3.3.1: 128x128 weight blocks, fp32 scales")
_MX = Cast(1, 2, 32, 1, "TE mxfp8.rst: one E8M0 scale per 32 elements, rowwise 1x32 and columnwise 32x1 "
                        "copies each quantised from the source")

# (recipe, GPU family) -> {tensor role: its cast}
CASTS: dict[tuple[str, str], dict[str, Cast]] = {
    ("tensorwise", "hopper"): dict.fromkeys(ROLES, _TENSORWISE_HOPPER),
    ("tensorwise", "blackwell"): dict.fromkeys(ROLES, _TENSORWISE_BLACKWELL),
    ("blockwise", "hopper"): {"input": _BLOCK_1D, "grad_output": _BLOCK_1D, "weight": _BLOCK_2D},
    ("mxfp8", "blackwell"): dict.fromkeys(ROLES, _MX),
}


def cast_of(recipe: str, family: str, role: str) -> Cast:
    """The cast ``recipe`` does on a GPU of ``family`` for a tensor of ``role`` (input,
    grad_output, weight); a ValueError for a pair the recipe does not run on."""
    try:
        return CASTS[(recipe, family)][role]
    except KeyError:
        raise ValueError(f"fp8 recipe {recipe!r} does not run on {family} GPUs") from None


# DeepSeek-V3 keeps the attention output (the input of the linear after attention, which the
# attention backward reads too) in "a customized E5M6 data format" [arXiv 2412.19437 §3.3.3
# "Low-Precision Activation" (1)]: 1 sign + 5 exponent + 6 mantissa bits = 12 bits, stored packed
# (1.5 B: inferred: the format's only gain over BF16 is its size)
E5M6_BYTES = 1.5


def cached_element_bytes(recipe: str) -> float:
    """Bytes per element of the FP8 input a Transformer Engine linear saves for its weight
    gradient: the columnwise copy only (transformer_engine/pytorch/module/linear.py:596-622
    @d0067d0da), one byte and its share of the input cast's scales. The recipe fixes it: a
    tensorwise scale is one per tensor on Hopper and Blackwell alike, blockwise runs on Hopper
    only, MXFP8 on Blackwell only (`RECIPE_FAMILIES`)."""
    cast = cast_of(recipe, RECIPE_FAMILIES[recipe][0], "input")
    return 1.0 + (cast.scale_bytes / cast.block if cast.block else 0.0)


def unsupported(recipe: str, family: str, has_fp8_peak: bool) -> str:
    """Why ``recipe`` cannot run on a GPU of ``family`` ("" when it can)."""
    if recipe == "none":
        return ""
    families = RECIPE_FAMILIES[recipe]
    if family not in families:
        return f"runs on {' or '.join(f.capitalize() for f in families)} GPUs only"
    if not has_fp8_peak:
        return "needs an 'fp8' entry in the GPU's peak_flops"
    return ""
