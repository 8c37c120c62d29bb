"""Progress bars on stderr, one way for every command: integer counts, and none at all when
stderr is not a terminal (a log file, a CI job, a pipe: no carriage-return bars in it)."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True, **kwargs: Any):
    """A tqdm bar of ``total`` (an integer) steps on stderr; disabled (its calls do nothing)
    when ``enabled`` is false or stderr is not a terminal (tqdm's ``disable=None``)."""
    from tqdm import tqdm

    return tqdm(total=int(total), desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=None if enabled else True, **kwargs)


class Counter:
    """A bar fed fractional steps (a benchmark round is 1/repeats of a step) that shows whole
    steps only: ``3/56``, never ``1.3333333333333333/56``."""

    def __init__(self, total: int, desc: str, unit: str = "step", enabled: bool = True):
        self.total, self.done = int(total), 0.0
        self.bar = progress_bar(self.total, desc, unit, enabled)

    def __call__(self, label: str = "", steps: float = 1.0) -> None:
        self.done = min(float(self.total), self.done + max(0.0, steps))
        whole = min(self.total, int(self.done + 1e-9))  # rounding: 3 x (1/3) is one whole step
        self.bar.set_postfix_str(label, refresh=False)
        if whole > self.bar.n:
            self.bar.update(whole - self.bar.n)

    def close(self) -> None:
        self.bar.close()
