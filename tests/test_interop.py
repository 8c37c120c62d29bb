"""Export to torchtitan / Megatron-LM job files and import back (piper_sim.interop).

- round trip: import(export(s)) compiles to the plan hash of s, for strategies across PP
  schedules, DP ZeRO 0-3, HSDP, TP+SP, CP, EP and recompute (each target: the ones it runs;
  the others are refused, naming the feature);
- counts vs sizes: microbatches is a count, torchtitan's and Megatron's micro-batch a size;
- the exported files load in torchtitan's own ConfigManager/JobConfig and build Megatron-Core's
  config dataclasses (skipped when the `interop` extra is not installed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
from typing import Any

import pytest

from piper_sim.interop import megatron, torchtitan
from piper_sim.interop.common import InteropError, canonical, job_from_strategy


def _s(model: str = "gpt-tiny", pp: int = 1, sched: str | None = None, v: int = 1, dp: int = 1, zero: int = 0,
       shard: int = 0, tp: int = 1, sp: bool = False, cp: int = 1, style: str = "allgather", ep: int = 1,
       recompute: str | None = None, m: int = 4, mbs: int = 1, seq: int = 32, dtype: str = "bf16",
       **top: Any) -> dict[str, Any]:
    """A strategy in the importers' canonical form (tests check it is)."""
    d: list[dict[str, Any]] = []
    if pp > 1:
        d += [{"op": "pipeline", "degree": pp, **({"stages_per_rank": v} if v > 1 else {})},
              {"op": "schedule", "name": sched or "1f1b"}]
    if dp > 1 or zero:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero, **({"shard_degree": shard} if shard else {})})
    if tp > 1:
        d.append({"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp})
    if cp > 1:
        d.append({"op": "context_parallel", "degree": cp, "style": style})
    if ep > 1:
        d.append({"op": "expert_parallel", "degree": ep})
    if recompute:
        d.append({"op": "recompute", "mode": recompute})
    return {"model": model, "cluster": f"cpu:{pp * dp * tp * cp}", "global_batch": dp * m * mbs, "seq_len": seq,
            "microbatches": m, "dtype": dtype, "directives": d, **top}


CASES: dict[str, dict[str, Any]] = {
    "single": _s(m=1),
    "accumulate-m4": _s(m=4, mbs=2),
    "gpipe-pp2": _s(pp=2, sched="gpipe"),
    "1f1b-pp4-m8": _s(pp=4, m=8, mbs=2),
    "interleaved-pp2-v2": _s(pp=2, sched="interleaved_1f1b", v=2),
    "interleaved-pp2-v4-dp2-z1": _s(pp=2, sched="interleaved_1f1b", v=4, m=4, dp=2, zero=1),
    "zb1p-pp2": _s(pp=2, sched="zb1p"),
    "zbv-pp2": _s(pp=2, sched="zbv", v=2),
    "dualpipev-pp2": _s(pp=2, sched="dualpipev", v=2),
    "dualpipe-pp2": _s(pp=2, sched="dualpipe"),
    "dp2-z0": _s(dp=2, m=2),
    "dp2-z1": _s(dp=2, zero=1),
    "dp2-z2": _s(dp=2, zero=2),
    "dp4-z3": _s(dp=4, zero=3, m=2),
    "pp2-dp2-z0": _s(pp=2, dp=2),
    "pp2-dp2-z2": _s(pp=2, dp=2, zero=2),
    "pp2-dp2-z3": _s(pp=2, dp=2, zero=3),
    "hsdp-dp4-shard2-z3": _s(dp=4, zero=3, shard=2, m=2),
    "hsdp-dp4-shard2-z1": _s(dp=4, zero=1, shard=2, m=2),
    "tp2-sp": _s(tp=2, sp=True),
    "tp2-nosp": _s(tp=2),
    "tp2-sp-dp2-z3": _s(tp=2, sp=True, dp=2, zero=3),
    "tp2-sp-pp2-1f1b": _s(tp=2, sp=True, pp=2),
    "cp2-z3": _s(cp=2, zero=3, seq=64),
    "cp2-ring-dp2-z2": _s(cp=2, style="ring", dp=2, zero=2, seq=64),
    "cp2-z0": _s(cp=2, seq=64),
    "recompute-full-pp2": _s(pp=2, recompute="full"),
    "recompute-selective-dp2-z3": _s(dp=2, zero=3, recompute="selective"),
    "recompute-full-zb1p": _s(pp=2, sched="zb1p", recompute="full"),
    "moe-ep2-dp2-z3": _s("moe-tiny", dp=2, zero=3, ep=2, m=2),
    "moe-ep2-dp2-z0": _s("moe-tiny", dp=2, ep=2, m=2),
    "moe-ep2-pp2-dp2-z1": _s("moe-tiny", pp=2, dp=2, zero=1, ep=2),
    "moe-ep2-pp2-dp2-z2-recompute": _s("moe-tiny", pp=2, dp=2, zero=2, ep=2, recompute="selective"),
    "moe-ep2-combined-pp2-v2-dp2-z3": _s("moe-tiny", pp=2, sched="combined_1f1b", v=2, dp=2, zero=3, ep=2),
    "fp32-seed-name-stack": _s(pp=2, dp=2, zero=3, dtype="fp32", seed=7, name="mine",
                               stack={"preset": "torchtitan-compile"}),
    "fp16": _s(dp=2, zero=1, dtype="fp16"),
}

# what each target refuses, and the feature its one-line error names
REFUSED = {
    "torchtitan": {"dualpipe-pp2": "schedule dualpipe", "dp2-z1": "zero 1", "interleaved-pp2-v4-dp2-z1": "zero 1",
                   "hsdp-dp4-shard2-z1": "zero 1", "moe-ep2-pp2-dp2-z1": "zero 1", "fp16": "dtype fp16",
                   "pp2-dp2-z0": "zero 0 (DDP)", "cp2-z0": "zero 0 with context_parallel",
                   "tp2-nosp": "sequence_parallel", "moe-ep2-dp2-z0": "zero 0 (DDP)",
                   "moe-ep2-combined-pp2-v2-dp2-z3": "schedule combined_1f1b"},
    "megatron": {"gpipe-pp2": "schedule gpipe", "zb1p-pp2": "schedule zb1p", "zbv-pp2": "schedule zbv",
                 "dualpipev-pp2": "schedule dualpipev", "dualpipe-pp2": "schedule dualpipe",
                 "recompute-full-zb1p": "schedule zb1p", "hsdp-dp4-shard2-z3": "shard_degree 2 with zero 3"},
}
TARGETS = {"torchtitan": torchtitan, "megatron": megatron}


def _import(target: str, text: str) -> dict:
    if target == "torchtitan":
        return torchtitan.parse(text, "job.toml")[0]
    return megatron.parse(text, "args.txt")[0]


def _hash(strategy: dict) -> str:
    from piper_sim.compiler import compile_strategy

    return compile_strategy(strategy).plan.content_hash()


def test_cases_are_canonical_and_each_target_round_trips_at_least_20():
    for name, s in CASES.items():
        assert canonical(s) == s, name
    for target, refused in REFUSED.items():
        assert set(refused) <= set(CASES)
        assert len(CASES) - len(refused) >= 20, target


@pytest.mark.parametrize("target,name", [pytest.param(t, n, id=f"{t}-{n}") for t in TARGETS for n in CASES
                                         if n not in REFUSED[t]])
def test_round_trip_same_plan_hash(target, name):
    """53 round trips (25 torchtitan, 28 Megatron) in about 24 s on 2 cores, 12-16 s of it the first compile."""
    s = CASES[name]
    text = TARGETS[target].export(job_from_strategy(s), "test")
    back = _import(target, text)
    assert back == s, f"{target} {name}: {json.dumps(back)}"
    assert _hash(back) == _hash(s)


@pytest.mark.parametrize("target,name", [(t, n) for t, r in REFUSED.items() for n in r])
def test_refused_with_the_feature_named(target, name):
    with pytest.raises(InteropError) as e:
        TARGETS[target].export(job_from_strategy(CASES[name]), "test")
    msg = str(e.value)
    assert "\n" not in msg and REFUSED[target][name] in msg, msg


def test_microbatches_is_a_count_trainer_micro_batch_a_size():
    # 4 DP ranks x 8 micro-batches (count) x 3 sequences (size) = 96 sequences per step
    s = _s(pp=2, dp=4, zero=3, m=8, mbs=3)
    assert s["global_batch"] == 96
    import tomllib

    tt = tomllib.loads(torchtitan.export(job_from_strategy(s)))
    assert tt["parallelism"]["pipeline_parallel_microbatch_size"] == 3  # a size
    assert tt["training"]["local_batch_size"] == 24  # per DP rank per step: 8 x 3
    assert tt["training"]["global_batch_size"] == 96
    args = megatron.tokens(megatron.export(job_from_strategy(s)))
    assert args["--micro-batch-size"] == ["3"] and args["--global-batch-size"] == ["96"]
    # without a pipeline torchtitan's local batch is the micro-batch; the count is gradient accumulation
    s1 = _s(dp=2, zero=3, m=4, mbs=3)
    tt1 = tomllib.loads(torchtitan.export(job_from_strategy(s1)))
    assert tt1["training"]["local_batch_size"] == 3 and tt1["training"]["global_batch_size"] == 24
    assert _import("torchtitan", torchtitan.export(job_from_strategy(s1)))["microbatches"] == 4


def test_import_a_users_torchtitan_job_without_the_comment():
    text = """
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 8
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 1
[activation_checkpoint]
mode = "full"
[compile]
enable = true
"""
    s, _notes = torchtitan.parse(text, "job.toml", cluster="h100:8x8")
    assert s["model"] == "llama3-8b" and s["microbatches"] == 8 and s["global_batch"] == 32
    d = {x["op"]: x for x in s["directives"]}
    assert d["data_parallel"] == {"op": "data_parallel", "degree": 4, "zero": 2}  # "default" with PP: no reshard
    assert d["pipeline"]["stages_per_rank"] == 2 and d["tensor_parallel"]["sequence_parallel"] is True
    assert s["stack"]["preset"] == "torchtitan-compile"
    with pytest.raises(InteropError, match="selective_ac_option"):  # torchtitan's default AC
        torchtitan.parse(text.replace('mode = "full"', ""), "job.toml", cluster="h100:8x8")
    with pytest.raises(InteropError, match="float8"):
        torchtitan.parse(text.replace('flavor = "8B"', 'flavor = "8B"\nconverters = ["quantize.linear.float8"]'),
                         "job.toml", cluster="h100:8x8")


def test_import_a_users_megatron_args_writes_the_model_when_not_in_the_zoo(tmp_path):
    text = ("torchrun pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\\n"
            "  --num-layers 8 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 \\\n"
            "  --max-position-embeddings 128 --vocab-size 512 --swiglu --normalization RMSNorm "
            "--untie-embeddings-and-output-weights --position-embedding-type rope --disable-bias-linear "
            "--hidden-dropout 0.0 --attention-dropout 0.0 --micro-batch-size 2 --global-batch-size 16 --bf16 "
            "--use-distributed-optimizer --lr 3e-4 --recompute-activations\n")
    s, _notes, files = megatron.parse(text, "args.txt", cluster="cpu:8")
    assert s["model"] == "gpt-tiny" and not files  # the zoo's gpt-tiny has these shapes
    assert s["microbatches"] == 4  # 16 / (2 x DP 2)
    d = {x["op"]: x for x in s["directives"]}
    assert d["data_parallel"]["zero"] == 1 and d["recompute"]["mode"] == "selective"
    s2, _notes2, files2 = megatron.parse(text.replace("--hidden-size 64", "--hidden-size 128"), "args.txt",
                                        cluster="cpu:8", model_file=str(tmp_path / "m.json"))
    assert list(files2) == [str(tmp_path / "m.json")] and s2["model"] == str(tmp_path / "m.json")
    (tmp_path / "m.json").write_text(files2[str(tmp_path / "m.json")])
    from piper_sim.sources import resolve_model

    assert resolve_model(s2["model"]).hidden == 128
    with pytest.raises(InteropError, match="--cluster"):
        megatron.parse(text, "args.txt")
    with pytest.raises(InteropError, match="some layers only"):
        megatron.parse(text.replace("--recompute-activations", "--recompute-granularity full --recompute-method "
                                    "block --recompute-num-layers 1"), "args.txt", cluster="cpu:8")


def test_zoo_models_export_megatron_shapes_that_import_to_the_same_model():
    from piper_sim.configs import BUILTIN_ZOO

    for name in BUILTIN_ZOO:
        s = _s(name, m=1)
        text = megatron.export(job_from_strategy(s))
        text = "\n".join(x for x in text.splitlines() if not x.startswith("# piper-sim:"))
        assert megatron.parse(text, "args.txt", cluster="cpu:1")[0]["model"] == name, name


def test_cli_export_import(tmp_path, capsys):
    from piper_sim.cli import main

    src = tmp_path / "s.json"
    src.write_text(json.dumps(CASES["tp2-sp-pp2-1f1b"]))
    job, args = tmp_path / "job.toml", tmp_path / "args.txt"
    assert main(["export", str(src), "--torchtitan", str(job), "--megatron", str(args)]) == 0
    for f in (job, args):
        out = tmp_path / (f.stem + ".strategy.json")
        assert main(["import", str(f), "-o", str(out)]) == 0
        assert json.loads(out.read_text()) == CASES["tp2-sp-pp2-1f1b"]
    src.write_text(json.dumps(CASES["dp2-z1"]))
    assert main(["export", str(src), "--torchtitan", str(tmp_path / "no.toml")]) == 2
    err = capsys.readouterr().err
    assert "zero 1" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "no.toml").exists()
    src.write_text(json.dumps({**CASES["dp2-z1"], "directives": CASES["dp2-z1"]["directives"]
                               + [{"op": "recompute", "stages": [0]}]}))
    assert main(["export", str(src), "--megatron", str(tmp_path / "x.txt")]) == 2
    assert "field 'stages'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the trainers' own classes


def _torchtitan_config():
    """torchtitan's ConfigManager and ParallelDims without running ``torchtitan/__init__.py``,
    which imports its MoE kernels and so triton (absent on CPU-only machines)."""
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            pytest.skip("torchtitan not installed (pip install -e '.[interop]')")
        pkg = types.ModuleType("torchtitan")
        pkg.__spec__ = spec
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = pkg
    try:
        from torchtitan.config import manager
    except ImportError as e:
        pytest.skip(f"torchtitan's config does not import: {e}")
    if not hasattr(manager, "JobConfig"):
        pytest.skip("torchtitan >= 0.3 reads Python config registries, not TOML job files")
    from torchtitan.distributed.parallel_dims import ParallelDims

    return manager.ConfigManager, ParallelDims


TT_CASES = ("1f1b-pp4-m8", "interleaved-pp2-v2", "zbv-pp2", "dualpipev-pp2", "hsdp-dp4-shard2-z3",
            "tp2-sp-dp2-z3", "cp2-ring-dp2-z2", "moe-ep2-dp2-z3", "recompute-selective-dp2-z3", "dp2-z0",
            "fp32-seed-name-stack")


@pytest.mark.parametrize("name", TT_CASES)
def test_torchtitan_loads_the_exported_job(name, tmp_path):
    ConfigManager, ParallelDims = _torchtitan_config()
    s = CASES[name]
    job = job_from_strategy(s)
    path = tmp_path / "job.toml"
    path.write_text(torchtitan.export(job))
    c = ConfigManager().parse_args(["--job.config_file", str(path)])
    p, t = c.parallelism, c.training
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=job.world)
    assert dims.dp_replicate * dims.dp_shard == job.dp and (dims.tp, dims.pp, dims.cp) == (job.tp, job.pp, job.cp)
    assert t.global_batch_size == job.global_batch and t.seq_len == job.seq_len
    if job.pp > 1:
        assert t.local_batch_size == job.local_batch
        assert p.pipeline_parallel_microbatch_size == job.micro_batch_size  # a size
        assert t.local_batch_size // p.pipeline_parallel_microbatch_size == job.microbatches  # the count
        from torch.distributed.pipelining.schedules import get_schedule_class

        get_schedule_class(p.pipeline_parallel_schedule)  # a name torch knows
    else:
        assert t.global_batch_size // (t.local_batch_size * job.dp) == job.microbatches
    assert c.activation_checkpoint.mode == {None: "none", "full": "full", "selective": "selective"}[job.recompute]
    assert c.training.mixed_precision_param == {"bf16": "bfloat16", "fp32": "float32"}[job.dtype]


