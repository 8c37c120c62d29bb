"""The training stack: which kernels a run really executes, as an input of profiling and pricing.

The same model and strategy run at different speeds under different stacks: torchtitan without
``torch.compile`` runs RMSNorm as torch's eager fp32 decomposition, llm-foundry's benchmarks run
Triton flash attention, a Megatron-LM fork without ``--use-flash-attn`` runs unfused attention
with the ``s x s`` scores in memory, Megatron-Core with Transformer Engine runs cuDNN attention.
A :class:`Stack` names those choices; the profile (``piper_sim.profiling``) records the kernels
they launch, the cost model (``costmodel.operators``) prices each attention kernel by its own
measured throughput, and the IR prices the optimizer and gradient reductions they imply.

Fields (``STACK_FIELDS`` below holds each one's choices):

``attention``     ``flash2`` (FlashAttention-2, torch SDPA's flash backend), ``flash3`` (Hopper
                  only), ``cudnn`` (cuDNN fused attention, TE's default on Hopper), ``triton``
                  (the Triton flash attention of ``flash_attn_triton``), ``unfused`` (bmm, fused
                  scale-mask-softmax, dropout, bmm: Megatron-LM's ``CoreAttention``)
``unpad``         the flash-attention *varlen* path of llm-foundry's ``attn_impl='flash'``
                  (llmfoundry/models/layers/attention.py:270-290, 349, 367 @5e85bd62d): q, k and v
                  each gathered into a token-major copy by flash-attn's ``bert_padding.unpad_input``
                  and the output scattered back into a zeroed tensor by ``pad_input``, which the
                  output projection keeps (flash-attn v2.4.2 flash_attn/bert_padding.py L8-60:
                  ``IndexFirstAxis`` gather / zeros + scatter in backward, ``IndexPutFirstAxis``
                  zeros + index-put / gather in backward). Its host syncs (``nonzero``, ``.item()``
                  in ``unpad_input``, L109-110) are not priced. Needs ``flash2`` or ``flash3``
``norms``         ``fused`` (one kernel per norm, as Apex/TE/Inductor) or ``eager`` (torch's own
                  decomposition of ``F.rms_norm``: an fp32 upcast and ~6 elementwise kernels)
``compile``       ``torch.compile`` on: norms default to ``fused``
``dropout``       hidden and attention dropout probability; None keeps the model's own
``optimizer``     AdamW as ``fused`` (one kernel) or ``foreach`` (torch's multi-tensor ops)
``reduce_dtype``  dtype of the gradient all-reduce / reduce-scatter (``compute``: the compute
                  dtype; ``fp32``: FSDP2 ``reduce_dtype=float32``, Megatron ``grad_reduce_in_fp32``)
``grad_dtype``    dtype of the gradient buffer the backward accumulates into over micro-batches
                  (``compute`` or ``fp32``). Megatron-Core DDP: ``main_grad`` is fp32 exactly when
                  ``grad_reduce_in_fp32`` (megatron-core 0.16.1 distributed/distributed_data_parallel.py
                  L147; ``OptimizerConfig.main_grads_dtype`` is only checked, never read), so a
                  Megatron run sets ``grad_dtype`` and ``reduce_dtype`` alike; FSDP2: the sharded
                  gradient has the sharded parameter's dtype. Default ``compute``, as piper-sim has
                  always counted it, whatever ``reduce_dtype`` says
``master_dtype``  the optimizer's master copy of parameters narrower than fp32: ``fp32`` (4 B;
                  Megatron's ``main_params_dtype=fp32``; FSDP2 with ``param_dtype=bf16``: its sharded
                  fp32 parameters are the master weights), ``remainder`` (2 B: only the low 16 bits of
                  the fp32 master beside bf16 parameters, TE FusedAdam ``store_param_remainders``,
                  transformer_engine/pytorch/optimizers/fused_adam.py docstring), ``none`` (the
                  optimizer updates the compute-dtype parameters themselves)
``moment_dtype``  dtype of AdamW's exp_avg and exp_avg_sq (``fp32`` or ``bf16``: Megatron's
                  ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` under ``use_precision_aware_optimizer``)
``rope``          rotary embedding as ``eager`` torch ops (mul, neg, cat, add on q and k) or one
                  ``fused`` kernel (Megatron-Core ``apply_rope_fusion``, Inductor under compile)
``swiglu``        SwiGLU's ``silu(gate) * up`` as ``eager`` torch ops or one ``fused`` kernel
                  (Megatron-Core ``bias_activation_fusion``: ``bias_swiglu_impl``; Inductor)
``tp_overlap``    tensor-parallel collectives overlapped with the layer's GEMMs (Megatron-Core
                  ``--tp-comm-overlap`` userbuffers, torchtitan async TP): a layer's collectives
                  run while it computes (slowing it, ``GPU.overlap_slowdown``), the next layer
                  waits for them; off: the next GEMM waits for each collective (simulate-only)
``tp_backward_overlap`` Megatron's column-parallel linear backward (megatron-core 0.16.1
                  tensor_parallel/layers.py:515-535, 542-558, 616-624
                  ``LinearWithGradAccumulationAndAsyncCommunication.backward``; Transformer Engine's
                  ``_Linear.backward`` likewise without userbuffers: ``gather_along_first_dim`` and
                  ``reduce_scatter_along_first_dim`` / ``allreduce`` with ``async_op=True``): the
                  re-gather of its sequence-parallel input runs beside the dgrad GEMM and the
                  reduce-scatter (SP) or all-reduce of its input gradient beside the wgrad GEMM, the
                  linear waiting for both before it returns; the all-gather of a row-parallel
                  linear's output gradient stays blocking. Priced as a unit's backward collectives
                  starting with its backward piece, in the modules' order, the async ones those of
                  attention, MLP, shared experts, head and MTP ``eh_proj``
                  (`piper_sim.parallel.tensor.async_in_backward`), the others (and a recompute's
                  re-run forward collectives) pausing the piece's compute until they end
                  (``Instruction.holds``); off: the piece and then each collective in turn. The executor's collectives are synchronous (same numbers)
``fp8``           the FP8 recipe of the transformer blocks' linear layers (`costmodel.fp8`):
                  ``none``, ``tensorwise`` (current scaling: TE ``Float8CurrentScaling``,
                  torchao/torchtitan float8), ``blockwise`` (1x128 / 128x128 blocks: TE
                  ``Float8BlockScaling``, DeepSeek-V3 §3.3.1; Hopper), ``mxfp8`` (TE
                  ``MXFP8BlockScaling``; Blackwell); embedding, output head, router and
                  attention stay in the model dtype (simulate-only)
``fp8_activations`` what an FP8 linear keeps of its input for the weight gradient: ``hp`` (the
                  high-precision input: torchao's Float8Linear, torchtitan's float8 converter,
                  ``matmul_with_hp_or_float8_args.forward`` saves ``input_hp``, torchao
                  float8/float8_linear.py) or ``fp8`` (the quantised columnwise copy: Transformer
                  Engine's Linear saves its FP8 input when the weight needs a gradient,
                  transformer_engine/pytorch/module/linear.py:596-622 @d0067d0da; DeepSeek-V3's
                  "Low-Precision Activation", arXiv 2412.19437 §3.3.3) or ``deepseek`` (all of
                  DeepSeek-V3's §3.3.3: ``fp8``, and the MoE SwiGLU's inputs cached in FP8, the
                  attention output kept once in E5M6 for both the output linear and the attention
                  backward). Counted only with ``fp8`` (`piper_sim.fp8.cache_inputs`); the
                  megatron-te preset sets ``fp8``
``moe_probs``     where a MoE layer multiplies the expert outputs by the router's weights:
                  ``combine`` (after the combine, as piper-sim's own models and Hugging Face MoE
                  blocks do: the weighted sum keeps the combined expert outputs, the forward
                  combine's buffer, for its backward) or ``experts`` (inside the experts: Megatron-Core
                  ``TEGroupedMLP`` scales the activation by ``permuted_probs``, weighted_bias_swiglu_impl,
                  and its unpermute takes no probs, megatron-core 0.16.1 transformer/moe/experts.py:680-700,
                  token_dispatcher.py:319, 833, 1310; torchtitan ``MoEArgs.score_before_experts = True``
                  scales the routed input): the combine's buffer is freed once the layer has added it

Megatron-Core's distributed optimizer (megatron-core 0.16.1, ``megatron/core/optimizer/``) in
these fields, bf16 parameters:
  default                                        master fp32, moments fp32
  ``use_precision_aware_optimizer``, ``main_params_dtype=fp32``, ``exp_avg(_sq)_dtype=bf16``,
  ``OptimizerConfig.fp8_recipe`` None or         master remainder, moments bf16: TE FusedAdam
  ``delayed`` (Megatron-LM's ``--fp8-recipe``    holds the master, ``store_param_remainders``
  default, training/arguments.py L1393 @92c8482) defaults to True (optimizer_config.py L192,
                                                 L355-362; __init__.py L365-387;
                                                 distrib_optimizer.py L800-806)
  the same with another ``fp8_recipe``           master fp32 (Megatron's own fp32 shard,
                                                 distrib_optimizer.py L378), moments bf16
                                                 (__init__.py L365-371)
and ``grad_dtype`` ``fp32`` exactly when ``grad_reduce_in_fp32``. Megatron-Bridge copies its
``MixedPrecisionConfig.fp8_recipe`` (default ``tensorwise``, also in bf16 runs) into the
optimizer config (Megatron-Bridge @1804c076f training/mixed_precision.py L45-47, L117-118, L125-144),
so its precision-aware bf16 recipes keep a whole fp32 master: master fp32, moments bf16.

``grad_dtype``, ``master_dtype`` and ``moment_dtype`` size the model states a rank holds
(``piper_sim.parallel.data.static_memory``: ZeRO-1 shards master and moments, ZeRO-2 the
gradients too, ZeRO-3 the parameters as well) and the bytes the optimizer step moves
(``costmodel.compute.adam_step_bytes``); the executor does not run them (simulate-only). Their
defaults are piper-sim's historical count: compute-dtype gradients, fp32 master, fp32 moments.

Presets (:data:`PRESETS`) are the stacks users run, each field with its source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from costmodel.fp8 import RECIPES as FP8_RECIPES, unsupported as fp8_unsupported
from costmodel.names import unknown_name, unknown_names

ATTENTION_KERNELS = ("flash2", "flash3", "cudnn", "triton", "unfused")
NORM_KERNELS = ("fused", "eager")
POINTWISE_KERNELS = ("eager", "fused")  # rope, swiglu
FP8_ACTIVATIONS = ("hp", "fp8", "deepseek")  # what an FP8 linear (and DeepSeek-V3's MoE SwiGLU) saves
MOE_PROBS = ("combine", "experts")  # where the router's weights scale the expert outputs
OPTIMIZERS = ("fused", "foreach")
REDUCE_DTYPES = ("compute", "fp32")
GRAD_DTYPES = ("compute", "fp32")
MASTER_DTYPES = ("fp32", "remainder", "none")
MOMENT_DTYPES = ("fp32", "bf16")
# how `Stack.describe` names the stored dtypes (shown only when not the default)
OPTIMIZER_DTYPE_LABELS = {"grad_dtype": "grad buffer", "master_dtype": "master", "moment_dtype": "Adam moments"}
# attention kernels that exist only on Hopper (sm_90): FA3 (arXiv 2407.08608 §1)
HOPPER_ONLY = ("flash3",)


class StackError(ValueError):
    """A bad ``stack`` value; the message is one line naming the field and the fix."""


@dataclass(frozen=True)
class Stack:
    """What kernels a run executes (see the module docstring)."""

    attention: str = "flash2"
    unpad: bool = False  # flash varlen: q, k, v gathered and the output scattered around the kernel
    norms: str = "fused"
    compile: bool = False
    dropout: float | None = None
    optimizer: str = "fused"
    reduce_dtype: str = "compute"
    grad_dtype: str = "compute"
    master_dtype: str = "fp32"
    moment_dtype: str = "fp32"
    rope: str = "eager"
    swiglu: str = "eager"
    tp_overlap: bool = False
    tp_backward_overlap: bool = False  # Megatron's async dgrad comm in column-parallel linears' backward
    fp8: str = "none"  # FP8 recipe of the block linears (costmodel.fp8)
    fp8_activations: str = "hp"  # what those linears save of their inputs (hp | fp8 | deepseek)
    moe_probs: str = "combine"  # where the router's weights scale the expert outputs
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: less fragmentation (costmodel.memory)
    expandable_segments: bool = False
    preset: str = ""  # the preset it started from ("" for none)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        # absent at their defaults: plans of stacks without them read as they did before the fields
        for key, default in (("fp8", "none"), ("rope", "eager"), ("swiglu", "eager"), ("moe_probs", "combine"),
                             ("tp_backward_overlap", False), ("unpad", False)):
            if out[key] == default:
                del out[key]
        if self.fp8 == "none":  # meaningless without FP8 linears: absent, as before the field
            del out["fp8_activations"]
        return out

    @property
    def fp8_cached_inputs(self) -> bool:
        """Whether FP8 linears keep their inputs in FP8 for the backward (`piper_sim.fp8.cache_inputs`)."""
        return self.fp8 != "none" and self.fp8_activations in ("fp8", "deepseek")

    def describe(self) -> str:
        """One line for ``show``/``simulate``, e.g. ``torchtitan-eager: attention flash2, norms eager, ...``."""
        parts = [f"attention {self.attention}" + (" (varlen: q, k, v unpadded)" if self.unpad else ""),
                 f"norms {self.norms}", f"compile {'on' if self.compile else 'off'}",
                 f"optimizer {self.optimizer}", f"grad reduce {self.reduce_dtype}"]
        for name, label in OPTIMIZER_DTYPE_LABELS.items():
            if getattr(self, name) != getattr(DEFAULT, name):
                parts.append(f"{label} {getattr(self, name)}")
        if self.dropout is not None:
            parts.append(f"dropout {self.dropout:g}")
        fused = [k for k in ("rope", "swiglu") if getattr(self, k) == "fused"]
        if fused:
            parts.append(f"fused {' and '.join(fused)}")
        if self.tp_overlap:
            parts.append("TP comm overlapped")
        elif self.tp_backward_overlap:
            parts.append("TP backward comm beside the GEMMs")
        if self.fp8 != "none":
            parts.append(f"fp8 {self.fp8} (block linears{', inputs saved in fp8' if self.fp8_cached_inputs else ''})")
        if self.moe_probs == "experts":
            parts.append("MoE probs applied in the experts")
        if self.expandable_segments:
            parts.append("expandable segments")
        return (f"{self.preset}: " if self.preset else "") + ", ".join(parts)

    def profile_key(self) -> "ProfileKernels":
        """The part of the stack that changes the profiled kernels (the profile cache key)."""
        return ProfileKernels(attention="unfused" if self.attention == "unfused" else "flash", norms=self.norms,
                              dropout=self.dropout, rope=self.rope, swiglu=self.swiglu, unpad=self.unpad)

    def reduce_bytes(self, dtype_bytes: int) -> int:
        """Bytes per gradient element the reductions move."""
        return 4 if self.reduce_dtype == "fp32" else dtype_bytes

    def grad_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the gradient buffer (``grad_dtype``)."""
        return 4 if self.grad_dtype == "fp32" else dtype_bytes

    def master_bytes(self, dtype_bytes: int) -> int:
        """Bytes per parameter of the master copy (``master_dtype``): none for fp32 parameters."""
        if dtype_bytes >= 4 or self.master_dtype == "none":
            return 0
        return 4 - dtype_bytes if self.master_dtype == "remainder" else 4

    def moment_bytes(self) -> int:
        """Bytes per parameter of AdamW's two moments (``moment_dtype``)."""
        return 2 * (2 if self.moment_dtype == "bf16" else 4)

    def optimizer_state_bytes(self, dtype_bytes: int) -> int:
        """Bytes per parameter the optimizer holds: its master copy and moments (ZeRO-1 shards them)."""
        return self.master_bytes(dtype_bytes) + self.moment_bytes()


