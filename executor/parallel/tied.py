"""Tied embeddings across pipeline stages on one rank: the plan's ``AR.embed`` op.

The first stage holds the word embedding (``embed.weight``), the last stage its own copy for
the output layer (``head.out.weight``, `piper_sim.models.Head.own_copy`: built from the same
seed, so equal at the start, as Megatron-Core's ``setup_embeddings_and_output_layer`` makes
them). The op all-reduces this rank's copy's gradient, in place in the flat gradient buffer,
over the embedding group (Megatron ``_allreduce_word_embedding_grads``); the plan orders it
before the data-parallel syncs of the buckets holding it, so both copies step identically.
A rank holding both stages (placement v, DualPipe) sums its two copies in place (a group of
one rank). For the global gradient norm the copy counts 0 (Megatron counts a shared parameter
once).
"""

from __future__ import annotations

import torch.distributed as dist

from executor.collectives import group_ranks
from executor.parallel.axis import Axis, Handler, Posted
from piper_sim.parallel.tied import STREAM
from piper_sim.plan import Instruction

COPY = "head.out.weight"  # the last stage's copy
MTP_COPY = "mtp_embed.weight"  # an untied model's: the embedding its MTP modules read (models.build_units)


class TiedEmbeddings(Axis):
    """The word-embedding gradient all-reduce between the first and the last stage."""

    @classmethod
    def applies(cls, rt) -> bool:
        return any(i.tied for lst in rt.prog.streams.values() for i in lst)

    def __init__(self, rt):
        self.rt = rt
        # an untied model's head.out.weight is its own output layer, not a copy (its MTP modules' is mtp_embed)
        copies = {COPY, MTP_COPY} if getattr(rt.cfg, "tie_embeddings", False) else {MTP_COPY}
        self.copies = copies & {n for stage in rt.stages.values() for n, _ in stage.units.named_parameters()}
        self.ends = {0, rt.header.num_stages - 1}  # the stages holding a copy

    def stream_handlers(self) -> dict[str, Handler]:
        return {STREAM: self.allreduce}

    def weight(self, stage: int):
        units = self.rt.stages[stage].units
        if "embed" in units:
            return units["embed"].weight
        return units["mtp_embed"].weight if "mtp_embed" in units else units["head"].out.weight

    def allreduce(self, ins: Instruction) -> Posted | None:
        if len(group_ranks(ins.group)) == 1:  # both copies here (placement v, DualPipe): summed in place
            grads = [self.weight(s).grad for s in sorted(self.rt.stages) if s in self.ends]
            total = sum(grads[1:], grads[0].clone())
            for g in grads:
                g.copy_(total)
            if self.rt.cuda:
                self._compute_waits(ins)()
            return None
        grad = self.weight(ins.stage).grad
        work = dist.all_reduce(grad, group=self.rt.comms.group(ins.stream, ins.group), async_op=True)
        return Posted(work, self._compute_waits(ins) if self.rt.cuda else None)

    def _compute_waits(self, ins: Instruction):
        """CUDA: a ZeRO reduce-scatter takes its bucket on the compute stream
        (`DataParallel._take_grads_in_compute_order`), which must see the summed gradient."""
        streams = self.rt.cuda_streams
        return lambda: streams["compute"].wait_stream(streams[ins.stream])

    def norm_share(self, name: str) -> float:
        return 0.0 if name in self.copies else 1.0

    def saved_name(self, name: str) -> str:
        """A copy is stored as the embedding it copies, so a checkpoint resumes onto a layout
        with the embedding and the head on one stage (no copy) and back."""
        return "embed.weight" if name in self.copies else name
