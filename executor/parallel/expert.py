"""Expert parallelism on one rank: the all-to-all token exchanges around each expert block.

A stage's experts are split over the ``ep`` consecutive data-parallel ranks (this rank holds
its ``ep_index``-th share, `executor.stage.Stage`). ``A2A.F|B.s{s}.mb{m}.e{e}.dispatch|combine``
ops move the routed tokens to the ranks of their experts (dispatch: the per-expert counts
first, then the tokens) and the expert outputs back (combine, then the weighted sum); in
backward the same exchanges run mirrored.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.parallel.axis import Axis, Handler, Posted
from executor.stage import Stage, backward_full
from piper_sim.plan import Instruction

A2A_MIRROR = {"dispatch": "combine", "combine": "dispatch"}


def expert_index(dp_rank: int, ep: int) -> int:
    """Which share of each stage's experts a data-parallel rank holds."""
    return dp_rank % ep


class ExpertParallel(Axis):
    """The ``ALL_TO_ALL`` ops of the stages' expert blocks."""

    @classmethod
    def applies(cls, rt) -> bool:
        return rt.layout.ep > 1

    def __init__(self, rt):
        self.rt = rt

    def handlers(self) -> dict[str, Handler]:
        return {"ALL_TO_ALL": self.all_to_all}

    def all_to_all(self, ins: Instruction):
        rt = self.rt
        direction, s, mb, e = ins.direction, ins.stage, ins.mb, ins.block
        # the forward op this one is (F) or is the backward of (B)
        what = ins.a2a if direction == "F" else A2A_MIRROR[ins.a2a]
        stage = rt.stages[s]
        layer = stage.expert_layers[e]
        pg = rt.comms.group(ins.stream, ins.group)
        env = rt.envs[(s, mb)] if direction == "F" else rt.backward_env(s, mb)
        routing, h = env.routing, rt.cfg.hidden

        def exchange(src: torch.Tensor, out_splits: list[int], in_splits: list[int], dst: dict, name: str):
            out = rt.for_compute(src.new_empty(sum(out_splits), h))
            work = dist.all_to_all_single(out, src.detach().contiguous(), out_splits, in_splits, group=pg,
                                          async_op=True)
            return Posted(work, lambda: dst.__setitem__(name, out))

        if direction == "F" and what == "dispatch":
            return self._dispatch(env, stage, layer, pg)
        sent, got = routing[f"in_splits.{layer}"], routing[f"out_splits.{layer}"]  # per rank, in dispatch
        if direction == "F":  # combine: expert outputs go home, then the weighted sum
            y = env.vals[f"y.{layer}"]
            posted = exchange(y, sent, got, env.vals, f"comb.{layer}")
            store = posted.then

            def then():
                store()
                env.records[f"post.{layer}"] = stage.combine_post(layer, env.vals, routing)
            return Posted(posted.work, then)
        if what == "combine":  # backward of the weighted sum, then its gradient to the experts
            rec = env.records.pop(f"post.{layer}")
            env.grads.update(backward_full(rec, rt.take_grads(env, rec)))
            return exchange(env.grads.pop(f"comb.{layer}"), got, sent, env.grads, f"y.{layer}")
        return exchange(env.grads.pop(f"recv.{layer}"), sent, got, env.grads, f"send.{layer}")

    def _dispatch(self, env, stage: Stage, layer: int, pg):
        """Exchange per-expert token counts, then the tokens themselves (``env``: the
        micro-batch's `executor.runtime.MicroBatch`)."""
        rt = self.rt
        counts = env.routing[f"counts.{layer}"]
        ep, n = rt.layout.ep, stage.local_experts
        send_counts = torch.tensor(counts, dtype=torch.int64, device=rt.device)
        recv_counts = torch.empty_like(send_counts)
        yield dist.all_to_all_single(recv_counts, send_counts, group=pg, async_op=True)
        rows = recv_counts.view(ep, n).tolist()
        sent = [sum(counts[j * n:(j + 1) * n]) for j in range(ep)]
        got = [sum(r) for r in rows]
        env.routing[f"recv_counts.{layer}"] = rows
        env.routing[f"in_splits.{layer}"], env.routing[f"out_splits.{layer}"] = sent, got
        tokens = env.vals[f"send.{layer}"]
        out = rt.for_compute(tokens.new_empty(sum(got), self.rt.cfg.hidden))
        work = dist.all_to_all_single(out, tokens.detach().contiguous(), got, sent, group=pg, async_op=True)
        return Posted(work, lambda: env.vals.__setitem__(f"recv.{layer}", out))
