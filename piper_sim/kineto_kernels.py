"""The kernels of one plan op as a real run's Kineto trace names them.

A compute op's operator profile (`piper_sim.kernels` rows: GEMM, attention, memory-bound
ops, with shapes) becomes one kernel per call: `op_kernels` returns them in a layer-like
interleaved order (each row's calls spread evenly over the op), each with

- ``name``: the CUDA kernel the stack runs, as Kineto records it: cuBLAS GEMMs
  (``sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64...`` on Hopper,
  ``ampere_bf16_s16816gemm_bf16_128x128...`` before), the attention kernel the profile row
  names (``costmodel.stack``: FA2 ``pytorch_flash::flash_fwd_kernel``, FA3, cuDNN, Triton),
  the fused norm (Apex ``cuApplyRMSNorm``, or Inductor's ``triton_red_fused_..._rms_norm``
  under ``torch.compile``), and torch's elementwise / reduction / index kernels;
- ``cpu_op``: the aten op that launched it (``aten::mm``,
  ``aten::_scaled_dot_product_flash_attention``...), with ``dims`` (Kineto's ``Input Dims``);
- ``weight``: its time on the GPU by the cost model (`costmodel.operators.table_time` of one
  call), so that the writer can scale the kernels of an op to fill its simulated time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from costmodel.dtypes import DTYPES
from costmodel.hardware import GPU
from costmodel.operators import table_time
from piper_sim.plan import COMPUTE_KINDS

__all__ = ["Kernel", "KernelLevel", "kernel_level", "op_kernels", "kernel_name", "cpu_op_name",
           "optimizer_kernel", "input_dims"]

# C++ element types of torch's kernel templates
CTYPES = {"bf16": "c10::BFloat16", "fp16": "c10::Half", "fp32": "float", "fp8": "c10::Float8_e4m3fn"}
# cuBLAS's dtype tags in kernel names
BLAS = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "fp8": "e4m3"}

GEMM_OPS = {"mm": "aten::mm", "addmm": "aten::addmm", "bmm": "aten::bmm", "baddbmm": "aten::baddbmm",
            "conv": "aten::convolution", "conv_bwd_input": "aten::convolution_backward",
            "conv_bwd_weight": "aten::convolution_backward"}
# attention kernels by the profile row's name (costmodel.stack): (forward, backward) kernel and cpu op
ATTENTION = {
    "flash": (("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
               "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, "
               "false, false, false, true, false, false>(pytorch_flash::Flash_fwd_params)",
               "aten::_scaled_dot_product_flash_attention"),
              ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, "
               "128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, "
               "cutlass::bfloat16_t> >, true, false, false, false, false, true, false>(pytorch_flash::"
               "Flash_bwd_params)", "aten::_scaled_dot_product_flash_attention_backward")),
    "flash3": (("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
                "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
                "cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, cutlass::bfloat16_t, float, "
                "cutlass::arch::Sm90, true> > > >(flash::FlashAttnFwdSm90::Params)", "flash_attn_3::fwd"),
               ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<"
                "flash::CollectiveMainloopBwdSm90<2, 128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, "
                "true> > > >(flash::FlashAttnBwdSm90::Params)", "flash_attn_3::bwd")),
    "cudnn": (("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
               "aten::_scaled_dot_product_cudnn_attention"),
              ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
               "aten::_scaled_dot_product_cudnn_attention_backward")),
    "triton": (("_fwd_kernel", "FlashAttnFunc"), ("_bwd_kernel", "FlashAttnFuncBackward")),
}
# memory-bound ops with their own kernel families (the rest are elementwise)
_REDUCE = {"sum", "mean", "amax", "max", "min", "norm", "linalg_vector_norm", "nll_loss_forward", "var_mean"}
_INDEX = {"embedding": "void at::native::(anonymous namespace)::indexSelectLargeIndex<{t}, long, unsigned int, 2, 2, "
                       "-2, true>(at::cuda::detail::TensorInfo<{t}, unsigned int>, ...)",
          "embedding_dense_backward": "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<{t}, "
                                      "float, long>(long const*, {t} const*, {t}*, int, long, int, int)",
          "cat": "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
                 "OpaqueType<2u>, unsigned int, 4, 64, 64>(...)",
          "_log_softmax": "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
                          "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
          "_log_softmax_backward_data": "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, "
                                        "float, at::native::(anonymous namespace)::LogSoftMaxBackwardEpilogue>"
                                        "(float*, float const*, float const*, long)",
          "_softmax": "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, {t}, float, {t}, "
                      "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>({t}*, {t} const*, int)",
          "_to_copy": "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
                      "at::TensorIteratorBase&)::{{lambda()#3}}::operator()() const, at::detail::Array<char*, 2>, "
                      "TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
                      "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)",
          "copy_": "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
                   "at::TensorIteratorBase&)::{{lambda()#3}}::operator()() const, at::detail::Array<char*, 2> >(int, ...)",
          "_fused_adam_": "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
                          "namespace)::TensorListMetadata<5>, at::native::(anonymous namespace)::FusedAdamMathFunctor"
                          "<{t}, 4, (at::native::ADAM_MODE)1, false>, ...>(...)"}
# the fused RMSNorm: Apex / TE eager kernels, or Inductor's under torch.compile
_NORM = {("rms_norm", False): "void cuApplyRMSNorm<{t}, float, {t}>({t}*, float*, {t} const*, int, int, float, "
                              "{t} const*)",
         ("rms_norm_backward", False): "void cuComputeGradInput<{t}, float, {t}>({t} const*, {t} const*, int, "
                                       "int, float const*, float const*, float, {t} const*, {t}*)",
         ("rms_norm", True): "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_rms_norm_0",
         ("rms_norm_backward", True): "triton_red_fused__to_copy_add_div_mul_pow_sum_rms_norm_backward_1",
         ("layer_norm", False): "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<{t}, float>"
                                "(int, float, {t} const*, {t} const*, {t} const*, float*, float*, {t}*)",
         ("layer_norm", True): "triton_red_fused_native_layer_norm_0"}


@dataclass(frozen=True)
class Kernel:
    """One kernel launch of an op (see the module doc)."""

    name: str
    cpu_op: str
    cls: str
    dims: tuple
    dtype: str
    flops: float
    bytes: float
    weight: float


def kernel_name(cls: str, name: str, dtype: str, family: str = "hopper", compiled: bool = False) -> str:
    """The CUDA kernel name of a profile row's call."""
    t = CTYPES.get(dtype, "float")
    if cls == "gemm":
        d = BLAS.get(dtype, "f32")
        if name.startswith("conv"):
            kind = {"conv": "fprop", "conv_bwd_input": "dgrad", "conv_bwd_weight": "wgrad"}[name]
            return f"sm90_xmma_{kind}_implicit_gemm_{d}{d}_{d}f32_f32_nhwckrsc_nhwc_tilesize128x128x64_" \
                   "warpgroupsize1x1x1_execute_kernel__5x_cudnn"
        if family in ("hopper", "blackwell"):
            sm = "sm100" if family == "blackwell" else "sm90"
            return f"{sm}_xmma_gemm_{d}{d}_{d}f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_" \
                   "execute_segment_k_off_kernel__5x_cublas"
        return f"ampere_{d}_s16816gemm_{d}_128x128_ldg8_f2f_stages_64x3_tn"
    if cls in ("attn_fwd", "attn_bwd"):
        fwd, bwd = ATTENTION.get(name, ATTENTION["flash"])
        return (bwd if cls == "attn_bwd" else fwd)[0]
    if (name, compiled) in _NORM:
        return _NORM[(name, compiled)].format(t=t)
    if name in _INDEX:
        return _INDEX[name].format(t=t)
    if name in _REDUCE:
        return f"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<{t}, at::native::func_wrapper_t<" \
               f"{t}, at::native::{name}_kernel_cuda>, unsigned int, {t}, 4> >(...)"
    return f"void at::native::vectorized_elementwise_kernel<4, at::native::{name.rstrip('_')}_kernel_cuda<{t}>, " \
           "at::detail::Array<char*, 3> >(int, ...)"


