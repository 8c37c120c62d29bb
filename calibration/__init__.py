"""Calibration microbenchmarks behind ``piper-sim calibrate`` (`microbench`): they measure this
machine with torch (matmuls, memory, the zoo's segments, p2p and collectives in worker
processes); `costmodel.fit` fits the cost model's parameters to what they measure."""
