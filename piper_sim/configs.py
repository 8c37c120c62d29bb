"""Model configurations without torch: `ModelConfig`, analytic parameter counts, the zoo,
pipeline units and tensor-parallel shards (`piper_sim.models` re-exports all of it and adds
the torch modules).

A model is an ordered list of *units*, the granularity at which pipeline stages are cut:
``embed``, ``layers.0`` ... ``layers.{L-1}``, then ``mtp.0`` ... ``mtp.{D-1}`` (multi-token
prediction modules, when ``mtp_layers`` > 0), ``head``. A MoE layer is one unit made of two
*segments* for the compiler: ``layers.i.pre`` (attention, norms, router, shared experts) and
``layers.i.experts`` (routed experts); an MTP module is ``mtp.d`` (or ``mtp.d.pre`` and
``mtp.d.experts``) and ``mtp.d.loss`` (its final norm, the shared output head and its loss).
See :func:`unit_names` and :func:`unit_segments`.

The zoo (:data:`ZOO`): ``gpt-tiny`` and ``moe-tiny`` (CPU tests in milliseconds), Llama 3
8B/70B/405B, the Piper paper's MoE evaluation configs ``qwen3-moe-1b``/``qwen3-moe-9b``,
``deepseek-v3`` (MLA, 1 shared + 256 routed experts, top-8; ~671B total and ~37B active
parameters; no multi-token-prediction module), ``deepseek-v3-mtp`` (the same with its one MTP module,
as it was trained and as Megatron-Bridge's "w/ MTP" runs train it) and ``gpt3-175b`` (Korthikanti et al. 2022).
Other models come from model files and Hugging Face configs (`piper_sim.sources`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from costmodel.names import did_you_mean, unknown_name
from piper_sim.checks import (MAX_COUNT, MAX_EXPERTS, MAX_LAYERS, MAX_MODEL_WIDTH, MAX_POSITIONS, MAX_VOCAB, integer,
                              number)
from piper_sim.header import PlanHeader


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer. ``n_experts == 0`` means dense.

    MoE layers have ``n_experts`` routed experts (``expert_ffn`` wide) of which ``top_k`` are
    used per token (softmax router; ``norm_topk``: renormalise the top-k weights), plus
    ``n_shared`` always-on shared experts (merged into one MLP of width ``n_shared *
    expert_ffn``). The first ``first_dense`` layers are dense (MLP of width ``ffn``).
    ``attention`` is ``"gqa"`` or ``"mla"`` (DeepSeek multi-head latent attention, with the
    MLA dims below).

    Architecture variants (defaults: Llama): ``kv_channels`` the attention head dim
    (Megatron's name; 0: ``hidden // n_heads``; read :attr:`head_dim`), ``qk_norm`` (RMSNorm
    over the head dim on q and k, Qwen3), ``attn_bias`` (q/k/v biases, Qwen2), ``o_bias``
    (output-projection bias), ``mlp_bias`` (biases on every MLP/expert linear), ``router_bias``,
    ``tie_embeddings`` (the head reuses the embedding matrix; counted once), ``sliding_window``
    (0: none) on the layers ``window_pattern`` selects (0: every layer; k: all but every k-th,
    i.e. layer i is full-attention when ``(i + 1) % k == 0``: GPT-OSS k=2, Gemma 3 k=6),
    ``mlp`` ``"swiglu"`` or ``"gelu"`` (``h -> ffn -> h``), ``norm`` ``"rms"`` or ``"layer"``,
    ``dropout`` before each residual add, ``rope`` (False: no position encoding).
    ``mtp_layers``: DeepSeek-V3's multi-token-prediction modules (arXiv 2412.19437 §2.2;
    Hugging Face ``num_nextn_predict_layers``; Megatron-Core ``mtp_num_layers``): each an
    RMSNorm of the hidden state and of the next token's embedding, a ``2h -> h`` projection
    (``eh_proj``), one transformer layer (MoE when the model's later layers are), a final norm
    and the shared output head with its own cross-entropy loss. Embedding and head are shared
    (counted once). ``mtp_loss_scale``: lambda, the weight of the MTP losses' mean in the
    training loss (Megatron-Core ``mtp_loss_scaling_factor``, default 0.1).
    ``tp``/``sequence_parallel``: this config is one tensor-parallel rank's shard (see
    :func:`tp_shard`); every count here (``param_count``...) is of the whole model.
    """

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    max_seq: int = 4096
    # mixture of experts
    n_experts: int = 0
    top_k: int = 0
    n_shared: int = 0
    expert_ffn: int = 0
    first_dense: int = 0
    norm_topk: bool = True
    router_bias: bool = False
    # attention
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    kv_channels: int = 0
    qk_norm: bool = False
    attn_bias: bool = False
    o_bias: bool = False
    sliding_window: int = 0
    window_pattern: int = 0
    # architecture variants
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    mlp_bias: bool = False
    norm: Literal["rms", "layer"] = "rms"
    dropout: float = 0.0
    rope: bool = True
    tie_embeddings: bool = False
    mtp_layers: int = 0
    mtp_loss_scale: float = 0.1  # lambda: Megatron-Core's mtp_loss_scaling_factor default (DeepSeek-V3 §4.2: 0.3, then 0.1)
    # one tensor-parallel rank's shard (profiling on meta; see tp_shard)
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.n_heads

    @property
    def local_heads(self) -> int:
        return self.n_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return self.n_kv_heads // self.tp

    @property
    def local_ffn(self) -> int:
        return self.ffn // self.tp

    @property
    def local_expert_ffn(self) -> int:
        return self.expert_ffn // self.tp

    @property
    def local_vocab(self) -> int:
        """Rows of the vocabulary-parallel embedding and head on one rank (padded up, as Megatron)."""
        return math.ceil(self.vocab / self.tp)

    def local_seq(self, seq: int) -> int:
        """Tokens of a sequence a layer holds on one rank: ``seq / tp`` under sequence parallelism."""
        return seq // self.tp if self.sequence_parallel else seq

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` is MoE (``i >= n_layers``: the transformer layer of MTP module ``i - n_layers``)."""
        return self.is_moe and i >= self.first_dense

    def layer_window(self, i: int) -> int:
        """Sliding-window size of layer ``i``'s attention (0: full causal attention)."""
        if not self.sliding_window or (self.window_pattern and (i + 1) % self.window_pattern == 0):
            return 0
        return self.sliding_window

    def param_count(self) -> int:
        """Total parameters, computed analytically (matches a real build; tied embeddings once)."""
        return sum(unit_param_count(self, n) for n in unit_names(self))

    def active_param_count(self, embedding: bool = True) -> int:
        """Parameters touched per token: routed experts count ``top_k`` of ``n_experts``;
        ``embedding=False`` leaves out the input embedding table (a lookup, no matmul: OpenAI's
        convention for GPT-OSS; a tied head still counts it)."""
        n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers + self.mtp_layers))
        inactive = n_moe * (self.n_experts - self.top_k) * _mlp_params(self, self.expert_ffn)
        lookup = 0 if embedding or self.tie_embeddings else self.vocab * self.hidden
        return self.param_count() - inactive - lookup


def _mlp_params(c: ModelConfig, f: int) -> int:
    """An MLP ``h -> f -> h``: SwiGLU has two input matrices, GELU one (biases if ``mlp_bias``)."""
    n_in = 1 if c.mlp == "gelu" else 2
    return (n_in + 1) * c.hidden * f + (n_in * f + c.hidden if c.mlp_bias else 0)


def _norm_params(c: ModelConfig) -> int:
    return 2 * c.hidden if c.norm == "layer" else c.hidden


def _attn_params(c: ModelConfig) -> int:
    h, H = c.hidden, c.n_heads
    if c.attention == "gqa":
        hd, kv = c.head_dim, c.n_kv_heads
        n = h * H * hd * 2 + 2 * h * kv * hd
        n += (H + 2 * kv) * hd if c.attn_bias else 0
        n += 2 * hd if c.qk_norm else 0
        return n + (h if c.o_bias else 0)
    qk = c.qk_nope_dim + c.qk_rope_dim
    q = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * qk) if c.q_lora_rank else h * H * qk
    kv = h * (c.kv_lora_rank + c.qk_rope_dim) + c.kv_lora_rank + c.kv_lora_rank * H * (c.qk_nope_dim + c.v_head_dim)
    return q + kv + H * c.v_head_dim * h + (h if c.o_bias else 0)


def unit_param_count(cfg: ModelConfig, name: str) -> int:
    """Analytic parameter count of one unit (a tied head owns no matrix: the embedding's)."""
    h = cfg.hidden
    if name == "embed":
        return cfg.vocab * h
    if name == "head":
        return _norm_params(cfg) + (0 if cfg.tie_embeddings else h * cfg.vocab)
    if name.startswith("mtp."):  # enorm, hnorm, eh_proj (2h -> h), its layer, final norm
        return 3 * _norm_params(cfg) + 2 * h * h + _block_params(cfg, cfg.n_layers + mtp_index(cfg, name))
    return _block_params(cfg, _layer_index(cfg, name))


def _block_params(cfg: ModelConfig, i: int) -> int:
    """One transformer layer (``i >= n_layers``: an MTP module's)."""
    h = cfg.hidden
    n = 2 * _norm_params(cfg) + _attn_params(cfg)
    if cfg.is_moe_layer(i):
        n += h * cfg.n_experts + (cfg.n_experts if cfg.router_bias else 0)
        n += cfg.n_experts * _mlp_params(cfg, cfg.expert_ffn)
        n += _mlp_params(cfg, cfg.n_shared * cfg.expert_ffn) if cfg.n_shared else 0
    else:
        n += _mlp_params(cfg, cfg.ffn)
    return n


def logits_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """Transient bytes of the head's logits: ``tokens x vocab`` (the rank's vocabulary shard
    under tensor parallelism) in the model dtype plus the fp32 copy the loss is computed on
    (none when the model is fp32)."""
    return tokens * cfg.local_vocab * (dtype_bytes + (4 if dtype_bytes != 4 else 0))


_DSV3 = dict(n_layers=61, hidden=7168, n_heads=128, n_kv_heads=128, ffn=18432, vocab=129280, n_experts=256, top_k=8,
             n_shared=1, expert_ffn=2048, first_dense=3, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, norm_eps=1e-6)
_LLAMA = dict(n_kv_heads=8, vocab=128256, max_seq=8192, rope_theta=500000.0)
ZOO: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig("gpt-tiny", n_layers=8, hidden=64, n_heads=4, n_kv_heads=4, ffn=256, vocab=512, max_seq=128),
        ModelConfig("moe-tiny", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=512, max_seq=128,
                    n_experts=4, top_k=2, expert_ffn=128),
        # CPU-sized models whose step is dominated by compute, not per-op overhead (validation).
        ModelConfig("gpt-small", n_layers=8, hidden=256, n_heads=8, n_kv_heads=8, ffn=1024, vocab=2048,
                    max_seq=512),
        ModelConfig("moe-small", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, ffn=512, vocab=2048, max_seq=512,
                    n_experts=4, top_k=2, expert_ffn=512),
        ModelConfig("llama3-8b", n_layers=32, hidden=4096, n_heads=32, ffn=14336, **_LLAMA),
        ModelConfig("llama3-70b", n_layers=80, hidden=8192, n_heads=64, ffn=28672, **_LLAMA),
        ModelConfig("llama3-405b", n_layers=126, hidden=16384, n_heads=128, ffn=53248, **_LLAMA),
        # The Piper paper's evaluation MoE configs (expert_ffn = ffn, no shared expert).
        ModelConfig("qwen3-moe-1b", n_layers=16, hidden=1024, n_heads=16, n_kv_heads=8, ffn=3584, vocab=151936,
                    n_experts=4, top_k=2, expert_ffn=3584, rope_theta=1e6),
        ModelConfig("qwen3-moe-9b", n_layers=24, hidden=2048, n_heads=32, n_kv_heads=8, ffn=7168, vocab=151936,
                    n_experts=8, top_k=2, expert_ffn=7168, rope_theta=1e6),
        # DeepSeek-V3 without the multi-token-prediction (MTP) module: ~671B total, ~37B active.
        ModelConfig("deepseek-v3", **_DSV3),
        # ... and with its one MTP module (config.json "num_nextn_predict_layers": 1; the report's
        # D = 1, arXiv 2412.19437 §4.2): ~683B unique parameters (HF's 685B counts the module's
        # own copies of the embedding and head).
        ModelConfig("deepseek-v3-mtp", **_DSV3, mtp_layers=1),
        # GPT-3 175B (Brown et al. 2020, Table 2.1) as Korthikanti et al. 2022 train it (Megatron):
        # LayerNorm, GELU MLP of 4h, dropout 0.1, vocabulary padded to 51200; bias-free linears
        # and no learned position embedding here (neither changes activation memory per layer).
        ModelConfig("gpt3-175b", n_layers=96, hidden=12288, n_heads=96, n_kv_heads=96, ffn=49152, vocab=51200,
                    max_seq=2048, mlp="gelu", norm="layer", dropout=0.1, rope=False),
    ]
}


# the zoo as shipped (ZOO gains registered models at run time; a plan names a built-in model only)
BUILTIN_ZOO: dict[str, ModelConfig] = dict(ZOO)

TP_FIELDS = ("n_heads", "n_kv_heads", "ffn", "expert_ffn")


def tp_divisibility_error(cfg: ModelConfig, tp: int) -> str:
    """Why ``tp`` cannot shard ``cfg`` (one line naming the model field), or ``""``."""
    checks = [("n_heads", cfg.n_heads, "attention heads"),
              ("n_kv_heads", cfg.n_kv_heads if cfg.attention == "gqa" else cfg.n_heads, "KV heads")]
    if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        checks.append(("ffn", cfg.ffn, "MLP width"))
    if cfg.is_moe:
        checks.append(("expert_ffn", cfg.expert_ffn, "experts' MLP width"))
    for fld, value, what in checks:
        if value % tp:
            return (f"degree {tp} does not divide the {value} {what} ({fld}) of {cfg.name}; "
                    f"use a divisor of {value}")
    return ""


def tp_shard(cfg: ModelConfig, tp: int, sequence_parallel: bool = False) -> ModelConfig:
    """The config of one tensor-parallel rank's shard of ``cfg`` (``cfg`` itself when tp is 1)."""
    if tp == 1:
        return cfg
    err = tp_divisibility_error(cfg, tp)
    if err:
        raise ValueError(f"tensor_parallel: {err}")
    return dataclasses.replace(cfg, tp=tp, sequence_parallel=sequence_parallel)


def get_config(name: str) -> ModelConfig:
    try:
        return ZOO[name]
    except KeyError:
        guess = did_you_mean(name, ZOO)
        raise ValueError(f"unknown model {name!r}{f'; did you mean {guess!r}?' if guess else ''}; choose one of: "
                         f"{', '.join(ZOO)} (or a model file, 'hf:PATH' to a config.json)") from None


# --------------------------------------------------------------------------- plans


FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of ``cfg`` that differ from the defaults (plus the required ones)."""
    return {k: getattr(cfg, k) for k, f in FIELDS.items()
            if f.default is dataclasses.MISSING or getattr(cfg, k) != f.default}


def config_from_dict(spec: dict[str, Any], where: str = "model") -> ModelConfig:
    """A `ModelConfig` from its field values; unknown or badly typed fields -> one-line ValueError."""
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: {unknown_name('field', unknown[0], FIELDS, 'fields')}")
    missing = [k for k, f in FIELDS.items() if f.default is dataclasses.MISSING and k not in spec]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r}")
    cfg = ModelConfig(**{k: check_field(k, v, f"{where}: field {k!r}") for k, v in spec.items()})
    check_config(cfg, where)
    return cfg


_W = MAX_MODEL_WIDTH
# integer fields -> (minimum, maximum); the maxima are the model-size limits of piper_sim.checks
INT_RANGES: dict[str, tuple[int, int]] = {
    "n_layers": (1, MAX_LAYERS), "hidden": (1, _W), "n_heads": (1, _W), "n_kv_heads": (1, _W), "ffn": (0, _W),
    "vocab": (1, MAX_VOCAB), "max_seq": (0, MAX_POSITIONS), "n_experts": (0, MAX_EXPERTS),
    "top_k": (0, MAX_EXPERTS), "n_shared": (0, MAX_EXPERTS), "expert_ffn": (0, _W), "first_dense": (0, MAX_COUNT),
    "q_lora_rank": (0, _W), "kv_lora_rank": (0, _W), "qk_nope_dim": (0, _W), "qk_rope_dim": (0, _W),
    "v_head_dim": (0, _W), "kv_channels": (0, _W), "sliding_window": (0, MAX_POSITIONS),
    "window_pattern": (0, MAX_COUNT), "tp": (1, MAX_COUNT), "mtp_layers": (0, 16),
}
# float fields -> (lower bound, whether it is excluded, upper bound excluded)
FLOAT_RANGES: dict[str, tuple[float, bool, float]] = {
    "rope_theta": (0.0, True, math.inf), "norm_eps": (0.0, True, math.inf), "dropout": (0.0, False, 1.0),
    "mtp_loss_scale": (0.0, False, math.inf),
}
_CHOICES = {"attention": ("gqa", "mla"), "mlp": ("swiglu", "gelu"), "norm": ("rms", "layer")}


def check_field(field: str, value: Any, label: str) -> Any:
    """``value`` for the `ModelConfig` ``field`` if its type and range are right (an int for
    an int: no bool, float or string; a finite float; a bool; one of the choices), else a
    one-line ValueError starting with ``label`` (the file and key) and saying what to give."""
    if field in INT_RANGES:
        return integer(value, label, *INT_RANGES[field])
    if field in FLOAT_RANGES:
        low, above, high = FLOAT_RANGES[field]
        got = number(value, label, low, above)
        if got >= high:
            raise ValueError(f"{label} must be a finite number below {high:g} (got {value!r})")
        return got
    if field in _CHOICES:
        if not isinstance(value, str) or value not in _CHOICES[field]:
            raise ValueError(f"{label} must be one of {', '.join(_CHOICES[field])} (got {value!r})")
        return value
    if field == "name":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label} must be a non-empty string (got {value!r})")
        return value
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be true or false (got {value!r})")
    return value


def check_config(cfg: ModelConfig, where: str = "model") -> None:
    """Consistency checks a builder relies on (one-line ValueError naming the field)."""
    if cfg.n_layers > MAX_LAYERS:  # before anything loops over the layers
        raise ValueError(f"{where}: field 'n_layers' ({cfg.n_layers:,}) exceeds the limit of {MAX_LAYERS:,} "
                         "(piper_sim.checks.MAX_LAYERS)")
    if cfg.attention == "gqa":
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"{where}: field 'n_kv_heads' ({cfg.n_kv_heads}) must divide n_heads ({cfg.n_heads})")
        if not cfg.kv_channels and cfg.hidden % cfg.n_heads:
            raise ValueError(f"{where}: hidden {cfg.hidden} is not a multiple of n_heads {cfg.n_heads}; "
                             "set the head dim ('kv_channels')")
        if cfg.rope and cfg.head_dim % 2:
            raise ValueError(f"{where}: rotary embeddings need an even head dim (got {cfg.head_dim})")
    if cfg.sliding_window and cfg.attention == "mla":
        raise ValueError(f"{where}: field 'sliding_window' is not supported with MLA attention")
    if cfg.is_moe:
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"{where}: field 'top_k' must be in 1..n_experts={cfg.n_experts} (got {cfg.top_k})")
        if cfg.expert_ffn < 1:
            raise ValueError(f"{where}: field 'expert_ffn' must be >= 1 for a MoE model")
    if cfg.first_dense > cfg.n_layers:
        raise ValueError(f"{where}: field 'first_dense' ({cfg.first_dense}) exceeds n_layers ({cfg.n_layers})")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)) and cfg.ffn < 1:
        raise ValueError(f"{where}: field 'ffn' must be >= 1 (the model has dense layers)")


def plan_model_meta(cfg: ModelConfig) -> dict[str, Any]:
    """What a plan's meta says about its model: ``model`` (the name) and, unless it is the
    built-in zoo model of that name, ``model_spec`` (its fields: the executor rebuilds the model
    from the plan alone). Zoo models' plans stay as they were (byte-identical). A user's
    nn.Module (`piper_sim.annotate.UserModel`) gives its name only: the compiler adds its
    factory as ``meta["user_model"]``."""
    if not isinstance(cfg, ModelConfig) or BUILTIN_ZOO.get(cfg.name) == cfg:
        return {"model": cfg.name}
    return {"model": cfg.name, "model_spec": config_to_dict(cfg)}


def config_from_meta(meta: dict[str, Any]) -> ModelConfig:
    """The model a plan was compiled for: ``meta["model_spec"]`` (any source), else the built-in
    zoo model it names."""
    return config_of(PlanHeader.from_meta(meta))


def config_of(header: PlanHeader) -> ModelConfig:
    """The model of a plan header (`config_from_meta`)."""
    if header.model_spec is not None:
        return config_from_dict(header.model_spec, "plan meta.model_spec")
    if header.model not in BUILTIN_ZOO:
        raise ValueError(f"plan meta: model {header.model!r} is not a built-in zoo model and the plan has no "
                         "model_spec; recompile it")
    return BUILTIN_ZOO[header.model]


# --------------------------------------------------------------------------- units


def unit_names(cfg: ModelConfig) -> list[str]:
    """Pipeline units in model order: ``embed``, ``layers.0`` ... ``layers.{L-1}``, ``mtp.0`` ...
    ``mtp.{D-1}``, ``head``."""
    return ["embed", *(f"layers.{i}" for i in range(cfg.n_layers)), *mtp_units(cfg), "head"]


def mtp_units(cfg: ModelConfig) -> list[str]:
    """The multi-token-prediction units, in order (none when ``mtp_layers`` is 0)."""
    return [f"mtp.{d}" for d in range(cfg.mtp_layers)]


def unit_segments(cfg: ModelConfig, unit_name: str) -> list[str]:
    """Segments of a unit: ``[unit]`` for dense units, ``[unit.pre, unit.experts]`` for MoE layers;
    an MTP module adds ``unit.loss`` (its final norm, the shared head and its loss)."""
    if unit_name in ("embed", "head"):
        return [unit_name]
    if unit_name.startswith("mtp."):
        moe = cfg.is_moe_layer(cfg.n_layers + mtp_index(cfg, unit_name))
        return [*([f"{unit_name}.pre", f"{unit_name}.experts"] if moe else [unit_name]), f"{unit_name}.loss"]
    i = _layer_index(cfg, unit_name)
    return [f"{unit_name}.pre", f"{unit_name}.experts"] if cfg.is_moe_layer(i) else [unit_name]


def mtp_index(cfg: ModelConfig, name: str) -> int:
    """The depth ``d`` of unit ``mtp.d``."""
    parts = name.split(".")
    if len(parts) != 2 or parts[0] != "mtp" or not parts[1].isdigit() or int(parts[1]) >= cfg.mtp_layers:
        raise ValueError(f"unknown unit {name!r} for {cfg.name} ({cfg.mtp_layers} MTP module(s): "
                         f"mtp.0..mtp.{cfg.mtp_layers - 1})" if cfg.mtp_layers else
                         f"unknown unit {name!r}: {cfg.name} has no multi-token-prediction module")
    return int(parts[1])


def layer_of_kind(cfg: ModelConfig, kind: str, windowed: bool = False) -> int:
    """The first layer of a segment kind (``dense``, ``moe_pre``, ``moe_experts``) whose
    attention is windowed or not (layers of one kind and window cost the same)."""
    moe = kind != "dense"
    for i in range(cfg.n_layers):
        if cfg.is_moe_layer(i) == moe and (cfg.layer_window(i) > 0) == windowed:
            return i
    raise ValueError(f"{cfg.name} has no {'windowed ' if windowed else ''}{kind} layer")


def _layer_index(cfg: ModelConfig, name: str) -> int:
    parts = name.split(".")
    if len(parts) != 2 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= cfg.n_layers:
        raise ValueError(f"unknown unit {name!r} for {cfg.name} (units: embed, layers.0..{cfg.n_layers - 1}, head)")
    return int(parts[1])