def cpu_op_name(cls: str, name: str) -> str:
    """The host operator (Kineto ``cpu_op``) that launches a profile row's call."""
    if cls == "gemm":
        return GEMM_OPS.get(name, f"aten::{name}")
    if cls in ("attn_fwd", "attn_bwd"):
        fwd, bwd = ATTENTION.get(name, ATTENTION["flash"])
        return (bwd if cls == "attn_bwd" else fwd)[1]
    return f"aten::{name}"


def optimizer_kernel(dtype: str, foreach: bool) -> tuple[str, str]:
    """(kernel, cpu op) of an optimizer step priced as one op: fused AdamW, or foreach's
    multi-tensor kernels (the profile has no rows for it)."""
    t = CTYPES.get(dtype, "float")
    if foreach:
        return (f"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
                f"::TensorListMetadata<3>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<{t}, 3, 2, 2>, "
                "std::plus<float>, float>(...)", "aten::_foreach_add_")
    return _INDEX["_fused_adam_"].format(t=t), "aten::_fused_adamw_"


def op_kernels(rows: Iterable, gpu: GPU | None, compiled: bool = False) -> list[Kernel]:
    """The kernel launches of an operator profile table, one per call, interleaved as the
    layers run them (each row's calls spread evenly over the op). ``weight``: seconds of
    one call on ``gpu`` (None: the call's FLOPs and bytes on an H100-like roofline)."""
    family = gpu.family if gpu is not None else "hopper"
    calls: list[tuple[float, int, Kernel]] = []
    for i, (cls, name, shape, dtype, count, flops, nbytes) in enumerate(rows):
        if count <= 0:
            continue
        one = (cls, name, tuple(shape), dtype, 1, flops / count, nbytes / count)
        w = table_time(gpu, [one]) if gpu is not None else max(one[5] / 5e14, one[6] / 3e12) + 2e-6
        k = Kernel(kernel_name(cls, name, dtype, family, compiled), cpu_op_name(cls, name), cls, tuple(shape), dtype,
                   one[5], one[6], float(w))
        calls += [((j + 0.5) / count, i, k) for j in range(int(count))]
    calls.sort(key=lambda c: (c[0], c[1]))
    return [k for _, _, k in calls]


