"""One module per parallelism technique: its checks and its IR passes (`piper_sim.axes`
lists them, in the order they run)."""