def test_torchtitan_rejects_a_field_it_does_not_have(tmp_path):
    ConfigManager, _ = _torchtitan_config()
    path = tmp_path / "job.toml"
    text = torchtitan.export(job_from_strategy(CASES["dp4-z3"]))
    path.write_text(text.replace("[parallelism]\n", "[parallelism]\nbogus_degree = 1\n"))
    with pytest.raises(ValueError, match="bogus_degree"):
        ConfigManager().parse_args(["--job.config_file", str(path)])


def test_torchtitan_field_names_exist_in_its_config_classes():
    """Every TOML key we write or read is a field of torchtitan's config dataclasses (0.2: JobConfig
    sections; 0.3: ParallelismConfig, TrainingConfig, CompileConfig... where the field survived)."""
    _torchtitan_config()
    from torchtitan.config import job_config

    sections = {f.name: f.type for f in dataclasses.fields(job_config.JobConfig)}
    for (key, _) in torchtitan.FIELDS.values():
        section, name = key.split(".")
        cls = sections[section]
        cls = getattr(job_config, cls) if isinstance(cls, str) else cls
        assert name in {f.name for f in dataclasses.fields(cls)}, key


MEG_CASES = ("1f1b-pp4-m8", "interleaved-pp2-v2", "interleaved-pp2-v4-dp2-z1", "tp2-sp-pp2-1f1b", "cp2-ring-dp2-z2",
             "moe-ep2-pp2-dp2-z1", "recompute-full-pp2", "recompute-selective-dp2-z3", "hsdp-dp4-shard2-z1",
             "fp16", "dp4-z3")


