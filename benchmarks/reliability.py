"""Reliability report: the hostile-user corpora, rerun, one table.

    python benchmarks/reliability.py            # tampered plans, bad inputs, faults (~4-10 min on 2 cores)
    python benchmarks/reliability.py --quick    # tampered plans and bad inputs only (~1 min)

Corpora:

- tampered plans: every mutation of `tests/test_plan_origin.py` (drop, duplicate, swap, move,
  resize, regroup, re-kind, self-dependency, NaN/negative costs, meta edits, 1,000 copies) of
  PP, split-backward, DP ZeRO 0-3, TP+SP, CP and EP plans; a mutation that changes what runs
  must be refused, one that changes cost estimates only accepted (`piper_sim.validate.check_plan_file`,
  the check `simulate`, `run` and each worker make);
- bad inputs: CLI options, model files, HF configs and ``py:`` models that must each give one
  line on stderr and exit 2, with no traceback and no file left behind;
- faults (not with --quick): PIPER_FAULT raise / hang / kill on each rank of 2- and 3-rank
  plans under ``piper-sim run``; the summary line must name the injected rank.

Prints per corpus: cases, as expected, seconds; then every case that was not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
ENV = {**os.environ, "PYTHONPATH": ROOT}
CLI = [sys.executable, "-m", "piper_sim.cli"]


def tampered_plans() -> tuple[int, list[str]]:
    from test_plan_origin import FAMILIES, _mutations

    from piper_sim.api import compile
    from piper_sim.validate import PlanValidationError, check_plan_file

    rng, total, wrong = random.Random(0), 0, []
    for family, strategy in FAMILIES.items():
        for what, accepted, plan in _mutations(compile(strategy), rng, per_kind=2):
            total += 1
            try:
                check_plan_file(plan)
                got = True
            except PlanValidationError:
                got = False
            if got != accepted:
                wrong.append(f"{family}: {what}: {'accepted' if got else 'refused'}")
    return total, wrong


def _bad_input_cases(d: str) -> dict[str, list[str]]:
    """name -> command line; each must exit 2 with one line."""
    def write(name: str, text: str | bytes) -> str:
        path = os.path.join(d, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        return path

    tiny = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 2,
            "directives": [{"op": "pipeline", "degree": 2}]}
    plan = os.path.join(d, "plan.json")
    subprocess.run([*CLI, "compile", write("tiny.json", json.dumps(tiny)), "-o", plan], env=ENV, check=True,
                   capture_output=True)
    hf = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}

    def hf_case(name: str, **edit) -> list[str]:
        cfg = write(f"{name}/config.json", json.dumps({**hf, **edit}))
        return [*CLI, "compile", write(f"{name}.s.json", json.dumps({**tiny, "model": f"hf:{cfg}"})),
                "-o", os.path.join(d, f"{name}.plan.json")]

    def py_case(name: str, body: str) -> list[str]:
        src = write(f"{name}.py", body)
        return [*CLI, "compile", write(f"{name}.s.json", json.dumps({**tiny, "model": f"py:{src}:make"})),
                "-o", os.path.join(d, f"{name}.plan.json")]

    os.makedirs(os.path.join(d, "adir"), exist_ok=True)
    return {
        "run --clip-grad-norm -1": [*CLI, "run", plan, "--clip-grad-norm", "-1"],
        "run --clip-grad-norm nan": [*CLI, "run", plan, "--clip-grad-norm", "nan"],
        "run --trace DIR": [*CLI, "run", plan, "--trace", os.path.join(d, "adir")],
        "run --save FILE": [*CLI, "run", plan, "--save", plan],
        "run --trace no/such/dir": [*CLI, "run", plan, "--trace", os.path.join(d, "no/such/dir/t.json")],
        "explore --cp 0": [*CLI, "explore", "--model", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4",
                           "--seq-len", "16", "--cp", "0"],
        "explore --tp 3,x": [*CLI, "explore", "--model", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4",
                             "--seq-len", "16", "--tp", "3,x"],
        "explore cpu:1000000": [*CLI, "explore", "--model", "gpt-tiny", "--cluster", "cpu:1000000",
                                "--global-batch", "4", "--seq-len", "16"],
        "hf hidden_size 2**40": hf_case("hf-wide", hidden_size=2 ** 40),
        "hf num_hidden_layers 4.7": hf_case("hf-float", num_hidden_layers=4.7),
        "hf num_hidden_layers '4'": hf_case("hf-str", num_hidden_layers="4"),
        "hf num_attention_heads true": hf_case("hf-bool", num_attention_heads=True),
        "hf num_hidden_layers 1e9": hf_case("hf-deep", num_hidden_layers=10 ** 9),
        "hf rope_theta 'abc'": hf_case("hf-theta", rope_theta="abc"),
        "binary model file": [*CLI, "compile", write("bin.s.json", json.dumps(
            {**tiny, "model": write("bin.json", b"\x00\x82\xff" * 10)})), "-o", os.path.join(d, "bin.plan.json")],
        "folder as model file": [*CLI, "compile", write("dir.s.json", json.dumps(
            {**tiny, "model": os.path.join(d, "adir")})), "-o", os.path.join(d, "dir.plan.json")],
        "py: sys.exit at import": py_case("exit_import", "import sys\nsys.exit(3)\n"),
        "py: sys.exit in factory": py_case("exit_factory", "import sys\ndef make():\n    sys.exit(0)\n"),
        "py: KeyboardInterrupt in factory": py_case("ki", "def make():\n    raise KeyboardInterrupt\n"),
        "plan with 1e9 ranks": [*CLI, "simulate", _huge_plan(plan, d)],
    }


def _huge_plan(plan: str, d: str) -> str:
    from piper_sim.plan import Plan, _hash

    body = Plan.load(plan).to_json()
    body["layout"]["dp"] = 10 ** 9
    body["hash"] = _hash({k: body[k] for k in ("kernels", "layout", "meta", "classes") if k in body})
    path = os.path.join(d, "huge.json")
    with open(path, "w") as f:
        json.dump(body, f)
    return path


def bad_inputs() -> tuple[int, list[str]]:
    wrong = []
    with tempfile.TemporaryDirectory() as d:
        cases = _bad_input_cases(d)
        for name, cmd in cases.items():
            before = set(os.listdir(d))
            r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120, cwd=d)
            lines = r.stderr.strip().splitlines()
            left = set(os.listdir(d)) - before
            if r.returncode != 2 or len(lines) != 1 or "Traceback" in r.stderr or left:
                wrong.append(f"{name}: exit {r.returncode}, {len(lines)} stderr line(s), left {sorted(left)}: "
                             f"{(lines or [''])[-1][:160]}")
    return len(cases), wrong


def faults() -> tuple[int, list[str]]:
    """raise / hang / kill at each rank of a PP2, PP3 and PP2xDP2 plan: the summary names it."""
    strategies = {"pp2": (2, {"op": "pipeline", "degree": 2}), "pp3": (3, {"op": "pipeline", "degree": 3})}
    total, wrong = 0, []
    with tempfile.TemporaryDirectory() as d:
        for name, (world, pipe) in strategies.items():
            s = {"model": "gpt-tiny", "cluster": f"cpu:{world}", "global_batch": 4, "seq_len": 16,
                 "microbatches": 4, "dtype": "fp32", "directives": [pipe]}
            src, plan = os.path.join(d, f"{name}.s.json"), os.path.join(d, f"{name}.json")
            with open(src, "w") as f:
                json.dump(s, f)
            subprocess.run([*CLI, "compile", src, "-o", plan], env=ENV, check=True, capture_output=True)
            for rank in range(world):
                for mode in ("raise", "hang", "kill"):
                    total += 1
                    env = {**ENV, "PIPER_FAULT": f"{rank}:1:F.s{rank}.mb1:{mode}"}
                    r = subprocess.run([*CLI, "run", plan, "--steps", "2", "--timeout", "10"], env=env,
                                       capture_output=True, text=True, timeout=180)
                    summary = [line for line in r.stderr.splitlines() if line.startswith("piper-sim run: rank")]
                    if r.returncode == 0 or not summary or not summary[-1].startswith(f"piper-sim run: rank {rank} "):
                        wrong.append(f"{name} {mode} on rank {rank}: exit {r.returncode}, "
                                     f"summary {summary[-1][:120] if summary else None!r}")
    return total, wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tampered plans and bad inputs only")
    args = p.parse_args()
    corpora = {"tampered plans": tampered_plans, "bad inputs (exit 2, one line)": bad_inputs}
    if not args.quick:
        corpora["faults (summary names the rank)"] = faults
    print(f"{'corpus':<36} {'cases':>6} {'as expected':>12} {'seconds':>8}")
    failures = []
    for name, run in corpora.items():
        t = time.perf_counter()
        total, wrong = run()
        print(f"{name:<36} {total:>6} {total - len(wrong):>12} {time.perf_counter() - t:>8.1f}", flush=True)
        failures += [f"{name}: {w}" for w in wrong]
    for line in failures:
        print("  not as expected:", line)


if __name__ == "__main__":
    main()
