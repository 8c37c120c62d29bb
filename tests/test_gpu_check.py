"""benchmarks/gpu_check.sh in its CPU dry run (tiny sizes): the sweep writes a valid
calibration file, the bf16 and fp32 single-device plans run with --check, and validate
reports simulated vs measured per op. On a CUDA machine the same script runs full size."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gc"
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=480, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    from costmodel.calibration import load_calibration

    cal = load_calibration(str(out / "calibration.json"))
    assert cal["peak_flops"] > 0 and len(cal["efficiency_table"]) == 8 and cal["meta"]["attention"]
    for dt, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        rows = [json.loads(x) for x in (out / f"run_{dt}.jsonl").read_text().splitlines() if x.startswith("{")]
        assert rows[-1]["max_rel_param_diff"] <= tol, (dt, rows[-1])
    summary = json.loads((out / "validation" / "validation.json").read_text())
    assert "dry run" in (out / "report.txt").read_text() and summary
