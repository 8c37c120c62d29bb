"""Real context parallelism for transformer stages of the zoo (`piper_sim.context_parallel`).

Each rank of a ``cp`` group holds the load-balanced share of every sequence: cut into ``2C``
chunks, rank ``i`` holds chunks ``i`` and ``2C - 1 - i`` (`cp_positions`); its tokens and
rotary positions are those tokens' true ones, so everything but attention runs unchanged on
``s / C`` tokens. The targets stay the whole sequence's (every rank reads the whole
micro-batch), and the losses take the rank's positions (`Stage.positions`): DeepSeek-V3's MTP
module ``d`` embeds, at position ``i``, token ``i + d + 1`` and predicts ``i + d + 2``, which
the rank then has without the boundary exchange Megatron-Core's ``roll_tensor`` makes over the
cp group (megatron-core 0.16.1 ``transformer/multi_token_prediction.py``). An MTP module's
layer attends over the group as the others (its plan ops ``mtp.{d}.kv.ag``, ``mtp.{d}.dkv.rs``).

Attention (`CPAttention`, replacing a layer's `GQAttention` or `TPAttention`; `CPMLAttention`,
its `MLAttention` or `TPMLAttention`: same parameters) is the local queries against every key
of the sequence, causal by true position; the collectives move K and V side by side (MLA: the
up-projected per-head K and V, of unequal head dims):

``allgather`` (Llama 3): one autograd function all-gathers K and V over the group (``kv.ag``),
    keeps only the local chunk, gathers again in backward (``kv.ag``; under full
    recomputation the recomputed forward's gather is kept instead, as the plan has no second
    one) and reduce-scatters dK, dV (``dkv.rs``).
``ring``: ``C - 1`` steps passing the K/V chunk to the next rank of the group (p2p) while the
    current one is attended, partial outputs merged by log-sum-exp (``kv.ag``); backward passes
    K/V around again with the dK/dV accumulated so far, which reach their owner after ``C``
    hops (``kv.ag``, ``dkv.rs``). A ring is logged as the one collective the plan prices it as.

The plan's ``CP.*`` ops are honoured like tensor parallelism's (`executor.parallel.tensor`):
every collective is logged under its pass; a plan op takes the next logged one of its pass
(``R``: a recompute's, inside the B pass) and must have its name and kind. The compiler
puts a piece's gathers *before* it (and a ring beside it); the collectives run inside the
piece, so each CP op moves after its piece (`reorder_after_pieces`).

The loss is each rank's mean over its ``s / C`` tokens scaled by ``1 / C`` more (equal token
counts: the sum over the group is the sequence mean; an MTP loss, whose masked tail lies on
rank 0, divides by the whole sequence's count instead: `models.mtp_loss`); parameters are
replicated over cp and their gradients summed over dp x cp by the plan's sync ops.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from executor.collectives import all_gather_flat, group_ranks, reduce_scatter_flat
from executor.parallel.tensor import ModuleCollectives, TPAttention, TPComm, TPMLAttention, _CopyManyToTP, column, row
from piper_sim.models import GQAttention, MLAttention, apply_rope, rope_cos_sin
from piper_sim.recompute import Recompute, reruns_forward_collective

# the compiler's stream of context-parallel collectives (piper_sim.ir.CP_STREAM)
CP_STREAM = "cp"
KV_TAG, DKV_TAG = 1, 2  # p2p tags of a ring's K/V and dK/dV hops (on the cp group)


def is_cp(ins) -> bool:
    return ins.stream == CP_STREAM


def ring_hops(ins, style: str, degree: int) -> int:
    """The point-to-point hops a plan CP op is performed as under ring attention (each a send
    and a receive): the K/V's C - 1 for its all-gather, dK/dV's C back home for its
    reduce-scatter; 0 for any other op or style (one collective)."""
    if not is_cp(ins) or style != "ring":
        return 0
    return degree - (ins.kind == "ALL_GATHER")


def cp_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """True positions of the tokens rank ``index`` holds: chunks ``index`` and ``2cp - 1 - index``."""
    c = seq_len // (2 * cp)
    last = 2 * cp - 1 - index
    return torch.cat([torch.arange(index * c, (index + 1) * c), torch.arange(last * c, (last + 1) * c)])


@dataclass
class CPComm(TPComm):
    """This rank's context-parallel group (``ranks``: global ranks in group order), its
    style, and the log of the collectives its attention ran."""

    WHAT = "context parallel"
    style: str = "allgather"
    ranks: tuple[int, ...] = ()
    seq_len: int = 0

    def __post_init__(self) -> None:
        self._positions = [cp_positions(self.seq_len, self.size, i) for i in range(self.size)] if self.seq_len else []

    def positions(self, index: int | None = None) -> torch.Tensor:
        """True positions of the tokens of group member ``index`` (default: this rank)."""
        return self._positions[self.index if index is None else index]

    def all_positions(self) -> torch.Tensor:
        """Every member's positions in group order (the order of an all-gather)."""
        return torch.cat(self._positions)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's K ``[B, h, s/C, dk]`` and V ``[B, h, s/C, dv]`` -> ``[B, h, s, d]`` in group
        order (one all-gather of both: `pack`)."""
        kv = pack(k, v).movedim(2, 0).contiguous()  # [s/C, B, h, dk + dv]
        out = kv.new_empty(kv.shape[0] * self.size, *kv.shape[1:])
        self._run(name, "ALL_GATHER", lambda: all_gather_flat(out, kv, self.index, self.size, group=self.group))
        return unpack(out.movedim(0, 2), k.shape[-1])

    def scatter_kv(self, dk: torch.Tensor, dv: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum over the group of full-sequence dK, dV (group order), this rank's part (one reduce-scatter,
        on gloo an all-to-all and a sum: `executor.collectives.reduce_scatter_flat`)."""
        full = pack(dk, dv).movedim(2, 0).contiguous()
        got = {}

        def scatter():
            got["piece"] = reduce_scatter_flat(full.view(-1), self.index, self.size, group=self.group)[1]
        self._run(name, "REDUCE_SCATTER", scatter)
        return unpack(got["piece"].view(full.shape[0] // self.size, *full.shape[1:]).movedim(0, 2), dk.shape[-1])

    def hop(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post sending ``t`` to the next rank of the ring and receiving the previous one's."""
        nxt, prev = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]
        buf = torch.empty_like(t)
        return buf, [dist.isend(t.contiguous(), nxt, group=self.group, tag=tag),
                     dist.irecv(buf, prev, group=self.group, tag=tag)]


def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V ``[B, h, s, dk|dv]`` side by side, ``[B, h, s, dk + dv]``: what a CP collective
    moves (MLA: ``dk = qk_nope + qk_rope`` and ``dv = v_head_dim`` per head; GQA ``dk = dv``)."""
    return torch.cat([k, v], -1)


def unpack(kv: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[..., :dk], kv[..., dk:]


def _wait(works: list) -> None:
    for w in works:
        w.wait()


# --------------------------------------------------------------------------- attention math


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the query heads' gradients onto the KV head they share (GQA)."""
    B, H, s, d = t.shape
    return t if H == kv_heads else t.view(B, kv_heads, H // kv_heads, s, d).sum(2)


def _scores(q, k, qpos, kpos, scale, window: int) -> torch.Tensor:
    """Causal scores by true position; with ``window`` a query sees itself and the
    ``window - 1`` tokens before it (`models.attention`)."""
    s = q @ _expand(k, q.shape[1]).transpose(-1, -2) * scale
    hidden = qpos[:, None] < kpos[None, :]
    if window:
        hidden |= qpos[:, None] - kpos[None, :] >= window
    return s.masked_fill(hidden, float("-inf"))


def partial_attention(q, k, v, qpos, kpos, scale, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries at ``qpos`` against keys at ``kpos`` (causal): output and log-sum-exp
    ``[B, H, sq, 1]`` (``-inf`` and a zero output for a query that sees none of them)."""
    s = _scores(q, k, qpos, kpos, scale, window)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = (s - m).exp()
    l = p.sum(-1, keepdim=True)
    return p @ _expand(v, q.shape[1]) / l.clamp_min(torch.finfo(l.dtype).tiny), m + l.log()


def merge(out, lse, out2, lse2) -> tuple[torch.Tensor, torch.Tensor]:
    new = torch.logaddexp(lse, lse2)
    return out * (lse - new).exp() + out2 * (lse2 - new).exp(), new


def partial_attention_backward(q, k, v, qpos, kpos, scale, lse, dout, delta, window: int = 0):
    """Gradients (dq, dk, dv) of the keys at ``kpos``' share of the attention, given the
    full output's log-sum-exp and ``delta = sum(dout * out)`` (flash-attention backward)."""
    kv_heads = k.shape[1]
    ke, ve = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    p = (_scores(q, k, qpos, kpos, scale, window) - lse).exp()
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ ve.transpose(-1, -2) - delta)
    return ds @ ke * scale, _fold(ds.transpose(-1, -2) @ q * scale, kv_heads), _fold(dv, kv_heads)


# --------------------------------------------------------------------------- autograd functions


class _GatheredAttention(torch.autograd.Function):
    """``allgather``: all-gather K, V; attention of the local queries; backward gathers again
    (or uses the kept gather, ``keep``) and reduce-scatters dK, dV."""

    @staticmethod
    def forward(ctx, q, k, v, cp: CPComm, label: str, keep: bool, window: int):
        qpos, kpos = cp.positions().to(q.device), cp.all_positions().to(q.device)
        K, V = cp.gather_kv(k, v, f"{label}.kv.ag")
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = partial_attention(q, K, V, qpos, kpos, scale, window)
        ctx.cp, ctx.label, ctx.keep, ctx.scale, ctx.window = cp, label, keep, scale, window
        ctx.save_for_backward(q, *((K, V) if keep else (k, v)), out, lse, qpos, kpos)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, qpos, kpos = ctx.saved_tensors
        cp = ctx.cp
        K, V = (k, v) if ctx.keep else cp.gather_kv(k, v, f"{ctx.label}.kv.ag")
        delta = (dout * out).sum(-1, keepdim=True)
        dq, dK, dV = partial_attention_backward(q, K, V, qpos, kpos, ctx.scale, lse, dout, delta, ctx.window)
        dk, dv = cp.scatter_kv(dK, dV, f"{ctx.label}.dkv.rs")
        return dq, dk, dv, None, None, None, None


class _RingAttention(torch.autograd.Function):
    """``ring``: the K/V chunks travel the group in ``C - 1`` p2p hops while the current one is
    attended; backward passes K/V and the dK/dV accumulated so far, home after ``C`` hops
    (``keep`` does not apply: the plan has the backward ring pass K/V again)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: CPComm, label: str, keep: bool, window: int):
        C, r = cp.size, cp.index
        qpos = cp.positions().to(q.device)
        scale = 1.0 / math.sqrt(q.shape[-1])
        kv, dk = pack(k, v), k.shape[-1]
        out = lse = None
        t0 = time.perf_counter()
        for t in range(C):
            nxt, works = cp.hop(kv, KV_TAG) if t < C - 1 else (None, [])
            o, l = partial_attention(q, *unpack(kv, dk), qpos, cp.positions((r - t) % C).to(q.device), scale, window)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
            _wait(works)
            kv = nxt
        cp.record(f"{label}.kv.ag", "ALL_GATHER", t0, time.perf_counter())
        ctx.cp, ctx.scale, ctx.label, ctx.window = cp, scale, label, window
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        C, r = cp.size, cp.index
        qpos = cp.positions().to(q.device)
        delta = (dout * out).sum(-1, keepdim=True)
        kv, dkv, d = pack(k, v), None, k.shape[-1]
        dq = torch.zeros_like(q)
        kv_t = [time.perf_counter(), 0.0]
        dkv_t = [0.0, 0.0]
        for t in range(C):
            nxt, works = cp.hop(kv, KV_TAG) if t < C - 1 else (None, [])
            dq_t, dk, dv = partial_attention_backward(q, *unpack(kv, d), qpos, cp.positions((r - t) % C).to(q.device),
                                                      scale, lse, dout, delta, ctx.window)
            dq += dq_t
            mine = pack(dk, dv)
            dkv = mine if dkv is None else dkv + mine
            if t == 0:
                dkv_t[0] = time.perf_counter()
            dkv, dworks = cp.hop(dkv, DKV_TAG)  # the chunk's gradients so far follow it
            _wait(works)
            if t == C - 2:
                kv_t[1] = time.perf_counter()
            _wait(dworks)
            kv = nxt
        dkv_t[1] = time.perf_counter()
        cp.record(f"{ctx.label}.kv.ag", "ALL_GATHER", *kv_t)
        cp.record(f"{ctx.label}.dkv.rs", "REDUCE_SCATTER", *dkv_t)
        return dq, *unpack(dkv, d), None, None, None, None


# --------------------------------------------------------------------------- the attention module


class CPAttention(nn.Module):
    """A layer's attention (`GQAttention`, or `TPAttention` on this rank's heads; same
    parameter names) on this rank's tokens at their true positions, against the whole
    sequence's keys over the cp group. ``keep``: the stage fully recomputes (allgather keeps
    the recomputed gather for its backward)."""

    def __init__(self, base: GQAttention | TPAttention, cp: CPComm, label: str, keep: bool):
        super().__init__()
        for name, mod in base.named_children():
            setattr(self, name, mod)
        self.cfg, self.window, self.cp, self.label, self.keep = base.cfg, base.window, cp, label, keep
        self.tp: TPComm | None = base.tp if isinstance(base, TPAttention) else None
        self.tp_label = base.label if isinstance(base, TPAttention) else ""
        self.heads = base.heads if isinstance(base, TPAttention) else base.cfg.local_heads
        self.kv_heads = base.kv_heads if isinstance(base, TPAttention) else base.cfg.local_kv_heads
        self.recompute_core = False  # the backward re-runs the core anyway (selective recomputation's work)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if self.tp is not None:
            q, k, v = column(self.tp, x, [self.wq, self.wk, self.wv], self.tp_label)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        B, s = q.shape[:2]
        q = q.view(B, s, self.heads, c.head_dim)
        k = k.view(B, s, self.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, s, self.kv_heads, c.head_dim).transpose(1, 2)
        if c.rope:
            pos = self.cp.positions().to(x.device)
            cos, sin = rope_cos_sin(self.cp.seq_len, c.head_dim, c.rope_theta, x.device, x.dtype)
            q, k = apply_rope(q, cos[pos], sin[pos]), apply_rope(k, cos[pos], sin[pos])
        fn = _RingAttention if self.cp.style == "ring" else _GatheredAttention
        window = self.window if 0 < self.window < self.cp.seq_len else 0
        o = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.cp, self.label, self.keep, window)
        o = o.transpose(1, 2).reshape(B, s, -1)
        return row(self.tp, o, self.wo, self.tp_label) if self.tp is not None else self.wo(o)


class CPMLAttention(MLAttention):
    """Multi-head latent attention (`MLAttention`, or `TPMLAttention` on this rank's heads; same
    parameter names) on this rank's tokens: the latents and up-projections as the base runs
    them (under TP their ``f`` / SP gather), the rotary embedding at the tokens' true positions,
    then the per-head ``q [B, H, s/C, nope + rope]``, ``k`` (the shared rotary key expanded per
    head) and ``v [B, H, s/C, v_head_dim]`` attend over the cp group as `CPAttention`'s: the
    collectives move K and V side by side, ``H * (nope + rope + v_head_dim)`` per token, what
    `piper_sim.parallel.context.kv_width` prices (Megatron-Core gathers the up-projected K/V)."""

    def __init__(self, base: MLAttention, cp: CPComm, label: str, keep: bool):
        nn.Module.__init__(self)
        for name, mod in base.named_children():
            setattr(self, name, mod)
        self.cfg, self.cp, self.label, self.keep = base.cfg, cp, label, keep
        self.tp: TPComm | None = base.tp if isinstance(base, TPMLAttention) else None
        self.tp_label = base.label if isinstance(base, TPMLAttention) else ""
        self.local = base.local if isinstance(base, TPMLAttention) else base.cfg.local_heads
        self.recompute_core = False  # as CPAttention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, tp, projected = self.cfg, self.tp, False
        if tp is None:
            q_in, kv, k_pe = self.latents(x)
        elif not tp.sp:
            q_in, kv, k_pe = _CopyManyToTP.apply(tp, f"{self.tp_label}.ar", *self.latents(x))
        else:  # as TPMLAttention: the down-projections read the gathered sequence
            lora = bool(c.q_lora_rank)
            q_in, kv, k_pe = self.normed_latents(*column(tp, x, [self.wq_a if lora else self.wq, self.wkv_a],
                                                         self.tp_label))
            projected = not lora
        pos = self.cp.positions().to(x.device)
        cos, sin = rope_cos_sin(self.cp.seq_len, c.qk_rope_dim, c.rope_theta, x.device, x.dtype)
        q, k, v = self.up_proj(q_in, kv, k_pe, self.local, projected, rope_tables=(cos[pos], sin[pos]))
        fn = _RingAttention if self.cp.style == "ring" else _GatheredAttention
        o = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.cp, self.label, self.keep, 0)
        o = o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return row(tp, o, self.wo, self.tp_label) if tp is not None else self.wo(o)


def has_attention(unit: str) -> bool:
    """Whether a unit has an attention: a layer, or an MTP module (``mtp.d``: its layer's)."""
    return unit.startswith(("layers.", "mtp."))


def cp_label(unit: str) -> str:
    """The name prefix of a unit's CP collectives in the plan: ``l{i}`` for layer i, ``mtp.{d}``
    for MTP module d (`piper_sim.parallel.context`)."""
    return unit if unit.startswith("mtp.") else "l" + unit.split(".")[1]


def cp_unit(op_name: str) -> str:
    """The unit whose attention performs a plan CP op (``l3.kv.ag``, ``mtp.0.dkv.rs``)."""
    head, *rest = op_name.split(".")
    return f"mtp.{rest[0]}" if head == "mtp" else "layers." + head[1:]


def context_stage(stage, cp: CPComm, keep: bool | set[str]) -> None:
    """Every layer of ``stage``, MTP modules' included, attends over the cp group (`CPAttention`,
    `CPMLAttention`); full recomputation re-runs whole layers, so the recomputed collectives
    recur in the plan's order. ``keep``: every layer, or the names of the units whose
    checkpoint re-runs the attention (full, every-N, op-SAC: `recomputed_layers`)."""
    stage.recompute_early_stop = False
    for name in filter(has_attention, stage.units.unit_names()):
        block = stage.units[name]
        block = getattr(block, "block", block)  # an MTP module's layer
        cls = CPMLAttention if isinstance(block.attn, MLAttention) else CPAttention
        block.attn = cls(block.attn, cp, cp_label(name), keep if isinstance(keep, bool) else name in keep)


def recomputed_layers(header, stage: int, units: list[str]) -> set[str]:
    """The layers (and MTP modules) of a stage whose checkpoint re-runs their whole forward,
    attention included (`piper_sim.recompute.reruns_forward_collective`)."""
    policy = Recompute.from_header((header.recompute or {}).get(stage, "none"),
                                   (header.recompute_policy or {}).get(stage))
    return {u for u, (mode, _) in policy.unit_modes(units).items()
            if has_attention(u) and reruns_forward_collective(mode, (), "kv")}


def reorder_after_pieces(streams: dict[str, list], stage_parts: list[list[list[str]]]) -> None:
    """The plan puts a piece's K/V gathers before it (and a ring beside it); here they run
    inside it. Each CP op also waits for its piece, and the piece, instead of its own CP ops,
    waits for what they waited for (in place on ``streams``)."""
    compute = streams.get("compute", [])
    pieces = {(i.kind == "F", i.stage, i.mb, i.part): i.id for i in compute if i.kind in ("F", "B", "BI")}
    cps = {i.id: i for lst in streams.values() for i in lst if is_cp(i)}

    def piece(ins) -> str:
        layer = cp_unit(ins.name)
        parts = stage_parts[ins.stage]
        part = next(k for k, segs in enumerate(parts) if any(s == layer or s.startswith(layer + ".") for s in segs))
        return pieces[(ins.direction == "F", ins.stage, ins.mb, part)]

    owner = {c: piece(i) for c, i in cps.items()}

    def piece_deps(deps: list[str], n: str) -> list[str]:
        """A piece's deps, its own CP ops replaced by what they waited for."""
        out: list[str] = []
        for d in deps:
            out += piece_deps(cps[d].deps, n) if owner.get(d) == n else [d]
        return out

    for name, lst in streams.items():
        streams[name] = [dataclasses.replace(i, deps=list(dict.fromkeys(
            [*i.deps, owner[i.id]] if i.id in owner else piece_deps(i.deps, i.id)))) for i in lst]


class ContextParallel(ModuleCollectives):
    """Every stage's attention runs over the plan's ``cp`` group; the CP ops wait for the
    pieces that perform their collectives; a micro-batch's tokens are this rank's chunks, its
    targets the whole sequence's, of which the last stage's losses take this rank's positions
    (`Stage.positions`: the MTP modules' shifted tokens and targets need every position)."""

    stream = CP_STREAM

    @classmethod
    def applies(cls, rt) -> bool:
        return rt.layout.cp > 1

    def __init__(self, rt):
        self.rt = rt
        group = next(i.group for lst in rt.prog.streams.values() for i in lst if is_cp(i))
        ranks = group_ranks(group)
        style = rt.header.cp.style
        self.comm = CPComm(rt.comms.group(CP_STREAM, group), rt.layout.cp, ranks.index(rt.rank), False,
                           style=style, ranks=ranks, seq_len=rt.seq)
        for s, stage in rt.stages.items():
            context_stage(stage, self.comm, keep=recomputed_layers(rt.header, s, stage.unit_names))
            stage.positions = self.comm.positions().to(rt.device)
        reorder_after_pieces(rt.prog.streams, rt.header.stage_parts)

    def local_seq(self, seq: int) -> int:
        return seq // self.rt.layout.cp

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's chunks of the tokens; the targets whole (`Stage.local` takes its positions)."""
        return tokens[:, self.comm.positions().to(tokens.device)], targets
