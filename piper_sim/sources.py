"""Where a strategy's model comes from (torch-free): :func:`resolve_model` turns a *model
source* into a `ModelConfig`.

Sources:

- a zoo name (``"llama3-8b"``, see ``piper-sim models``) or a name given to :func:`register_model`;
- ``"file:PATH"``, or a path ending in ``.yaml``/``.yml``/``.json``: a model file, a mapping
  of the keys in :data:`FILE_KEYS` (Calculon-like: ``layers``, ``hidden``, ``heads``...) or of
  `ModelConfig` field names;
- ``"hf:PATH"``: a Hugging Face ``config.json`` (the file, or a folder holding it) of one of
  the families in :data:`HF_FAMILIES` (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
  DeepSeek-V3, GPT-OSS), translated by its ``model_type``. Rotary scaling (``rope_scaling``:
  llama3, yarn, linear, dynamic, longrope) is checked and not modelled: it changes neither
  shapes nor costs (:data:`ROPE_TYPES`; another type is refused by name); ``torch_dtype`` /
  ``dtype`` is checked (any spelling of a format) and is not the training dtype, which is the
  strategy's ``dtype``;
- ``"py:module:function"``: a user model factory (an annotated nn.Module, see `piper_sim.annotate`);
- a `ModelConfig`, a dict (a Hugging Face config when it has ``model_type``, else a model
  file's mapping) or a transformers ``PretrainedConfig`` (its ``to_dict()``).

Every error is one line naming the source and the key or field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from costmodel.names import unknown_name
from costmodel.dtypes import DTYPES, dtype_from_spelling
from piper_sim.checks import MAX_MODEL_FILE_BYTES, integer, number
from piper_sim.configs import FIELDS, ZOO, ModelConfig, check_config, check_field, config_from_dict

MODEL_FILE_SUFFIXES = (".yaml", ".yml", ".json")

# model-file key -> ModelConfig field (a field's own name is accepted too)
FILE_KEYS = {
    "layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "kv_channels",
    "activation": "mlp", "tied_embeddings": "tie_embeddings", "experts": "n_experts",
    "shared_experts": "n_shared", "dense_first_layers": "first_dense", "seq": "max_seq",
    "q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_dim",
    "qk_rope_head_dim": "qk_rope_dim",
}


def resolve_model(source: Any) -> ModelConfig:
    """The `ModelConfig` a model source names (see the module docstring)."""
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, dict):
        return from_hf_dict(source) if "model_type" in source else from_model_dict(source)
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # a transformers PretrainedConfig
        return from_hf_dict(source.to_dict(), where=f"{type(source).__name__}")
    if not isinstance(source, str) or not source:
        raise ValueError(f"model: expected a zoo name, 'file:PATH', 'hf:PATH' or a model file (got {source!r})")
    if source.startswith("py:"):
        return _python_model(source)
    if source.startswith("hf:"):
        return from_hf_path(source[3:])
    if source.startswith("file:"):
        return from_model_file(source[5:])
    if source.lower().endswith(MODEL_FILE_SUFFIXES):
        return from_model_file(source)
    if source in ZOO:
        return ZOO[source]
    raise ValueError(f"unknown model {source!r}; choose one of: {', '.join(ZOO)} "
                     "(or a model file PATH.yaml/.json, 'file:PATH', 'hf:PATH' to a Hugging Face config.json)")


def _python_model(source: str):
    """The single dispatch point for ``py:module:function`` user model factories: the
    factory's annotated nn.Module as a `piper_sim.annotate.UserModel` (imports torch)."""
    from piper_sim.annotate import load_user_model  # its AnnotationError is a ValueError

    return load_user_model(source)