@dataclass(frozen=True)
class ProfileKernels:
    """What profiling on meta must run differently: unfused vs flash attention, eager vs fused
    norms, the dropout probability (None: the model's), the varlen path's gathers (``unpad``)."""

    attention: str = "flash"
    norms: str = "fused"
    dropout: float | None = None
    rope: str = "eager"
    swiglu: str = "eager"
    unpad: bool = False


DEFAULT = Stack()

# Named stacks. Each value names its source (repository file and line, or paper section).
PRESETS: dict[str, Stack] = {
    # piper-sim's historical assumption: the best fused kernels everywhere
    "fused": Stack(rope="fused", swiglu="fused", preset="fused"),
    # torchtitan, compile = false: torch SDPA (flash backend) [torchtitan models/attention.py];
    # RMSNorm as torch's eager decomposition [torchtitan models/norms.py, build_norm("rmsnorm") ->
    # torch.nn.RMSNorm]; AdamW implementation "foreach" [torchtitan config/job_config.py
    # Optimizer.implementation]; FSDP2 mixed_precision_reduce = "float32" [job_config.py Training];
    # PYTORCH_ALLOC_CONF="expandable_segments:True" [torchtitan run_train.sh L43 @b5bcd76c]
    "torchtitan": Stack(attention="flash2", norms="eager", compile=False, optimizer="foreach",
                        reduce_dtype="fp32", expandable_segments=True, preset="torchtitan"),
    # the same with compile = true: Inductor fuses the norms and the pointwise chains of rope and
    # SwiGLU into generated kernels (torchtitan benchmarks/llama3_h100_202412_torchtitan.md: +15.7%
    # tokens/s from torch.compile; TorchInductor's pointwise fusion, PyTorch torch.compile docs)
    # and compiles the loss (torchtitan components/loss.py:25-30 @e7c0cae; its memory:
    # piper_sim.memory.compiled_loss; op-SAC under compile: piper_sim.recompute.LayerTable.op_sac_saved)
    "torchtitan-compile": Stack(attention="flash2", norms="fused", rope="fused", swiglu="fused", compile=True,
                                optimizer="foreach",
                                reduce_dtype="fp32", expandable_segments=True, preset="torchtitan-compile"),
    # Megatron-Core + Transformer Engine: cuDNN fused attention on Hopper (TE attention backend
    # selection), TE fused norms, Apex/TE fused Adam, grads reduced in fp32
    # (Megatron-Bridge recipes: grad_reduce_in_fp32 = True); fused rope and SwiGLU
    # (Megatron-Bridge @1804c076f src/megatron/bridge/models/llama/llama_provider.py:52-56
    # bias_activation_fusion, apply_rope_fusion True; gpt_provider.py bias_activation_fusion True);
    # with FP8, TE's linears save their FP8 input (fp8_activations); MoE experts scale their
    # activation by the router's probs (moe_probs experts; both: see the module docstring)
    "megatron-te": Stack(attention="cudnn", norms="fused", optimizer="fused", reduce_dtype="fp32",
                         rope="fused", swiglu="fused", fp8_activations="fp8", moe_probs="experts",
                         tp_backward_overlap=True, preset="megatron-te"),
    # Megatron-LM of 2023 and its forks without --use-flash-attn (Zero Bubble v0.1.0
    # examples/pretrain_zero_bubble.sh): unfused CoreAttention, Apex fused LayerNorm, fused
    # Adam, attention and hidden dropout 0.1 (megatron/arguments.py defaults of that era); the
    # column-parallel linears' backward collectives beside their GEMMs (tp_backward_overlap:
    # NVIDIA/Megatron-LM @02bb1f5c megatron/mpu/layers.py, the sequence-parallel code of
    # arXiv 2205.05198: ColumnParallelLinearWithSequenceParallelism.backward gathers async beside
    # the dgrad GEMM and reduce-scatters async beside the wgrad GEMM; without SP
    # ColumnParallelLinearWithAsyncAllreduce, unless --no-async-tensor-model-parallel-allreduce)
    "megatron-legacy": Stack(attention="unfused", norms="fused", dropout=0.1, optimizer="fused",
                             tp_backward_overlap=True, preset="megatron-legacy"),
    # llm-foundry benchmark script: attn_impl defaults to 'triton' [scripts/train/benchmarking/
    # submit_benchmarks.py @5e85bd62d]; low_precision_layernorm (one fused kernel); FSDP
    # mixed_precision DEFAULT (Composer: reduce in fp32)
    "llm-foundry": Stack(attention="triton", norms="fused", optimizer="foreach", reduce_dtype="fp32",
                         preset="llm-foundry"),
    # DeepSpeed (Megatron-DeepSpeed): flash attention, fused LayerNorm, fused Adam, fp32 reduce
    # off by default (communication_data_type = the compute dtype)
    "deepspeed": Stack(attention="flash2", norms="fused", optimizer="fused", preset="deepspeed"),
}

