"""The single-process reference: the same model, data and optimizer in one process, and
the comparison of a distributed run's parameters against it (``--check``)."""

from __future__ import annotations

from datetime import timedelta

import torch

from executor.collectives import all_gather
from executor.data import SyntheticData
from executor.lr import LRSchedule
from executor.stage import FlatParams, keep_first_grads, make_optimizer, set_lr
from costmodel.dtypes import torch_dtype
from piper_sim.configs import config_of
from piper_sim.models import DropoutStream, build_model, set_dropout_stream
from piper_sim.plan import Plan



def reference_training(plan: Plan, steps: int, device: torch.device | str = "cpu",
                       clip_grad_norm: float | None = None,
                       first_grads: dict[str, torch.Tensor] | None = None,
                       lr_schedule: LRSchedule | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train the plan's model for ``steps`` steps on the full global batch in one process
    (gradients clipped to ``clip_grad_norm`` by global norm, as the executor does);
    returns its parameters by name and the loss of every step. ``first_grads``: filled
    with the first step's gradients by name (before clipping and the optimizer);
    ``lr_schedule``: the learning rate of each step (the executor's ``--lr`` options)."""
    h = plan.header
    if h.user_model is not None:
        from executor.user_stage import user_reference_training

        return user_reference_training(plan, steps, device, torch_dtype(h.dtype), clip_grad_norm, first_grads,
                                       lr_schedule)
    cfg = config_of(h)
    model = build_model(cfg, device=device, dtype=torch_dtype(h.dtype), seed=h.seed)
    opt = make_optimizer(list(model.parameters()))
    data = SyntheticData(cfg.vocab, h.seq_len, h.global_batch, h.seed)
    losses = []
    for step in range(steps):
        tokens, targets = data.batch(step)
        # dropout masks from the per-(step, sample, layer, site) stream the executor's ranks draw from
        set_dropout_stream(DropoutStream(h.seed, step, range(h.global_batch), h.seq_len) if cfg.dropout else None)
        try:
            loss = model.training_loss(tokens.to(device), targets.to(device))  # with the MTP losses, if any
        finally:
            set_dropout_stream(None)
        loss.backward()
        keep_first_grads(first_grads, step, model.named_parameters())
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if lr_schedule is not None:
            set_lr([opt], lr_schedule(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out = {n: p.detach() for n, p in model.named_parameters()}
    if cfg.tie_embeddings:  # a last stage's own copy of the tied matrix (executor.parallel.tied) is this one
        out["head.out.weight"] = out["embed.weight"]
        if first_grads is not None and "embed.weight" in first_grads:
            first_grads["head.out.weight"] = first_grads["embed.weight"]
    elif cfg.mtp_layers:  # a last stage's copy of the embedding its MTP modules read (executor.parallel.tied)
        out["mtp_embed.weight"] = out["embed.weight"]
        if first_grads is not None and "embed.weight" in first_grads:
            first_grads["mtp_embed.weight"] = first_grads["embed.weight"]
    return out, losses


def _gather_flat(fp: FlatParams, comms, piece, like: torch.Tensor) -> torch.Tensor:
    """A full flat buffer of the group, bucket ``b`` all-gathered from every rank's ``piece(b)``."""
    pg = comms.group(fp.stream, "ranks:" + ",".join(map(str, fp.group)))
    full = torch.empty(fp.total_len, dtype=like.dtype, device=like.device)
    works = [all_gather(full[fp.offsets[b]:fp.offsets[b] + fp.lens[b]], piece(b), group=pg, async_op=True)
             for b in range(fp.n_buckets)]
    for w in works:
        w.wait(timeout=timedelta(seconds=120))
    return full


def _rel(mine: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 difference ``||mine - want|| / ||want||`` (in fp32)."""
    return (mine.float() - want.float()).norm().item() / max(want.float().norm().item(), 1e-30)


def full_parameters(fp: FlatParams, comms) -> torch.Tensor:
    """The full flat parameters of a group (all-gathered from the shards under ZeRO-3)."""
    if fp.materialised():
        return fp.full_flat()
    return _gather_flat(fp, comms, fp.shard_piece, fp.params[0])


def compare(flats: dict, comms, ref: dict[str, torch.Tensor], view=None) -> tuple[float, float]:
    """Largest absolute difference of any parameter element, and largest per-tensor relative
    difference ``||a - b|| / ||b||`` (L2), over this rank's parameters.

    Per element, Adam turns fp32 round-off in a near-cancelling gradient into an update
    difference of up to a few % of the learning rate, whatever the strategy (plain
    micro-batching does it in one process), so a per-element max relative difference is
    not a round-off measure; the tensor norm is. ``view(name, ref_tensor)``: the part of a
    reference parameter this rank holds (a tensor-parallel slice).

    Under tensor parallelism the relative difference is per shard."""
    max_abs = max_rel = 0.0
    for _, fp in sorted(flats.items()):
        full = full_parameters(fp, comms)
        for name, mine in fp.named_views(full).items():
            want = (view(name, ref[name]) if view else ref[name]).to(mine.device, mine.dtype)
            diff = (mine.float() - want.float()).abs().max().item()
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, _rel(mine, want))
    return max_abs, max_rel


def full_flat(fp: FlatParams, t: torch.Tensor, comms) -> torch.Tensor:
    """The full flat layout of ``t``, a tensor in the optimizer's layout (a gradient it
    stepped, an AdamW moment): the flat buffer itself, or under ZeRO this rank's shard,
    all-gathered bucket by bucket from the group."""
    if fp.shard is None:
        return t
    return _gather_flat(fp, comms, lambda b: t[fp.piece_offsets[b]:fp.piece_offsets[b] + fp.piece_lens[b]], t)


def compare_grads(flats: dict, stepped: dict, comms, ref: dict[str, torch.Tensor], view=None) -> float:
    """Largest per-tensor relative L2 difference of the first step's gradients (what each
    optimizer stepped, ``Runtime.stepped_grads``) from the reference's (``first_grads`` of
    `reference_training`): the strategy's arithmetic without Adam's amplification of
    round-off, so fp32 holds it to 1e-5 (`executor.worker.CHECK_GRAD_TOLERANCE`)."""
    max_rel = 0.0
    for key, fp in sorted(flats.items()):
        full = full_flat(fp, stepped[key], comms)
        for name, mine in fp.named_views(full).items():
            want = (view(name, ref[name]) if view else ref[name]).to(mine.device, mine.dtype)
            max_rel = max(max_rel, _rel(mine, want))
    return max_rel
