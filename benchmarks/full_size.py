"""The full-size strategies the benchmarks compile and simulate (the issues' targets)."""

STRATEGIES = {
    "deepseek-v3 h800:256x8 PP16 dualpipe EP64 DP128 ZeRO-1": {
        "model": "deepseek-v3", "cluster": "h800:256x8", "global_batch": 4096, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 16}, {"op": "schedule", "name": "dualpipe"},
                       {"op": "data_parallel", "degree": 128, "zero": 1}, {"op": "expert_parallel", "degree": 64}]},
    "llama3-405b h100:1024x8 PP16 1f1b DP512 ZeRO-3": {
        "model": "llama3-405b", "cluster": "h100:1024x8", "global_batch": 16384, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 16}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 512, "zero": 3}]},
    "llama3-70b h100:128x8 PP8 1f1b DP128 ZeRO-1": {
        "model": "llama3-70b", "cluster": "h100:128x8", "global_batch": 4096, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 8}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 128, "zero": 1}]},
}