STACK_FIELDS: dict[str, tuple] = {
    "attention": ATTENTION_KERNELS, "norms": NORM_KERNELS, "optimizer": OPTIMIZERS, "reduce_dtype": REDUCE_DTYPES,
    "grad_dtype": GRAD_DTYPES, "master_dtype": MASTER_DTYPES, "moment_dtype": MOMENT_DTYPES,
    "fp8": FP8_RECIPES, "rope": POINTWISE_KERNELS, "swiglu": POINTWISE_KERNELS, "fp8_activations": FP8_ACTIVATIONS,
    "moe_probs": MOE_PROBS,
}
_ALLOWED = set(STACK_FIELDS) | {"preset", "compile", "dropout", "tp_overlap", "tp_backward_overlap",
                                 "expandable_segments", "unpad"}
# the attention kernels with a varlen entry point (flash_attn_varlen_func) that ``unpad`` feeds
UNPAD_KERNELS = ("flash2", "flash3")


def parse_stack(value: Any, where: str = "strategy field 'stack'") -> Stack:
    """A preset name, a mapping ``{"preset": ..., <field>: ...}``, or a Stack; raises StackError."""
    if value is None:
        return DEFAULT
    if isinstance(value, Stack):
        return value
    if isinstance(value, str):
        value = {"preset": value}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise StackError(f"{where} must be a preset name ({', '.join(PRESETS)}) or a mapping of stack fields")
    unknown = set(value) - _ALLOWED
    if unknown:
        raise StackError(f"{where}: {unknown_names('field', unknown, sorted(_ALLOWED))}")
    preset = value.get("preset", "")
    if not isinstance(preset, str) or preset and preset not in PRESETS:
        raise StackError(f"{where}: {unknown_name('preset', preset, PRESETS)}")
    base = PRESETS[preset] if preset else DEFAULT
    fields: dict[str, Any] = {}
    for key, choices in STACK_FIELDS.items():
        if key in value:
            if value[key] not in choices:
                raise StackError(f"{where}: {key} must be one of {', '.join(choices)} (got {value[key]!r})")
            fields[key] = value[key]
    for flag in ("tp_overlap", "tp_backward_overlap", "expandable_segments", "unpad"):
        if flag in value:
            if not isinstance(value[flag], bool):
                raise StackError(f"{where}: {flag} must be true or false (got {value[flag]!r})")
            fields[flag] = value[flag]
    if "compile" in value:
        if not isinstance(value["compile"], bool):
            raise StackError(f"{where}: compile must be true or false (got {value['compile']!r})")
        fields["compile"] = value["compile"]
        for key in ("norms", "rope", "swiglu"):
            if value["compile"] and key not in value:
                fields[key] = "fused"  # Inductor fuses the norm's decomposition and the pointwise chains
    if "dropout" in value:
        p = value["dropout"]
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1):
            raise StackError(f"{where}: dropout must be a probability in [0, 1) or null (got {p!r})")
        fields["dropout"] = None if p is None else float(p)
    stack = dataclasses.replace(base, preset=preset, **fields)
    if stack.unpad and stack.attention not in UNPAD_KERNELS:
        raise StackError(f"{where}: unpad runs flash_attn_varlen_func, which attention {stack.attention!r} has not; "
                         f"set attention to {' or '.join(UNPAD_KERNELS)}, or unpad false")
    return stack


