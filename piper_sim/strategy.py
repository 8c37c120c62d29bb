"""Strategy files: a model, a cluster, a batch, and a list of scheduling directives.

A strategy is JSON::

    {"model": "gpt-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 64,
     "microbatches": 4, "directives": [
        {"op": "pipeline", "degree": 2},
        {"op": "data_parallel", "degree": 2, "zero": 1},
        {"op": "schedule", "name": "1f1b"}]}

``model`` is a zoo name, or a user's annotated nn.Module: ``"py:module:function"``,
``"py:path/to/file.py:function"`` or ``{"source": "py:...", "kwargs": {...}}`` naming a factory
that returns `piper_sim.annotate.annotate(...)` (see that module).

High-level directives (``pipeline``, ``data_parallel``, ``expert_parallel``,
``tensor_parallel``, ``context_parallel``, ``schedule``) expand to the low-level set of the Piper
paper (``split``, ``place``, ``replicate``, ``shard``, ``shard_tensor``, ``shard_sequence``,
``order``, ``recompute``, ``stream``);
see ``expand``.
Every error is a `StrategyError` with one line that names the directive and field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from costmodel.dtypes import TRAINING_DTYPES, training_dtype
from costmodel.names import unknown_name, unknown_names
from costmodel.stack import DEFAULT as DEFAULT_STACK, Stack, StackError, check_stack_dtype, parse_stack, stack_to_strategy
from piper_sim import checks
from piper_sim.checks import StrategyError  # noqa: F401  (defined there so piper_sim.layouts needs no strategy)


# op -> (required fields, optional fields)
DIRECTIVE_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    # high level
    "pipeline": ({"degree"}, {"stages_per_rank", "placement", "layers_per_stage", "layout"}),
    "data_parallel": ({"degree"}, {"zero", "bucket_mb", "reduce", "overlap_param_gather", "shard_degree"}),
    "expert_parallel": ({"degree"}, set()),
    "tensor_parallel": ({"degree"}, {"sequence_parallel"}),
    "context_parallel": ({"degree"}, {"style"}),
    "schedule": ({"name"}, set()),
    # low level
    "split": ({"microbatches"}, set()),
    "place": ({"stage", "pp_rank"}, {"microbatches", "from"}),
    "replicate": ({"degree"}, {"zero", "bucket_mb", "reduce", "overlap_param_gather", "shard_degree"}),
    "shard": ({"degree"}, set()),
    "shard_tensor": ({"degree"}, {"sequence_parallel", "layers", "embedding", "head"}),
    "shard_sequence": ({"degree"}, {"style"}),
    "order": ({"pp_rank", "slots"}, {"from"}),
    "recompute": (set(), {"stages", "mode", "method", "num_layers", "every", "modules"}),
    "stream": ({"kind", "name"}, set()),
    "segment": ({"layers_per_stage"}, set()),
}
HIGH_LEVEL = ("pipeline", "data_parallel", "expert_parallel", "tensor_parallel", "context_parallel", "schedule")
TOP_LEVEL_FIELDS = {"model", "cluster", "global_batch", "seq_len", "microbatches", "directives",
                    "dtype", "name", "seed", "stack"}
STREAM_KINDS = ("SEND", "RECV", "ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL")
DTYPES = TRAINING_DTYPES
RECOMPUTE_MODES = ("full", "selective", "op", "every")  # piper_sim.recompute.MODES
RECOMPUTE_METHODS = ("uniform", "block")  # Megatron --recompute-method
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe_act", "moe", "shared_experts", "mla_up_proj")
REDUCE_MODES = ("per_microbatch", "per_step")  # when ZeRO-2/3 reduce-scatter gradients
CP_STYLES = ("allgather", "ring")  # context parallel: K/V all-gather (Llama 3) or ring attention


@dataclass
class Strategy:
    model: str | dict[str, Any]  # a zoo name, a "py:..." factory, or {"source": "py:...", "kwargs": {...}}
    cluster: str
    global_batch: int
    seq_len: int
    microbatches: int = 1
    directives: list[dict[str, Any]] = field(default_factory=list)
    dtype: str = "bf16"
    name: str = ""
    seed: int = 0
    stack: Stack = DEFAULT_STACK  # the kernels the run executes (costmodel.stack)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "model": self.model, "cluster": self.cluster,
               "global_batch": self.global_batch, "seq_len": self.seq_len,
               "microbatches": self.microbatches, "dtype": self.dtype, "seed": self.seed,
               "directives": self.directives}
        if self.stack != DEFAULT_STACK:
            out["stack"] = stack_to_strategy(self.stack)
        return out

    def short(self) -> str:
        """One-line summary, e.g. ``pp4 1f1b m8 | dp2 z1 | ep2``."""
        parts = []
        for d in self.directives:
            op = d["op"]
            if op == "pipeline":
                v = d.get("stages_per_rank") or 1
                if "layout" in d and "stages_per_rank" not in d:  # pp × v stages (piper_sim.layouts)
                    from piper_sim.layouts import parse_layout

                    v = max(1, len(parse_layout(d["layout"], "directive pipeline")) // d["degree"])
                parts.append(f"pp{d['degree']}" + (f"v{v}" if v > 1 else ""))
            elif op == "schedule":
                parts.append(f"{d['name']} m{self.microbatches}")
            elif op == "data_parallel":
                parts.append(f"dp{d['degree']} z{d.get('zero', 0)}")
            elif op == "expert_parallel":
                parts.append(f"ep{d['degree']}")
            elif op == "tensor_parallel":
                parts.append(f"tp{d['degree']}" + (" sp" if d.get("sequence_parallel") else ""))
            elif op == "context_parallel":
                parts.append(f"cp{d['degree']}" + (" ring" if d.get("style") == "ring" else ""))
            elif op == "recompute":
                mode = d.get("mode", "full")
                parts.append("recompute" + (f"({mode})" if mode != "full" else "")
                             + (f"({d.get('method', 'uniform')} {d['num_layers']})" if "num_layers" in d else ""))
        return " ".join(parts) or "single device"


def _check_int(value: Any, where: str, minimum: int = 1, maximum: int | None = checks.MAX_COUNT) -> int:
    return checks.integer(value, where, minimum, maximum, StrategyError)


def _check_values(d: dict[str, Any], where: str) -> None:
    """Exact types and ranges of the fields that more than one op shares or that hold lists."""
    for key in ("stage", "pp_rank"):
        if key in d:
            _check_int(d[key], f"{where} field '{key}'", minimum=0)
    for key in ("name", "from"):
        if key in d and not isinstance(d[key], str):
            raise StrategyError(f"{where} field '{key}' must be a string (got {d[key]!r})")
    if d["op"] == "place" and "microbatches" in d:
        mbs = d["microbatches"]
        if not isinstance(mbs, list) or len(mbs) != 2:
            raise StrategyError(f"{where} field 'microbatches' must be [first, end] (got {mbs!r})")
        first = _check_int(mbs[0], f"{where} field 'microbatches' first", minimum=0)
        _check_int(mbs[1], f"{where} field 'microbatches' end", minimum=first + 1)
    if "stages" in d and d["stages"] != "all":
        if not isinstance(d["stages"], list):
            raise StrategyError(f"{where} field 'stages' must be \"all\" or a list of stage numbers "
                                f"(got {d['stages']!r})")
        for s in d["stages"]:
            _check_int(s, f"{where} field 'stages' entry", minimum=0)
    if "slots" in d and (not isinstance(d["slots"], list) or not all(isinstance(s, str) for s in d["slots"])):
        raise StrategyError(f"{where} field 'slots' must be a list of action strings like '0F1' or '(0F3;1B2)' "
                            f"(got {d['slots']!r})")


def check_directive(d: Any, index: int) -> dict[str, Any]:
    """Check one directive's op and fields; return it unchanged."""
    if not isinstance(d, dict) or "op" not in d:
        raise StrategyError(f"directive #{index} must be an object with an 'op' field (got {d!r})")
    op = d["op"]
    if not isinstance(op, str) or op not in DIRECTIVE_FIELDS:
        raise StrategyError(f"directive #{index}: {unknown_name('op', op, DIRECTIVE_FIELDS, 'known ops')} "
                            "in field 'op'")
    required, optional = DIRECTIVE_FIELDS[op]
    unknown = d.keys() - required - optional - {"op"}
    if unknown:
        allowed = sorted(required | optional) or ["none"]
        raise StrategyError(f"directive #{index} ({op}): {unknown_names('field', unknown, allowed)}")
    missing = required - d.keys()
    if missing:
        raise StrategyError(f"directive #{index} ({op}): missing field(s) {', '.join(sorted(missing))}")
    where = f"directive #{index} ({op})"
    for key in ("degree", "stages_per_rank", "microbatches"):
        if key in d and not (op == "place" and key == "microbatches"):
            _check_int(d[key], f"{where} field '{key}'")
    if "zero" in d:
        _check_int(d["zero"], f"{where} field 'zero'", minimum=0, maximum=3)
    if "shard_degree" in d:  # hybrid sharding (HSDP): ZeRO within groups of this many DP ranks
        shard = _check_int(d["shard_degree"], f"{where} field 'shard_degree'")
        if isinstance(d.get("degree"), int) and d["degree"] % shard:
            raise StrategyError(f"{where} field 'shard_degree' {shard} must divide the data-parallel degree "
                                f"{d['degree']} (replicas = degree / shard_degree)")
        if d.get("zero", 0) == 0 and shard < d.get("degree", shard):
            raise StrategyError(f"{where} field 'shard_degree' shards ZeRO state, but zero is 0; set zero 1, 2 or 3 "
                                "(HSDP is FSDP's ZeRO-3 within groups) or drop shard_degree")
    if "bucket_mb" in d:
        checks.number(d["bucket_mb"], f"{where} field 'bucket_mb' (MB)", error=StrategyError)
    _check_values(d, where)
    if "overlap_param_gather" in d and not isinstance(d["overlap_param_gather"], bool):
        raise StrategyError(f"{where} field 'overlap_param_gather' must be true or false "
                            f"(got {d['overlap_param_gather']!r})")
    if "reduce" in d:
        if d["reduce"] not in REDUCE_MODES:
            raise StrategyError(f"{where} field 'reduce' must be 'per_microbatch' or 'per_step' (got {d['reduce']!r})")
        if d["reduce"] == "per_microbatch" and d.get("zero", 0) < 2:
            raise StrategyError(f"{where} field 'reduce': 'per_microbatch' needs zero 2 or 3 (ZeRO-0/1 "
                                "accumulate full gradients and sync once per step); drop the field")
    if "placement" in d and d["placement"] not in ("loop", "v"):
        raise StrategyError(f"{where} field 'placement' must be 'loop' or 'v' (got {d['placement']!r})")
    if op == "stream" and d["kind"] not in STREAM_KINDS:
        raise StrategyError(f"{where} field 'kind' must be one of {', '.join(STREAM_KINDS)} (got {d['kind']!r})")
    lps = d.get("layers_per_stage", "balanced")
    if lps != "balanced" and (not isinstance(lps, list) or not lps
                              or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in lps)):
        raise StrategyError(f"{where} field 'layers_per_stage' must be \"balanced\" or a list of layer counts "
                            f"(0 or more), one per stage (got {d['layers_per_stage']!r})")
    if "layout" in d:  # Megatron's --pipeline-model-parallel-layout (piper_sim.layouts)
        from piper_sim.layouts import layout_layers

        if "layers_per_stage" in d:
            raise StrategyError(f"{where} fields 'layout' and 'layers_per_stage' both give the layers per stage; "
                                "keep one")
        layout_layers(d["layout"], where)
    if "sequence_parallel" in d and not isinstance(d["sequence_parallel"], bool):
        raise StrategyError(f"{where} field 'sequence_parallel' must be true or false (got {d['sequence_parallel']!r})")
    for key in ("embedding", "head"):
        if key in d and not isinstance(d[key], bool):
            raise StrategyError(f"{where} field '{key}' must be true or false (got {d[key]!r})")
    if "layers" in d:
        tp_layers(d["layers"], where)
    if "style" in d and d["style"] not in CP_STYLES:
        raise StrategyError(f"{where} field 'style' must be 'allgather' or 'ring' (got {d['style']!r})")
    if op == "recompute":
        _check_recompute(d, where)
    return d


