#!/usr/bin/env bash
# One GPU check (well under 8 minutes on one GPU):
#   1. kernel sweeps -> calibration file (GEMM table, SDPA/flash attention, copy bandwidth, launch)
#   2. single-GPU plans in bf16 and fp32, 3 steps each, with --check against the one-process reference
#   3. piper-sim validate: simulated vs measured per op with that calibration
# Usage: benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]   (default OUT_DIR traces/gpu_check)
# --dry-run, or no CUDA: the same steps on the CPU at tiny sizes (what the test runs).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT="${1:-traces/gpu_check}"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  [[ $DRY == 1 ]] || echo "gpu_check: no CUDA device: dry run on the CPU"
  DRY=1
fi
mkdir -p "$OUT"
START=$SECONDS
if [[ $DRY == 1 ]]; then
  DEVICE=cpu; CLUSTER=cpu:1; MODEL=gpt-tiny; SEQ=32; BATCH=4; MB=2; SWEEP="--tiny --dtype fp32"; STEPS=2
else
  DEVICE=cuda; CLUSTER=h200:1x1; MODEL=gpt-small; SEQ=1024; BATCH=16; MB=4; SWEEP="--dtype bf16"; STEPS=6
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" || true
fi
echo "== 1. kernel sweeps ($DEVICE)"
timeout 240 python benchmarks/gpu_sweep.py -o "$OUT/calibration.json" --device "$DEVICE" $SWEEP

echo "== 2. single-device plans with --check"
for DT in fp32 bf16; do
  cat > "$OUT/strategy_$DT.json" <<JSON
{"name": "single-device-$DT", "model": "$MODEL", "cluster": "$CLUSTER", "global_batch": $BATCH, "seq_len": $SEQ, "microbatches": $MB,
 "dtype": "$DT", "directives": []}
JSON
  python -m piper_sim compile "$OUT/strategy_$DT.json" -o "$OUT/plan_$DT.json"
  timeout 120 python -m piper_sim run "$OUT/plan_$DT.json" --steps 3 --check --json --device "$DEVICE" \
    | tee "$OUT/run_$DT.jsonl"
done

echo "== 3. simulated vs measured (piper-sim validate)"
timeout 200 python -m piper_sim validate "$OUT/strategy_fp32.json" "$OUT/strategy_bf16.json" \
  --costmodel "$OUT/calibration.json" --steps "$STEPS" --warmup 1 --out "$OUT/validation"

python - "$OUT" "$DRY" "$((SECONDS - START))" <<'PY'
import json, sys, os
out, dry, took = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
lines = [f"gpu_check {'(dry run on CPU)' if dry else ''}: {took} s"]
for dt in ("fp32", "bf16"):
    rows = [json.loads(l) for l in open(os.path.join(out, f"run_{dt}.jsonl")) if l.startswith("{")]
    chk = [r for r in rows if "max_rel_param_diff" in r]
    lines.append(f"{dt}: losses {[round(r['loss'], 4) for r in rows if 'loss' in r]} "
                 f"check max_rel_param_diff {chk[0]['max_rel_param_diff']:.2e}" if chk else f"{dt}: no check row")
lines.append(f"validation report: {os.path.join(out, 'validation')}")
open(os.path.join(out, "report.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
