"""PyTorch's own ways of running the same model and data, as peers for the executor:
``torch.distributed.pipelining`` schedules (gradient oracle, speed baseline), DDP (alone
and with ``ZeroRedundancyOptimizer``, torch's ZeRO-1) and FSDP2 (speed baselines). Same
weights (``build_units``/``build_model``), same micro-batches, same AdamW, so numbers and
gradients are directly comparable."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from costmodel.dtypes import torch_dtype
from executor.data import SyntheticData
from executor.stage import adamw_kwargs, make_optimizer, optimizer_impl
from piper_sim.configs import config_of
from piper_sim.models import build_model, build_units, lm_loss, run_units
from piper_sim.plan import Plan
from piper_sim.schedules import SCHEDULE_TABLE



class UnitsModule(nn.Module):
    """A pipeline stage as one module: tokens or hidden states in, hidden states or logits out."""

    def __init__(self, units, names: list[str]):
        super().__init__()
        self.units, self.names = units, names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_units(self.units, self.names, x)


class TorchPipeline:
    """A ``torch.distributed.pipelining`` schedule over the plan's stages on this rank
    (pipeline only: one data-parallel replica, stage ``s`` on rank ``s % pp`` as in torch's
    loop placement)."""

    SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # loop placement, built from stages alone

    def __init__(self, plan: Plan, rank: int, device: torch.device | str = "cpu", schedule: str | None = None):
        from torch.distributed import pipelining

        h = self.header = plan.header
        self.cfg = config_of(h)
        self.rank = rank
        self.pp, n = plan.layout.pp, h.num_stages
        self.stage_ids = [s for s in range(n) if s % self.pp == rank]
        dtype = torch_dtype(h.dtype)
        self.modules = {s: UnitsModule(build_units(self.cfg, h.stage_units[s], device=device, dtype=dtype,
                                                   seed=h.seed), h.stage_units[s])
                        for s in self.stage_ids}
        stages = [pipelining.PipelineStage(self.modules[s], s, n, torch.device(device)) for s in self.stage_ids]
        ours = schedule or h.schedule
        if ours not in self.SCHEDULES:
            raise ValueError(f"TorchPipeline runs {', '.join(self.SCHEDULES)}, not {ours!r}")
        name = "Schedule" + SCHEDULE_TABLE[ours].torch_name
        cls = getattr(pipelining, name)
        m = h.microbatches
        self.schedule = cls(stages if len(stages) > 1 or "Interleaved" in name else stages[0], n_microbatches=m,
                            loss_fn=lm_loss)
        self.params = [p for mod in self.modules.values() for p in mod.parameters()]
        self.optimizer = make_optimizer(self.params)
        self.data = SyntheticData(self.cfg.vocab, h.seq_len, h.global_batch, h.seed)
        self.is_first, self.is_last = 0 in self.stage_ids, n - 1 in self.stage_ids

    def step(self, step: int, optimizer: bool = True) -> None:
        tokens, targets = self.data.batch(step)
        args = (tokens,) if self.is_first else ()
        kwargs = {"target": targets, "losses": []} if self.is_last else {}
        self.schedule.step(*args, **kwargs)
        if optimizer:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def named_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for mod in self.modules.values() for n, p in mod.units.named_parameters()
                if p.grad is not None}


# torch's DistributedDataParallel default bucket_cap_mb, given explicitly so a comparison can
# give the executor the same buckets (`benchmarks/bench_executor.py`)
DDP_BUCKET_MB = 25


class TorchDDP:
    """The whole model under DistributedDataParallel (``DDP_BUCKET_MB`` buckets); gradients
    synced on the last micro-batch."""

    def __init__(self, plan: Plan, rank: int, device: torch.device | str = "cpu"):
        h = self.header = plan.header
        cfg = config_of(h)
        model = build_model(cfg, device=device, dtype=torch_dtype(h.dtype), seed=h.seed)
        self.model = self.wrap(model)
        self.optimizer = self.build_optimizer(list(model.parameters()))
        self.dp_rank, self.dp = rank, dist.get_world_size()
        self.data = SyntheticData(cfg.vocab, h.seq_len, h.global_batch, h.seed)

    @staticmethod
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, bucket_cap_mb=DDP_BUCKET_MB)

    @staticmethod
    def build_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return make_optimizer(params)

    def step(self, step: int) -> None:
        m = self.header.microbatches
        for mb in range(m):
            tokens, targets = self.data.microbatch(step, self.dp_rank, self.dp, m, mb)
            ctx = self.model.no_sync() if mb < m - 1 else _Null()
            with ctx:
                (lm_loss(self.model(tokens), targets) / m).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TorchZeRO1(TorchDDP):
    """DDP with torch's ZeRO-1: ``ZeroRedundancyOptimizer`` around the same AdamW; each rank
    steps the parameters of its partition and broadcasts them to the others."""

    @staticmethod
    def build_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                                       **adamw_kwargs(optimizer_impl(params)))


class TorchFSDP2(TorchDDP):
    """The whole model under FSDP2 ``fully_shard``: each layer, the embedding and the head
    one unit (the root holds the rest), gradients reduce-scattered every micro-batch."""

    @staticmethod
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model.embed)
        fully_shard(model.head)
        return fully_shard(model)

    def step(self, step: int) -> None:
        m = self.header.microbatches
        for mb in range(m):
            tokens, targets = self.data.microbatch(step, self.dp_rank, self.dp, m, mb)
            (lm_loss(self.model(tokens), targets) / m).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
