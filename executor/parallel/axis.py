"""What one parallelism axis gives a rank's runtime (`executor.runtime.Runtime`).

An axis is set up by its constructor, after the rank's stages are built: it may shard the
stages' modules and rewrite the dependencies of the rank's program (``rt.prog``). The runtime
then merges every axis's instruction handlers into its own table and calls the hooks below at
fixed points of a step; an axis overrides only the hooks it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from piper_sim.plan import Instruction

Handler = Callable[[Instruction], Any]


@dataclass
class Posted:
    """Async work an instruction posted, and what to do on the issuing thread when it ends."""

    work: Any
    then: Callable[[], None] | None = None


@dataclass
class Logged:
    """One collective a module performed (the plan op that names it records its times)."""

    name: str
    kind: str
    start: float
    end: float


class Axis:
    """One parallelism axis on one rank: set-up, instruction handlers and step hooks."""

    @classmethod
    def applies(cls, rt) -> bool:
        """Whether the plan uses this axis (else the runtime does not build it)."""
        return True

    def handlers(self) -> dict[str, Handler]:
        """Instruction kind -> handler."""
        return {}

    def stream_handlers(self) -> dict[str, Handler]:
        """Stream -> handler of its every op, whatever the kind: collectives the axis's modules
        perform inside a compute piece (done once the piece is)."""
        return {}

    def begin_step(self) -> None:
        """The step starts: before its first instruction is issued."""

    def before_issue(self, ins: Instruction) -> None:
        """Right before ``ins`` is issued."""

    def enter_pass(self, phase: tuple[str, int, int]) -> None:
        """A compute piece of pass ``(F|B, stage, micro-batch)`` is about to run."""

    def end_step(self) -> None:
        """Every instruction of the step is done."""

    def leftovers(self) -> list[Any]:
        """State the step left behind (the step fails if any axis reports some)."""
        return []

    def local_seq(self, seq: int) -> int:
        """Tokens per sequence of a boundary tensor this rank holds, of ``seq``."""
        return seq

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a micro-batch's tokens and targets."""
        return tokens, targets

    def reference_view(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of reference parameter ``name`` that this rank holds."""
        return full

    def distributed(self, name: str, local: torch.Tensor) -> torch.Tensor | None:
        """``local``, this rank's part of parameter ``name``, as a DTensor over the axis's
        group when the axis splits that parameter (a checkpoint then stores it where it lies
        in the whole, `executor.checkpoint`); None when this rank holds it whole."""
        return None

    def saved_name(self, name: str) -> str:
        """The parameter a checkpoint stores ``name`` under: another name when ``name`` is a
        copy of that parameter (a tied embedding's copy on the last stage)."""
        return name

    def norm_share(self, name: str) -> float:
        """The share of parameter ``name``'s squared gradient this rank adds to the global norm
        (1: its gradient is this rank's alone among the peers of this axis)."""
        return 1.0
