"""Re-simulate the committed CPU validation runs against their measured traces (no new runs).

    python benchmarks/replay_validation.py [--costmodel traces/calibration/cpu-2core.json]
    python benchmarks/replay_validation.py --spread [--costmodel ...]

`traces/validation/` holds the executor's measured Chrome traces of the validation suite
(`piper_sim.cli.validation.suite`, measured on the machine `cpu-2core.json` was calibrated on);
`traces/validation_spread/` those of the spread suite (`spread_suite`: strategies whose step
times differ by more than the machine's noise, the ranking check), with the calibration
measured back to back with them (`calibration.json`, the default cost model under --spread).
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
from piper_sim.cli.validation import kendall_tau, op_errors, slug, spread_suite, suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALIDATION = os.path.join(ROOT, "traces", "validation")
SPREAD = os.path.join(ROOT, "traces", "validation_spread")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spread", action="store_true",
                    help="replay the spread suite (traces/validation_spread/) instead of the validation suite")
    ap.add_argument("--costmodel", help="cost model to simulate with (default: traces/calibration/cpu-2core.json; "
                                        "with --spread, the calibration measured with it)")
    args = ap.parse_args()
    folder, strategies = (SPREAD, spread_suite()) if args.spread else (VALIDATION, suite())
    costmodel = args.costmodel or (os.path.join(SPREAD, "calibration.json") if args.spread
                                   else os.path.join(ROOT, "traces", "calibration", "cpu-2core.json"))
    with open(os.path.join(folder, "validation.json")) as f:
        measured = {r["name"]: r["measured_s"] for r in json.load(f)["rows"]}
    step_errs, ops, pred, meas = [], [], [], []
    print(f"{'strategy':26s} {'sim ms':>8s} {'meas ms':>8s} {'error':>7s} {'ops':>4s} {'op |err| med':>12s}")
    for s in strategies:
        sim = simulate(compile(s), costmodel)
        _, comp = op_errors(sim.events, read_chrome_trace(os.path.join(folder, f"{slug(s['name'])}.measured.json")))
        m = measured[s["name"]]
        err = 100 * (sim.step_time_s - m) / m
        step_errs.append(abs(err))
        ops += comp
        pred.append(sim.step_time_s)
        meas.append(m)
        med = statistics.median(abs(e) for e in comp) if comp else float("nan")
        print(f"{s['name']:26s} {sim.step_time_s * 1e3:8.1f} {m * 1e3:8.1f} {err:+6.1f}% {len(comp):4d} {med:11.1f}%")
    print(f"median |step-time error| {statistics.median(step_errs):.1f}%, compute-op |error| median "
          f"{statistics.median(abs(e) for e in ops):.1f}% over {len(ops)} ops, Kendall tau {kendall_tau(pred, meas):.2f}")


if __name__ == "__main__":
    main()
