"""piper-sim executor: replay a compiled Plan with torch.distributed, one process per rank.

``piper-sim run PLAN.json`` starts the ranks through torchrun; ``torchrun ... -m executor
PLAN.json`` runs the workers directly. See `executor.runtime` for instruction semantics.
"""
