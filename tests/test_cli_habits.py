"""Command-line habits (issue 29): -v/-q/--no-progress before or after the subcommand with one
meaning everywhere, user-facing --help, whole-step progress bars drawn only on a terminal,
torch's and Hugging Face's dtype spellings, rope_scaling, and "did you mean" for typos."""

from __future__ import annotations

import argparse
import json
import logging
import os

import pytest

from costmodel.names import unknown_name, unknown_names
from piper_sim.cli import build_parser, main
from piper_sim.cli.common import add_to_subcommands, merge_common, progress_enabled
from piper_sim.progress import Counter, progress_bar
from piper_sim.sources import resolve_model
from piper_sim.strategy import parse_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# meta-llama/Llama-3.1-8B config.json, the published values
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
    "use_cache": True, "vocab_size": 128256,
}
EXPLORE = ["--model", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16"]


def parse(argv: list[str]) -> argparse.Namespace:
    return merge_common(build_parser().parse_args(argv))


# ------------------------------------------------------------------ flags anywhere, one meaning


def test_verbose_and_quiet_after_the_subcommand_add_to_the_global_ones():
    assert parse(["explore", *EXPLORE, "-q"]).log_quiet == 1
    assert parse(["-q", "explore", *EXPLORE, "-q"]).log_quiet == 2
    args = parse(["-v", "run", "plan.json", "-v"])
    assert (args.verbose, args.log_quiet) == (2, 0)
    assert not hasattr(args, "sub_verbose") and not hasattr(args, "sub_quiet")
    assert parse(["show", "plan.json"]).verbose == 0  # absent after the subcommand: the global default stays


def test_every_subcommand_takes_the_common_options():
    p = build_parser()
    subparsers = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert len(subparsers.choices) >= 12
    for name, sub in subparsers.choices.items():
        assert {"-v", "--verbose", "-q", "--quiet", "--no-progress"} <= set(sub._option_string_actions), name
    # a subcommand another module registers later gets them from the same helper
    extra = subparsers.add_parser("extra")
    add_to_subcommands(subparsers)
    args = merge_common(p.parse_args(["extra", "-qq", "--no-progress"]))
    assert (args.log_quiet, args.no_progress) == (2, True)


@pytest.mark.parametrize("argv,quiet,progress", [
    (["explore", *EXPLORE, "--quiet"], 1, False),          # explore's old spelling: now -q everywhere
    (["explore", *EXPLORE, "--no-progress"], 0, False),    # bars only
    (["calibrate", "-o", "c.json", "--no-progress"], 0, False),  # calibrate's old spelling, unchanged
    (["calibrate", "-o", "c.json", "-q"], 1, False),
    (["demo", "--quiet"], 1, False),
    (["--no-progress", "demo"], 0, False),
    (["demo"], 0, True),
])
def test_quiet_means_less_logging_and_no_bars_no_progress_means_no_bars(argv, quiet, progress):
    args = parse(argv)
    assert (args.log_quiet, progress_enabled(args)) == (quiet, progress)


def test_run_v_is_the_common_verbose_and_still_shows_torchruns_report():
    from piper_sim.cli.run import launch_env

    args = parse(["run", "plan.json", "-v"])
    assert args.verbose == 1 and launch_env(args.verbose)["PIPER_VERBOSE"] == "1"
    assert "PIPER_VERBOSE" not in launch_env(parse(["run", "plan.json"]).verbose)


def test_quiet_after_the_subcommand_sets_the_log_level(capsys):
    loggers = [logging.getLogger(n) for n in ("piper_sim", "costmodel", "executor")]
    saved = [(lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    try:
        assert main(["models", "-qq"]) == 0
        assert logging.getLogger("piper_sim").level == logging.ERROR
        assert main(["models", "--json", "gpt-tiny", "-v"]) == 0
        assert logging.getLogger("piper_sim").level == logging.DEBUG
    finally:
        for lg, (level, handlers, propagate) in zip(loggers, saved):
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
    assert '"name": "gpt-tiny"' in capsys.readouterr().out


# ------------------------------------------------------------------ help for users


DEVELOPER_MARKERS = ("``", "add_run_parser", "add_calibrate_parser", "(subparsers)", "Register it",
                     "imports no torch", "CalibrationError", "calibration.microbench")


def test_every_subcommand_help_is_written_for_users():
    p = build_parser()
    subparsers = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        text = sub.format_help()
        assert sub.description, f"{name}: no description"
        assert not [m for m in DEVELOPER_MARKERS if m in text], f"{name} --help:\n{text}"
    for name in ("run", "calibrate", "explore", "simulate", "demo", "compile"):
        assert "example" in subparsers.choices[name].description, name
    assert "piper-sim run plan.json" in subparsers.choices["run"].format_help()


# ------------------------------------------------------------------ progress


def test_no_bar_when_stderr_is_not_a_terminal(capsys):
    from piper_sim.cli.explore import progress_printer

    bar = progress_bar(10, "x", "step")
    assert bar.disable  # pytest's captured stderr is no terminal
    bar.update(3)
    bar.close()
    show = progress_printer(True)
    for i in range(11):
        show("screen", i, 10)
    tick = Counter(56, "calibrate")
    tick("mm", 1 / 3)
    tick.close()
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_whole_step_counts(tty_stderr):
    tty_stderr.attach()
    tick = Counter(56, "calibrate")
    assert not tick.bar.disable
    for _ in range(4):
        tick("matmul", 1 / 3)  # benchmark rounds: fractions of a step
    assert tick.bar.n == 1 and isinstance(tick.bar.n, int)
    for _ in range(3):
        tick("matmul", 1 / 3)  # 7 thirds: still 2 whole steps
    assert tick.bar.n == 2
    tick.close()
    text = tty_stderr.read()
    assert "2/56" in text and "1.33" not in text and "2.33" not in text


def test_disabled_counter_never_draws(tty_stderr):
    import sys

    tty_stderr.attach()
    tick = Counter(5, "calibrate", enabled=False)
    tick("x", 2.0)
    tick.close()
    assert tick.bar.disable
    sys.stderr.write("end\n")
    assert tty_stderr.read().strip() == "end"


# ------------------------------------------------------------------ dtypes and rope_scaling


@pytest.mark.parametrize("spelling,name", [
    ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("bf16", "bf16"), ("BF16", "bf16"),
    ("float16", "fp16"), ("half", "fp16"), ("fp16", "fp16"), ("float32", "fp32"), ("torch.float32", "fp32"),
    ("fp32", "fp32"),
])
def test_strategy_dtype_accepts_torch_and_hf_spellings(spelling, name):
    s = parse_strategy({"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 2, "seq_len": 8, "dtype": spelling})
    assert s.dtype == name and s.to_json()["dtype"] == name


def test_bfloat16_compiles_the_plan_bf16_compiles():
    from piper_sim.api import compile

    base = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 2,
            "directives": [{"op": "pipeline", "degree": 2}]}
    assert compile({**base, "dtype": "bfloat16"}).content_hash() == compile({**base, "dtype": "bf16"}).content_hash()


def test_strategy_dtype_refused_by_name(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 2, "seq_len": 8,
                                "dtype": "float64"}))
    assert main(["expand", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'dtype'" in err and "bfloat16" in err and "'float64'" in err


def test_llama31_config_with_rope_scaling_and_torch_dtype():
    cfg = resolve_model(LLAMA_31_8B)
    assert cfg.param_count() == 8_030_261_248  # published 8.03B
    # rope_scaling changes no cost: the same config with and without it
    plain = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_scaling", "torch_dtype")}
    assert resolve_model(plain) == cfg
    # transformers >= 4.56 writes "dtype", transformers 5 "rope_parameters"; DeepSeek's yarn says "type"
    newer = {**plain, "dtype": "torch.bfloat16", "rope_parameters": {**LLAMA_31_8B["rope_scaling"], "rope_theta": 5e5}}
    assert resolve_model(newer) == cfg
    yarn = {**plain, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 4096}}
    assert resolve_model(yarn) == cfg


@pytest.mark.parametrize("change,needle", [
    ({"torch_dtype": "int8"}, "key 'torch_dtype' is 'int8'"),
    ({"dtype": "float32"}, "'dtype' and 'torch_dtype' disagree"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "key 'rope_scaling' has rope_type 'su'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": -8.0}}, "key 'rope_scaling.factor' must be a finite number"),
    ({"rope_scaling": "llama3"}, "key 'rope_scaling' must be a mapping"),
])
def test_hf_dtype_and_rope_scaling_refused_by_name(change, needle):
    with pytest.raises(ValueError, match=needle) as e:
        resolve_model({**LLAMA_31_8B, **change})
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ did you mean


def test_yaml_typo_says_did_you_mean(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nlayers: 2\nhiden: 64\nheads: 4\nffn: 128\nvocab: 100\n")
    assert main(["models", "--json", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"model file {path}: unknown key 'hiden'; did you mean 'hidden'? (keys: layers, " in err
    path.write_text("name: m\nlayers: 2\nhidden: 64\nheads: 4\nffn: 128\nvocab: 100\ndtype: bfloat16\n")
    assert resolve_model(str(path)).hidden == 64  # a model file's dtype: checked like an HF config's


@pytest.mark.parametrize("change,needle", [
    ({"microbatch": 2}, "unknown strategy field(s) microbatch; did you mean 'microbatches'?"),
    ({"directives": [{"op": "pipelin", "degree": 2}]}, "unknown op 'pipelin'; did you mean 'pipeline'?"),
    ({"directives": [{"op": "pipeline", "degre": 2}]}, "unknown field(s) degre; did you mean 'degree'?"),
    ({"directives": [{"op": "data_parallel", "degree": 2, "zer0": 1}]}, "did you mean 'zero'?"),
    ({"stack": "torchtitn"}, "unknown preset 'torchtitn'; did you mean 'torchtitan'?"),
    ({"stack": {"atention": "flash3"}}, "did you mean 'attention'?"),
])
def test_strategy_typos_say_did_you_mean(change, needle):
    from piper_sim.strategy import StrategyError

    with pytest.raises(StrategyError) as e:
        parse_strategy({"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 2, "seq_len": 8, **change})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_did_you_mean_messages():
    assert unknown_name("key", "hiden", ["hidden", "heads"]) == \
        "unknown key 'hiden'; did you mean 'hidden'? (known: hidden, heads)"
    assert unknown_name("key", "zzz", ["hidden"]) == "unknown key 'zzz' (known: hidden)"
    assert unknown_names("field", {"bucket", "zer0"}, ["zero", "bucket_mb"]) == \
        "unknown field(s) bucket, zer0; did you mean 'bucket_mb' for 'bucket', 'zero' for 'zer0'? " \
        "(allowed: zero, bucket_mb)"
    from costmodel.hardware import get_gpu
    from piper_sim.configs import get_config

    with pytest.raises(ValueError, match=r"unknown GPU 'H10'; did you mean 'h100'\?"):
        get_gpu("H10")
    with pytest.raises(ValueError, match=r"unknown model 'llama3-8'; did you mean 'llama3-8b'\?; choose one of"):
        get_config("llama3-8")


# ------------------------------------------------------------------ demo output


def test_demo_writes_into_the_cache_folder_unless_out_is_given():
    from piper_sim.cli.demo import default_out

    assert parse(["demo"]).out is None and parse(["demo", "--out", "here"]).out == "here"
    assert default_out() == os.path.join(os.environ["PIPER_SIM_CACHE_DIR"], "demo")  # tests/conftest.py sets it
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "piper-sim-demo/" in f.read().split()