def _megatron():
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[interop]')")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.num_microbatches_calculator import (
            ConstantNumMicroBatchesCalculator,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig, ModelParallelConfig, DistributedDataParallelConfig, ConstantNumMicroBatchesCalculator


@pytest.mark.parametrize("name", MEG_CASES)
def test_megatron_core_builds_its_configs_from_the_exported_args(name):
    """As Megatron-LM's core_transformer_config_from_args: every flag whose name (dashes as
    underscores) is a field of TransformerConfig / DistributedDataParallelConfig sets it."""
    import torch

    TransformerConfig, _ModelParallelConfig, DDPConfig, Calculator = _megatron()
    s = CASES[name]
    job = job_from_strategy(s)
    args = megatron.tokens(megatron.export(job))

    def value(flag):
        vals = args[flag]
        if not vals:
            return True
        v = vals[0]
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v

    names = {f[2:].replace("-", "_"): value(f) for f in args}
    if "cp_comm_type" in names:
        names["cp_comm_type"] = {"allgather": "all_gather"}.get(names["cp_comm_type"], names["cp_comm_type"])
    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {k: v for k, v in names.items() if k in tc_fields}
    kw["gated_linear_unit"] = "swiglu" in names
    kw["layernorm_epsilon"] = names["norm_epsilon"]
    kw["add_bias_linear"] = "disable_bias_linear" not in names
    if "num_layers_per_virtual_pipeline_stage" in names:
        kw["virtual_pipeline_model_parallel_size"] = (names["num_layers"] // names["pipeline_model_parallel_size"]
                                                      // names["num_layers_per_virtual_pipeline_stage"])
    dtype = torch.bfloat16 if "bf16" in names else torch.float16 if "fp16" in names else torch.float32
    kw.update(params_dtype=dtype, pipeline_dtype=dtype)
    if "num_experts" in names:
        kw["num_moe_experts"] = names["num_experts"]
    tc = TransformerConfig(**kw)
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.context_parallel_size,
            tc.expert_model_parallel_size) == (job.tp, job.pp, job.cp, job.ep)
    assert tc.sequence_parallel == job.sp
    assert (tc.virtual_pipeline_model_parallel_size or 1) == job.stages_per_rank
    assert tc.overlap_moe_expert_parallel_comm == (job.schedule == "combined_1f1b")  # and its asserts held
    assert tc.recompute_granularity == job.recompute
    cfg = __import__("piper_sim.sources", fromlist=["resolve_model"]).resolve_model(job.model)
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.ffn_hidden_size) == \
        (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.ffn)
    ddp_fields = {f.name for f in dataclasses.fields(DDPConfig)}
    ddp = DDPConfig(**{k: v for k, v in names.items() if k in ddp_fields})
    zero = 1 if ddp.use_distributed_optimizer else 0
    if ddp.use_megatron_fsdp:
        zero = megatron.FSDP_STRATEGIES[ddp.data_parallel_sharding_strategy]
    assert zero == job.zero
    assert ddp.num_distributed_optimizer_instances == (job.dp // job.dp_shard if job.dp_shard else 1)
    # the micro-batch count Megatron computes from the sizes, on the world size the comment names
    calc = Calculator(global_batch_size=names["global_batch_size"], micro_batch_size=names["micro_batch_size"],
                      data_parallel_size=job.world // (job.tp * job.pp * job.cp), decrease_batch_size_if_needed=False,
                      rank=0)
    assert calc.get() == job.microbatches  # a count, from Megatron's sizes
