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
    # issue 12: 16,384 GPUs, Llama 3's 16M-token batch (2,048 x 8,192), 16 micro-batches per replica
    "llama3-405b h100:2048x8 TP8 PP16 1f1b DP128 ZeRO-1": {
        "model": "llama3-405b", "cluster": "h100:2048x8", "global_batch": 2048, "seq_len": 8192,
        "microbatches": 16,
        "directives": [{"op": "pipeline", "degree": 16}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 128, "zero": 1},
                       {"op": "tensor_parallel", "degree": 8, "sequence_parallel": True}]},
    "llama3-70b h100:128x8 PP8 1f1b DP128 ZeRO-1": {
        "model": "llama3-70b", "cluster": "h100:128x8", "global_batch": 4096, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 8}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 128, "zero": 1}]},
}