def register_model(name: str, spec: Any) -> ModelConfig:
    """Make ``name`` a zoo name for ``spec`` (a `ModelConfig`, a dict or a source string) in this
    process; returns the config (named ``name``). Re-registering the same config is a no-op."""
    if not isinstance(name, str) or not name or ":" in name or name.lower().endswith(MODEL_FILE_SUFFIXES):
        raise ValueError(f"register_model: name {name!r} must be a non-empty string without ':' or a file suffix")
    from dataclasses import replace

    cfg = replace(resolve_model(spec), name=name)
    if name in ZOO and ZOO[name] != cfg:
        raise ValueError(f"register_model: {name!r} is already a different model; choose another name")
    ZOO[name] = cfg
    return cfg


# --------------------------------------------------------------------------- model files


def model_files(folder: str) -> list[str]:
    """Model sources found in ``folder`` (not recursive): its model files, and ``hf:`` for each
    sub-folder holding a ``config.json``; sorted."""
    p = Path(folder)
    if not p.is_dir():
        raise ValueError(f"--dir {folder}: not a folder")
    out = [str(f) for f in p.iterdir() if f.is_file() and f.suffix.lower() in MODEL_FILE_SUFFIXES]
    out += [f"hf:{d}" for d in p.iterdir() if (d / "config.json").is_file()]
    return sorted(out)