def _check_recompute(d: dict[str, Any], where: str) -> None:
    """The recompute directive's policy fields (`piper_sim.recompute`), each named when wrong."""
    mode = d.get("mode", "full")
    if mode not in RECOMPUTE_MODES:
        raise StrategyError(f"{where} field 'mode' must be one of {', '.join(RECOMPUTE_MODES)} (got {mode!r})")
    if "method" in d:
        if mode != "full":
            raise StrategyError(f"{where} field 'method' (Megatron --recompute-method) needs mode 'full' "
                                f"(got mode {mode!r})")
        if d["method"] not in RECOMPUTE_METHODS:
            raise StrategyError(f"{where} field 'method' must be 'uniform' or 'block' (got {d['method']!r})")
        if "num_layers" not in d:
            raise StrategyError(f"{where} field 'method' needs field 'num_layers' (Megatron --recompute-num-layers)")
    if "num_layers" in d:
        if mode != "full":
            raise StrategyError(f"{where} field 'num_layers' (Megatron --recompute-num-layers) needs mode 'full' "
                                f"(got mode {mode!r})")
        _check_int(d["num_layers"], f"{where} field 'num_layers'")
    if "every" in d and mode != "every":
        raise StrategyError(f"{where} field 'every' needs mode 'every' (got mode {mode!r})")
    if mode == "every":
        if "every" not in d:
            raise StrategyError(f"{where} mode 'every' needs field 'every' (recompute every N-th layer, "
                                "torchtitan selective_ac_option = \"N\")")
        _check_int(d["every"], f"{where} field 'every'")
    if "modules" in d:
        mods = d["modules"]
        if mode != "selective":
            raise StrategyError(f"{where} field 'modules' (Megatron --recompute-modules) needs mode 'selective' "
                                f"(got mode {mode!r})")
        if not isinstance(mods, list) or not mods:
            raise StrategyError(f"{where} field 'modules' must be a non-empty list of "
                                f"{', '.join(RECOMPUTE_MODULES)} (got {mods!r})")
        for m in mods:
            if m not in RECOMPUTE_MODULES:
                raise StrategyError(f"{where} field 'modules' entry {m!r} is not one of {', '.join(RECOMPUTE_MODULES)}")
        if len(set(mods)) != len(mods):
            raise StrategyError(f"{where} field 'modules' names a module twice ({mods!r})")