@dataclass
class KernelLevel:
    """What a kernel-level trace needs from the plan (see `kernel_level`): each compute op's
    kernels (`piper_sim.kineto_kernels.Kernel`), each op's same-rank dependencies, and the
    optimizer step's kernel when it has no profile rows."""

    kernels: dict[str, list[Kernel]] = field(default_factory=dict)
    deps: dict[str, list[str]] = field(default_factory=dict)
    optimizer: tuple[str, str] = ("", "")


def kernel_level(plan: Any, rank: int) -> KernelLevel:
    """`KernelLevel` of one rank of a `piper_sim.plan.Plan`: the kernels of each compute
    op from its operator profile table (``Plan.kernels``), priced on the plan's GPU."""
    from costmodel.hardware import parse_cluster

    cluster = plan.meta.get("cluster")
    try:
        gpu = parse_cluster(cluster).gpu if cluster else None
    except ValueError:
        gpu = None
    stack = plan.meta.get("stack") or {}
    compiled = bool(stack.get("compile", False))
    out = KernelLevel(optimizer=optimizer_kernel(str(plan.meta.get("dtype", "bf16")),
                                                 stack.get("optimizer") == "foreach"))
    tables: dict[str, list[Kernel]] = {}
    for ins in (i for lst in plan.program(rank).streams.values() for i in lst):
        out.deps[ins.id] = list(ins.deps)
        if ins.kind in COMPUTE_KINDS and ins.kernels and ins.kernels in plan.kernels:
            if ins.kernels not in tables:
                tables[ins.kernels] = op_kernels(plan.kernels[ins.kernels], gpu, compiled)
            out.kernels[ins.id] = tables[ins.kernels]
    return out


def input_dims(k: Kernel) -> list[list[int]]:
    """Kineto's ``Input Dims`` of a kernel's aten op, from its profile row's shape."""
    s = k.dims
    if k.cls == "gemm":
        m, n, kk, b = s
        return [[b, m, kk], [b, kk, n]] if b > 1 else [[m, kk], [kk, n]]
    if k.cls in ("attn_fwd", "attn_bwd"):
        b, h, sq, skv, d = s[:5]
        return [[b, h, sq, d], [b, h, skv, d], [b, h, skv, d]]
    elt = DTYPES[k.dtype].bytes if k.dtype in DTYPES else 4
    return [[int(s[0] // elt // 2) if s else 0]]  # bytes read + written: about two tensors