def _read_text(path: str, what: str) -> str:
    """The text of a model file or config.json; a folder, a missing, oversized or binary file
    is a one-line ValueError naming it."""
    p = Path(path)
    if p.is_dir():
        hint = f", or hf:{path} for its Hugging Face config" if (p / "config.json").is_file() else ""
        raise ValueError(f"{what} {path}: is a folder, not a file; give the file's path{hint}")
    if not p.is_file():
        raise ValueError(f"{what} {path}: no such file")
    size = p.stat().st_size
    if size > MAX_MODEL_FILE_BYTES:
        raise ValueError(f"{what} {path}: {size:,} bytes is not a model description (the limit is "
                         f"{MAX_MODEL_FILE_BYTES:,}); give the YAML/JSON model file or the config.json")
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path}: not a text file (byte {data[e.start]:#04x} at offset {e.start} is not "
                         "UTF-8); give the YAML/JSON model file or the config.json") from None


def _read_mapping(path: str, what: str) -> dict:
    p = Path(path)
    text = _read_text(path, what)
    is_yaml = p.suffix.lower() in (".yaml", ".yml")
    try:
        if is_yaml:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError, RecursionError
        raise ValueError(f"{what} {path}: not valid {'YAML' if is_yaml else 'JSON'}: {' '.join(str(e).split())}") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: must be a mapping of keys to values")
    return data


def from_model_file(path: str) -> ModelConfig:
    """A model file (YAML or JSON); its ``name`` defaults to the file name without suffix."""
    data = _read_mapping(path, "model file")
    if "model_type" in data:  # a Hugging Face config.json given as a plain path
        return from_hf_dict(data, where=f"model file {path}", default_name=Path(path).parent.name)
    data.setdefault("name", Path(path).stem)
    return from_model_dict(data, where=f"model file {path}")


def from_model_dict(data: dict, where: str = "model") -> ModelConfig:
    """A model file's mapping (keys of :data:`FILE_KEYS` or `ModelConfig` fields)."""
    spec: dict[str, Any] = {}
    _hf_dtype(_Keys(data, where))  # checked as in a Hugging Face config; the strategy's dtype trains
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {key!r} must be a string")
        if key in CHECKPOINT_DTYPE_KEYS:
            continue
        field = FILE_KEYS.get(key, key)
        if field not in FIELDS:
            raise ValueError(f"{where}: {unknown_name('key', key, [*FILE_KEYS, *FIELDS, *CHECKPOINT_DTYPE_KEYS], 'keys')}")
        if field in spec:
            raise ValueError(f"{where}: key {key!r} repeats field {field!r}; give it once")
        spec[field] = value
    if "name" not in spec:
        raise ValueError(f"{where}: missing key 'name'")
    if spec.get("mlp") == "silu":
        spec["mlp"] = "swiglu"
    if spec.get("n_kv_heads") is None and "n_heads" in spec:
        spec["n_kv_heads"] = spec["n_heads"]
    if spec.get("ffn") is None and spec.get("n_experts"):
        spec["ffn"] = spec.get("expert_ffn", 0)
    return config_from_dict(spec, where)


# --------------------------------------------------------------------------- Hugging Face


def from_hf_path(path: str) -> ModelConfig:
    """A Hugging Face ``config.json`` (or a folder holding one); named after its folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = _read_mapping(str(p), "hf config")
    return from_hf_dict(data, where=f"hf config {p}", default_name=p.resolve().parent.name)


class _Keys:
    """Reads a Hugging Face config dict; a missing key is a one-line error naming it."""

    def __init__(self, data: dict, where: str):
        self.data, self.where = data, where

    def __call__(self, key: str, default: Any = ...) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is ...:
                raise ValueError(f"{self.where}: missing key {key!r} (model_type {self.data.get('model_type')!r})")
            return default
        return value

    def typed(self, key: str, field: str, default: Any = ...) -> Any:
        """Key ``key`` checked as the `ModelConfig` ``field`` it becomes (type and range; the
        message names the key)."""
        return check_field(field, self(key, default), f"{self.where}: key {key!r}")

    def count(self, key: str, default: int) -> int:
        """An integer >= 1 that becomes no field (a layer frequency, say)."""
        return integer(self(key, default), f"{self.where}: key {key!r}")

    def flag(self, key: str, default: bool) -> bool:
        """A true/false key (a string such as "yes" is refused, not read as true)."""
        value = self(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false (got {value!r})")
        return value

    def ints(self, key: str) -> list[int]:
        """A list of non-negative integers (empty when the key is absent)."""
        value = self(key, [])
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                  for v in value):
            self.fail(key, f"must be a list of layer indices (integers >= 0), got {value!r}")
        return value

    def fail(self, key: str, why: str) -> None:
        raise ValueError(f"{self.where}: key {key!r} {why}")


def _rope_theta(k: _Keys, default: float) -> float:
    params = k.data.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None and k.data.get("rope_theta") is None:
        return check_field("rope_theta", params["rope_theta"], f"{k.where}: key 'rope_parameters.rope_theta'")
    return k.typed("rope_theta", "rope_theta", default)


# Rotary scaling types (``rope_scaling.rope_type``, older configs ``type``) that are accepted and
# not modelled, on purpose: each only rescales the rotary frequencies (llama3: per-band factors,
# yarn: NTK-by-parts plus an attention temperature that folds into the softmax scale, linear /
# dynamic NTK / longrope: position or base rescaling) — the same elementwise rotation of the
# same q and k tensors, so no shape, flop, byte or memory the cost model counts changes. A type
# not listed is refused by name: we could not vouch that it leaves the costs alone.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope_scaling(k: _Keys) -> None:
    """Check ``rope_scaling`` (and transformers 5's ``rope_parameters``): a mapping whose type is
    one of :data:`ROPE_TYPES` and whose ``factor``, when given, is a number > 0."""
    for key in ("rope_scaling", "rope_parameters"):
        value = k.data.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            k.fail(key, f"must be a mapping (rope_type, factor, ...), got {value!r}")
        # transformers 5 may give one mapping per layer type ({"full_attention": {...}, ...})
        per_type = value if value and all(isinstance(v, dict) for v in value.values()) else {"": value}
        for layer_type, params in per_type.items():
            where = f"{key}.{layer_type}" if layer_type else key
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in ROPE_TYPES:
                k.fail(where, f"has rope_type {kind!r}, which piper-sim does not know; known (each only rescales "
                              f"the rotary frequencies, so costs are unchanged): {', '.join(ROPE_TYPES)}")
            if params.get("factor") is not None:
                number(params["factor"], f"{k.where}: key '{where}.factor'")


CHECKPOINT_DTYPE_KEYS = ("torch_dtype", "dtype")


def _hf_dtype(k: _Keys) -> str | None:
    """The checkpoint's format (``torch_dtype``, transformers >= 4.56 ``dtype``) as a format name,
    checked. It is not the training dtype: that is the strategy's ``dtype`` (default bf16), as in
    torchtitan and Megatron, whose mixed-precision setting is independent of how the weights are
    stored; an unknown spelling is refused by name."""
    names = set()
    for key in CHECKPOINT_DTYPE_KEYS:
        value = k.data.get(key)
        if value is None:
            continue
        name = dtype_from_spelling(value)
        if name is None:
            k.fail(key, f"is {value!r}, not a floating-point format piper-sim knows ({', '.join(DTYPES)}, "
                        "or as torch spells them: bfloat16, float16, float32, torch.bfloat16, ...)")
        names.add(name)
    if len(names) > 1:
        k.fail("dtype", f"and 'torch_dtype' disagree ({', '.join(sorted(names))}); give one")
    return names.pop() if names else None


def _window(k: _Keys, n_layers: int) -> dict:
    """``sliding_window``/``window_pattern`` from ``layer_types`` (or the family's flags)."""
    types = k.data.get("layer_types")
    # Qwen2/3 carry a window they do not use
    window = 0 if k.data.get("use_sliding_window") is False else k.typed("sliding_window", "sliding_window", 0)
    if not types:
        return {"sliding_window": window} if window else {}
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        k.fail("layer_types", f"must be a list of layer type names, got {types!r}")
    if len(types) != n_layers:
        k.fail("layer_types", f"has {len(types)} entries for {n_layers} layers")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        k.fail("layer_types", f"has unsupported layer type {sorted(unknown)[0]!r}")
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return {}
    if not window:
        k.fail("sliding_window", "must be set: layer_types has sliding_attention layers")
    for pattern in [0, *range(2, n_layers + 1)]:
        if all(s == (not pattern or (i + 1) % pattern != 0) for i, s in enumerate(sliding)):
            return {"sliding_window": window, "window_pattern": pattern}
    k.fail("layer_types", "is not a repeating 'k-1 sliding, 1 full' pattern (not supported)")
    return {}


def _silu(k: _Keys) -> None:
    act = k("hidden_act", "silu")
    if act != "silu":
        k.fail("hidden_act", f"is {act!r}: only 'silu' (SwiGLU) is supported for this family")


def _common(k: _Keys) -> dict:
    """The keys every family shares: sizes, heads, vocabulary, positions, rotary base, norm."""
    heads = k.typed("num_attention_heads", "n_heads")
    return dict(n_layers=k.typed("num_hidden_layers", "n_layers"), hidden=k.typed("hidden_size", "hidden"),
                n_heads=heads, n_kv_heads=k.typed("num_key_value_heads", "n_kv_heads", heads),
                ffn=k.typed("intermediate_size", "ffn"), vocab=k.typed("vocab_size", "vocab"),
                max_seq=k.typed("max_position_embeddings", "max_seq", 4096),
                rope_theta=_rope_theta(k, 10000.0), norm_eps=k.typed("rms_norm_eps", "norm_eps", 1e-6),
                tie_embeddings=k.flag("tie_word_embeddings", False))


def _llama(k: _Keys) -> dict:
    """Llama, and the common keys of the families below."""
    _silu(k)
    out = _common(k)
    bias = k.flag("attention_bias", False)
    return {**out, "kv_channels": k.typed("head_dim", "kv_channels", 0), "attn_bias": bias, "o_bias": bias,
            "mlp_bias": k.flag("mlp_bias", False), **_window(k, out["n_layers"])}


def _qwen2(k: _Keys) -> dict:
    return {**_llama(k), "attn_bias": True, "o_bias": False}  # q/k/v biases, none on o_proj


def _qwen3(k: _Keys) -> dict:
    return {**_llama(k), "qk_norm": True}


def _experts(k: _Keys, *count_keys: str) -> dict:
    """Routed experts: their number (the first of ``count_keys`` present: spellings differ
    between config.json and to_dict()) and top-k."""
    key = next((c for c in count_keys if k.data.get(c) is not None), count_keys[0])
    return {"n_experts": k.typed(key, "n_experts"), "top_k": k.typed("num_experts_per_tok", "top_k")}


def _qwen3_moe(k: _Keys) -> dict:
    out = _qwen3(k)
    if k.count("decoder_sparse_step", 1) != 1:
        k.fail("decoder_sparse_step", "must be 1 (every layer MoE); other steps are not supported")
    dense = sorted(k.ints("mlp_only_layers"))
    if dense != list(range(len(dense))):
        k.fail("mlp_only_layers", "must be the first layers (0, 1, ...): dense layers elsewhere are not supported")
    return {**out, **_experts(k, "num_experts", "num_local_experts"),
            "expert_ffn": k.typed("moe_intermediate_size", "expert_ffn"), "first_dense": len(dense),
            "norm_topk": k.flag("norm_topk_prob", False)}


def _mixtral(k: _Keys) -> dict:
    out = _llama(k)
    return {**out, **_experts(k, "num_local_experts"), "expert_ffn": out["ffn"]}


def _deepseek_v3(k: _Keys) -> dict:
    """DeepSeek-V3 (MLA; the multi-token-prediction module, ``num_nextn_predict_layers``, is left
    out; routing is costed as a softmax top-k: the same shapes as its sigmoid group routing)."""
    _silu(k)
    if k.count("moe_layer_freq", 1) != 1:
        k.fail("moe_layer_freq", "must be 1 (every layer after the dense ones is MoE)")
    return {**_common(k), **_experts(k, "n_routed_experts"),
            "n_shared": k.typed("n_shared_experts", "n_shared", 0),
            "expert_ffn": k.typed("moe_intermediate_size", "expert_ffn"),
            "first_dense": k.typed("first_k_dense_replace", "first_dense", 0),
            "norm_topk": k.flag("norm_topk_prob", True), "attention": "mla",
            "q_lora_rank": k.typed("q_lora_rank", "q_lora_rank", 0),
            "kv_lora_rank": k.typed("kv_lora_rank", "kv_lora_rank"),
            "qk_nope_dim": k.typed("qk_nope_head_dim", "qk_nope_dim"),
            "qk_rope_dim": k.typed("qk_rope_head_dim", "qk_rope_dim"),
            "v_head_dim": k.typed("v_head_dim", "v_head_dim"), "o_bias": k.flag("attention_bias", False)}


def _gpt_oss(k: _Keys) -> dict:
    """GPT-OSS: biased attention, router and experts, alternating 128-token sliding windows.
    Approximations: its clamped SwiGLU runs as SwiGLU (same shapes and flops) and the
    attention sinks (one logit per head and layer) are left out."""
    out = {**_llama(k), "attn_bias": True, "o_bias": True}
    return {**out, **_experts(k, "num_local_experts"), "expert_ffn": out["ffn"], "router_bias": True,
            "mlp_bias": True}


HF_FAMILIES: dict[str, Callable[[_Keys], dict]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss,
}


def from_hf_dict(data: dict, where: str = "hf config", default_name: str = "") -> ModelConfig:
    """A Hugging Face config dict of one of :data:`HF_FAMILIES`, by ``model_type``."""
    family = data.get("model_type")
    if family not in HF_FAMILIES:
        raise ValueError(f"{where}: unsupported model_type {family!r}; supported: {', '.join(HF_FAMILIES)}")
    keys = _Keys(data, where)
    _rope_scaling(keys)
    _hf_dtype(keys)
    spec = HF_FAMILIES[family](keys)
    name = data.get("_name_or_path") or default_name or family
    spec["name"] = os.path.basename(str(name).rstrip("/")) or family
    cfg = config_from_dict(spec, where)
    check_config(cfg, where)
    return cfg
