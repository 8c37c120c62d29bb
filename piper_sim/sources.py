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
  llama3, yarn) is not modelled: it changes neither shapes nor costs;
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

from piper_sim.configs import FIELDS, ZOO, ModelConfig, check_config, config_from_dict

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


def _read_mapping(path: str, what: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {path}: no such file")
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        raise ValueError(f"{what} {path}: not valid {p.suffix[1:].upper()}: {' '.join(str(e).split())}") from None
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
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {key!r} must be a string")
        field = FILE_KEYS.get(key, key)
        if field not in FIELDS:
            raise ValueError(f"{where}: unknown key {key!r}; keys: {', '.join([*FILE_KEYS, *FIELDS])}")
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

    def first(self, *keys: str) -> Any:
        """The first of ``keys`` present (spellings differ between config.json and to_dict())."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        return self(keys[0])

    def fail(self, key: str, why: str) -> None:
        raise ValueError(f"{self.where}: key {key!r} {why}")


def _rope_theta(k: _Keys, default: float) -> float:
    params = k.data.get("rope_parameters") or {}
    return float(k("rope_theta", params.get("rope_theta", default) if isinstance(params, dict) else default))


def _window(k: _Keys, n_layers: int) -> dict:
    """``sliding_window``/``window_pattern`` from ``layer_types`` (or the family's flags)."""
    types = k.data.get("layer_types")
    window = k.data.get("sliding_window")
    if k.data.get("use_sliding_window") is False:  # Qwen2/3 carry a window they do not use
        window = None
    if not types:
        return {"sliding_window": int(window)} if window else {}
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
            return {"sliding_window": int(window), "window_pattern": pattern}
    k.fail("layer_types", "is not a repeating 'k-1 sliding, 1 full' pattern (not supported)")
    return {}


def _silu(k: _Keys) -> None:
    act = k("hidden_act", "silu")
    if act != "silu":
        k.fail("hidden_act", f"is {act!r}: only 'silu' (SwiGLU) is supported for this family")


def _llama(k: _Keys) -> dict:
    """Llama, and the common keys of the families below."""
    _silu(k)
    heads = int(k("num_attention_heads"))
    n = int(k("num_hidden_layers"))
    bias = bool(k("attention_bias", False))
    return dict(n_layers=n, hidden=int(k("hidden_size")), n_heads=heads,
                n_kv_heads=int(k("num_key_value_heads", heads)), ffn=int(k("intermediate_size")),
                vocab=int(k("vocab_size")), max_seq=int(k("max_position_embeddings", 4096)),
                kv_channels=int(k("head_dim", 0)), rope_theta=_rope_theta(k, 10000.0),
                norm_eps=float(k("rms_norm_eps", 1e-6)), tie_embeddings=bool(k("tie_word_embeddings", False)),
                attn_bias=bias, o_bias=bias, mlp_bias=bool(k("mlp_bias", False)), **_window(k, n))


def _qwen2(k: _Keys) -> dict:
    return {**_llama(k), "attn_bias": True, "o_bias": False}  # q/k/v biases, none on o_proj


def _qwen3(k: _Keys) -> dict:
    return {**_llama(k), "qk_norm": True}


def _qwen3_moe(k: _Keys) -> dict:
    out = _qwen3(k)
    if int(k("decoder_sparse_step", 1)) != 1:
        k.fail("decoder_sparse_step", "must be 1 (every layer MoE); other steps are not supported")
    dense = sorted(k("mlp_only_layers", []))
    if dense != list(range(len(dense))):
        k.fail("mlp_only_layers", "must be the first layers (0, 1, ...): dense layers elsewhere are not supported")
    return {**out, "n_experts": int(k.first("num_experts", "num_local_experts")), "top_k": int(k("num_experts_per_tok")),
            "expert_ffn": int(k("moe_intermediate_size")), "first_dense": len(dense),
            "norm_topk": bool(k("norm_topk_prob", False))}


def _mixtral(k: _Keys) -> dict:
    out = _llama(k)
    return {**out, "n_experts": int(k("num_local_experts")), "top_k": int(k("num_experts_per_tok")),
            "expert_ffn": out["ffn"]}


def _deepseek_v3(k: _Keys) -> dict:
    """DeepSeek-V3 (MLA; the multi-token-prediction module, ``num_nextn_predict_layers``, is left
    out; routing is costed as a softmax top-k: the same shapes as its sigmoid group routing)."""
    _silu(k)
    if int(k("moe_layer_freq", 1)) != 1:
        k.fail("moe_layer_freq", "must be 1 (every layer after the dense ones is MoE)")
    heads = int(k("num_attention_heads"))
    return dict(n_layers=int(k("num_hidden_layers")), hidden=int(k("hidden_size")), n_heads=heads,
                n_kv_heads=int(k("num_key_value_heads", heads)), ffn=int(k("intermediate_size")),
                vocab=int(k("vocab_size")), max_seq=int(k("max_position_embeddings", 4096)),
                n_experts=int(k("n_routed_experts")), top_k=int(k("num_experts_per_tok")),
                n_shared=int(k("n_shared_experts", 0)), expert_ffn=int(k("moe_intermediate_size")),
                first_dense=int(k("first_k_dense_replace", 0)), norm_topk=bool(k("norm_topk_prob", True)),
                attention="mla", q_lora_rank=int(k("q_lora_rank", 0)), kv_lora_rank=int(k("kv_lora_rank")),
                qk_nope_dim=int(k("qk_nope_head_dim")), qk_rope_dim=int(k("qk_rope_head_dim")),
                v_head_dim=int(k("v_head_dim")), rope_theta=_rope_theta(k, 10000.0),
                norm_eps=float(k("rms_norm_eps", 1e-6)), tie_embeddings=bool(k("tie_word_embeddings", False)),
                o_bias=bool(k("attention_bias", False)))


def _gpt_oss(k: _Keys) -> dict:
    """GPT-OSS: biased attention, router and experts, alternating 128-token sliding windows.
    Approximations: its clamped SwiGLU runs as SwiGLU (same shapes and flops) and the
    attention sinks (one logit per head and layer) are left out."""
    out = {**_llama(k), "attn_bias": True, "o_bias": True}
    return {**out, "n_experts": int(k("num_local_experts")), "top_k": int(k("num_experts_per_tok")),
            "expert_ffn": out["ffn"], "router_bias": True, "mlp_bias": True}


HF_FAMILIES: dict[str, Callable[[_Keys], dict]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss,
}


def from_hf_dict(data: dict, where: str = "hf config", default_name: str = "") -> ModelConfig:
    """A Hugging Face config dict of one of :data:`HF_FAMILIES`, by ``model_type``."""
    family = data.get("model_type")
    if family not in HF_FAMILIES:
        raise ValueError(f"{where}: unsupported model_type {family!r}; supported: {', '.join(HF_FAMILIES)}")
    spec = HF_FAMILIES[family](_Keys(data, where))
    name = data.get("_name_or_path") or default_name or family
    spec["name"] = os.path.basename(str(name).rstrip("/")) or family
    cfg = config_from_dict(spec, where)
    check_config(cfg, where)
    return cfg