def stack_to_strategy(stack: Stack) -> dict[str, Any]:
    """The strategy form of a stack: its preset and the fields that differ from it."""
    base = PRESETS[stack.preset] if stack.preset else DEFAULT
    out: dict[str, Any] = {"preset": stack.preset} if stack.preset else {}
    out.update({k: v for k, v in stack.to_json().items() if k != "preset" and v != getattr(base, k)})
    if "compile" in out:  # compile sets the norms, rope and swiglu unless they are given: give them
        out.update(norms=stack.norms, rope=stack.rope, swiglu=stack.swiglu)
    return out


def check_stack_dtype(stack: Stack, dtype: str, where: str = "strategy field 'stack'") -> None:
    """Refuse a master copy the run's parameters cannot have: remainders need bf16 parameters
    (TE FusedAdam and Megatron store them for bf16 only; fp16 keeps the whole fp32 master)."""
    if stack.master_dtype == "remainder" and dtype not in ("bf16", "fp32"):
        raise StackError(f"{where}: master_dtype 'remainder' needs bf16 parameters (the plan trains in {dtype}); "
                         "use master_dtype fp32")


def check_stack_on(stack: Stack, gpu, where: str = "strategy field 'stack'") -> None:
    """Refuse a kernel the cluster's GPU (a ``costmodel.hardware.GPU``) cannot run: FA3 off Hopper,
    an FP8 recipe off the GPU families it runs on (`costmodel.fp8.RECIPE_FAMILIES`)."""
    hopper = gpu.name.upper().startswith(("H100", "H200", "H800", "GH200"))
    if stack.attention in HOPPER_ONLY and not hopper:
        raise StackError(f"{where}: attention {stack.attention!r} runs on Hopper GPUs only (H100/H200/H800), "
                         f"not {gpu.name}; use flash2, cudnn, triton or unfused")
    why = fp8_unsupported(stack.fp8, gpu.family, "fp8" in gpu.peak_flops)
    if why:
        fits = [r for r in FP8_RECIPES[1:] if not fp8_unsupported(r, gpu.family, "fp8" in gpu.peak_flops)]
        raise StackError(f"{where}: fp8 {stack.fp8!r} {why}, not {gpu.name} ({gpu.family}); "
                         f"use fp8 {' or '.join(fits + ['none'])}")
