"""Re-simulate the committed CPU validation runs against their measured traces (no new runs).

    python benchmarks/replay_validation.py [--costmodel traces/calibration/cpu-2core.json]

`traces/validation/` holds the executor's measured Chrome traces of the validation suite
(`piper_sim.cli.validation.suite`, measured on the machine `cpu-2core.json` was calibrated on).
This compiles each strategy with the current code, simulates it with the calibration, and
prints the step-time error against the measured median and the per-op error of the compute
ops matched by op id — so a cost-model change can be judged on the same measurements,
free of this machine's noise. Ops cut differently now (ZeRO-3 per-unit pieces) match fewer ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from piper_sim.api import compile
from piper_sim.simulator import simulate
from piper_sim.trace import read_chrome_trace
from piper_sim.cli.validation import kendall_tau, op_errors, suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALIDATION = os.path.join(ROOT, "traces", "validation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costmodel", default=os.path.join(ROOT, "traces", "calibration", "cpu-2core.json"),
                    help="cost model to simulate with (default: the committed CPU calibration)")
    args = ap.parse_args()
    with open(os.path.join(VALIDATION, "validation.json")) as f:
        measured = {r["name"]: r["measured_s"] for r in json.load(f)["rows"]}
    step_errs, ops, pred, meas = [], [], [], []
    print(f"{'strategy':22s} {'sim ms':>8s} {'meas ms':>8s} {'error':>7s} {'ops':>4s} {'op |err| med':>12s}")
    for s in suite():
        slug = "".join(c if c.isalnum() else "_" for c in s["name"]).strip("_")
        sim = simulate(compile(s), args.costmodel)
        _, comp = op_errors(sim.events, read_chrome_trace(os.path.join(VALIDATION, f"{slug}.measured.json")))
        m = measured[s["name"]]
        err = 100 * (sim.step_time_s - m) / m
        step_errs.append(abs(err))
        ops += comp
        pred.append(sim.step_time_s)
        meas.append(m)
        med = statistics.median(abs(e) for e in comp) if comp else float("nan")
        print(f"{s['name']:22s} {sim.step_time_s * 1e3:8.1f} {m * 1e3:8.1f} {err:+6.1f}% {len(comp):4d} {med:11.1f}%")
    print(f"median |step-time error| {statistics.median(step_errs):.1f}%, compute-op |error| median "
          f"{statistics.median(abs(e) for e in ops):.1f}% over {len(ops)} ops, Kendall tau {kendall_tau(pred, meas):.2f}")


if __name__ == "__main__":
    main()