def tp_layers(value: Any, where: str) -> tuple[int, ...]:
    """``shard_tensor``'s ``layers``: a list of layer indices or an inclusive range ``"a-b"``."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
        if not m or int(m.group(1)) > int(m.group(2)):
            raise StrategyError(f"{where} field 'layers' must be a list of layer indices or a range "
                                f"\"first-last\" like \"0-15\" (got {value!r})")
        return tuple(range(int(m.group(1)), int(m.group(2)) + 1))
    if not isinstance(value, list):
        raise StrategyError(f"{where} field 'layers' must be a list of layer indices or a range "
                            f"\"first-last\" like \"0-15\" (got {value!r})")
    for x in value:
        _check_int(x, f"{where} field 'layers' entry", minimum=0)
    return tuple(sorted(set(value)))


def format_layers(layers) -> str:
    """Layer indices as runs, e.g. ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _check_model_source(model: dict[str, Any]) -> None:
    """A user model given as ``{"source": "py:...", "kwargs": {...}}`` (piper_sim.annotate)."""
    unknown = model.keys() - {"source", "kwargs"}
    if unknown:
        raise StrategyError(f"strategy field 'model': {unknown_names('key', unknown, ['source', 'kwargs'])}")
    if not isinstance(model.get("source"), str) or not model["source"].startswith("py:"):
        raise StrategyError("strategy field 'model.source' must be a string py:module:function or "
                            f"py:path/file.py:function (got {model.get('source')!r})")
    if not isinstance(model.get("kwargs", {}), dict):
        raise StrategyError(f"strategy field 'model.kwargs' must be an object (got {model['kwargs']!r})")


