"""Kernel sweeps for a calibration file (``costmodel/calibration.py`` format): GEMMs by
(m, n, k) -> "efficiency_table" against the best measured FLOP/s ("peak_flops"), and
scaled-dot-product (flash) attention by sequence length and head dim, forward and
backward, kept under "meta.attention" with the same efficiency convention; "hbm_bw" from a
large copy, "launch_s" from a tiny kernel.

    python benchmarks/gpu_sweep.py -o cal.json [--device cuda|cpu] [--dtype bf16|fp32] [--tiny]

``--tiny`` (the CPU dry run of gpu_check.sh) uses a few small shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from costmodel.calibration import save_calibration  # noqa: E402
from costmodel.dtypes import torch_dtype  # noqa: E402

SWEEP_DTYPES = ("bf16", "fp32")


def timeit(fn, device: torch.device, reps: int) -> float:
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def gemm_sweep(device, dtype, sizes, reps) -> list[tuple[int, int, int, float]]:
    rows = []
    for m in sizes:
        for n in sizes:
            for k in sizes:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                t = timeit(lambda: a @ b, device, reps)
                rows.append((m, n, k, 2 * m * n * k / t))
    return rows


def attention_sweep(device, dtype, seqs, head_dims, reps, batch_heads=(4, 8)) -> list[dict]:
    rows = []
    b, h = batch_heads
    for s in seqs:
        for d in head_dims:
            q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            t_f = timeit(fwd, device, reps)
            out = fwd()
            g = torch.randn_like(out)
            t_b = timeit(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), device, reps)
            flops = 4 * b * h * s * s * d / 2  # causal: half of QK^T and PV
            rows.append({"seq": s, "head_dim": d, "causal": True, "batch": b, "heads": h,
                         "fwd_s": t_f, "bwd_s": t_b, "fwd_flops": flops / t_f, "bwd_flops": 2.5 * flops / t_b})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=SWEEP_DTYPES, default="bf16")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch_dtype(args.dtype)
    if args.tiny:
        sizes, seqs, dims, reps = [64, 128], [64, 128], [32], 2
    else:
        sizes, seqs, dims, reps = [256, 1024, 2048, 4096, 8192], [512, 1024, 2048, 4096, 8192], [64, 128], 10
    t0 = time.perf_counter()
    gemms = gemm_sweep(device, dtype, sizes, reps)
    peak = max(r[3] for r in gemms)
    attn = attention_sweep(device, dtype, seqs, dims, reps)
    n = 1 << (20 if args.tiny else 28)
    x = torch.empty(n, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    hbm = 2 * n / timeit(lambda: y.copy_(x), device, reps)
    tiny = torch.zeros(1, device=device)
    launch = timeit(lambda: tiny.add_(1), device, 50)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    cal = {"kind": "calibration", "device": name, "dtype": args.dtype, "peak_flops": peak,
           "efficiency_table": [[m, n_, k, f / peak] for m, n_, k, f in gemms], "launch_s": launch, "hbm_bw": hbm,
           "meta": {"tool": "benchmarks/gpu_sweep.py", "torch": torch.__version__, "host": platform.node(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sweep_s": time.perf_counter() - t0,
                    "attention": [{**r, "fwd_eff": r["fwd_flops"] / peak, "bwd_eff": r["bwd_flops"] / peak}
                                  for r in attn]}}
    save_calibration(cal, args.output)
    print(f"{name}: {len(gemms)} GEMMs (peak {peak / 1e12:.2f} TFLOP/s), {len(attn)} attention shapes, "
          f"copy {hbm / 1e9:.1f} GB/s, launch {launch * 1e6:.1f} us -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
