"""A user model's stages, data and single-process reference (`piper_sim.annotate.UserModel`).

`UserStage` has the interface of `executor.stage.Stage` for the runtime: its pieces call the
user's units in order; the first stage's first piece takes ``tokens`` (the inputs of the
model's ``example_batch``), a piece hands ``x`` on, and the last unit's output goes to the
model's loss. Parameters are named ``{unit}.{name inside the unit}``, in the reference too.
`UserData` splits a step's global batch (``example_batch(global_batch, ...)`` under a seed
per step) into replicas and micro-batches by rows, as `executor.data.SyntheticData` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint, set_checkpoint_early_stop

from executor.lr import LRSchedule
from executor.stage import Piece, Record, _leaf, keep_first_grads, make_optimizer, set_lr
from piper_sim.annotate import AnnotationError, UserModel, load_user_model
from piper_sim.header import PlanHeader
from piper_sim.plan import Plan, PlanError


def user_model_of(header: PlanHeader) -> UserModel:
    """Rebuild a plan's user model from its source (the header's ``user_model``)."""
    um = header.user_model
    if not um.get("source"):
        raise PlanError(f"plan's user model {um.get('name')} was given as an object, not an importable factory; "
                        "compile with a module-level factory function or a \"py:module:function\" model to run it")
    try:
        model = load_user_model(um["source"], um.get("kwargs"))
    except AnnotationError as e:
        raise PlanError(str(e)) from None
    if model.units != um["units"]:
        raise PlanError(f"user model {um['source']} now has units {model.units}, the plan {um['units']}; recompile")
    return model


@dataclass
class UserData:
    """Seeded batches of a user model, split by rows like `SyntheticData`."""

    model: UserModel
    seq_len: int
    global_batch: int
    seed: int
    dtype: torch.dtype

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.example_batch(self.global_batch, self.seq_len, "cpu", self.dtype,
                                        self.seed * 1_000_003 + 7919 * (step + 1))

    def microbatch(self, step: int, dp_rank: int, dp: int, microbatches: int, mb: int,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(step)
        mbs = self.global_batch // dp // microbatches
        lo = dp_rank * (self.global_batch // dp) + mb * mbs
        return inputs[lo:lo + mbs].to(device), targets[lo:lo + mbs].to(device)


class UserStage:
    """The units of one stage of a user model on this rank, cut into pieces (unit lists)."""

    expert_split = False

    def __init__(self, model: UserModel, index: int, num_stages: int, units: list[str],
                 parts: list[list[str]], device: torch.device, dtype: torch.dtype, seed: int):
        self.model, self.index = model, index
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.units = model.build_units(units, device=device, dtype=dtype, seed=seed)
        self.last_unit = model.units[-1]
        self.pieces = [Piece([(n, -1) for n in names], ["tokens" if self.is_first and i == 0 else "x"])
                       for i, names in enumerate(parts)]
        self.collect_piece_params()

    def collect_piece_params(self) -> None:
        """Each piece's parameters (again after its units are replaced by tensor-parallel shards)."""
        for piece in self.pieces:
            piece.params = [p for n, _ in piece.steps for p in self.units[n].parameters()]

    def named_parameters(self) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
        """(parameters named as in the whole model, no expert parameters)."""
        return [(f"{u}.{n}", p) for u, mod in self.units.items() for n, p in mod.named_parameters()], []

    full_recompute = False
    recompute_early_stop = True  # False under tensor parallelism: a recomputed unit re-runs every collective

    def set_recompute(self, policy) -> None:
        """Plain full recompute (every unit keeps only its input) or none; the finer policies
        need the zoo's blocks (`piper_sim.recompute`)."""
        if not policy.plain or policy.mode == "selective":
            raise PlanError(f"recompute mode {policy.mode!r} does not apply to a user model; use mode full")
        self.full_recompute = policy.mode == "full"

    def recomputes(self, i: int) -> bool:
        """Every unit of a piece runs again under full recompute."""
        return self.full_recompute

    def forward_piece(self, i: int, vals: dict[str, torch.Tensor], routing: dict[str, Any],
                      targets: torch.Tensor | None, loss_scale: float, checkpoint: bool = True) -> Record:
        """Run piece ``i``'s units on ``vals`` (``tokens`` or ``x``); the last unit's output
        goes to the loss (``loss``), any other to ``x``. Under full recompute (and
        ``checkpoint``) every unit keeps only its input and runs again in backward."""
        checkpoint = checkpoint and self.full_recompute
        piece = self.pieces[i]
        inputs = {n: vals[n].detach() if n == "tokens" else _leaf(vals[n]) for n in piece.inputs}  # no input grad
        outputs: dict[str, torch.Tensor] = {}

        def run(fn, *args):
            if not checkpoint:
                return fn(*args)
            with set_checkpoint_early_stop(self.recompute_early_stop):
                return _checkpoint(fn, *args, use_reentrant=False)

        with torch.enable_grad():
            x = inputs[piece.inputs[0]]
            for name, _ in piece.steps:
                if name == self.last_unit:
                    outputs["loss"] = run(self._unit_loss, x, targets) * loss_scale
                else:
                    x = run(self.units[name], x)
            if "loss" not in outputs:
                outputs["x"] = x
        vals.update(outputs)
        return Record(inputs, outputs, piece.params)

    def _unit_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(self.units[self.last_unit](x), targets)


def user_reference_training(plan: Plan, steps: int, device: torch.device | str, dtype: torch.dtype,
                            clip_grad_norm: float | None = None,
                            first_grads: dict[str, torch.Tensor] | None = None,
                            lr_schedule: LRSchedule | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`executor.reference.reference_training` for a user model: all its units in one
    process, on the whole global batch."""
    h = plan.header
    model = user_model_of(h)
    units = model.build_units(model.units, device=device, dtype=dtype, seed=h.seed)
    named = [(f"{u}.{n}", p) for u, mod in units.items() for n, p in mod.named_parameters()]
    params = [p for _, p in named]
    opt = make_optimizer(params)
    data = UserData(model, h.seq_len, h.global_batch, h.seed, dtype)
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step)
        loss = model.loss(model.run(units, inputs.to(device)), targets.to(device))
        loss.backward()
        keep_first_grads(first_grads, step, named)
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        if lr_schedule is not None:
            set_lr([opt], lr_schedule(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {n: p.detach() for n, p in named}, losses