def parse_strategy(data: Any) -> Strategy:
    """Validate a strategy dict (as loaded from JSON) and return a `Strategy`."""
    if not isinstance(data, dict):
        raise StrategyError("a strategy must be a JSON object with model, cluster, global_batch, seq_len, directives")
    unknown = data.keys() - TOP_LEVEL_FIELDS
    if unknown:
        raise StrategyError(unknown_names("strategy field", unknown, sorted(TOP_LEVEL_FIELDS)))
    for key in ("model", "cluster", "global_batch", "seq_len"):
        if key not in data:
            raise StrategyError(f"strategy is missing the field '{key}'")
    if isinstance(data["model"], dict):
        _check_model_source(data["model"])
    for key in ("model", "cluster") if not isinstance(data["model"], dict) else ("cluster",):
        if not isinstance(data[key], str):
            raise StrategyError(f"strategy field '{key}' must be a string (got {data[key]!r})")
    global_batch = _check_int(data["global_batch"], "strategy field 'global_batch'")
    seq_len = _check_int(data["seq_len"], "strategy field 'seq_len'")
    microbatches = _check_int(data.get("microbatches", 1), "strategy field 'microbatches'")
    try:  # torch's and Hugging Face's spellings too: "bfloat16" is "bf16" (the plan keeps the short name)
        dtype = training_dtype(data.get("dtype", "bf16"), "strategy field 'dtype'")
    except ValueError as e:
        raise StrategyError(str(e)) from None
    directives = data.get("directives", [])
    if not isinstance(directives, list):
        raise StrategyError("strategy field 'directives' must be a list of {\"op\": ...} objects")
    seed = _check_int(data.get("seed", 0), "strategy field 'seed'", minimum=0, maximum=2**63 - 1)
    if not isinstance(data.get("name", ""), str):
        raise StrategyError(f"strategy field 'name' must be a string (got {data['name']!r})")
    try:
        stack = parse_stack(data.get("stack"))
        check_stack_dtype(stack, dtype)
    except StackError as e:
        raise StrategyError(f"{e}") from None
    directives = [check_directive(d, i) for i, d in enumerate(directives)]
    seen: set[str] = set()
    for i, d in enumerate(directives):
        if d["op"] in HIGH_LEVEL + ("split",):
            if d["op"] in seen:
                raise StrategyError(f"directive #{i} ({d['op']}): given twice; keep one")
            seen.add(d["op"])
    return Strategy(model=data["model"], cluster=data["cluster"], global_batch=global_batch,
                    seq_len=seq_len, microbatches=microbatches, directives=directives, dtype=dtype,
                    name=data.get("name", ""), seed=seed, stack=stack)


def load_strategy(path: str) -> Strategy:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise StrategyError(f"strategy file {path} not found") from None
    except json.JSONDecodeError as e:
        raise StrategyError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError:
        raise StrategyError(f"{path}: not a text (JSON) file") from None
    except RecursionError:
        raise StrategyError(f"{path}: JSON nested too deeply") from None
    return parse_strategy(data)
